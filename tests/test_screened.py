"""Screened OAR-P: exact OAR-P perturbation only on OAR-G's top ``screen_fraction`` tokens.

On the tiny model and batch of tests/test_attribution.py: q = 1 is exact OAR-P; for q < 1 the
selected tokens are OAR-G's top ceil(q * n) per row and carry the exact values, the others rank
below them in OAR-G's order, and only the selected tokens cost a masked copy; rows that are not
scored stay 0; TP=2 equals TP=1, and equals itself under full activation recompute (the
recompute model built in the same TP2 world: a few seconds). The rescaling rule's edge cases are
tested on plain tensors.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from megatron_oar.attribution import AttributionConfig, ProbeConfig
from megatron_oar.attribution.importance_passes import merge_screened, screen_count, screen_positions
from tests.distributed import launch, save_gathered
from tests.test_attribution import SEQ_ADV, make_batch, recompute_tolerance, rel_error
from tests.tiny import SMALL

SIGMA = 1e-2  # as in test_attribution: keeps OAR-G's fp32 rounding floor (~1e-5) below the TP tolerance
EXACT = dict(perturb_micro_batch_size=4, length_bucket=8)
CASES = {
    "exact": AttributionConfig(method="oar_p", **EXACT),
    "oar_g": AttributionConfig(method="oar_g", sigma=SIGMA),
    **{f"q{q}": AttributionConfig(method="oar_p_screened", sigma=SIGMA, screen_fraction=q, **EXACT)
       for q in (1.0, 0.5, 0.2)},
    "q0.2_uniform": AttributionConfig(method="oar_p_screened", sigma=SIGMA, screen_fraction=0.2,
                                      probe=ProbeConfig(no_answer="uniform"), **EXACT),
}
TP_CASES = ("q0.5", "q0.2")


def _compute(ckpt: str, tp: int, names, recompute: str | None = None, init: bool = True) -> dict:
    """{case: (importance, score_mask, stats)} on this rank, plus the all-zero-advantage case;
    ``recompute``: of a model built with that ``model.recompute``; ``init``: start the runtime."""
    from transformers import AutoTokenizer

    from megatron_oar.attribution import compute_importance
    from megatron_oar.models import ModelOptions, build_gpt_model, read_hf_config
    from megatron_oar.models.model_checkpoint import load_model
    from megatron_oar.runtime import ParallelConfig, init_runtime

    if init:
        init_runtime(ParallelConfig(tp=tp, pp=1))
    model = build_gpt_model(read_hf_config(Path(ckpt) / "hf"), ModelOptions(recompute=recompute))
    meta = load_model(model, ckpt)
    tok = AutoTokenizer.from_pretrained(str(Path(ckpt) / "hf"))
    batch = make_batch(tok)
    out = {}
    for name in names:
        attr = compute_importance(model, batch, CASES[name], vocab_size=meta.vocab_size, seq_adv=SEQ_ADV,
                                  step=3, tokenizer=tok)
        out[name] = (attr.importance, attr.score_mask, attr.stats)
    attr = compute_importance(model, batch, CASES["q0.2"], vocab_size=meta.vocab_size,
                              seq_adv=torch.zeros_like(SEQ_ADV), step=3, tokenizer=tok)
    out["zero_adv"] = (attr.importance, attr.score_mask, attr.stats)
    return out


def _tp_worker(ckpt: str, tp: int, out: str) -> None:
    results = _compute(ckpt, tp, TP_CASES)
    # screened OAR-P's OAR-G stage under full recompute (models/recompute.py), the same world
    results["recompute"] = _compute(ckpt, tp, TP_CASES, recompute="full", init=False)
    save_gathered(results, out)


@pytest.fixture(scope="module")
def tiny(scaled_checkpoint, tmp_path_factory):
    """(root, checkpoint, TP=1 results): attribution in this process, world size 1."""
    from megatron_oar.runtime import destroy_runtime

    root = tmp_path_factory.mktemp("screened")
    # larger weights than HF's default, so masking a token moves the probe well above fp32 rounding
    ckpt = scaled_checkpoint
    try:
        results = _compute(str(ckpt), 1, CASES)
    finally:
        destroy_runtime()
    return root, ckpt, results


def expected_selection(g: torch.Tensor, mask: torch.Tensor, q: float) -> torch.Tensor:
    """OAR-G's top ceil(q * n) scored tokens per row, written independently of the package."""
    sel = torch.zeros_like(mask)
    for i in range(mask.shape[0]):
        pos = mask[i].nonzero().flatten().tolist()
        k = max(1, math.ceil(q * len(pos) - 1e-9)) if pos else 0
        sel[i, sorted(pos, key=lambda t: (-float(g[i, t]), t))[:k]] = True
    return sel


def test_q1_is_exact_oar_p(tiny):
    _, _, r = tiny
    exact, mask, stats = r["exact"]
    got, got_mask, got_stats = r["q1.0"]
    assert torch.equal(got, exact) and torch.equal(got_mask, mask)
    assert got_stats["masked_forwards"] == stats["masked_forwards"] == float(mask.sum())
    assert got_stats["screened_out_tokens"] == 0


@pytest.mark.parametrize("q", [0.5, 0.2])
def test_screened_selection_values_order_and_cost(tiny, q):
    _, _, r = tiny
    exact, mask, _ = r["exact"]
    g = r["oar_g"][0]
    got, got_mask, stats = r[f"q{q}"]
    assert torch.equal(got_mask, mask)
    sel = expected_selection(g, mask, q)
    unsel = mask & ~sel
    assert unsel.any(), "the test batch should leave tokens unselected"
    # selected: the exact OAR-P values (up to fp32 rounding: the copies share micro-batches with
    # other copies than in the exact run, which changes GEMM blocking; q = 1 above is bitwise)
    assert torch.allclose(got[sel], exact[sel], rtol=2e-5, atol=0)
    for i in range(mask.shape[0]):
        if not unsel[i].any():
            continue
        s, u = got[i, sel[i]], got[i, unsel[i]]
        assert torch.isfinite(u).all() and (u >= 0).all()
        assert u.max() < s.min(), f"row {i}: an unselected token ranks above a selected one"
        # unselected keep OAR-G's order: sorted by OAR-G, the screened values never increase
        order = torch.sort(g[i, unsel[i]], descending=True, stable=True).indices
        assert (u[order].diff() <= 0).all(), f"row {i}: OAR-G's order not kept"
        assert len(u) == 1 or u.unique().numel() > 1  # a rescaling, not a constant
    # cost: one masked copy per selected token, sum over rows of ceil(q * n_row)
    n_rows = mask.sum(-1)
    want = sum(max(1, math.ceil(q * int(n) - 1e-9)) for n in n_rows if n > 0)
    assert stats["masked_forwards"] == want == float(sel.sum())
    assert stats["screened_out_tokens"] == float(mask.sum()) - want


def test_unscored_rows_untouched(tiny):
    _, _, r = tiny
    for name in ("q0.2", "q0.2_uniform", "zero_adv"):
        imp, mask, _ = r[name]
        assert (imp[~mask] == 0).all(), name
        assert not mask[2].any() and (imp[2] == 0).all(), name  # row 2 has zero advantage
    imp, mask, stats = r["q0.2_uniform"]  # row 3 has no answer: not scored under no_answer=uniform
    assert not mask[3].any() and (imp[3] == 0).all() and mask[0].any()
    imp, mask, stats = r["zero_adv"]
    assert not mask.any() and (imp == 0).all()
    assert stats["masked_forwards"] == 0 and stats["screened_out_tokens"] == 0


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    def ranks(x):  # average ranks for ties
        x = x.double()
        return torch.tensor([(x < v).sum() + ((x == v).sum() - 1) / 2 for v in x], dtype=torch.float64)
    ra, rb = ranks(a), ranks(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    denom = (ra.norm() * rb.norm())
    return float((ra @ rb) / denom) if denom > 0 else 1.0


def top_recall(got: torch.Tensor, want: torch.Tensor, frac: float = 0.2) -> float:
    k = max(1, math.ceil(frac * len(want) - 1e-9))
    top_got = set(torch.sort(got, descending=True, stable=True).indices[:k].tolist())
    top_want = set(torch.sort(want, descending=True, stable=True).indices[:k].tolist())
    return len(top_got & top_want) / k


def test_report_agreement_with_exact(tiny):
    """Prints (does not assert) how well screened OAR-P matches exact OAR-P on this batch."""
    _, _, r = tiny
    exact, mask, exact_stats = r["exact"]
    for name in ("oar_g", "q0.5", "q0.2"):
        got, _, stats = r[name]
        rows = [i for i in range(mask.shape[0]) if mask[i].sum() >= 2]
        rho = [spearman(got[i, mask[i]], exact[i, mask[i]]) for i in rows]
        rec = [top_recall(got[i, mask[i]], exact[i, mask[i]]) for i in rows]
        # forward-equivalents: a masked copy is one forward; OAR-G (the screen) is a noisy
        # forward plus an input-gradient backward, about 2 per scored sequence
        fe = stats["masked_forwards"] + 2 * stats["scored_sequences"]
        print(f"\n{name}: Spearman per row {[round(x, 3) for x in rho]} (mean {sum(rho) / len(rho):.3f}); "
              f"top-20% recall per row {[round(x, 2) for x in rec]} (mean {sum(rec) / len(rec):.2f}); "
              f"masked copies {stats['masked_forwards']:.0f} of {exact_stats['masked_forwards']:.0f} "
              f"(scored tokens per row {mask.sum(-1).tolist()}); forward-equivalents {fe:.0f} vs "
              f"{exact_stats['masked_forwards']:.0f} exact = {fe / exact_stats['masked_forwards']:.0%}; "
              f"wall {stats['seconds']:.2f}s vs {exact_stats['seconds']:.2f}s exact")


@pytest.mark.slow
def test_tp2_equals_tp1(tiny):
    root, ckpt, r = tiny
    out = root / "screened_tp2.pt"
    launch(_tp_worker, 2, str(ckpt), 2, str(out))
    tol = recompute_tolerance(max(SMALL["hidden_size"], SMALL["intermediate_size"]), SMALL["num_hidden_layers"])
    for rank, results in enumerate(torch.load(out, weights_only=False)):
        for name in TP_CASES:
            got, mask, stats = results[name]
            want, want_mask, want_stats = r[name]
            err = rel_error(got, want)
            print(f"tp=2 rank={rank} {name}: rel err {err:.2e}")
            assert torch.equal(mask, want_mask)
            assert stats["masked_forwards"] == want_stats["masked_forwards"]
            assert err <= 1e-4, f"{name} rank {rank}: {err:.2e}"
            # under full recompute: the same tokens selected (as many copies), the same scores
            got_rc, mask_rc, stats_rc = results["recompute"][name]
            err_rc = rel_error(got_rc, got)
            print(f"tp=2 rank={rank} {name} under full recompute: rel err {err_rc:.2e} (tolerance {tol:.2e})")
            assert torch.equal(mask_rc, mask) and stats_rc["masked_forwards"] == stats["masked_forwards"]
            assert err_rc <= tol, f"{name} rank {rank} under full recompute: {err_rc:.2e}"


# ----------------------------------------------------------------- the rescaling rule, on tensors

def test_screen_count():
    assert [screen_count(n, 0.2) for n in (0, 1, 4, 5, 6, 15, 100)] == [0, 1, 1, 1, 2, 3, 20]
    assert screen_count(7, 1.0) == 7 and screen_count(3, 0.999) == 3


def test_merge_edge_cases():
    mask = torch.tensor([[1, 1, 1, 1, 1, 0]] * 5, dtype=torch.bool)
    g = torch.tensor([[5.0, 4.0, 3.0, 3.0, 0.0, 9.0],   # ties and a zero among the unselected
                      [5.0, 4.0, 4.0, 1.0, 0.5, 0.0],   # a tie at the cut: 4.0 selected, 4.0 not
                      [0.0, 0.0, 0.0, 0.0, 0.0, 0.0],   # g_cut == 0
                      [5.0, 4.0, 3.0, 2.0, 1.0, 0.0],   # m == 0
                      [5.0, 4.0, 3.0, 2.0, 1.0, 0.0]])  # a row that is not scored
    exact = torch.tensor([[0.2, 0.1, 0, 0, 0, 0], [1.0, 2.0, 0, 0, 0, 0], [0.3, 0.4, 0, 0, 0, 0],
                          [0.0, 0.7, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0]])
    sel = screen_positions(g, mask, [0, 1, 2, 3], 0.4)
    assert sel.sum(-1).tolist() == [2, 2, 2, 2, 0]
    assert sel[1, :3].tolist() == [True, True, False]  # tie at the cut: the earlier position
    out = merge_screened(exact * sel, g, sel, mask)
    assert torch.isfinite(out).all() and (out >= 0).all()
    assert torch.allclose(out[0, 2:5], torch.tensor([0.1 * 3 / 4, 0.1 * 3 / 4, 0.0]))
    assert out[1, 2] < 1.0 and out[1, 2] == torch.nextafter(torch.tensor(1.0), torch.tensor(0.0))
    assert out[1, 3] > out[1, 4] > 0
    assert (out[2, 2:5] == 0).all() and (out[3, 2:5] == 0).all()
    assert (out[4] == 0).all() and (out[:, 5] == 0).all()
    assert torch.equal(out[sel], exact[sel])
    one = torch.tensor([[0, 1, 0]], dtype=torch.bool)  # one scored token: selected, nothing to rescale
    assert torch.equal(merge_screened(torch.tensor([[0, 0.5, 0]]), torch.ones(1, 3),
                                      screen_positions(torch.ones(1, 3), one, [0], 0.2), one),
                       torch.tensor([[0, 0.5, 0]]))


def test_work_counted_in_tokens(tiny):
    """The stats the trainer logs for `oar bench attribution`: OAR-G runs over whole scored
    sequences, each OAR-P copy is a forward over its sequence."""
    from transformers import AutoTokenizer

    _, ckpt, r = tiny
    lengths = make_batch(AutoTokenizer.from_pretrained(str(Path(ckpt) / "hf"))).lengths
    exact, mask, stats = r["exact"]
    rows = mask.any(-1)
    assert stats["oar_g_tokens"] == 0
    assert stats["masked_copy_tokens"] == float((mask.sum(-1) * lengths).sum())
    _, _, s = r["q0.5"]
    sel = expected_selection(r["oar_g"][0], mask, 0.5)
    assert s["oar_g_tokens"] == float(lengths[rows].sum())
    assert s["masked_copy_tokens"] == float((sel.sum(-1) * lengths).sum())
    assert r["oar_g"][2]["oar_g_tokens"] == float(lengths[rows].sum())
    assert r["oar_g"][2]["masked_copy_tokens"] == 0
