"""PPO clipped surrogate (Eq. 18): hand cases, analytic gradients, aggregation, KL and entropy."""

import pytest
import torch

from megatron_oar.algorithms import PolicyLossConfig, aggregate, policy_loss
from megatron_oar.algorithms.loss import k3_kl


def one_token(ratio, adv, **cfg):
    logp = torch.tensor([[float(torch.tensor(ratio).log())]], dtype=torch.float64, requires_grad=True)
    loss, stats = policy_loss(logp, torch.zeros(1, 1, dtype=torch.float64),
                                torch.tensor([[adv]], dtype=torch.float64), torch.ones(1, 1),
                                PolicyLossConfig(**cfg))
    loss.backward()
    return loss.item(), logp.grad.item(), stats


@pytest.mark.parametrize("ratio,adv,loss,clipped", [
    (1.5, 1.0, -1.28, True),    # above 1 + clip_high with A > 0: clipped, no gradient
    (0.5, 1.0, -0.5, False),    # below 1 - clip_low with A > 0: unclipped (pessimistic branch)
    (0.5, -1.0, 0.8, True),     # below 1 - clip_low with A < 0: clipped
    (1.5, -1.0, 1.5, False),    # above 1 + clip_high with A < 0: unclipped
    (1.1, 2.0, -2.2, False),    # inside the trust region
])
def test_clip_hand_computed(ratio, adv, loss, clipped):
    value, grad, stats = one_token(ratio, adv)
    assert value == pytest.approx(loss)
    assert stats["clip_frac"].item() == float(clipped)
    # d/dlogp of -A * rho is -A * rho; zero when the clip is active
    assert grad == pytest.approx(0.0 if clipped else -adv * ratio)


def test_clip_higher_is_asymmetric():
    assert one_token(1.25, 1.0)[0] == pytest.approx(-1.25)  # inside [0.8, 1.28]
    assert one_token(1.25, 1.0, clip_high=0.2)[0] == pytest.approx(-1.2)


def test_dual_clip():
    value, grad, stats = one_token(5.0, -1.0, dual_clip=3.0)
    assert value == pytest.approx(3.0) and grad == 0.0 and stats["dual_clip_frac"].item() == 1.0
    assert one_token(5.0, -1.0)[0] == pytest.approx(5.0)
    assert one_token(5.0, 1.0, dual_clip=3.0)[0] == pytest.approx(-1.28)  # A > 0 untouched


def analytic_grad(logp, old, adv, mask, cfg, weights):
    """d loss / d logp per token: -A rho * weight where the unclipped branch is active."""
    rho = (logp - old).exp()
    lo, hi = 1 - cfg.clip_low, 1 + cfg.clip_high
    active = ((adv >= 0) & (rho <= hi)) | ((adv < 0) & (rho >= lo))
    return torch.where(active & mask, -adv * rho * weights, torch.zeros_like(rho))


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_gradient_equals_analytic(agg):
    g = torch.Generator().manual_seed(0)
    b, t = 4, 6
    old = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3
    logp = (old + torch.randn(b, t, generator=g, dtype=torch.float64) * 0.3).requires_grad_()
    adv = torch.randn(b, t, generator=g, dtype=torch.float64)
    mask = torch.rand(b, t, generator=g) > 0.3
    mask[:, 0] = True
    cfg = PolicyLossConfig(agg=agg, norm_len=10)
    loss, _ = policy_loss(logp, old, adv, mask, cfg)
    loss.backward()
    lengths = mask.sum(-1, keepdim=True).double()
    weights = {"token_mean": torch.full_like(old, 1 / mask.sum().item()),
               "seq_mean_token_mean": (1 / (lengths * b)).expand(b, t),
               "seq_mean_token_sum_norm": torch.full_like(old, 1 / (10 * b))}[agg]
    torch.testing.assert_close(logp.grad, analytic_grad(logp.detach(), old, adv, mask, cfg, weights))


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_global_counts_make_microbatches_sum_to_the_batch(agg):
    g = torch.Generator().manual_seed(1)
    values = torch.randn(6, 5, generator=g)
    mask = torch.rand(6, 5, generator=g) > 0.4
    mask[2] = False  # an empty row never counts
    full = aggregate(values, mask, agg, norm_len=5)
    counts = dict(num_tokens=int(mask.sum()), num_seqs=int(mask.any(-1).sum()), norm_len=5)
    parts = sum(aggregate(values[i:i + 2], mask[i:i + 2], agg, **counts) for i in range(0, 6, 2))
    torch.testing.assert_close(parts, full)


def test_aggregation_hand_computed():
    v = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    m = torch.tensor([[1, 1, 1], [1, 0, 0]])
    assert aggregate(v, m, "token_mean").item() == pytest.approx(10 / 4)
    assert aggregate(v, m, "seq_mean_token_mean").item() == pytest.approx((2 + 4) / 2)
    assert aggregate(v, m, "seq_mean_token_sum_norm", norm_len=4).item() == pytest.approx((6 / 4 + 4 / 4) / 2)
    assert aggregate(v, m, "seq_mean_token_sum_norm").item() == pytest.approx((6 / 3 + 4 / 3) / 2)


def test_k3_kl_and_coefficients():
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    ref = torch.tensor([[-1.0, -1.5]])
    kl = k3_kl(logp, ref).detach()
    assert kl[0, 0] == 0 and kl[0, 1] == pytest.approx(float(torch.tensor(0.5).exp()) - 0.5 - 1)
    assert (k3_kl(torch.randn(50, 3), torch.randn(50, 3)) >= 0).all()
    zeros = torch.zeros(1, 2)
    base, _ = policy_loss(logp, logp.detach(), zeros, torch.ones(1, 2), PolicyLossConfig())
    with_kl, stats = policy_loss(logp, logp.detach(), zeros, torch.ones(1, 2),
                                   PolicyLossConfig(kl_coef=0.1), ref_logprobs=ref)
    assert with_kl.item() == pytest.approx(base.item() + 0.1 * kl.mean().item())
    assert stats["ref_kl"].item() == pytest.approx(kl.mean().item())
    ent = torch.tensor([[2.0, 4.0]], requires_grad=True)
    with_ent, _ = policy_loss(logp, logp.detach(), zeros, torch.ones(1, 2),
                                PolicyLossConfig(entropy_coef=0.01), entropy=ent)
    assert with_ent.item() == pytest.approx(base.item() - 0.01 * 3.0)
    with_ent.backward()
    torch.testing.assert_close(ent.grad, torch.tensor([[-0.005, -0.005]]))


def test_stats_and_padding():
    logp = torch.tensor([[0.0, float("nan")]])  # padding may hold anything
    loss, stats = policy_loss(logp, torch.zeros(1, 2), torch.ones(1, 2), torch.tensor([[1, 0]]),
                                PolicyLossConfig())
    assert loss.item() == -1.0
    assert stats["approx_kl"].item() == 0.0 and stats["ratio_mean"].item() == 1.0


@pytest.mark.parametrize("kwargs", [dict(agg="sum"), dict(clip_low=1.0), dict(dual_clip=0.5),
                                    dict(norm_len=0), dict(kl_coef=-1.0)])
def test_config_errors(kwargs):
    with pytest.raises(ValueError):
        PolicyLossConfig(**kwargs)


def test_missing_inputs():
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(x, x, x, torch.ones(1, 2), PolicyLossConfig(kl_coef=0.1))
    with pytest.raises(ValueError, match="advantages has shape"):
        policy_loss(x, x, torch.zeros(1, 3), torch.ones(1, 2), PolicyLossConfig())


# ----------------------------------------------------------------------- GSPO, GSPO-token, CISPO

def _random_batch(seed: int, b: int = 4, t: int = 7, spread: float = 0.3, const_adv: bool = False):
    """float64 ``(logp with grad, old, adv, mask)``; rows of different lengths, row 0 full."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3
    logp = (old + torch.randn(b, t, generator=g, dtype=torch.float64) * spread).requires_grad_()
    adv = torch.randn(b, t, generator=g, dtype=torch.float64)
    if const_adv:
        adv = adv[:, :1].expand(b, t).clone()
    mask = torch.rand(b, t, generator=g) > 0.3
    mask[:, 0] = True
    mask[0] = True
    return logp, old, adv, mask


def gspo_reference(logp, old, adv, mask, lo, hi):
    """GSPO per row, written out: s_i = exp(mean_t (logp - old)); mean_i max(-A s, -A clip(s))."""
    losses = []
    for i in range(logp.shape[0]):
        m = mask[i]
        s = torch.exp((logp[i][m] - old[i][m]).mean())
        a = adv[i][m].mean()
        losses.append(torch.maximum(-a * s, -a * s.clamp(1 - lo, 1 + hi)))
    return torch.stack(losses).mean()


@pytest.mark.parametrize("spread", [1e-4, 0.3])  # inside GSPO's clip range, and mostly outside
def test_gspo_matches_the_sequence_formula(spread):
    logp, old, adv, mask = _random_batch(2, spread=spread, const_adv=True)
    cfg = PolicyLossConfig(policy_loss="gspo", agg="seq_mean_token_mean")
    loss, stats = policy_loss(logp, old, adv, mask, cfg)
    loss.backward()
    ref_logp = logp.detach().clone().requires_grad_()
    ref = gspo_reference(ref_logp, old, adv, mask, cfg.gspo_clip_low, cfg.gspo_clip_high)
    ref.backward()
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(logp.grad, ref_logp.grad)
    # the statistics are of the sequence ratio
    s = torch.exp(torch.stack([(logp[i][mask[i]] - old[i][mask[i]]).mean() for i in range(4)]))
    assert stats["ratio_max"].item() == pytest.approx(s.max().item())
    if spread > 1e-3:
        assert stats["clip_frac"].item() > 0 and (logp.grad[~mask] == 0).all()


def test_gspo_hand_computed():
    # one row of two tokens, log-ratios 0.1 and 0.3: s = exp(0.2) > 1 + 4e-4, A > 0: clipped
    logp = torch.tensor([[0.1, 0.3]], dtype=torch.float64, requires_grad=True)
    zeros = torch.zeros(1, 2, dtype=torch.float64)
    cfg = PolicyLossConfig(policy_loss="gspo", agg="seq_mean_token_mean")
    loss, stats = policy_loss(logp, zeros, torch.ones(1, 2, dtype=torch.float64), torch.ones(1, 2), cfg)
    loss.backward()
    assert loss.item() == pytest.approx(-(1 + 4e-4)) and stats["clip_frac"].item() == 1.0
    assert (logp.grad == 0).all()
    # A < 0: the unclipped branch; d/dlogp_t of -A exp(mean log r) = -A s / 2
    logp.grad = None
    loss, _ = policy_loss(logp, zeros, -torch.ones(1, 2, dtype=torch.float64), torch.ones(1, 2), cfg)
    loss.backward()
    s = float(torch.tensor(0.2).exp())
    assert loss.item() == pytest.approx(s)
    torch.testing.assert_close(logp.grad, torch.full((1, 2), s / 2, dtype=torch.float64))


def test_gspo_token_equals_gspo_with_sequence_advantages():
    """The GSPO paper: with A_it = A_i, GSPO-token's objective and gradient are GSPO's."""
    out = {}
    for name in ("gspo", "gspo_token"):
        logp, old, adv, mask = _random_batch(6, spread=1e-3, const_adv=True)
        loss, stats = policy_loss(logp, old, adv, mask,
                                  PolicyLossConfig(policy_loss=name, agg="seq_mean_token_mean"))
        loss.backward()
        out[name] = (loss.detach(), logp.grad, stats["clip_frac"])
    torch.testing.assert_close(out["gspo"][0], out["gspo_token"][0])
    torch.testing.assert_close(out["gspo"][1], out["gspo_token"][1])
    assert 0 < out["gspo"][2].item() < 1  # both branches present
    torch.testing.assert_close(out["gspo"][2], out["gspo_token"][2])


def test_gspo_token_keeps_token_advantages():
    """Token t of row i: value s_i, gradient -A_t s_i / (|y_i| B) where unclipped, 0 where clipped."""
    logp, old, adv, mask = _random_batch(6, spread=1e-3)
    cfg = PolicyLossConfig(policy_loss="gspo_token", agg="seq_mean_token_mean")
    loss, _ = policy_loss(logp, old, adv, mask, cfg)
    loss.backward()
    n = mask.sum(-1, keepdim=True).double()
    s = torch.exp(((logp.detach() - old) * mask).sum(-1, keepdim=True) / n).expand_as(old)
    lo, hi = 1 - cfg.gspo_clip_low, 1 + cfg.gspo_clip_high
    active = ((adv >= 0) & (s <= hi)) | ((adv < 0) & (s >= lo))
    want = torch.where(active & mask, -adv * s / (n * 4), torch.zeros_like(s))
    torch.testing.assert_close(logp.grad, want)
    value = torch.maximum(-adv * s, -adv * s.clamp(lo, hi))
    torch.testing.assert_close(loss.detach(), ((value * mask).sum(-1, keepdim=True) / n).mean())
    assert active[mask].any() and (~active[mask]).any()


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean"])
def test_cispo_gradient_is_the_clipped_weight(agg):
    """d/dlogp_t = -sg(clip(r_t, 0, 5)) A_t * (the aggregation's weight), never zeroed."""
    logp, old, adv, mask = _random_batch(5, spread=1.5)
    cfg = PolicyLossConfig(policy_loss="cispo", agg=agg)
    loss, stats = policy_loss(logp, old, adv, mask, cfg)
    loss.backward()
    r = (logp.detach() - old).exp()
    w = r.clamp(max=5.0)
    agg_w = (torch.full_like(old, 1 / mask.sum().item()) if agg == "token_mean"
             else (1 / (mask.sum(-1, keepdim=True).double() * 4)).expand_as(old))
    torch.testing.assert_close(logp.grad, torch.where(mask, -w * adv * agg_w, torch.zeros_like(w)))
    torch.testing.assert_close(loss.detach(), (-w * adv * logp.detach() * agg_w)[mask].sum())
    clipped = (r > 5.0)[mask].double().mean()
    assert clipped > 0 and stats["clip_frac"].item() == pytest.approx(clipped.item())
    assert stats["clip_frac_low"].item() == 0.0  # no lower bound by default


def test_cispo_hand_computed():
    # r = 8 > 5: weight 5; loss -5 * A * logp; its gradient -5 A
    logp = torch.tensor([[-1.0]], dtype=torch.float64, requires_grad=True)
    old = logp.detach() - float(torch.tensor(8.0).log())
    loss, _ = policy_loss(logp, old, torch.tensor([[2.0]], dtype=torch.float64), torch.ones(1, 1),
                          PolicyLossConfig(policy_loss="cispo"))
    loss.backward()
    assert loss.item() == pytest.approx(-5 * 2 * -1.0) and logp.grad.item() == pytest.approx(-10.0)
    # a lower bound at 1 - 0.2: r = 0.5 is raised to 0.8
    logp.grad = None
    old = logp.detach() - float(torch.tensor(0.5).log())
    loss, _ = policy_loss(logp, old, torch.tensor([[1.0]], dtype=torch.float64), torch.ones(1, 1),
                          PolicyLossConfig(policy_loss="cispo", cispo_clip_low=0.2))
    loss.backward()
    assert logp.grad.item() == pytest.approx(-0.8)


@pytest.mark.parametrize("name", ["ppo_clip", "gspo"])
def test_gradcheck(name):
    """torch's finite-difference check of the losses without a stop-gradient (gspo_token and
    cispo stop it on purpose; their gradients are checked against the formulas above), ratios
    inside the clip ranges (clip boundaries are kinks), with a token-level TIS weight and KL."""
    logp, old, adv, mask = _random_batch(6, spread=1e-5)
    rollout = old + 0.05 * torch.randn(old.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    ref = old - 0.1
    cfg = PolicyLossConfig(policy_loss=name, agg="seq_mean_token_mean", kl_coef=0.1,
                           rollout_correction="tis")

    def f(lp):
        return policy_loss(lp, old, adv, mask, cfg, rollout_logprobs=rollout, ref_logprobs=ref)[0]

    assert torch.autograd.gradcheck(f, (logp.detach().clone().requires_grad_(),))


# ----------------------------------------------------------------------- rollout correction

def test_rollout_weights_hand_computed():
    from megatron_oar.algorithms.rollout_correction import rollout_weights

    # old - rollout per token: log 3, log 0.25, log 1.5, and a padding token
    old = torch.tensor([[3.0, 0.25, 1.5, 7.0]], dtype=torch.float64).log()
    rollout = torch.zeros(1, 4, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0]])
    w, stats = rollout_weights(old, rollout, mask, "tis")  # [0, 2]
    torch.testing.assert_close(w, torch.tensor([[2.0, 0.25, 1.5, 0.0]], dtype=torch.float64))
    assert stats["rollout_truncated_frac"].item() == pytest.approx(1 / 3)
    w, stats = rollout_weights(old, rollout, mask, "mis")  # [0.5, 2]
    torch.testing.assert_close(w, torch.tensor([[0.0, 0.0, 1.5, 0.0]], dtype=torch.float64))
    assert stats["rollout_masked_frac"].item() == pytest.approx(2 / 3)
    w, _ = rollout_weights(old, rollout, mask, "icepop")  # [0.5, 5]
    torch.testing.assert_close(w, torch.tensor([[3.0, 0.0, 1.5, 0.0]], dtype=torch.float64))
    # sequence level: the product 3 * 0.25 * 1.5 = 1.125 on every token
    w, _ = rollout_weights(old, rollout, mask, "tis", level="sequence")
    torch.testing.assert_close(w, torch.tensor([[1.125] * 3 + [0.0]], dtype=torch.float64))
    w, stats = rollout_weights(old, rollout, mask, "mis", level="sequence", high=1.1)
    assert (w == 0).all() and stats["rollout_masked_frac"].item() == 1.0
    w, stats = rollout_weights(old, rollout, mask, "tis", low=0.5, high=1.2)
    torch.testing.assert_close(w, torch.tensor([[1.2, 0.5, 1.2, 0.0]], dtype=torch.float64))
    # mismatch: k3 of KL(pi_rollout || pi_old) and k1, token means over the mask
    d = old[0, :3]
    assert stats["mismatch_kl"].item() == pytest.approx((d.exp() - d - 1).mean().item())
    assert stats["mismatch_k1"].item() == pytest.approx(-d.mean().item())
    w, stats = rollout_weights(old, rollout, mask, "none")
    assert stats["rollout_is_weight_mean"].item() == 1.0 and stats["rollout_masked_frac"].item() == 0
    # vLLM's -inf (a token outside a processed top-k): bounded, the statistics finite
    w, stats = rollout_weights(old, torch.tensor([[0.0, -float("inf"), 0.0, 0.0]], dtype=torch.float64),
                               mask, "tis")
    assert w[0, 1] == 2.0 and all(torch.isfinite(v) for v in stats.values())


@pytest.mark.parametrize("name", ["ppo_clip", "gspo_token", "cispo"])
@pytest.mark.parametrize("mode,level", [("tis", "token"), ("mis", "sequence"), ("icepop", "token")])
def test_correction_weighs_each_token_loss(name, mode, level):
    """The loss and gradient with a correction are those without it, each token times its weight."""
    from megatron_oar.algorithms.rollout_correction import rollout_weights

    logp, old, adv, mask = _random_batch(8, spread=0.3)
    rollout = old + 0.4 * torch.randn(old.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    kw = dict(policy_loss=name, agg="token_mean")
    weights, _ = rollout_weights(old, rollout, mask, mode, level=level, high=3.0 if level == "sequence" else None)
    assert (weights[mask] == 0).any() or mode == "tis"
    cfg = PolicyLossConfig(**kw, rollout_correction=mode, rollout_correction_level=level,
                           rollout_correction_high=3.0 if level == "sequence" else None)
    loss, stats = policy_loss(logp, old, adv, mask, cfg, rollout_logprobs=rollout)
    loss.backward()
    corrected = logp.grad.clone()
    logp.grad = None
    plain, _ = policy_loss(logp, old, adv, mask, PolicyLossConfig(**kw), rollout_logprobs=rollout)
    plain.backward()
    torch.testing.assert_close(corrected, logp.grad * weights)
    assert stats["rollout_is_weight_mean"].item() == pytest.approx(weights[mask].mean().item())


@pytest.mark.parametrize("name", ["ppo_clip", "gspo", "gspo_token", "cispo"])
@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_micro_batches_sum_to_the_batch(name, agg):
    """Rows split over micro-batches (whole rows, as models.micro_batches makes them) with the
    global counts: the losses and gradients sum to the whole batch's, a sequence-level rollout
    correction included."""
    logp, old, adv, mask = _random_batch(10, b=6, spread=0.2, const_adv=name == "gspo")
    rollout = old + 0.2 * torch.randn(old.shape, generator=torch.Generator().manual_seed(11), dtype=torch.float64)
    cfg = PolicyLossConfig(policy_loss=name, agg=agg, norm_len=7, rollout_correction="mis",
                           rollout_correction_level="sequence", rollout_correction_high=1.5)
    full, _ = policy_loss(logp, old, adv, mask, cfg, rollout_logprobs=rollout)
    full.backward()
    want = logp.grad.clone()
    logp.grad = None
    counts = dict(num_tokens=int(mask.sum()), num_seqs=int(mask.any(-1).sum()))
    parts = sum(policy_loss(logp[g], old[g], adv[g], mask[g], cfg, rollout_logprobs=rollout[g], **counts)[0]
                for g in ([0, 3], [1], [2, 4, 5]))
    parts.backward()
    torch.testing.assert_close(parts, full)
    torch.testing.assert_close(logp.grad, want)


@pytest.mark.parametrize("kwargs,match", [
    (dict(policy_loss="grpo"), "loss.policy_loss='grpo'"),
    (dict(gspo_clip_low=1.0), "loss.gspo_clip_low"),
    (dict(cispo_clip_high=0.0), "loss.cispo_clip_high"),
    (dict(policy_loss="cispo", dual_clip=3.0), "loss.dual_clip"),
    (dict(rollout_correction="is"), "loss.rollout_correction='is'"),
    (dict(rollout_correction="tis", rollout_correction_level="seq"), "loss.rollout_correction_level"),
    (dict(rollout_correction="icepop", rollout_correction_level="sequence"), "use loss.rollout_correction=mis"),
    (dict(rollout_correction="mis", rollout_correction_low=2.0), "need 0 <= low < high"),
])
def test_new_config_errors_name_the_key(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PolicyLossConfig(**kwargs)


def test_correction_needs_rollout_logprobs():
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="needs rollout_logprobs"):
        policy_loss(x, x, x, torch.ones(1, 2), PolicyLossConfig(rollout_correction="tis"))
