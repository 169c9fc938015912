"""Megatron TP/PP shards -> full Hugging Face tensors, in buckets of bounded size.

Every rank ends up with every full HF tensor (each rank feeds its own vLLM engine, whose
``weight_loader`` keeps the slice its rollout-TP rank needs), one bucket at a time:

1. The *manifest*: each pipeline stage lists its parameters (megatron name with the global layer
   number, full shape, dtype); one ``all_gather_object`` over the PP group gives every rank the
   same ordered list (stage 0 first).
2. Per parameter, the owning stage all-gathers the TP shards over the TP group along the
   parameter's ``partition_dim`` (``linear_fc1`` holds ``[gate_i; up_i]`` per rank, so gate and
   up are re-joined separately), then it broadcasts the full tensor over the PP group.
3. The converter's mapping (:mod:`megatron_oar.models.hf_mapping`) turns the megatron tensor into
   HF tensors: ``linear_qkv`` -> q/k/v, ``linear_fc1`` -> gate/up, padded vocab rows dropped;
   Qwen3's q/k norms (not TP-sharded: every TP rank holds the whole ``[head_dim]`` vector) go
   as they are, from the TP rank's own copy.
4. Tensors accumulate into a bucket until the next one would exceed the bound; the bucket is
   yielded, handed to vLLM, and freed before the next is gathered.

Tied embeddings: only the first stage's ``embedding.word_embeddings.weight`` travels (the last
stage's copy in ``output_layer`` is skipped); vLLM ties ``lm_head`` itself.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_oar.models import QwenArch, hf_mapping


@dataclass(frozen=True)
class SyncEntry:
    """One megatron parameter as every rank sees it."""

    stage: int  # pipeline rank that owns it
    key: str  # megatron name; decoder layers carry their *global* number
    shape: tuple[int, ...]  # full shape (TP shards joined)
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty((), dtype=self.dtype).element_size()


@dataclass
class WeightBucket:
    """Full HF tensors ready for ``model.load_weights``; ``sources`` megatron tensors made them."""

    tensors: list[tuple[str, torch.Tensor]]
    nbytes: int
    sources: int


def unwrap_chunks(model) -> list[torch.nn.Module]:
    """The ``GPTModel`` chunk(s) behind DDP/Float16Module-style wrappers (a list for VPP)."""
    chunks = model if isinstance(model, (list, tuple)) else [model]
    out = []
    for m in chunks:
        while hasattr(m, "module") and not hasattr(m, "decoder"):
            m = m.module
        if not hasattr(m, "decoder"):
            raise TypeError(f"expected a megatron GPTModel (or a wrapper of one), got {type(m).__name__}")
        out.append(m)
    return out


def mcore_tensor_to_hf(key: str, tensor: torch.Tensor, arch: QwenArch) -> list[tuple[str, torch.Tensor]]:
    """One full megatron tensor -> its HF tensor(s), with the converter's layouts.

    ``key`` is a megatron name with a global layer number (``decoder.layers.{i}.<rel>``, local
    or TE norm spelling) or ``embedding.word_embeddings.weight`` / ``decoder.final_layernorm.weight``
    / ``output_layer.weight``.
    """
    if key.startswith(hf_mapping.MC_LAYER_PREFIX):
        layer_str, rel = key[len(hf_mapping.MC_LAYER_PREFIX):].split(".", 1)
        rel = hf_mapping.rename_spec(rel, "local", "te")
        try:
            return hf_mapping.mcore_to_hf_layer_tensor(arch, int(layer_str), rel, tensor, "te")
        except KeyError:
            raise KeyError(f"no HF name for megatron parameter {key!r} (qkv_bias={arch.qkv_bias}, "
                           f"qk_norm={arch.qk_norm})") from None
    hf_name = {hf_mapping.MC_EMBED: hf_mapping.HF_EMBED, hf_mapping.MC_NORM: hf_mapping.HF_NORM,
               hf_mapping.MC_HEAD: hf_mapping.HF_HEAD}.get(key)
    if hf_name is None:
        raise KeyError(f"no HF name for megatron parameter {key!r}")
    return [(hf_name, hf_mapping.mcore_to_hf_global_tensor(lambda _: tensor, arch, hf_name))]


def _local_params(chunks, arch: QwenArch) -> dict[str, torch.nn.Parameter]:
    """This rank's parameters keyed by megatron name with global layer numbers, in order."""
    out: dict[str, torch.nn.Parameter] = {}
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            if name == hf_mapping.MC_HEAD and arch.tie_word_embeddings:
                continue  # the last stage's copy of the tied embedding
            if name.startswith(hf_mapping.MC_LAYER_PREFIX):
                local_str, rel = name[len(hf_mapping.MC_LAYER_PREFIX):].split(".", 1)
                layer = chunk.decoder.layers[int(local_str)].layer_number - 1
                name = f"{hf_mapping.MC_LAYER_PREFIX}{layer}.{rel}"
            if name in out:
                raise ValueError(f"parameter {name!r} appears twice across model chunks")
            out[name] = p
    return out


def _tp_dim(p: torch.Tensor) -> int | None:
    return p.partition_dim if getattr(p, "tensor_model_parallel", False) else None


def _full_shape(p: torch.Tensor, tp: int) -> tuple[int, ...]:
    shape = list(p.shape)
    dim = _tp_dim(p)
    if dim is not None:
        shape[dim] *= tp
    return tuple(shape)


def build_manifest(chunks, arch: QwenArch) -> tuple[list[SyncEntry], dict[str, torch.nn.Parameter]]:
    """Collective over the PP group: the ordered list of every megatron tensor to send."""
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    pp = ps.get_pipeline_model_parallel_world_size()
    stage = ps.get_pipeline_model_parallel_rank()
    local = _local_params(chunks, arch)
    mine = [SyncEntry(stage, k, _full_shape(p, tp), p.dtype) for k, p in local.items()]
    if pp == 1:
        return mine, local
    per_stage: list = [None] * pp
    dist.all_gather_object(per_stage, mine, group=ps.get_pipeline_model_parallel_group())
    return [e for entries in per_stage for e in entries], local


def _join_tp(p: torch.Tensor, key: str, tp_group, tp: int) -> torch.Tensor:
    shard = p.detach().contiguous()
    dim = _tp_dim(p)
    if dim is None or tp == 1:
        return shard
    parts = [torch.empty_like(shard) for _ in range(tp)]
    dist.all_gather(parts, shard, group=tp_group)
    if key.endswith(hf_mapping.FC1_W):  # each rank holds [gate_i; up_i]
        halves = [torch.chunk(x, 2, dim=0) for x in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(parts, dim=dim)


def iter_hf_buckets(model, arch: QwenArch, bucket_bytes: int) -> Iterator[WeightBucket]:
    """Collective generator (every rank must drain it): full HF tensors in bounded buckets.

    A bucket holds the HF tensors of whole megatron tensors whose full sizes add up to at most
    ``bucket_bytes``; a single tensor larger than that forms a bucket of its own.
    """
    from megatron.core import parallel_state as ps

    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes={bucket_bytes} must be > 0")
    chunks = unwrap_chunks(model)
    manifest, local = build_manifest(chunks, arch)
    tp = ps.get_tensor_model_parallel_world_size()
    pp = ps.get_pipeline_model_parallel_world_size()
    stage = ps.get_pipeline_model_parallel_rank()
    tp_group = ps.get_tensor_model_parallel_group()
    pp_group = ps.get_pipeline_model_parallel_group()
    pp_ranks = dist.get_process_group_ranks(pp_group) if pp > 1 else None
    device = next(iter(local.values())).device if local else torch.device("cpu")

    tensors: list[tuple[str, torch.Tensor]] = []
    size = sources = 0
    for e in manifest:
        if tensors and size + e.nbytes > bucket_bytes:
            yield WeightBucket(tensors, size, sources)
            tensors, size, sources = [], 0, 0
        if e.stage == stage:
            full = _join_tp(local[e.key], e.key, tp_group, tp)
        else:
            full = torch.empty(e.shape, dtype=e.dtype, device=device)
        if pp > 1:
            dist.broadcast(full, src=pp_ranks[e.stage], group=pp_group)
        if tuple(full.shape) != e.shape:
            raise RuntimeError(f"{e.key}: gathered shape {tuple(full.shape)}, planned {e.shape}")
        tensors.extend(mcore_tensor_to_hf(e.key, full, arch))
        size += e.nbytes
        sources += 1
    if tensors:
        yield WeightBucket(tensors, size, sources)
