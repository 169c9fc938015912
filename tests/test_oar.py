"""OAR reshaping (Eqs. 14-17): hand-computed cases, a scalar reference, edge cases, properties."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_oar.algorithms.oar import (
    bilevel_gate,
    bilevel_weights,
    normalize_importance,
    oar_weights,
    reshape_advantages,
    row_quantile,
)

EPS = 1e-6


# --- a scalar, loop-based reference of the paper's equations -------------------------------------

def reference_weights(importance, valid, tau, beta, tau_mode, floor=0.0, eps=EPS):
    """Eqs. 14, 16, 17 on one row of python floats (valid tokens are all scored)."""
    idx = [i for i, v in enumerate(valid) if v]
    out = [0.0] * len(importance)
    if not idx:
        return out
    bar = [math.log1p(importance[i]) for i in idx]
    lo, hi = min(bar), max(bar)
    norm = [(b - lo) / (hi - lo + eps) for b in bar]
    if max(norm) == min(norm):
        omega = [1.0] * len(norm)
    else:
        if tau_mode == "quantile":
            s = sorted(norm)
            pos = tau * (len(s) - 1)
            f = math.floor(pos)
            c = math.ceil(pos)
            thr = s[f] + (s[c] - s[f]) * (pos - f)
        else:
            thr = tau
        omega = [max(n / (thr + eps), floor) if n < thr else 1 + beta * (n - thr) / (1 - thr + eps)
                 for n in norm]
    total = sum(omega)
    for i, w in zip(idx, omega):
        out[i] = w * len(idx) / total
    return out


# --- Eq. 14 ----------------------------------------------------------------------------------------

def test_normalize_hand_computed():
    imp = torch.tensor([[0.0, math.e - 1, math.e ** 2 - 1, 123.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    out = normalize_importance(imp, mask, eps=EPS)
    torch.testing.assert_close(out, torch.tensor([[0.0, 1 / (2 + EPS), 2 / (2 + EPS), 0.0]]))


def test_normalize_rejects_nonfinite_naming_rows():
    imp = torch.zeros(3, 4)
    imp[2, 1] = float("nan")
    with pytest.raises(ValueError, match=r"rows \[2\]"):
        normalize_importance(imp, torch.ones(3, 4))
    imp[2, 1] = float("inf")
    with pytest.raises(ValueError, match="NaN or inf"):
        normalize_importance(imp, torch.ones(3, 4))


def test_normalize_negative():
    with pytest.raises(ValueError, match=">= 0"):
        normalize_importance(torch.tensor([[1.0, -0.5]]), torch.ones(1, 2))
    out = normalize_importance(torch.tensor([[1.0, -1e-9]]), torch.ones(1, 2))  # rounding noise
    assert out[0, 1] == 0


def test_normalize_upcasts_bf16():
    out = normalize_importance(torch.tensor([[0.0, 1.0, 3.0]], dtype=torch.bfloat16), torch.ones(1, 3))
    assert out.dtype == torch.float32


# --- Eqs. 16-17 ------------------------------------------------------------------------------------

def test_bilevel_value_mode_hand_computed():
    norm = torch.tensor([[0.0, 0.25, 0.5, 1.0]])
    w = bilevel_weights(norm, torch.ones(1, 4), tau=0.5, beta=2.0, tau_mode="value", eps=1e-12)
    omega = torch.tensor([[0.0, 0.5, 1.0, 3.0]])  # suppress 0/.5, .25/.5; threshold 1; 1+2*(.5/.5)
    torch.testing.assert_close(w, omega * 4 / 4.5)


def test_bilevel_quantile_threshold_is_torch_quantile():
    x = torch.rand(5, 9)
    mask = torch.rand(5, 9) > 0.3
    mask[:, 0] = True
    thr = row_quantile(x, mask, 0.4)
    for b in range(5):
        assert thr[b, 0] == pytest.approx(float(torch.quantile(x[b][mask[b]], 0.4)), abs=1e-6)


def test_paper_setting_boosts_top_60_percent():
    imp = torch.arange(10.0).unsqueeze(0) ** 2
    w = oar_weights(imp, torch.ones(1, 10), tau=0.4, beta=2.0)
    gate = w / w[0, 4]  # renormalisation is one factor per row; the 5th of 10 sits nearest tau=0.4
    assert (w[0, :4] < w[0, 4:5]).all()
    assert (gate[0, 4:] >= gate[0, 4] - 1e-6).all()
    # 6 of 10 tokens are at or above the 0.4-quantile
    norm = normalize_importance(imp, torch.ones(1, 10))
    assert int((norm >= row_quantile(norm, torch.ones(1, 10, dtype=torch.bool), 0.4)).sum()) == 6


@pytest.mark.parametrize("tau_mode", ["quantile", "value"])
def test_boost_only_and_suppress_only(tau_mode):
    imp = torch.tensor([[0.1, 0.5, 2.0, 7.0, 3.0]])
    mask = torch.ones(1, 5)
    norm = normalize_importance(imp, mask)
    thr0 = row_quantile(norm, mask.bool(), 0.0) if tau_mode == "quantile" else 0.0
    thr1 = row_quantile(norm, mask.bool(), 1.0) if tau_mode == "quantile" else 1.0
    assert (bilevel_gate(norm, thr0, 2.0) >= 1).all()  # tau = 0: boost-only
    assert (bilevel_gate(norm, thr1, 2.0) <= 1).all()  # tau = 1: suppress-only
    for tau in (0.0, 1.0):
        w = bilevel_weights(norm, mask, tau=tau, tau_mode=tau_mode)
        assert torch.isfinite(w).all()
        torch.testing.assert_close(w.sum(), torch.tensor(5.0))


def test_floor_bounds_suppressed_weights():
    norm = normalize_importance(torch.tensor([[0.0, 0.1, 5.0, 9.0]]), torch.ones(1, 4))
    plain = bilevel_weights(norm, torch.ones(1, 4), tau=0.5, tau_mode="value")
    floored = bilevel_weights(norm, torch.ones(1, 4), tau=0.5, tau_mode="value", floor=0.3)
    assert plain[0, 0] == 0
    ref = reference_weights([0.0, 0.1, 5.0, 9.0], [1, 1, 1, 1], 0.5, 2.0, "value", floor=0.3)
    torch.testing.assert_close(floored[0], torch.tensor(ref), rtol=1e-5, atol=1e-6)
    assert floored[0, 0] > 0


@pytest.mark.parametrize("bad", [dict(tau=1.5), dict(beta=-1.0), dict(tau_mode="percentile"),
                                 dict(floor=2.0), dict(eps=0.0)])
def test_option_errors(bad):
    with pytest.raises(ValueError):
        bilevel_weights(torch.zeros(1, 3), torch.ones(1, 3), **bad)


# --- edge cases ------------------------------------------------------------------------------------

def test_edge_cases():
    imp = torch.tensor([
        [3.0, 0.0, 0.0, 0.0],   # one valid token
        [2.0, 2.0, 2.0, 2.0],   # all-equal importance
        [0.0, 0.0, 0.0, 0.0],   # fully masked row
        [1.0, 4.0, 0.5, 9.0],   # ordinary row, zero advantage
    ])
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0], [1, 1, 1, 1]])
    for tau_mode in ("quantile", "value"):
        w = oar_weights(imp, mask, tau_mode=tau_mode)
        assert torch.isfinite(w).all()
        assert w[0].tolist() == [1.0, 0.0, 0.0, 0.0]
        assert w[1].tolist() == [1.0] * 4
        assert w[2].tolist() == [0.0] * 4
        adv = reshape_advantages(torch.tensor([1.5, -2.0, 1.0, 0.0]), imp, mask, tau_mode=tau_mode)
        assert adv[0].tolist() == [1.5, 0.0, 0.0, 0.0]
        assert adv[1].tolist() == [-2.0] * 4
        assert adv[2].tolist() == [0.0] * 4
        assert adv[3].tolist() == [0.0] * 4


def test_unscored_tokens_keep_weight_one():
    imp = torch.tensor([[0.1, 5.0, 0.3, 2.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 0]])
    score = torch.tensor([[1, 1, 1, 0, 0, 0]])  # positions 3, 4: the answer span
    w = oar_weights(imp, mask, score_mask=score)
    assert w[0, 3:].tolist() == [1.0, 1.0, 0.0]
    torch.testing.assert_close(w[0, :3].sum(), torch.tensor(3.0))
    torch.testing.assert_close(w.sum(), torch.tensor(5.0))
    ref = reference_weights([0.1, 5.0, 0.3], [1, 1, 1], 0.4, 2.0, "quantile")
    torch.testing.assert_close(w[0, :3], torch.tensor(ref), rtol=1e-5, atol=1e-6)
    # unscored tokens' importance is ignored, even when it is garbage
    imp[0, 3] = float("nan")
    assert torch.equal(oar_weights(imp, mask, score_mask=score), w)


def test_reshape_is_mass_preserving_and_checks_shapes():
    imp = torch.rand(3, 7) * 10
    mask = torch.ones(3, 7)
    adv = torch.tensor([1.0, -0.5, 2.0])
    out = reshape_advantages(adv, imp, mask)
    torch.testing.assert_close(out.sum(-1), adv * 7)
    with pytest.raises(ValueError, match="seq_adv"):
        reshape_advantages(torch.ones(2), imp, mask)
    with pytest.raises(ValueError, match="mask has shape"):
        reshape_advantages(adv, imp, torch.ones(3, 6))


# --- properties (hypothesis) -----------------------------------------------------------------------

finite = st.floats(min_value=0.0, max_value=1e4, allow_nan=False, allow_infinity=False)


@st.composite
def batches(draw, max_b=4, max_t=12):
    b = draw(st.integers(1, max_b))
    t = draw(st.integers(1, max_t))
    imp = draw(st.lists(st.lists(finite, min_size=t, max_size=t), min_size=b, max_size=b))
    mask = draw(st.lists(st.lists(st.booleans(), min_size=t, max_size=t), min_size=b, max_size=b))
    return torch.tensor(imp, dtype=torch.float64), torch.tensor(mask)


options = st.fixed_dictionaries({
    "tau": st.floats(0.0, 1.0), "beta": st.floats(0.0, 5.0),
    "tau_mode": st.sampled_from(["quantile", "value"]), "floor": st.sampled_from([0.0, 0.1]),
})


@settings(max_examples=200, deadline=None)
@given(batches(), options)
def test_property_matches_reference_and_preserves_mass(batch, opts):
    imp, mask = batch
    w = oar_weights(imp, mask, **opts)
    assert torch.isfinite(w).all()
    assert (w >= 0).all()
    torch.testing.assert_close(w.sum(-1), mask.sum(-1).double(), rtol=1e-9, atol=1e-9)
    assert (w[~mask] == 0).all()
    for b in range(imp.shape[0]):
        ref = reference_weights(imp[b].tolist(), mask[b].tolist(), **opts)
        torch.testing.assert_close(w[b], torch.tensor(ref, dtype=torch.float64), rtol=1e-7, atol=1e-7)


@settings(max_examples=200, deadline=None)
@given(st.floats(0.01, 1.0), st.floats(0.0, 5.0), st.floats(1e-9, 1e-4))
def test_property_gate_continuous_at_threshold(thr, beta, delta):
    at = bilevel_gate(torch.tensor([thr], dtype=torch.float64), thr, beta)
    assert at.item() == 1.0
    lo, hi = thr - delta, thr + delta
    below = bilevel_gate(torch.tensor([lo], dtype=torch.float64), thr, beta).item()
    above = bilevel_gate(torch.tensor([hi], dtype=torch.float64), thr, beta).item()
    # |omega - 1| is bounded by the slope times the step actually taken (thr +- delta is rounded
    # in float64, and the boost slope beta / (1 - thr) magnifies that rounding when thr ~ 1),
    # plus the eps smoothing
    assert abs(below - 1) <= ((thr - lo) / thr + EPS / thr) * (1 + 1e-9) + 1e-12
    assert abs(above - 1) <= beta * (hi - thr) / (1 - thr + EPS) * (1 + 1e-9) + 1e-12


@settings(max_examples=200, deadline=None)
@given(batches(), options)
def test_property_monotone_in_importance(batch, opts):
    imp, mask = batch
    w = oar_weights(imp, mask, **opts)
    for b in range(imp.shape[0]):
        idx = mask[b].nonzero().flatten()
        order = idx[imp[b, idx].argsort()]
        diffs = w[b, order].diff()
        assert (diffs >= -1e-9).all()


@settings(max_examples=200, deadline=None)
@given(batches(), options, st.randoms(use_true_random=False))
def test_property_permutation_equivariant(batch, opts, rnd):
    imp, mask = batch
    perm = list(range(imp.shape[1]))
    rnd.shuffle(perm)
    perm = torch.tensor(perm)
    w = oar_weights(imp, mask, **opts)
    wp = oar_weights(imp[:, perm], mask[:, perm], **opts)
    torch.testing.assert_close(wp, w[:, perm], rtol=1e-9, atol=1e-9)


@settings(max_examples=200, deadline=None)
@given(batches(), options, st.sampled_from([float("nan"), float("inf"), -5.0, 1e30]))
def test_property_padding_never_leaks(batch, opts, junk):
    imp, mask = batch
    w = oar_weights(imp, mask, **opts)
    dirty = torch.where(mask, imp, torch.full_like(imp, junk))
    adv = torch.linspace(-1, 1, imp.shape[0], dtype=torch.float64)
    assert torch.equal(oar_weights(dirty, mask, **opts), w)
    assert torch.equal(reshape_advantages(adv, dirty, mask, **opts), adv.unsqueeze(-1) * w)
