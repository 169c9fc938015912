"""Which samples each DP rank trains on (training/dp_split.py): every sample once, equal counts
per rank within every mini-batch, and balanced tokens; the equality of the update under any
assignment is tested at DP2 in tests/test_micro_batches.py."""

from __future__ import annotations

import pytest
import torch

from megatron_oar.training.dp_split import dp_assignment, token_imbalance


def _lengths(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(n, generator=g) * 400 + 100).long().tolist()  # 100..500 tokens, 5:1


@pytest.mark.parametrize("dp,minis", [(1, 1), (2, 1), (4, 2), (8, 4)])
@pytest.mark.parametrize("balance", [True, False])
def test_every_sample_once_and_equal_counts_per_mini_batch(dp, minis, balance):
    n = 64
    ranks = dp_assignment(_lengths(n), dp, minis, balance=balance)
    assert sorted(i for rows in ranks for i in rows) == list(range(n))
    per_mini, room = n // minis, n // minis // dp
    for rows in ranks:
        assert len(rows) == n // dp
        for m in range(minis):  # the rank's m-th mini-batch is drawn from the global m-th
            assert all(m * per_mini <= i < (m + 1) * per_mini for i in rows[m * room:(m + 1) * room])
            assert rows[m * room:(m + 1) * room] == sorted(rows[m * room:(m + 1) * room])


def test_strided_is_the_old_split():
    ranks = dp_assignment(_lengths(12), 3, 1, balance=False)
    assert ranks == [list(range(d, 12, 3)) for d in range(3)]


def test_balancing_evens_out_tokens():
    lengths = _lengths(64, seed=1)
    for dp in (2, 4, 8):
        strided = token_imbalance(lengths, dp_assignment(lengths, dp, balance=False))
        balanced = token_imbalance(lengths, dp_assignment(lengths, dp))
        assert balanced <= strided
        assert balanced < 1.03, (dp, balanced, strided)
    # the case strided splits worst: long and short responses alternate
    alternating = [500 if i % 2 == 0 else 100 for i in range(16)]
    assert token_imbalance(alternating, dp_assignment(alternating, 2, balance=False)) == pytest.approx(5 / 3)
    assert token_imbalance(alternating, dp_assignment(alternating, 2)) == 1.0


def test_deterministic_and_errors():
    lengths = _lengths(32)
    assert dp_assignment(lengths, 4, 2) == dp_assignment(list(lengths), 4, 2)
    with pytest.raises(ValueError, match="30 samples do not split into 2 mini-batches x 4 DP ranks"):
        dp_assignment(lengths[:30], 4, 2)
