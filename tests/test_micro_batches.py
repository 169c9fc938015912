"""Token-budget micro-batches (``models/micro_batches.py``, ``train.batching``).

The grouping itself on plain lengths; then the trainer's Megatron passes (old-logprob with the
probe teacher, reference log-probs, one ``update_step``) run with ``padded`` and with
``token_budget`` micro-batches on the same rows at TP1, TP2, PP2 and DP2: log-probs, entropies,
the teacher, the loss, the gradients and the updated weights agree at fp32 rounding, and the
token-budget pass ran micro-batches of several shapes, narrower than the padded ones. At DP2,
token-balanced rows (training/dp_split.py) give the update of the strided split.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_oar.models.micro_batches import micro_batches, padding_fraction, token_slots
from tests.distributed import launch_and_load, save_gathered
from tests.test_attribution import SEQ_ADV, make_batch
from tests.test_padding import _probe, _record_lengths
from tests.tolerances import assert_close_to_rounding, tiny_grad_tol, tiny_logprob_tol

BUDGET = 60  # padded tokens per micro-batch: the 5 test rows (widths 13..29) fall into 3 groups
LOGPROB_TOL, GRAD_TOL = tiny_logprob_tol(), tiny_grad_tol()  # tests/tolerances.py
LR = 1e-3  # OptimConfig(lr=...) below


# ----------------------------------------------------------------------------- the grouping

def test_token_budget_groups():
    lengths = [10, 40, 12, 38, 11, 9, 25]
    groups = micro_batches(lengths, batching="token_budget", rows_per_micro=2, max_tokens=80)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))  # every row once
    for g in groups:  # longest first, and within the budget (or alone)
        width = max(lengths[i] for i in g)
        assert len(g) == 1 or len(g) * width <= 80
        assert lengths[g[0]] == width
    assert groups == [[1, 3], [6, 2, 4], [0, 5]]
    # the sequence multiple rounds each group's width up: 16 -> 48 per row for the longest
    assert micro_batches(lengths, batching="token_budget", rows_per_micro=2, max_tokens=80,
                         multiple=16)[0] == [1]
    # a row longer than the budget gets a micro-batch of its own
    assert micro_batches([100, 5, 5], batching="token_budget", rows_per_micro=2, max_tokens=50) == [[0], [1, 2]]


def test_padded_groups_and_errors():
    assert micro_batches([5, 9, 3, 4], batching="padded", rows_per_micro=2) == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match="not divisible by micro_batch_size 3"):
        micro_batches([5, 9, 3, 4], batching="padded", rows_per_micro=3)
    with pytest.raises(ValueError, match="needs max_tokens >= 1"):
        micro_batches([5], batching="token_budget", rows_per_micro=1)
    with pytest.raises(ValueError, match="batching must be one of"):
        micro_batches([5], batching="dynamic", rows_per_micro=1)


def test_padding_fraction_drops_with_token_budgets():
    """Lengths spread 4:1, as reasoning rollouts do: padding to the longest wastes a third or
    more; token budgets leave a few percent."""
    g = torch.Generator().manual_seed(0)
    lengths = (torch.rand(256, generator=g) * 300 + 100).long().tolist()  # 100..400 tokens
    padded = micro_batches(lengths, batching="padded", rows_per_micro=8)
    budget = micro_batches(lengths, batching="token_budget", rows_per_micro=8, max_tokens=8 * 400)
    assert padding_fraction(lengths, padded, width=max(lengths)) > 0.3
    assert padding_fraction(lengths, budget) < 0.05
    processed, real = token_slots(lengths, budget)
    assert real == sum(lengths) and processed >= real


# ----------------------------------------------------------------------------- the passes

def _passes(ckpt: str, rows: list[int], batching: str, sharded_optimizer: bool = True, *,
            logits_chunk: int | None = None, sequence_parallel: bool = False,
            attention: str = "auto", probe_sites: bool = True, temperature: float = 1.0) -> dict:
    """The trainer's Megatron passes on ``rows`` of the test batch; this rank's outputs
    (``sharded_optimizer=False``: DDP all-reduces whole gradients, so ``grads`` are global;
    ``logits_chunk``: ``train.logits_chunk_tokens``, None for the passes' default;
    ``attention``: ``model.attention``; ``probe_sites=False``: the old-logprob pass without
    the probe teacher, as the trainer runs it for credit without attribution; ``temperature``:
    ``rollout.temperature``, the passes' softmax(logits / T))."""
    from transformers import AutoTokenizer

    from megatron_oar.algorithms import PolicyLossConfig
    from megatron_oar.attribution import ProbeConfig, locate_probes
    from megatron_oar.attribution.spans import SpanFinder
    from megatron_oar.config import ModelConfig, OptimConfig
    from megatron_oar.models import read_hf_config
    from megatron_oar.training.inputs import TrainBatch
    from megatron_oar.training.policy import build_policy
    from megatron_oar.training.policy_passes import old_logprob_pass, reference_logprobs, update_step

    ckpt = Path(ckpt)
    policy = build_policy(read_hf_config(ckpt / "hf"),
                          ModelConfig(path=str(ckpt), spec="local", sequence_parallel=sequence_parallel,
                                      attention=attention),
                          OptimConfig(lr=LR, use_distributed_optimizer=sharded_optimizer), checkpoint=ckpt,
                          total_optimizer_steps=4)
    vocab = read_hf_config(ckpt / "hf")["vocab_size"]
    tok = AutoTokenizer.from_pretrained(str(ckpt / "hf"))
    seqs = make_batch(tok)
    full = TrainBatch(seqs.tokens, seqs.prompt_lens, seqs.lengths, seqs.sample_ids,
                      loss_mask=seqs.response_mask(), rollout_logprobs=torch.zeros(seqs.tokens.shape),
                      seq_adv=SEQ_ADV)
    batch = full.select(rows)
    grouping = {"batching": batching, "max_tokens": BUDGET,
                **({} if logits_chunk is None else {"logits_chunk": logits_chunk}),
                **({} if temperature == 1.0 else {"temperature": temperature})}
    shapes, key = {}, [""]
    hook = _record_lengths(policy.gpt, shapes, key)
    probe = ProbeConfig(kind="answer_mean")
    sites = locate_probes(batch, probe, 3, SpanFinder(tok, probe.answer_pattern)) if probe_sites else None
    out = {}
    key[0] = "old_logprob"
    batch.old_logprobs, batch.entropy, teacher = old_logprob_pass(policy.model, batch, vocab, 1,
                                                                  sites=sites, **grouping)
    out.update(logprobs=batch.old_logprobs, entropy=batch.entropy, teacher=_probe(teacher))
    key[0] = "reference"
    batch.ref_logprobs = reference_logprobs(policy.model, batch, vocab, 1, **grouping)
    out["ref_logprobs"] = batch.ref_logprobs
    batch.advantages = batch.seq_adv[:, None] * batch.loss_mask
    key[0] = "update"
    result = update_step(policy, batch, PolicyLossConfig(kl_coef=0.1, entropy_coef=0.01), vocab, 1,
                         **grouping)
    hook.remove()
    out.update(loss=result.stats["loss"], grad_norm=result.grad_norm, applied=result.applied,
               grads=[p.main_grad.clone() for p in policy.gpt.parameters()],
               weights=[p.detach().clone() for p in policy.gpt.parameters()], widths=shapes,
               names=[n for n, _ in policy.gpt.named_parameters()],
               valid=batch.positions() < batch.lengths[:, None])
    return out


def _worker(ckpt: str, tp: int, pp: int, out: str) -> None:
    from megatron.core import parallel_state as ps
    from transformers import AutoTokenizer

    from megatron_oar.runtime import ParallelConfig, init_runtime

    init_runtime(ParallelConfig(tp=tp, pp=pp))
    dp, d = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    rows = list(range(d, 5, dp))  # the trainer's split of the step's rows over DP
    results = {b: _passes(ckpt, rows, b) for b in ("padded", "token_budget")}
    if dp > 1:  # 4 of the rows, strided over DP and token-balanced (training/dp_split.py)
        from megatron_oar.training.dp_split import dp_assignment

        lengths = make_batch(AutoTokenizer.from_pretrained(str(Path(ckpt) / "hf"))).lengths[:4].tolist()
        for name, balance in (("strided", False), ("balanced", True)):
            split = dp_assignment(lengths, dp, balance=balance)
            results[name] = {"rows": split, **_passes(ckpt, split[d], "token_budget", sharded_optimizer=False)}
    save_gathered(results, out)


@pytest.fixture(scope="module", params=[(1, 1, 1), (2, 1, 2), (1, 2, 2), (1, 1, 2)],
                ids=["tp1", "tp2", "pp2", "dp2"])
def runs(request, scaled_checkpoint, tmp_path_factory):
    tp, pp, world = request.param
    out = tmp_path_factory.mktemp("micro_batches") / f"tp{tp}pp{pp}w{world}.pt"
    return launch_and_load(_worker, world, out, str(scaled_checkpoint), tp, pp)


def assert_same_passes(got: dict, want: dict, rank: int) -> None:
    """Two runs of ``_passes`` agree to fp32 rounding: log-probs, entropies and reference
    log-probs on the valid tokens, the probe teacher, the update's loss, grad norm, gradients and
    updated weights (the packing and chunked-logits tests use it too). Tolerances:
    tests/tolerances.py, from the tiny model's reductions on the test batch."""
    valid = want["valid"]  # past a row's end the padded path scores pad tokens; never read
    for name in ("logprobs", "entropy", "ref_logprobs"):
        assert got[name].shape == want[name].shape
        assert_close_to_rounding(got[name][valid], want[name][valid], LOGPROB_TOL, f"rank {rank}: {name}")
    for g, w in zip(got["teacher"], want["teacher"]):
        assert_close_to_rounding(g, w, LOGPROB_TOL, f"rank {rank}: teacher")
    assert_same_update(got, want, f"rank {rank}")


def assert_same_update(got: dict, want: dict, where: str, lr: float = LR, *, grad_tol: float = GRAD_TOL,
                       logprob_tol: float = LOGPROB_TOL) -> None:
    """Two runs of one ``update_step`` (Adam, learning rate ``lr``) agree to fp32 rounding: both
    applied, loss, grad norm, gradients and updated weights (tests/test_loss_layouts.py and
    tests/test_padding.py too). Tolerances: tests/tolerances.py (``grad_tol``, default
    :data:`GRAD_TOL`, for what went through the backward, ``logprob_tol``, default
    :data:`LOGPROB_TOL`, for the loss: the tiny Qwen2's; another model passes its own)."""
    assert want["applied"] and got["applied"], where
    assert got["loss"] == pytest.approx(want["loss"], rel=logprob_tol), where
    assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=grad_tol), where
    for i, (g, w) in enumerate(zip(got["grads"], want["grads"])):
        assert_close_to_rounding(g, w, grad_tol, f"{where}: grads[{i}]")
    # Adam's first step is lr * g / (|g| + eps): where a gradient is within rounding of 0 its
    # sign, and so the step, is rounding; where it is firmly away from 0 (twice the gradients'
    # tolerance) the updated weights agree
    for i, (g, w, grad) in enumerate(zip(got["weights"], want["weights"], want["grads"])):
        firm = grad.abs() > 2 * grad_tol * grad.abs().max()
        assert_close_to_rounding(g[firm], w[firm], grad_tol, f"{where}: updated weights[{i}]")
        assert (g - w).abs().max() <= 2 * lr * (1 + grad_tol), f"{where}: updated weights[{i}]"


@pytest.mark.slow
def test_token_budget_equals_padded(runs):
    for rank, res in enumerate(runs):
        assert_same_passes(res["token_budget"], res["padded"], rank)


@pytest.mark.slow
def test_token_budget_runs_narrower_micro_batches(runs):
    narrower = set()
    for res in runs:
        padded, budget = res["padded"]["widths"], res["token_budget"]["widths"]
        for name in ("old_logprob", "reference", "update"):
            if not budget.get(name):  # a pipeline stage that only receives activations
                continue
            assert len(padded[name]) == 1, (name, padded[name])  # one width: the longest row's
            assert max(budget[name]) <= max(padded[name]), (name, budget[name], padded[name])
            if min(budget[name]) < max(padded[name]):
                narrower.add(name)
    # rows of widths 13..29 in budgets of 60 tokens: some micro-batch runs narrower on some rank
    assert narrower == {"old_logprob", "reference", "update"}


@pytest.mark.slow
def test_dp_token_balancing_changes_only_rounding(runs):
    if "balanced" not in runs[0]:
        pytest.skip("a DP1 layout")
    for rank, res in enumerate(runs):
        strided, balanced = res["strided"], res["balanced"]
        assert strided["rows"] != balanced["rows"], "the test needs an assignment that differs"
        # global gradients (all-reduced over DP): the update's checks
        assert_same_update(balanced, strided, f"rank {rank}")


# ----------------------------------------------------------------------------- FP8 at DP > 1
# TE's delayed scaling all-reduces amax over TP x DP at every FP8 autocast exit of a grad-enabled
# pass (and in its backward): DP ranks running different numbers of micro-batches in the update
# would pair those collectives wrongly and hang. A CPU model cannot run TE's FP8, so the FP8 run
# switches the agreement on through ``models.equal_calls.equal_calls`` (what ``model.fp8`` set
# decides) and megatron's schedule is wrapped to record each pass's micro-batch count.

def _fp8_worker(ckpt: str, out: str) -> None:
    from megatron.core import parallel_state as ps

    from megatron_oar.models import equal_calls, forward
    from megatron_oar.runtime import ParallelConfig, init_runtime

    init_runtime(ParallelConfig(tp=1, pp=1))
    dp, d = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    rows = list(range(d, 5, dp))  # widths 27, 15, 28 and 26, 29: 2 and 1 micro-batches of 60 tokens
    real_schedule, real_rule = forward.get_forward_backward_func, equal_calls.equal_calls
    results = {}
    try:
        for fp8 in (False, True):
            calls = []  # (num_microbatches, forward_only, autograd on) per pass

            def recording():
                schedule = real_schedule()

                def run(**kw):
                    calls.append((kw["num_microbatches"], kw["forward_only"], torch.is_grad_enabled()))
                    return schedule(**kw)
                return run

            forward.get_forward_backward_func = recording
            # model.fp8 set or not: FP8's rule, for the passes with a backward
            equal_calls.equal_calls = lambda config, forward_only, fp8=fp8: fp8 and not forward_only
            results[fp8] = {"calls": calls,
                            **_passes(ckpt, rows, "token_budget", sharded_optimizer=False)}
    finally:
        forward.get_forward_backward_func = real_schedule
        equal_calls.equal_calls = real_rule
    save_gathered(results, out)


@pytest.fixture(scope="module")
def fp8_runs(scaled_checkpoint, tmp_path_factory):
    """Per DP rank (DP2): ``{False: the run as without FP8, True: the run with FP8's agreement}``."""
    out = tmp_path_factory.mktemp("fp8_micro_batches") / "dp2.pt"
    return launch_and_load(_fp8_worker, 2, out, str(scaled_checkpoint))


def _grad_passes(calls) -> list[int]:
    return [n for n, forward_only, _ in calls if not forward_only]


@pytest.mark.slow
def test_fp8_update_runs_equal_micro_batch_counts_over_dp(fp8_runs):
    plain = [_grad_passes(r[False]["calls"]) for r in fp8_runs]
    assert plain == [[2], [1]], "the test needs DP ranks with different micro-batch counts"
    assert [_grad_passes(r[True]["calls"]) for r in fp8_runs] == [[2], [2]]
    for res in fp8_runs:  # old-logprob and reference: under no_grad, where TE reduces no amax
        for n, forward_only, grad_on in res[True]["calls"]:
            assert not forward_only or not grad_on, "a forward-only pass ran with autograd on"


@pytest.mark.slow
def test_fp8_filler_micro_batches_change_nothing(fp8_runs):
    for rank, res in enumerate(fp8_runs):
        plain, filled = res[False], res[True]
        assert_same_update(filled, plain, f"rank {rank}")  # global gradients: all-reduced over DP
