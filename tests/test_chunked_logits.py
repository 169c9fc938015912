"""Chunked log-probs and entropy from hidden states (``models/chunked_logits.py``,
``train.logits_chunk_tokens``) against the unchunked path (each micro-batch's whole logits).

The config key's check (fast). Slow, one pooled world of 2 gloo ranks (the scaled tiny Qwen2,
vocabulary 1000 padded to 1024, so TP rank 1 has 24 padded rows) running every layout in one
job: TP1 (as DP2) and TP2 with sequence parallelism, each with token budgets and with packed
micro-batches (the THD attention emulated as in tests/test_packing.py), TP2 without sequence
parallelism and PP2 with token budgets; at each, the trainer's old-logprob pass (with the probe
teacher), reference pass and one ``update_step`` (KL and entropy terms on), chunks of 5
positions (neither dividing a micro-batch nor the sequence multiple) against chunks of 0
(today's path): log-probs, entropies, the teacher, the loss, the gradient norm, every gradient
and the updated weights agree to fp32 rounding. Then, at TP2+SP, a dispatch-mode recorder sees
every tensor the old-logprob pass and the update create: the largest one with the local
vocabulary as its last dimension is ``chunk x V/TP`` chunked, and at least a whole micro-
batch's ``tokens x V/TP`` unchunked. Cost: 21-47 s on 2 cores with the pool warm (load average
near 14 for the 47 s; 28 passes, 14 policy builds).

A second job of 2 ranks: a TIED copy of that model at PP2, where megatron's
``finalize_model_grads`` all-reduces the embedding's gradient between the stages; the update
with chunks of 5 against chunks of 0 (it deadlocked before ``hidden_states_out`` restored
``post_process`` around that call). Its gloo timeout is one minute, the job's deadline 240 s.
Cost: 3 s with the pool warm, about a minute from a cold pool with the conversion.
"""

from __future__ import annotations

import pytest
import torch
import torch.utils._pytree as pytree

from tests.distributed import launch_and_load, save_gathered
from tests.test_config import HF, example, raises
from tests.test_micro_batches import LR, assert_same_passes

CHUNK = 5
# (tp, pp, sequence parallel, batchings) in a world of 2. TP2 without SP caught a gradient that
# megatron's copy-to-TP-region backward left un-reduced (``chunked_logits.full_hidden``).
LAYOUTS = [(1, 1, False, ("token_budget", "packed")), (2, 1, True, ("token_budget", "packed")),
           (2, 1, False, ("token_budget",)), (1, 2, False, ("token_budget",))]
CASES = [(tp, pp, sp, b) for tp, pp, sp, batchings in LAYOUTS for b in batchings]


def test_logits_chunk_tokens_is_checked():
    from megatron_oar.config import validate

    with raises(r"train.logits_chunk_tokens=-1: must be >= 0"):
        validate(example("tiny_cpu.yaml", "train.logits_chunk_tokens=-1"), world_size=2, hf_config=HF["tiny"])
    assert example("tiny_cpu.yaml").train.logits_chunk_tokens > 0  # chunked by default
    validate(example("tiny_cpu.yaml", "train.logits_chunk_tokens=0"), world_size=2, hf_config=HF["tiny"])


class _LargestVocabTensor(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the largest tensor (elements) any op allocates (views are not allocations) whose
    last dimension is one of ``widths`` (the rank's vocabulary slice, and its real rows)."""

    def __init__(self, widths: set[int]):
        super().__init__()
        self.widths, self.largest = widths, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage().data_ptr() for a in pytree.tree_leaves((args, kwargs))
                  if isinstance(a, torch.Tensor)}
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if (isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] in self.widths
                    and t.untyped_storage().data_ptr() not in inputs):  # a view allocates nothing
                self.largest = max(self.largest, t.numel())
        return out


def _largest_logits(ckpt: str, chunk: int) -> dict:
    """The old-logprob pass and one update on the test rows at this layout (TP2+SP), under the
    recorder: the largest vocab-wide tensor, the slice width and the largest micro-batch."""
    from pathlib import Path

    from megatron.core import parallel_state as ps
    from transformers import AutoTokenizer

    from megatron_oar.algorithms import PolicyLossConfig
    from megatron_oar.config import ModelConfig, OptimConfig
    from megatron_oar.models import read_hf_config
    from megatron_oar.models.micro_batches import micro_batches
    from megatron_oar.models.padding import sequence_multiple
    from megatron_oar.training.inputs import TrainBatch
    from megatron_oar.training.policy import build_policy
    from megatron_oar.training.policy_passes import old_logprob_pass, update_step
    from tests.test_attribution import SEQ_ADV, make_batch
    from tests.test_micro_batches import BUDGET

    ckpt = Path(ckpt)
    hf = read_hf_config(ckpt / "hf")
    policy = build_policy(hf, ModelConfig(path=str(ckpt), spec="local", sequence_parallel=True),
                          OptimConfig(lr=LR), checkpoint=ckpt, total_optimizer_steps=4)
    seqs = make_batch(AutoTokenizer.from_pretrained(str(ckpt / "hf")))
    batch = TrainBatch(seqs.tokens, seqs.prompt_lens, seqs.lengths, seqs.sample_ids,
                       loss_mask=seqs.response_mask(), rollout_logprobs=torch.zeros(seqs.tokens.shape),
                       seq_adv=SEQ_ADV)
    vocab = hf["vocab_size"]
    local = policy.gpt.output_layer.weight.shape[0]
    valid = min(local, vocab - ps.get_tensor_model_parallel_rank() * local)
    grouping = {"batching": "token_budget", "max_tokens": BUDGET, "logits_chunk": chunk}
    recorder = _LargestVocabTensor({local, valid})
    with recorder:
        batch.old_logprobs, batch.entropy, _ = old_logprob_pass(policy.model, batch, vocab, 1, **grouping)
        batch.advantages = batch.seq_adv[:, None] * batch.loss_mask
        update_step(policy, batch, PolicyLossConfig(entropy_coef=0.01), vocab, 1, **grouping)
    groups = micro_batches(batch.lengths.tolist(), batching="token_budget", rows_per_micro=1,
                           max_tokens=BUDGET, multiple=sequence_multiple(policy.gpt.config))
    tokens = max(len(g) * max(int(batch.lengths[i]) for i in g) for g in groups)
    return {"largest": recorder.largest, "local": local, "micro_tokens": tokens}


def _worker(ckpt: str, out: str) -> None:
    from megatron.core import parallel_state as ps

    from megatron_oar.runtime import ParallelConfig, init_runtime
    from tests.test_micro_batches import _passes
    from tests.test_packing import _emulate_te_thd_attention

    _emulate_te_thd_attention([])
    results = {}
    for tp, pp, sp, batchings in LAYOUTS:
        init_runtime(ParallelConfig(tp=tp, pp=pp, sequence_parallel=sp))
        dp, d = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        rows = list(range(d, 5, dp))
        for batching in batchings:
            for chunk in (0, CHUNK):
                # whole gradients on every DP rank (not the sharded optimizer's reduce-scatter), so
                # that the weights' check below knows which gradients are firm
                results[tp, pp, sp, batching, chunk] = _passes(ckpt, rows, batching, sharded_optimizer=False,
                                                           logits_chunk=chunk, sequence_parallel=sp)
    init_runtime(ParallelConfig(tp=2, pp=1, sequence_parallel=True))
    results["memory"] = {chunk: _largest_logits(ckpt, chunk) for chunk in (0, CHUNK)}
    save_gathered(results, out)


@pytest.fixture(scope="module")
def runs(scaled_checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("chunked_logits") / "runs.pt"
    return launch_and_load(_worker, 2, out, str(scaled_checkpoint))


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp,sp,batching", CASES,
                         ids=[f"tp{t}{'_sp' if s else ''}_pp{p}_{b}" for t, p, s, b in CASES])
def test_chunked_equals_unchunked(runs, tp, pp, sp, batching):
    for rank, res in enumerate(runs):
        whole, chunked = res[tp, pp, sp, batching, 0], res[tp, pp, sp, batching, CHUNK]
        assert whole["logprobs"][whole["valid"]].abs().max() > 1  # not a vacuous comparison
        assert_same_passes(chunked, whole, rank)


@pytest.mark.slow
def test_logits_memory_is_one_chunk(runs):
    for rank, res in enumerate(runs):
        whole, chunked = res["memory"][0], res["memory"][CHUNK]
        local = whole["local"]
        assert whole["largest"] >= whole["micro_tokens"] * local, (rank, whole)  # the old path's logits
        assert 0 < chunked["largest"] <= CHUNK * local, (rank, chunked)


# ---------------------------------------------------------------- tied embeddings at PP2

TIED_DEADLINE_S = 240.0  # the job's own deadline: a deadlocked update fails here, not at pytest's 900 s


def _tied_pp2_worker(ckpt: str, out: str) -> None:
    from megatron_oar.runtime import ParallelConfig, init_runtime
    from tests.test_micro_batches import _passes

    # a collective left waiting (the deadlock this guards against) fails after a minute
    init_runtime(ParallelConfig(pp=2, timeout_minutes=1))
    rows = list(range(5))
    results = {chunk: _passes(ckpt, rows, "token_budget", sharded_optimizer=False, logits_chunk=chunk)
               for chunk in (0, CHUNK)}
    save_gathered(results, out)


@pytest.fixture(scope="module")
def tied_pp2(tmp_path_factory):
    """The scaled tiny Qwen2 with TIED embeddings at PP2 (world 2): the first stage holds the
    embedding, the last the output layer's copy of it, and megatron's ``finalize_model_grads``
    all-reduces their gradients over the embedding group inside the schedule."""
    from checkpoints_convert.convert import hf_to_megatron
    from tests.distributed import launch
    from tests.tiny import make_tiny_qwen2

    root = tmp_path_factory.mktemp("tied_pp2")
    hf = make_tiny_qwen2(root / "hf", tied=True, seed=5, initializer_range=0.3)
    hf_to_megatron(hf, root / "ckpt", progress=False)
    out = root / "runs.pt"
    launch(_tied_pp2_worker, 2, str(root / "ckpt"), str(out), deadline_s=TIED_DEADLINE_S)
    return torch.load(out, weights_only=False)


@pytest.mark.slow
def test_tied_pp2_chunked_update_matches_unchunked(tied_pp2):
    """Chunked logits with tied embeddings at PP2 (issue 39, item 1): the update finishes (it
    deadlocked while ``post_process`` was off in ``finalize_model_grads``), and its gradients
    and updated weights, the tied embedding's included, are the unchunked path's."""
    for rank, res in enumerate(tied_pp2):
        whole, chunked = res[0], res[CHUNK]
        assert whole["logprobs"][whole["valid"]].abs().max() > 1
        assert_same_passes(chunked, whole, rank)
    # the two stages' copies of the tied weight got one gradient and stayed equal
    first, last = tied_pp2[0][CHUNK], tied_pp2[1][CHUNK]
    emb = first["names"].index("embedding.word_embeddings.weight")
    head = last["names"].index("output_layer.weight")
    assert first["grads"][emb].abs().max() > 0
    for kind in ("grads", "weights"):
        a, b = first[kind][emb], last[kind][head]
        assert (a - b).abs().max() <= 1e-6 * a.abs().max(), kind
