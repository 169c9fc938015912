"""Chunked log-probs and entropy from hidden states (``models/chunked_logits.py``,
``train.logits_chunk_tokens``) against the unchunked path (each micro-batch's whole logits).

The config key's check and, on one process, the output weight's gradient over several chunks
against the unchunked fp32 path, accumulated in place into megatron DDP's ``main_grad`` with no
tensor of the weight's shape made in the backward (fp32 and bf16; without ``main_grad`` one fp32
buffer), all fast. Slow, one pooled world of 2 gloo ranks (the scaled tiny Qwen2,
vocabulary 1000 padded to 1024, so TP rank 1 has 24 padded rows) running every layout in one
job: TP1 (as DP2) and TP2 with sequence parallelism, each with token budgets and with packed
micro-batches (through SDPA's THD attention, the local spec's default), TP2 without sequence
parallelism and PP2 with token budgets; at each, the trainer's old-logprob pass (with the probe
teacher), reference pass and one ``update_step`` (KL and entropy terms on), chunks of 5
positions (neither dividing a micro-batch nor the sequence multiple) against chunks of 0
(today's path): log-probs, entropies, the teacher, the loss, the gradient norm, every gradient
and the updated weights agree to fp32 rounding. Then, at TP2+SP, a dispatch-mode recorder sees
every tensor the old-logprob pass and the update create: the largest one with the local
vocabulary as its last dimension is ``chunk x V/TP`` chunked, and at least a whole micro-
batch's ``tokens x V/TP`` unchunked; and in the update's backward the chunked path makes no
tensor of the output weight's shape (the input embedding's own gradient aside), where the
unchunked output layer makes its weight gradient. The same equality on the tied model at TP1
and TP2 (token budgets). Cost: 21-47 s on 2 cores with the pool warm before the tied cases
(load average near 14 for the 47 s; 28 passes, 14 policy builds); with them (12 more passes, 4
builds) the job took 87 s at load 13-20, the tied model's conversion included.

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
from tests.tolerances import reduction_tol

CHUNK = 5
# (tp, pp, sequence parallel, batchings) in a world of 2. TP2 without SP caught a gradient that
# megatron's copy-to-TP-region backward left un-reduced (``chunked_logits.full_hidden``).
LAYOUTS = [(1, 1, False, ("token_budget", "packed")), (2, 1, True, ("token_budget", "packed")),
           (2, 1, False, ("token_budget",)), (1, 2, False, ("token_budget",))]
CASES = [(tp, pp, sp, b) for tp, pp, sp, batchings in LAYOUTS for b in batchings]
# the same on a tied model (the embedding weight is the output weight, its gradient one sum of
# both uses): TP1 and TP2, token budgets
TIED_LAYOUTS = [(1, 1, False, ("token_budget",)), (2, 1, False, ("token_budget",))]
TIED_CASES = [(tp, pp, sp, b, "tied") for tp, pp, sp, batchings in TIED_LAYOUTS for b in batchings]


def test_logits_chunk_tokens_is_checked():
    from megatron_oar.config import validate

    with raises(r"train.logits_chunk_tokens=-1: must be >= 0"):
        validate(example("tiny_cpu.yaml", "train.logits_chunk_tokens=-1"), world_size=2, hf_config=HF["tiny"])
    assert example("tiny_cpu.yaml").train.logits_chunk_tokens > 0  # chunked by default
    validate(example("tiny_cpu.yaml", "train.logits_chunk_tokens=0"), world_size=2, hf_config=HF["tiny"])


class _LargestVocabTensor(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the largest tensor (elements) any op allocates (views are not allocations) whose
    last dimension is one of ``widths`` (the rank's vocabulary slice, and its real rows); and,
    per op, the bytes of every tensor allocated during a backward whose shape is one of
    ``weights`` (the output weight's ``[V/TP, h]``, and its real rows)."""

    def __init__(self, widths: set[int], weights: set[tuple[int, ...]] = frozenset()):
        super().__init__()
        self.widths, self.weights, self.largest = widths, weights, 0
        self.weight_bytes: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage().data_ptr() for a in pytree.tree_leaves((args, kwargs))
                  if isinstance(a, torch.Tensor)}
        backward = torch._C._current_graph_task_id() >= 0  # inside autograd's backward
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if not isinstance(t, torch.Tensor) or t.untyped_storage().data_ptr() in inputs:
                continue  # a view allocates nothing
            if t.dim() >= 2 and t.shape[-1] in self.widths:
                self.largest = max(self.largest, t.numel())
            if backward and tuple(t.shape) in self.weights:
                name = str(func)
                self.weight_bytes[name] = self.weight_bytes.get(name, 0) + t.numel() * t.element_size()
        return out


# The input embedding's own gradient (megatron's VocabParallelEmbedding: F.embedding's backward),
# the one weight-shaped gradient the chunked path leaves to autograd
EMBEDDING_GRAD_OP = "aten.embedding_dense_backward.default"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("main_grad", [True, False], ids=["main_grad", "no_main_grad"])
def test_weight_gradient_accumulates_in_place(monkeypatch, dtype, main_grad):
    """The output weight's gradient over several chunks (TP1, padded vocabulary rows): equal to
    the unchunked fp32 path's, and accumulated in place: into megatron DDP's ``main_grad`` (on
    top of what an earlier micro-batch left there) with no weight-shaped tensor allocated in the
    backward; without ``main_grad``, one float32 buffer (and its cast to a bf16 weight's dtype).
    Before, the backward held a float32 buffer and per chunk a bf16 product and its float32
    copy, about 10 bytes per weight element."""
    from megatron.core import parallel_state

    from megatron_oar.models.chunked_logits import ChunkedTokenStats

    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_world_size", lambda: 1)
    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_rank", lambda: 0)
    rows, vocab, h, n, chunk = 64, 60, 16, 45, 8  # 4 padded rows; 6 chunks, the last short
    g = torch.Generator().manual_seed(0)
    weight = torch.nn.Parameter((torch.randn(rows, h, generator=g) * 0.5).to(dtype))
    hidden = torch.randn(n, h, generator=g).to(dtype).requires_grad_(True)
    targets = torch.randint(0, vocab, (n,), generator=g)
    c_lp, c_ent = torch.randn(n, generator=g), torch.randn(n, generator=g)
    earlier = torch.full((rows, h), 0.25)  # an earlier micro-batch's gradient
    if main_grad:
        weight.main_grad = earlier.clone()
    recorder = _LargestVocabTensor(set(), {(rows, h), (vocab, h)})
    with recorder:
        lp, ent = ChunkedTokenStats.apply(hidden, weight, targets, vocab, chunk, True)
        ((lp * c_lp).sum() + (ent * c_ent).sum()).backward()

    w32 = weight.detach().float().requires_grad_(True)
    h32 = hidden.detach().float().requires_grad_(True)
    logp = torch.nn.functional.linear(h32, w32[:vocab]).log_softmax(-1)
    ref_lp, ref_ent = logp.gather(-1, targets[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)
    ((ref_lp * c_lp).sum() + (ref_ent * c_ent).sum()).backward()
    # fp32: two orders of the same reductions (tests/tolerances.py): the logits over h, the
    # softmax over the vocabulary and back, the gradient's sum over the n tokens. bf16: the
    # gradients are handed back in bf16 (a value rounded to eps/2 = 3.9e-3 of itself) from bf16
    # inputs: 2e-2, about 2.5 bf16 epsilons
    tol = reduction_tol(h, vocab, vocab, h, n) if dtype is torch.float32 else 2e-2
    if main_grad:
        assert weight.grad is None  # nothing left for DDP's hook to add a second time
        got = weight.main_grad - earlier
    else:
        got = weight.grad.float()
    assert (got - w32.grad).abs().max() <= tol * w32.grad.abs().max()
    assert (hidden.grad.float() - h32.grad).abs().max() <= tol * h32.grad.abs().max()
    allowed = 0 if main_grad else rows * h * (4 + (2 if dtype is torch.bfloat16 else 0))
    assert sum(recorder.weight_bytes.values()) <= allowed, recorder.weight_bytes


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
    local, h = policy.gpt.output_layer.weight.shape
    valid = min(local, vocab - ps.get_tensor_model_parallel_rank() * local)
    grouping = {"batching": "token_budget", "max_tokens": BUDGET, "logits_chunk": chunk}
    recorder = _LargestVocabTensor({local, valid}, {(local, h), (valid, h)})
    with recorder:
        batch.old_logprobs, batch.entropy, _ = old_logprob_pass(policy.model, batch, vocab, 1, **grouping)
        batch.advantages = batch.seq_adv[:, None] * batch.loss_mask
        update_step(policy, batch, PolicyLossConfig(entropy_coef=0.01), vocab, 1, **grouping)
    groups = micro_batches(batch.lengths.tolist(), batching="token_budget", rows_per_micro=1,
                           max_tokens=BUDGET, multiple=sequence_multiple(policy.gpt.config))
    tokens = max(len(g) * max(int(batch.lengths[i]) for i in g) for g in groups)
    return {"largest": recorder.largest, "local": local, "micro_tokens": tokens,
            "weight_bytes": recorder.weight_bytes}


def _worker(ckpt: str, tied_ckpt: str, out: str) -> None:
    from megatron.core import parallel_state as ps

    from megatron_oar.runtime import ParallelConfig, init_runtime
    from tests.test_micro_batches import _passes

    results = {}
    for model, tag, layouts in ((ckpt, (), LAYOUTS), (tied_ckpt, ("tied",), TIED_LAYOUTS)):
        for tp, pp, sp, batchings in layouts:
            init_runtime(ParallelConfig(tp=tp, pp=pp, sequence_parallel=sp))
            dp, d = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
            rows = list(range(d, 5, dp))
            for batching in batchings:
                for chunk in (0, CHUNK):
                    # whole gradients on every DP rank (not the sharded optimizer's reduce-scatter),
                    # so that the weights' check below knows which gradients are firm
                    results[(tp, pp, sp, batching, *tag, chunk)] = _passes(
                        model, rows, batching, sharded_optimizer=False, logits_chunk=chunk, sequence_parallel=sp)
    init_runtime(ParallelConfig(tp=2, pp=1, sequence_parallel=True))
    results["memory"] = {chunk: _largest_logits(ckpt, chunk) for chunk in (0, CHUNK)}
    save_gathered(results, out)


@pytest.fixture(scope="module")
def tied_scaled_checkpoint(tmp_path_factory):
    """``scaled_checkpoint``'s model with tied embeddings."""
    from checkpoints_convert.convert import hf_to_megatron
    from tests.tiny import make_tiny_qwen2

    root = tmp_path_factory.mktemp("tied_scaled_checkpoint")
    hf_to_megatron(make_tiny_qwen2(root / "hf", seed=5, initializer_range=0.3, tied=True), root / "ckpt",
                   progress=False)
    return root / "ckpt"


@pytest.fixture(scope="module")
def runs(scaled_checkpoint, tied_scaled_checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("chunked_logits") / "runs.pt"
    return launch_and_load(_worker, 2, out, str(scaled_checkpoint), str(tied_scaled_checkpoint))


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES + TIED_CASES,
                         ids=[f"tp{c[0]}{'_sp' if c[2] else ''}_pp{c[1]}_{c[3]}{'_tied' if len(c) > 4 else ''}"
                              for c in CASES + TIED_CASES])
def test_chunked_equals_unchunked(runs, case):
    for rank, res in enumerate(runs):
        whole, chunked = res[(*case, 0)], res[(*case, CHUNK)]
        assert whole["logprobs"][whole["valid"]].abs().max() > 1  # not a vacuous comparison
        assert_same_passes(chunked, whole, rank)


@pytest.mark.slow
def test_logits_memory_is_one_chunk(runs):
    for rank, res in enumerate(runs):
        whole, chunked = res["memory"][0], res["memory"][CHUNK]
        local = whole["local"]
        assert whole["largest"] >= whole["micro_tokens"] * local, (rank, whole)  # the old path's logits
        assert 0 < chunked["largest"] <= CHUNK * local, (rank, chunked)
        # weight-shaped tensors made in the update's backward: the unchunked output layer's
        # gradient (megatron's ColumnParallelLinear, one per micro-batch) is seen; the chunked
        # path accumulates into main_grad and makes none (the input embedding's own gradient
        # aside)
        output_grads = {op: b for op, b in whole["weight_bytes"].items() if op != EMBEDDING_GRAD_OP}
        assert sum(output_grads.values()) > 0, (rank, whole["weight_bytes"])
        assert set(chunked["weight_bytes"]) <= {EMBEDDING_GRAD_OP}, (rank, chunked["weight_bytes"])


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
