"""Group-relative advantages (Eq. 2) and the GRPO / Dr.GRPO options."""

import math

import pytest
import torch

from megatron_oar.algorithms import constant_groups, group_advantages


def test_eq2_hand_computed():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 1.0, 0.0])
    adv = group_advantages(r, group_size=4, eps=0.0)
    std = math.sqrt(0.1875)  # mean 0.25, population variance 3/16
    expected = [0.75 / std, -0.25 / std, -0.25 / std, -0.25 / std, 1.0, -1.0, 1.0, -1.0]
    torch.testing.assert_close(adv, torch.tensor(expected))


def test_dr_grpo_skips_std():
    r = torch.tensor([2.0, 0.0, 1.0, 1.0])
    torch.testing.assert_close(group_advantages(r, group_size=2, std_normalize=False),
                               torch.tensor([1.0, -1.0, 0.0, 0.0]))


def test_eps_in_denominator():
    r = torch.tensor([1.0, 0.0])
    torch.testing.assert_close(group_advantages(r, group_size=2, eps=0.5), torch.tensor([0.5, -0.5]))


def test_constant_group_is_exactly_zero():
    # 0.1 * 8 / 8 != 0.1 in floating point: the all-equal group must still give exact zeros
    r = torch.tensor([0.1] * 8 + [0.3, 0.7] * 4)
    adv = group_advantages(r, group_size=8)
    assert (adv[:8] == 0).all()
    assert (adv[8:] != 0).all()
    assert constant_groups(r, group_size=8).tolist() == [True] * 8 + [False] * 8


def test_group_ids_any_order_and_sizes():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 1.0, 0.0])
    ids = torch.tensor([7, 3, 7, 3, 7, 9, 9])
    adv = group_advantages(r, group_ids=ids)
    for g in ids.unique():
        sel = ids == g
        ref = group_advantages(r[sel], group_size=int(sel.sum()))
        torch.testing.assert_close(adv[sel], ref)


def test_single_completion_group_is_zero():
    assert group_advantages(torch.tensor([1.0, 0.0]), group_size=1).tolist() == [0.0, 0.0]


@pytest.mark.parametrize("kwargs,match", [
    (dict(group_size=3), "does not divide"),
    (dict(), "exactly one"),
    (dict(group_size=2, group_ids=torch.zeros(4)), "exactly one"),
])
def test_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        group_advantages(torch.zeros(4), **kwargs)


def test_nonfinite_rewards_rejected():
    with pytest.raises(ValueError, match="NaN"):
        group_advantages(torch.tensor([1.0, float("nan")]), group_size=2)
