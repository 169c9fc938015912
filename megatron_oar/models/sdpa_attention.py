"""Core attention through PyTorch's ``scaled_dot_product_attention`` for megatron's local spec.

Megatron's local ``DotProductAttention`` materialises ``[b, heads, s, s]`` scores and an fp32
softmax of them, so its memory and time grow with the square of the sequence (a 1.5B model ran
out of memory on an 80 GB H100 at 8k-token responses, docs/gpu-validation.md). :class:`SDPAttention`
keeps megatron's interface (it is a ``DotProductAttention``: same constructor, same state dict,
the same per-partition heads under TP) and hands the work to
``torch.nn.functional.scaled_dot_product_attention``, which picks FlashAttention, cuDNN or the
memory-efficient kernel on CUDA and its own flash kernel on the CPU (no ``s x s`` tensor is kept;
the math backend, which keeps one, only where a mask is given).

- **Causal**, as megatron's local spec: with ``attention_mask`` None a causal mask (no mask for a
  single query), with a mask given that mask alone (megatron's ``FusedScaleMaskSoftmax`` rule:
  True = masked out).
- **GQA** without repeating K/V (``enable_gqa``): the kernels read each KV head for its group.
- **Token-budget micro-batches** are right-padded rows: causal attention keeps the pads after
  every real token, so no mask is needed.
- **Packed THD** (``train.batching=packed``, ``query [T, heads, dim]`` with megatron's
  ``PackedSeqParams``): on CUDA in bf16/fp16, variable-length FlashAttention
  (``torch.nn.attention.varlen.varlen_attn``) over ``cu_seqlens_q_padded``; elsewhere (CPU, fp32,
  a torch without varlen) one causal SDPA call per row segment. Both cost memory linear in ``T``
  and never let a row see another; a block-diagonal document mask would cost ``T x T`` and rule
  out the flash kernels, so it is not used. Pads attend as trailing tokens of their row (the
  lengths are the padded ones, as :mod:`megatron_oar.models.packing` passes them to TE too).

- **Context parallelism** (``parallel.cp > 1``, :mod:`megatron_oar.models.context_parallel`): each
  rank holds two of the ``2 x CP`` chunks of every sequence. K and V are all-gathered over the CP
  group (the backward sums their gradients over the ranks and keeps this rank's part: a
  reduce-scatter), put in sample order, and each local query chunk ``j`` attends to the keys of
  chunks ``0..j``, causal aligned to the bottom right (``torch.nn.attention.bias.causal_lower_right``:
  query ``i`` of the chunk sees the keys up to its global position ``j x c + i``; no mask tensor,
  which CUDA's SDPA kernels take as such, the CPU materialises). GQA keeps the gathered K/V
  small: ``2 x kv_heads x head_dim`` per token. Exact; the TE spec's CP attention (ring exchange,
  no whole-sequence K/V) is the path for long sequences on GPUs. Packed THD under CP: each row
  split on its own (two chunks of every row per rank, Transformer Engine's THD layout), K/V
  gathered into packed order, one causal SDPA call per local chunk over its row's earlier keys.

``model.attention`` picks the core attention (``models.builder.resolve_attention``); the backend SDPA chose is
logged once per process at the first call (:func:`sdpa_backend`).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import logging

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from torch.nn.attention.bias import causal_lower_right

log = logging.getLogger(__name__)

_CAUSAL = (AttnMaskType.causal, AttnMaskType.padding_causal)
_BACKENDS = {0: "math", 1: "flash_attention", 2: "efficient_attention", 3: "cudnn_attention",
             4: "overrideable"}  # torch's SDPBackend order (torch/nn/attention/__init__.py)
_logged: set[str] = set()
_logged_backend: list[bool] = []


def sdpa_backend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, causal: bool,
                 gqa: bool) -> str:
    """The kernel SDPA dispatches these inputs to (``[b, heads, s, dim]``), as torch decides it
    (on the CPU too: its flash kernel for causal attention without a mask, else math)."""
    try:
        choice = torch._fused_sdp_choice(query, key, value, None, 0.0, causal, scale=None,
                                         enable_gqa=gqa)
    except (AttributeError, RuntimeError, TypeError):  # a private API: its signature may move
        return "unknown"
    return f"{_BACKENDS.get(int(choice), str(choice))} ({query.device.type})"


def _log_once(line: str) -> None:
    if line not in _logged:
        _logged.add(line)
        log.info(line)


@functools.cache
def _varlen():
    """``(varlen_attn, the keyword that makes it causal, whether it takes enable_gqa)`` or None
    where this torch has no variable-length attention (before 2.10)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    causal = "window_size" if "window_size" in params else "is_causal" if "is_causal" in params else None
    return None if causal is None else (varlen_attn, causal, "enable_gqa" in params)


class SDPAttention(DotProductAttention):
    """Megatron's local core attention computed by ``scaled_dot_product_attention`` (module doc)."""

    def __init__(self, config, *args, **kwargs):
        # megatron's local DotProductAttention asserts context_parallel_size == 1; this one
        # gathers K/V over the CP group itself (_context_parallel)
        cp = config.context_parallel_size
        if cp > 1:
            plain = copy.copy(config)  # no __post_init__: the same config but for the assert
            plain.context_parallel_size = 1
            super().__init__(plain, *args, **kwargs)
            self.config = config
        else:
            super().__init__(config, *args, **kwargs)
        self.cp = cp
        if self.config.softmax_type != "vanilla":
            raise ValueError(f"model.attention=sdpa: softmax_type={self.config.softmax_type!r} is "
                             "not supported (vanilla only); use model.attention=unfused")
        if self.scale_mask_softmax.window_size is not None:
            raise ValueError("model.attention=sdpa: sliding-window attention is not supported; "
                             "use model.attention=unfused")
        self.groups = self.num_attention_heads_per_partition // self.num_query_groups_per_partition

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if attention_bias is not None:
            raise ValueError("model.attention=sdpa: attention_bias is not supported")
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        causal = mask_type in _CAUSAL
        dropout = self.attention_dropout.p if self.training else 0.0
        with self._dropout_rng(dropout):
            if self.cp > 1:
                if attention_mask is not None or not causal:
                    raise ValueError("model.attention=sdpa with parallel.cp > 1: causal attention "
                                     "without a mask only")
                if packed_seq_params is not None:
                    return self._context_parallel_packed(query, key, value, packed_seq_params, dropout)
                return self._context_parallel(query, key, value, dropout)
            if packed_seq_params is not None:
                if attention_mask is not None:
                    raise ValueError("model.attention=sdpa: packed (THD) sequences take no "
                                     "attention_mask")
                return self._packed(query, key, value, packed_seq_params, causal, dropout)
            return self._dense(query, key, value, attention_mask, causal, dropout)

    def _dropout_rng(self, dropout: float):
        """Megatron's RNG for attention dropout (a different stream per TP rank, as its local
        attention forks it); nothing to fork without dropout."""
        if dropout == 0.0 or self.config.sequence_parallel:
            return contextlib.nullcontext()
        return tensor_parallel.get_cuda_rng_tracker().fork()

    def _sdpa(self, q, k, v, mask, causal: bool, dropout: float) -> torch.Tensor:
        """``[b, heads, s, dim]`` in and out."""
        gqa = self.groups > 1
        if not _logged_backend:  # the kernel SDPA picks, once per process (asking costs a dispatch)
            _logged_backend.append(True)
            _log_once(f"attention: sdpa backend={sdpa_backend(q, k, v, causal=causal, gqa=gqa)} "
                      f"dtype={str(q.dtype).removeprefix('torch.')} gqa={gqa}")
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout,
                                              is_causal=causal, scale=self.softmax_scale,
                                              enable_gqa=gqa)

    def _dense(self, query, key, value, attention_mask, causal: bool, dropout: float):
        """``[s, b, heads, dim]`` in, ``[s, b, heads * dim]`` out."""
        sq, b = query.shape[:2]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, dim]
        mask = None
        if attention_mask is not None:  # megatron's rule: a given mask alone, True = masked out
            mask, causal = ~attention_mask.bool(), False
        elif sq == 1:
            causal = False  # megatron's causal mask is for sq > 1 only
        context = self._sdpa(q, k, v, mask, causal, dropout)
        return context.permute(2, 0, 1, 3).reshape(sq, b, self.hidden_size_per_partition)

    def _context_parallel(self, query, key, value, dropout: float):
        """``[s/CP, b, heads, dim]`` in (this rank's two chunks), ``[s/CP, b, heads * dim]`` out:
        causal attention over the whole sequence, K/V gathered from every CP rank."""
        from megatron_oar.models import context_parallel as cpx

        sl, b = query.shape[:2]
        c = sl // 2
        keys, values = (cpx.gather(t, 0, replicated=False) for t in (key, value))  # [s, b, g, d]
        out = []
        for half, chunk in enumerate(cpx.chunk_ids(self.cp, cpx.cp_rank())):
            end = (chunk + 1) * c  # keys after this chunk are never visible to it
            q = query[half * c:(half + 1) * c].permute(1, 2, 0, 3)
            k, v = (t[:end].permute(1, 2, 0, 3) for t in (keys, values))
            # query i of the chunk (global chunk * c + i) sees keys 0..chunk * c + i: causal,
            # aligned to the bottom right (no [c, end] mask tensor: on CUDA SDPA's kernels take it)
            mask = causal_lower_right(c, end)
            out.append(self._sdpa(q, k, v, mask, False, dropout))  # [b, heads, c, dim]
        context = torch.cat(out, dim=2)
        return context.permute(2, 0, 1, 3).reshape(sl, b, self.hidden_size_per_partition)

    def _context_parallel_packed(self, query, key, value, p, dropout: float):
        """THD ``[T/CP, heads, dim]`` in (this rank's two chunks of every packed row,
        ``context_parallel.thd_local_index``), ``[T/CP, heads * dim]`` out: K/V gathered over
        the CP group into packed order, and each local query chunk ``j`` of a row attends to that
        row's keys of chunks ``0..j`` (causal aligned to the bottom right, as
        :meth:`_context_parallel`): rows never see each other, and the attention is the one the
        row would get alone."""
        from megatron_oar.models import context_parallel as cpx

        offsets = self._segments(p).tolist()  # the global packed layout
        order = cpx.thd_global_order(offsets, self.cp, query.device)  # cached per layout
        keys, values = (cpx.gather(t, 0, replicated=False, order=order) for t in (key, value))  # [T, g, d]
        if keys.shape[0] != offsets[-1] or offsets[0] != 0:
            raise ValueError(f"model.attention=sdpa: packed segments {offsets[0]}..{offsets[-1]} do "
                             f"not cover the {keys.shape[0]} tokens gathered over parallel.cp")
        chunks = cpx.chunk_ids(self.cp, cpx.cp_rank())
        pieces, at = [], 0
        for start, end in zip(offsets, offsets[1:]):
            c = (end - start) // (2 * self.cp)
            for chunk in chunks if c else ():
                seen = (chunk + 1) * c  # the row's keys up to the end of this chunk
                q = query[at:at + c].transpose(0, 1).unsqueeze(0)  # [1, heads, c, dim]
                k, v = (t[start:start + seen].transpose(0, 1).unsqueeze(0) for t in (keys, values))
                out = self._sdpa(q, k, v, causal_lower_right(c, seen), False, dropout)
                pieces.append(out[0].transpose(0, 1).reshape(c, self.hidden_size_per_partition))
                at += c
        if at != query.shape[0]:
            raise ValueError(f"model.attention=sdpa: {query.shape[0]} local packed tokens, the segments "
                             f"split over parallel.cp={self.cp} give {at}")
        return torch.cat(pieces)

    @staticmethod
    def _segments(p) -> torch.Tensor:
        """The packed rows' (padded) offsets of megatron's ``PackedSeqParams``: THD self-attention."""
        if p.qkv_format != "thd":
            raise ValueError(f"model.attention=sdpa: packed qkv_format={p.qkv_format!r}; expected thd")
        cu = p.cu_seqlens_q_padded if p.cu_seqlens_q_padded is not None else p.cu_seqlens_q
        cu_kv = p.cu_seqlens_kv_padded if p.cu_seqlens_kv_padded is not None else p.cu_seqlens_kv
        if cu_kv is not cu and not torch.equal(cu, cu_kv):
            raise ValueError("model.attention=sdpa: packed sequences need the same query and key "
                             "segments (self-attention)")
        return cu

    def _packed(self, query, key, value, p, causal: bool, dropout: float):
        """THD ``[T, heads, dim]`` in, ``[T, heads * dim]`` out: each row of
        ``cu_seqlens_q_padded`` attends within itself."""
        cu = self._segments(p)
        total = query.shape[0]
        varlen = _varlen() if query.is_cuda and query.dtype in (torch.bfloat16, torch.float16) else None
        if varlen is not None and dropout == 0.0:
            fn, causal_kw, takes_gqa = varlen
            k, v = key, value
            kw = {"scale": self.softmax_scale}
            if self.groups > 1:
                if takes_gqa:
                    kw["enable_gqa"] = True
                else:
                    k, v = (t.repeat_interleave(self.groups, dim=1) for t in (key, value))
            kw[causal_kw] = ((-1, 0) if causal else (-1, -1)) if causal_kw == "window_size" else causal
            _log_once(f"attention: sdpa packed backend=varlen_flash dtype="
                      f"{str(query.dtype).removeprefix('torch.')} gqa={self.groups > 1}")
            cu32 = cu.to(torch.int32)
            context = fn(query, k, v, cu32, cu32, int(p.max_seqlen_q), int(p.max_seqlen_kv), **kw)
            return context.reshape(total, self.hidden_size_per_partition)
        offsets = cu.tolist()
        if offsets[0] != 0 or offsets[-1] != total:
            raise ValueError(f"model.attention=sdpa: packed segments {offsets[0]}..{offsets[-1]} do "
                             f"not cover the {total} tokens")
        pieces = []
        for start, end in zip(offsets, offsets[1:]):
            if end == start:
                continue
            q, k, v = (t[start:end].transpose(0, 1).unsqueeze(0) for t in (query, key, value))
            row = self._sdpa(q, k, v, None, causal and end - start > 1, dropout)  # [1, heads, n, dim]
            pieces.append(row[0].transpose(0, 1).reshape(end - start, self.hidden_size_per_partition))
        return torch.cat(pieces)
