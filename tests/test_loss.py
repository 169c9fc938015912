"""PPO clipped surrogate (Eq. 18): hand cases, analytic gradients, aggregation, KL and entropy."""

import pytest
import torch

from megatron_oar.algorithms import PolicyLossConfig, aggregate, ppo_clip_loss
from megatron_oar.algorithms.loss import k3_kl


def one_token(ratio, adv, **cfg):
    logp = torch.tensor([[float(torch.tensor(ratio).log())]], dtype=torch.float64, requires_grad=True)
    loss, stats = ppo_clip_loss(logp, torch.zeros(1, 1, dtype=torch.float64),
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
    loss, _ = ppo_clip_loss(logp, old, adv, mask, cfg)
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
    base, _ = ppo_clip_loss(logp, logp.detach(), zeros, torch.ones(1, 2), PolicyLossConfig())
    with_kl, stats = ppo_clip_loss(logp, logp.detach(), zeros, torch.ones(1, 2),
                                   PolicyLossConfig(kl_coef=0.1), ref_logprobs=ref)
    assert with_kl.item() == pytest.approx(base.item() + 0.1 * kl.mean().item())
    assert stats["ref_kl"].item() == pytest.approx(kl.mean().item())
    ent = torch.tensor([[2.0, 4.0]], requires_grad=True)
    with_ent, _ = ppo_clip_loss(logp, logp.detach(), zeros, torch.ones(1, 2),
                                PolicyLossConfig(entropy_coef=0.01), entropy=ent)
    assert with_ent.item() == pytest.approx(base.item() - 0.01 * 3.0)
    with_ent.backward()
    torch.testing.assert_close(ent.grad, torch.tensor([[-0.005, -0.005]]))


def test_stats_and_padding():
    logp = torch.tensor([[0.0, float("nan")]])  # padding may hold anything
    loss, stats = ppo_clip_loss(logp, torch.zeros(1, 2), torch.ones(1, 2), torch.tensor([[1, 0]]),
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
        ppo_clip_loss(x, x, x, torch.ones(1, 2), PolicyLossConfig(kl_coef=0.1))
    with pytest.raises(ValueError, match="advantages has shape"):
        ppo_clip_loss(x, x, torch.zeros(1, 3), torch.ones(1, 2), PolicyLossConfig())
