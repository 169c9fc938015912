"""Credit schemes (grpo, random, entropy Eq. 6, oar) and the credit metrics (Eqs. 27-28)."""

import pytest
import torch

from megatron_oar.algorithms import ShapingConfig, assign_credit, credit_metrics, ess_ratio, top_mass
from megatron_oar.algorithms.credit import entropy_advantages, random_weights
from tests.test_oar import reference_weights


def test_grpo_broadcasts():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    out = assign_credit(ShapingConfig(scheme="grpo"), torch.tensor([0.5, -1.0]), mask)
    assert out.advantages.tolist() == [[0.5, 0.5, 0.0], [-1.0, 0.0, 0.0]]
    assert out.weights.tolist() == [[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]]


def test_entropy_eq6_hand_computed():
    h = torch.tensor([[0.0, 1.0, 5.0], [0.0, 1.0, 5.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv = entropy_advantages(torch.tensor([1.0, -1.0]), h, mask, alpha=0.4, kappa=2.0)
    # A + min(0.4 H, |A| / 2): bonus 0, 0.4, capped at 0.5
    torch.testing.assert_close(adv, torch.tensor([[1.0, 1.4, 1.5], [-1.0, -0.6, 0.0]]))
    assert not adv.requires_grad  # sg(H): no gradient flows into the entropy


def test_entropy_bonus_is_non_negative_and_keeps_the_sign():
    """Eq. 6 adds ``min(alpha H, |A| / kappa) >= 0`` to every token (not mass preserving: a
    sequence's sum grows by up to ``T |A| / kappa``, 50% at kappa 2); a negative advantage shrinks
    towards 0 and keeps its sign only with kappa > 1, so kappa <= 1 is refused (issue 39, item 6)."""
    h = torch.tensor([[0.3, 2.0, 9.0]] * 2)
    seq = torch.tensor([1.5, -1.5])
    adv = entropy_advantages(seq, h, torch.ones(2, 3), alpha=0.4, kappa=2.0)
    bonus = adv - seq[:, None]
    assert (bonus >= 0).all() and (bonus <= seq.abs()[:, None] / 2).all()
    assert (adv[1] < 0).all()  # the sign of A kept
    # bonuses 0.4 * 0.3, then the cap 1.5 / 2 twice: each sum grows by 1.62 (T A_i = +-4.5)
    torch.testing.assert_close(adv.sum(-1), torch.tensor([4.5 + 1.62, -4.5 + 1.62]))
    for kappa in (1.0, 0.5):  # kappa 1 zeroes the high-entropy token's negative credit, 0.5 flips it
        with pytest.raises(ValueError, match=rf"shaping.entropy_kappa={kappa}: must be > 1"):
            ShapingConfig(scheme="entropy", entropy_kappa=kappa)
        with pytest.raises(ValueError, match=rf"shaping.entropy_kappa={kappa}: must be > 1"):
            entropy_advantages(seq, h, torch.ones(2, 3), alpha=0.4, kappa=kappa)
    with pytest.raises(ValueError, match=r"shaping.entropy_alpha=-0.1: must be >= 0"):
        ShapingConfig(entropy_alpha=-0.1)


def test_entropy_scheme_weights_and_zero_advantage():
    h = torch.tensor([[2.0, 0.5], [2.0, 0.5]])
    out = assign_credit(ShapingConfig(scheme="entropy"), torch.tensor([2.0, 0.0]), torch.ones(2, 2),
                        entropy=h)
    torch.testing.assert_close(out.advantages, torch.tensor([[2.8, 2.2], [0.0, 0.0]]))
    torch.testing.assert_close(out.weights, torch.tensor([[1.4, 1.1], [1.0, 1.0]]))


def test_random_is_mass_preserving_and_seeded():
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 0, 0, 0]])
    w1 = random_weights(mask, generator=torch.Generator().manual_seed(3))
    w2 = random_weights(mask, generator=torch.Generator().manual_seed(3))
    assert torch.equal(w1, w2)
    torch.testing.assert_close(w1.sum(-1), torch.tensor([4.0, 2.0]))
    assert (w1[~mask.bool()] == 0).all()
    assert w1.std() > 0
    score = torch.tensor([[1, 1, 0, 1, 0], [1, 1, 0, 0, 0]])
    out = assign_credit(ShapingConfig(scheme="random"), torch.tensor([1.0, 1.0]), mask,
                        score_mask=score, generator=torch.Generator().manual_seed(0))
    assert out.weights[0, 2] == 1.0
    torch.testing.assert_close(out.weights.sum(-1), torch.tensor([4.0, 2.0]))


def test_oar_scheme_uses_importance():
    imp = torch.tensor([[0.0, 1.0, 10.0]])
    out = assign_credit(ShapingConfig(scheme="oar"), torch.tensor([-1.0]), torch.ones(1, 3), importance=imp)
    assert out.weights[0, 2] > 1 > out.weights[0, 0]
    torch.testing.assert_close(out.advantages, -out.weights)


def test_suppression_floor_default_and_mass():
    """Default floor 0 is Eqs. 14-16 (each row's least important scored token gets weight 0);
    the authors' 0.1 floor bounds every suppressed weight away from 0; both preserve the mass."""
    g = torch.Generator().manual_seed(0)
    imp = torch.rand(6, 12, generator=g) ** 4 * 10  # skewed, like real importance
    mask = torch.ones(6, 12, dtype=torch.bool)
    mask[1, 9:] = mask[4, 5:] = False  # padding
    score_mask = mask.clone()
    score_mask[:, 7:] = False  # the answer span and what follows: not scored, weight 1
    seq_adv = torch.tensor([1.0, -0.5, 2.0, -1.5, 0.7, 1.0])
    assert ShapingConfig().floor == 0.0
    for floor in (0.0, 0.1, 0.5):
        cfg = ShapingConfig(floor=floor)
        out = assign_credit(cfg, seq_adv, mask, importance=imp, score_mask=score_mask)
        w, s = out.weights, score_mask
        torch.testing.assert_close(w.sum(-1), mask.sum(-1).float())  # Eq. 17: sum of weights = T
        torch.testing.assert_close((w * s).sum(-1), s.sum(-1).float())  # scored mass stays scored
        torch.testing.assert_close(out.advantages.sum(-1), seq_adv * mask.sum(-1))
        assert (w[mask & ~s] == 1).all() and (w[~mask] == 0).all()
        lowest = torch.where(s, imp, torch.full_like(imp, float("inf"))).argmin(-1)
        w_low = w[torch.arange(6), lowest]
        assert (w_low == 0).all() if floor == 0 else (w_low > 0).all()  # Eq. 16 at I_hat = 0
        for i in range(6):  # the scored tokens carry the paper's weights, floored before Eq. 17
            sub = imp[i][s[i]].tolist()
            want = reference_weights(sub, [1] * len(sub), cfg.tau, cfg.beta, cfg.tau_mode, floor)
            torch.testing.assert_close(w[i][s[i]], torch.tensor(want), rtol=1e-5, atol=1e-6)


def test_scheme_errors():
    with pytest.raises(ValueError, match="credit scheme must be one of"):
        ShapingConfig(scheme="oar_x")
    with pytest.raises(ValueError, match="tau"):
        ShapingConfig(tau=2.0)
    with pytest.raises(ValueError, match="needs importance"):
        assign_credit(ShapingConfig(scheme="oar"), torch.ones(1), torch.ones(1, 2))
    with pytest.raises(ValueError, match="needs token entropies"):
        assign_credit(ShapingConfig(scheme="entropy"), torch.ones(1), torch.ones(1, 2))


# --- metrics ---------------------------------------------------------------------------------------

def test_ess_ratio_eq27():
    w = torch.tensor([[1.0, 1.0, 1.0, 1.0], [4.0, 0.0, 0.0, 0.0], [2.0, 1.0, 9.0, 9.0], [0.0] * 4])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0]])
    out = ess_ratio(w, mask)
    torch.testing.assert_close(out[:3], torch.tensor([1.0, 0.25, 9 / (2 * 5)]))
    assert out[3].isnan()


def test_top_mass_eq28():
    adv = torch.tensor([[10.0, -5.0] + [1.0] * 18, [1.0, 2.0, 3.0, 4.0, 5.0] + [0.0] * 15])
    mask = torch.ones(2, 20)
    mask[1, 5:] = 0
    out = top_mass(adv, mask)  # K = 2 for T = 20, K = max(1, 0) = 1 for T = 5
    torch.testing.assert_close(out, torch.tensor([15 / 33, 5 / 15]))
    assert top_mass(torch.zeros(1, 4), torch.ones(1, 4))[0].isnan()


def test_credit_metrics_only_count_nonzero_advantage_rows():
    w = torch.tensor([[0.5, 1.5], [1.0, 1.0]])
    adv = torch.tensor([[0.5, 1.5], [0.0, 0.0]])
    m = credit_metrics(w, adv, torch.ones(2, 2), seq_adv=torch.tensor([1.0, 0.0]))
    assert m["frac_boosted"] == 0.5 and m["frac_suppressed"] == 0.5
    torch.testing.assert_close(m["ess_ratio"], torch.tensor(4 / (2 * 2.5)))
    torch.testing.assert_close(m["top10_mass"], torch.tensor(0.75))
    assert float(m["max_weight"]) == 1.5 and float(m["max_weight_negative"]) == 0.0  # no A < 0 row
    m = credit_metrics(torch.tensor([[0.5, 1.5], [3.0, 0.0], [1.2, 0.8]]), torch.ones(3, 2),
                       torch.tensor([[1, 1], [1, 0], [1, 1]]), seq_adv=torch.tensor([1.0, -1.0, -2.0]))
    assert float(m["max_weight"]) == pytest.approx((1.5 + 3.0 + 1.2) / 3)
    assert float(m["max_weight_negative"]) == pytest.approx((3.0 + 1.2) / 2)


def test_sign_aware_reshapes_only_positive_rows_and_keeps_every_sum():
    """``shaping.variant=sign_aware`` (ours): the paper's weights where A_i > 0, GRPO's uniform
    weights where A_i < 0; every row still sums to T * A_i. The paper's variant reshapes both."""
    imp = torch.tensor([[0.0, 0.1, 2.0, 0.5], [0.0, 0.1, 2.0, 0.5], [0.3, 0.1, 2.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 0]])
    seq_adv = torch.tensor([1.0, -1.0, 0.0])
    paper = assign_credit(ShapingConfig(), seq_adv, mask, importance=imp)
    ours = assign_credit(ShapingConfig(variant="sign_aware"), seq_adv, mask, importance=imp)
    expected = reference_weights(imp[0].tolist(), [1, 1, 1, 1], 0.4, 2.0, "quantile")
    torch.testing.assert_close(ours.weights[0], torch.tensor(expected, dtype=ours.weights.dtype))
    torch.testing.assert_close(ours.weights[0], paper.weights[0])
    assert ours.weights[1].tolist() == [1.0, 1.0, 1.0, 1.0]          # no boost on the wrong rollout
    assert ours.advantages[1].tolist() == [-1.0, -1.0, -1.0, -1.0]
    assert paper.weights[1].max() > 1.5                             # the paper boosts it
    assert ours.weights[2].tolist() == [1.0, 1.0, 1.0, 0.0]          # A = 0: uniform, padding 0
    for c in (paper, ours):
        torch.testing.assert_close(c.advantages.sum(-1), seq_adv * mask.sum(-1))
    with pytest.raises(ValueError, match="shaping.variant='x'"):
        ShapingConfig(variant="x")
