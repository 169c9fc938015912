"""Packed sequences (THD): a micro-batch's rows run as ONE sequence (``train.batching=packed``).

The rows go back to back into ``tokens [1, T]``, each right-padded only to the sequence multiple
(``models.padding``), never to the micro-batch's longest row. Megatron-core takes the layout as
``PackedSeqParams(qkv_format="thd")``: rotary embeddings restart at every row's offset in
``cu_seqlens_padded``, and the core attention keeps the rows apart: Transformer Engine's THD
attention, or SDPA's under the local spec (``models/sdpa_attention.py``); megatron's unfused
``DotProductAttention`` refuses packed sequences (``model.attention=unfused`` is refused with it).

Each row, not only the total, is padded to the multiple: ``T`` is then a multiple too, which
sequence parallelism needs (it scatters the ``T`` axis over the TP ranks) and TE's FP8 GEMMs want
(16-multiples), and every row's pad tokens sit in the row's own THD segment, after its real
tokens, where causal attention keeps them away from every real token. The attention lengths
are the padded ones as well (``cu_seqlens_q == cu_seqlens_q_padded``, as NeMo-RL and verl pass
them): the pads then attend like trailing tokens of their row and stay finite, and TE may use
any of its THD backends; real tokens see exactly what they would see alone.

:func:`unpack` maps the per-token outputs (the logits) back to ``[m, width, ...]``, so a pass
reads them as it reads a token-budget micro-batch's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate

import torch
from megatron.core.packed_seq_params import PackedSeqParams

from megatron_oar.models.padding import padded_length


@dataclass
class Packed:
    tokens: torch.Tensor             # [1, T] the rows back to back, each padded to the multiple
    position_ids: torch.Tensor       # [1, T] 0, 1, ... restarting at every row (its pads included)
    cu_seqlens: torch.Tensor         # [m + 1] int32: cumulative real lengths
    cu_seqlens_padded: torch.Tensor  # [m + 1] int32: cumulative padded lengths (the rows' offsets)
    max_seqlen: int                  # the longest padded row
    rows: torch.Tensor = field(repr=False)   # [n] row of each real token (n = sum of the lengths)
    cols: torch.Tensor = field(repr=False)   # [n] its column in the row
    index: torch.Tensor = field(repr=False)  # [n] its position in the packed sequence

    @property
    def size(self) -> int:  # rows
        return self.cu_seqlens.numel() - 1

    @property
    def total(self) -> int:  # T
        return self.tokens.shape[1]


def pack(tokens: torch.Tensor, lengths, multiple: int = 1) -> Packed:
    """Rows ``tokens [m, S]`` (row ``i`` real up to ``lengths[i]``) as one sequence ``[1, T]``."""
    lengths = [int(n) for n in lengths]
    m, width = tokens.shape
    if len(lengths) != m or not all(1 <= n <= width for n in lengths):
        raise ValueError(f"lengths {lengths} do not fit tokens of shape {tuple(tokens.shape)}")
    padded = [padded_length(n, multiple) for n in lengths]
    offsets = [0, *accumulate(padded)]
    dev = tokens.device
    lens = torch.tensor(lengths, device=dev)
    rows = torch.repeat_interleave(torch.arange(m, device=dev), lens)
    starts = torch.tensor([0, *accumulate(lengths)][:-1], device=dev)
    cols = torch.arange(rows.numel(), device=dev) - starts[rows]
    index = torch.tensor(offsets[:-1], device=dev)[rows] + cols
    flat = tokens.new_zeros(offsets[-1]).index_put((index,), tokens[rows, cols])
    position_ids = torch.cat([torch.arange(p, device=dev) for p in padded])
    return Packed(
        tokens=flat.unsqueeze(0), position_ids=position_ids.unsqueeze(0),
        cu_seqlens=torch.tensor([0, *accumulate(lengths)], dtype=torch.int32, device=dev),
        cu_seqlens_padded=torch.tensor(offsets, dtype=torch.int32, device=dev),
        max_seqlen=max(padded), rows=rows, cols=cols, index=index)


def packed_seq_params(packed: Packed) -> PackedSeqParams:
    """Megatron's THD parameters for ``packed`` (attention over the padded rows: module doc)."""
    cu = packed.cu_seqlens_padded
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu,
                           cu_seqlens_kv_padded=cu, max_seqlen_q=packed.max_seqlen,
                           max_seqlen_kv=packed.max_seqlen)


def unpack(values: torch.Tensor, packed: Packed, width: int) -> torch.Tensor:
    """Per-token ``values [1, T, ...]`` (or ``[T, ...]``) of ``packed`` as ``[m, width, ...]``
    in row order, zero past each row's length (differentiable)."""
    if values.dim() > 1 and values.shape[:2] == (1, packed.total):
        values = values[0]
    if values.shape[0] != packed.total:
        raise ValueError(f"values of shape {tuple(values.shape)} are not per token of a packed "
                         f"sequence of {packed.total}")
    out = values.new_zeros(packed.size, width, *values.shape[1:])
    return out.index_put((packed.rows, packed.cols), values[packed.index])
