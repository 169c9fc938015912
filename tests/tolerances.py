"""Tolerances of the numerical equality tests, derived from what the comparison accumulates.

Two runs that differ only in how their sums are ordered (padding, micro-batch split, packing,
chunked logits, an attention kernel, TP / PP layout, and the CPU's own kernels: AVX-512, AVX2 or
the scalar path, MKL's or oneDNN's blocking) agree to rounding, and the size of that rounding
follows from the dtype and the reductions the compared value went through, not from what one
machine printed. A tolerance taken from one machine's results fails on the next (issue 53: a
gradient 1.28e-5 of its tensor's largest apart under ``ATEN_CPU_CAPABILITY=default``, where the
test allowed 1e-5).

The model (Higham & Mary, "A new approach to probabilistic rounding error analysis", SIAM J. Sci.
Comput. 41(5), 2019, Theorem 2.4): a sum of ``n`` products evaluated in floating point with unit
roundoff ``u = eps / 2`` is within ``lam * sqrt(n) * u`` of the exact value, relative to the sum
of the terms' magnitudes, with a probability that goes to 1 quickly in ``lam`` (the worst-case
bound ``n * u`` is never approached by rounding errors of mixed sign, and would make the tests
blind). Two evaluations are each within that of the exact value, so within ``lam * sqrt(n) * eps``
of each other. A value computed through a chain of reductions (a layer's GEMMs, attention over
the sequence, the softmax over the vocabulary, the same again backwards, the sum over tokens into a
weight gradient) carries, to first order, the sum of the chain's terms:

    tol = lam * eps(dtype) * sum(sqrt(n) for n in chain)          # :func:`reduction_tol`

relative to the compared tensor's largest magnitude (:func:`assert_close_to_rounding`), which
stands in for the terms' magnitudes. ``lam`` is :data:`LAMBDA` = 3: on the tiny model below the
largest gradient difference measured (1.28e-5 relative, AMD EPYC under
``ATEN_CPU_CAPABILITY=default``, issue 53) is 107 eps and the gradient chain's sum of square roots
is 641, so ``lam`` = 3 (2.3e-4) leaves a factor 18 for other CPUs (against float64, one fp32 run
of the tiny model was 4.6e-5 off under ATen's scalar kernels, 20% of it, and 1.4e-5 under
AVX-512: tests/kernel_levels.py, docs/testing.md "Other CPUs' kernels"); a real bug (a pad token
attended, a token counted twice, a loss normalised by one token too many) moves these values by
1e-3 or more of their scale, above every tolerance here.
Where a test can compute in float64 it does (tests/test_sdpa_attention.py): the
same formula with float64's eps is then a tolerance of ~1e-13.

``make test-kernels`` runs the tests that use these tolerances under each CPU dispatch level
(docs/testing.md, "Other CPUs' kernels").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

LAMBDA = 3.0


def reduction_tol(*chain: int, dtype: torch.dtype = torch.float32, lam: float = LAMBDA) -> float:
    """``lam * eps(dtype) * sum(sqrt(n))`` over the reduction lengths of ``chain``: how far apart,
    relative to the value's scale, two evaluations of it may be that sum in other orders."""
    if not chain or any(n < 1 for n in chain):
        raise ValueError(f"reduction lengths must be >= 1, got {chain}")
    return lam * torch.finfo(dtype).eps * sum(math.sqrt(n) for n in chain)


@dataclass(frozen=True)
class ModelShape:
    """The reductions of a dense GPT (Qwen2-style: GQA attention, SwiGLU MLP, RMSNorm) that a
    log-prob or a gradient goes through."""

    hidden: int
    ffn: int
    layers: int
    vocab: int
    head_dim: int

    @classmethod
    def from_hf(cls, hf: dict) -> ModelShape:
        heads = hf["num_attention_heads"]
        return cls(hidden=hf["hidden_size"], ffn=hf["intermediate_size"], layers=hf["num_hidden_layers"],
                   vocab=hf["vocab_size"], head_dim=hf.get("head_dim") or hf["hidden_size"] // heads)

    def layer(self, seq: int) -> list[int]:
        """One layer, forward: the norm, QKV, the scores (head_dim), probabilities x values (and
        the softmax) over the sequence, the output projection, the norm, FC1, FC2."""
        h = self.hidden
        return [h, h, self.head_dim, seq, seq, h, h, h, self.ffn]

    def logprob_chain(self, seq: int) -> list[int]:
        """Embedding to log-prob: every layer, the final norm, the output layer, the log-softmax
        over the vocabulary."""
        return [n for _ in range(self.layers) for n in self.layer(seq)] + [self.hidden, self.hidden, self.vocab]

    def grad_chain(self, seq: int, tokens: int) -> list[int]:
        """A weight gradient: the forward, the same reductions backwards, and the sum over the
        ``tokens`` of the update (all micro-batches)."""
        forward = self.logprob_chain(seq)
        return forward + forward + [tokens]

    def logprob_tol(self, seq: int, dtype: torch.dtype = torch.float32) -> float:
        return reduction_tol(*self.logprob_chain(seq), dtype=dtype)

    def grad_tol(self, seq: int, tokens: int, dtype: torch.dtype = torch.float32) -> float:
        return reduction_tol(*self.grad_chain(seq, tokens), dtype=dtype)


def tiny_shape() -> ModelShape:
    """The tests' tiny Qwen2 (``megatron_oar.models.tiny.SMALL``: the ``scaled_checkpoint`` and
    ``trainer_checkpoint`` fixtures)."""
    from megatron_oar.models.tiny import SMALL

    return ModelShape.from_hf(SMALL)


# The test batch of tests/test_attribution.py (``make_batch``), which the padding, micro-batch,
# packing, chunked-logits and loss-layout tests run: 5 rows of 13..29 tokens, padded to 32 at most
# (the sequence multiple 16); an update sums over at most all of them.
TEST_BATCH_SEQ = 32
TEST_BATCH_TOKENS = 5 * 32


def tiny_logprob_tol() -> float:
    """Log-probs, entropies, the probe teacher and the loss of the tiny model on the test batch."""
    return tiny_shape().logprob_tol(TEST_BATCH_SEQ)


def tiny_grad_tol() -> float:
    """Gradients (and the grad norm, and updated weights where Adam's step follows the gradient)
    of the tiny model's update on the test batch."""
    return tiny_shape().grad_tol(TEST_BATCH_SEQ, TEST_BATCH_TOKENS)


def rounding_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """``max|got - want| / max|want|`` over the finite entries, in float64 (0 for two all-zero
    tensors); ``inf`` where a non-finite entry (a masked position's ``-inf``, a NaN) differs."""
    got, want = got.double(), want.double()
    finite = torch.isfinite(want)
    if not torch.equal(finite, torch.isfinite(got)) or not torch.equal(got[~finite].nan_to_num(),
                                                                       want[~finite].nan_to_num()):
        return math.inf
    got, want = got[finite], want[finite]
    scale = float(want.abs().max()) if want.numel() else 0.0
    diff = float((got - want).abs().max()) if want.numel() else 0.0
    if scale == 0.0:
        return 0.0 if diff == 0.0 else math.inf
    return diff / scale


def assert_close_to_rounding(got: torch.Tensor, want: torch.Tensor, tol: float, what: str) -> None:
    """``got`` equals ``want`` to ``tol`` of ``want``'s largest magnitude (shapes equal)."""
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    err = rounding_error(got, want)
    assert err <= tol, f"{what}: max|d| is {err:.3g} of the largest value, tolerance {tol:.3g}"
