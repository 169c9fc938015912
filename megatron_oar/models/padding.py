"""Sequence lengths every Megatron pass can run: padding to the model's multiple, and trimming back.

Sequence parallelism scatters ``[s, b, h]`` along ``s`` over the TP ranks (megatron asserts that
TP divides ``s``), and TE's FP8 GEMMs need leading dimensions divisible by 16: under sequence
parallelism a rank's GEMMs see its ``s / TP`` tokens, so that share must be a multiple of 16
(``s`` a multiple of ``16 x TP``, not only of ``lcm(TP, 16)``). Every Megatron
pass (old log-probs, reference log-probs, attribution, the update step) right-pads its tokens to
:func:`sequence_multiple` and trims the outputs back. Attention is causal, so the padding never
changes an earlier position's logits; padded positions never enter a loss, a probe or a score.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F

FP8_MULTIPLE = 16  # TE's FP8 GEMMs: leading dimensions divisible by 8 (16 to be safe)

_forced = 1  # see force_multiple


def sequence_multiple(config) -> int:
    """The multiple that sequence lengths are padded to for a megatron ``TransformerConfig``:
    TP with sequence parallelism, 16 with FP8, ``16 x TP`` with both (each rank's FP8 GEMMs
    run on its ``s / TP`` share, which must itself divide by 16), 1 otherwise (and its lcm with
    :func:`force_multiple`'s value inside that context). Under context parallelism
    (``context_parallel_size`` CP > 1) that times ``2 x CP``: the sequence splits into ``2 x CP``
    equal chunks (``models.context_parallel``), each rank's ``s / CP`` tokens still a multiple of
    the above."""
    multiple = config.tensor_model_parallel_size if config.sequence_parallel else 1
    if config.fp8:
        multiple *= FP8_MULTIPLE
    cp = getattr(config, "context_parallel_size", 1)
    if cp > 1:
        multiple *= 2 * cp
    return math.lcm(multiple, _forced)


@contextlib.contextmanager
def force_multiple(multiple: int) -> Iterator[None]:
    """Inside the block, every pass also pads to a multiple of ``multiple`` (tests: the padding
    of an SP or FP8 run on a CPU model that has neither)."""
    global _forced
    if multiple < 1:
        raise ValueError(f"multiple must be >= 1, got {multiple}")
    saved, _forced = _forced, multiple
    try:
        yield
    finally:
        _forced = saved


def padded_length(length: int, multiple: int) -> int:
    """``length`` rounded up to a multiple of ``multiple``."""
    return -(-length // multiple) * multiple


def pad_to(t: torch.Tensor, length: int, dim: int = 1, value: int | float = 0) -> torch.Tensor:
    """``t`` right-padded with ``value`` along ``dim`` to ``length`` (itself when long enough)."""
    extra = length - t.shape[dim]
    if extra <= 0:
        return t
    pad = [0, 0] * (t.dim() - 1 - dim % t.dim()) + [0, extra]
    return F.pad(t, pad, value=value)


def trim(t: torch.Tensor, length: int, dim: int = 1) -> torch.Tensor:
    """The first ``length`` entries of ``t`` along ``dim`` (undoes :func:`pad_to`)."""
    return t.narrow(dim, 0, length)
