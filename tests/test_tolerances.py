"""tests/tolerances.py: the rounding tolerances of the equality tests, and that they hold for this
process's CPU kernels.

The tiny model's fp32 log-probs and gradients (tests/kernel_levels.py's run: the scaled tiny Qwen2,
5 rows of 32 tokens) are within half the tolerance of a float64 run (each of two compared fp32 runs
carries at most half), and a one-token error in a loss's normalisation is far outside it.
``make test-kernels`` runs this file under every CPU dispatch level; here it runs with this
machine's own. Cost: about 3 s (one process, the tiny model in fp32 and float64).
"""

from __future__ import annotations

import math

import pytest
import torch

from tests import kernel_levels
from tests.tolerances import (
    ModelShape,
    assert_close_to_rounding,
    reduction_tol,
    rounding_error,
    tiny_grad_tol,
    tiny_shape,
)


def test_reduction_tol_arithmetic():
    eps32, eps64 = torch.finfo(torch.float32).eps, torch.finfo(torch.float64).eps
    assert reduction_tol(100) == pytest.approx(3 * eps32 * 10)
    assert reduction_tol(16, 9, dtype=torch.float64, lam=1) == pytest.approx(eps64 * 7)
    with pytest.raises(ValueError, match=">= 1"):
        reduction_tol(0)
    shape = ModelShape(hidden=4, ffn=9, layers=1, vocab=16, head_dim=1)
    assert shape.logprob_chain(25) == [4, 4, 1, 25, 25, 4, 4, 4, 9, 4, 4, 16]
    assert shape.grad_chain(25, 100) == shape.logprob_chain(25) * 2 + [100]
    assert tiny_shape() == ModelShape(hidden=64, ffn=128, layers=4, vocab=1000, head_dim=16)


def test_rounding_error_compares_masked_positions_exactly():
    inf = math.inf
    assert rounding_error(torch.tensor([2.0, -inf]), torch.tensor([2.0, -inf])) == 0.0
    assert rounding_error(torch.tensor([2.0, 0.0]), torch.tensor([2.0, -inf])) == inf
    assert rounding_error(torch.tensor([2.002, 1.0]), torch.tensor([2.0, 1.0])) == pytest.approx(1e-3, rel=1e-4)
    assert rounding_error(torch.zeros(3), torch.zeros(3)) == 0.0
    with pytest.raises(AssertionError, match="tolerance"):
        assert_close_to_rounding(torch.tensor([1.1]), torch.tensor([1.0]), 1e-3, "x")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("tolerances")
    threads = torch.get_num_threads()
    try:
        for dtype in ("float32", "float64"):
            kernel_levels._run(str(out / f"{dtype}.pt"), dtype)
    finally:
        torch.set_num_threads(threads)
    return {dtype: torch.load(out / f"{dtype}.pt") for dtype in ("float32", "float64")}


def test_fp32_is_within_half_the_tolerance_of_float64(runs):
    shape = tiny_shape()
    fp32, exact = runs["float32"], runs["float64"]
    seq, tokens = kernel_levels.SEQ, kernel_levels.ROWS * kernel_levels.SEQ
    assert_close_to_rounding(fp32["logp"], exact["logp"], shape.logprob_tol(seq) / 2, "log-probs")
    for i, (g, w) in enumerate(zip(fp32["grads"], exact["grads"])):
        assert_close_to_rounding(g, w, shape.grad_tol(seq, tokens) / 2, f"grads[{i}]")


def test_a_one_token_normalisation_error_is_caught(runs):
    """The tolerance still sees a bug: gradients of a loss averaged over one token too many."""
    grads = runs["float32"]["grads"]
    n = kernel_levels.ROWS * (kernel_levels.SEQ - 1)
    worst = max(rounding_error(g * n / (n + 1), g) for g in grads)
    assert worst > 10 * tiny_grad_tol()
