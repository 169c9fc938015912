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

**Shards** (``shards=ShardTarget(...)``: Megatron TP == vLLM TP with the same rank order). vLLM's
weight loaders only take full tensors: each narrows the tensor it is given to its own TP slice,
``[tp_rank * n, (tp_rank + 1) * n)`` along the parameter's ``output_dim`` (column parallel:
q/k/v, gate/up, vocabulary rows) or ``input_dim`` (row parallel: o_proj, down_proj), and reads
nothing else (docs/rollout.md names the functions). A rank's Megatron shard is exactly that slice
(its query groups hold the same q heads as vLLM's rank; ``[gate_r; up_r]`` splits into vLLM's
gate and up shards), so step 2 is skipped: the owning stage converts its own shard (q/k/v split
with the per-rank head counts), the PP broadcast carries shards (1/TP of the bytes), and each
HF tensor is handed to vLLM in a full-shaped *frame* holding the shard at this rank's offset and
NaN elsewhere (a loader reading outside its slice would poison vLLM's weights and fail the logprob
check loudly). The embedding / untied lm_head go this way only when Megatron's vocabulary rows
per rank equal vLLM's (``vocab_rows``, vLLM's own padding); otherwise they are gathered as above.
Replicated tensors (norms) travel whole either way.

:func:`sync_traffic` computes, from the architecture and the layouts, the bytes each rank
receives; the buckets count what really arrived (``received_tp``, ``received_pp``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace

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
    tp_dim: int | None = None  # megatron's partition_dim; None: every TP rank holds it whole

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty((), dtype=self.dtype).element_size()

    def shard_shape(self, tp: int) -> tuple[int, ...]:
        shape = list(self.shape)
        if self.tp_dim is not None:
            shape[self.tp_dim] //= tp
        return tuple(shape)


@dataclass(frozen=True)
class ShardTarget:
    """This rank's vLLM shard, when vLLM's TP ranks are Megatron's (same size, same order)."""

    tp: int
    rank: int
    vocab_rows: int  # vLLM's vocabulary rows per TP rank (its padding, not Megatron's)


@dataclass
class WeightBucket:
    """Full HF tensors ready for ``model.load_weights``; ``sources`` megatron tensors made them."""

    tensors: list[tuple[str, torch.Tensor]]
    nbytes: int
    sources: int
    received_tp: int = 0  # bytes this rank received to build it: TP all-gathers
    received_pp: int = 0  # ... and PP broadcasts from other stages


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
    mine = [SyncEntry(stage, k, _full_shape(p, tp), p.dtype, _tp_dim(p)) for k, p in local.items()]
    if pp == 1:
        return mine, local
    per_stage: list = [None] * pp
    dist.all_gather_object(per_stage, mine, group=ps.get_pipeline_model_parallel_group())
    return [e for entries in per_stage for e in entries], local


def _join_tp(p: torch.Tensor, key: str, tp_group, tp: int) -> tuple[torch.Tensor, int]:
    """The full tensor and the bytes this rank received for it."""
    shard = p.detach().contiguous()
    dim = _tp_dim(p)
    if dim is None or tp == 1:
        return shard, 0
    parts = [torch.empty_like(shard) for _ in range(tp)]
    dist.all_gather(parts, shard, group=tp_group)
    received = (tp - 1) * shard.nbytes
    if key.endswith(hf_mapping.FC1_W):  # each rank holds [gate_i; up_i]
        halves = [torch.chunk(x, 2, dim=0) for x in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0), received
    return torch.cat(parts, dim=dim), received


_VOCAB = {hf_mapping.MC_EMBED: hf_mapping.HF_EMBED, hf_mapping.MC_HEAD: hf_mapping.HF_HEAD}


def _travels_as_shard(e: SyncEntry, target: ShardTarget | None) -> bool:
    """Whether ``e`` goes as this rank's shard (same decision on every rank)."""
    if target is None or e.tp_dim is None:
        return False
    if e.key in _VOCAB:  # vLLM pads the vocabulary its own way: the rows per rank must agree
        return e.shape[0] // target.tp == target.vocab_rows
    return True


def shard_to_hf_frames(e: SyncEntry, shard: torch.Tensor, arch: QwenArch,
                       target: ShardTarget) -> list[tuple[str, torch.Tensor]]:
    """This rank's megatron shard -> its HF tensors, each in a full-shaped frame that holds the
    shard where vLLM's loader for TP rank ``target.rank`` reads it, and NaN elsewhere."""
    tp, r = target.tp, target.rank
    if e.key in _VOCAB:  # rows [r*P, min((r+1)*P, vocab)) of the unpadded vocabulary
        lo = r * target.vocab_rows
        hi = min(lo + target.vocab_rows, arch.vocab_size)
        frame = shard.new_full((arch.vocab_size, *shard.shape[1:]), float("nan"))
        frame[lo:hi] = shard[:max(0, hi - lo)]
        return [(_VOCAB[e.key], frame)]
    # the shard is the layer of a model with 1/tp of the heads, query groups and FFN width
    local = replace(arch, num_heads=arch.num_heads // tp, num_kv_heads=arch.num_kv_heads // tp,
                    intermediate_size=arch.intermediate_size // tp)
    out = []
    for name, t in mcore_tensor_to_hf(e.key, shard, local):
        n = t.shape[e.tp_dim]
        shape = list(t.shape)
        shape[e.tp_dim] = n * tp
        frame = t.new_full(shape, float("nan"))
        frame.narrow(e.tp_dim, r * n, n).copy_(t)
        out.append((name, frame))
    return out


def iter_hf_buckets(model, arch: QwenArch, bucket_bytes: int, *,
                    shards: ShardTarget | None = None) -> Iterator[WeightBucket]:
    """Collective generator (every rank must drain it): full HF tensors in bounded buckets.

    A bucket holds the HF tensors of whole megatron tensors whose full sizes add up to at most
    ``bucket_bytes``; a single tensor larger than that forms a bucket of its own. With
    ``shards`` (Megatron TP == vLLM TP, same rank order; the same on every rank) the TP-sharded
    tensors travel as this rank's shard in full-shaped frames (module docstring).
    """
    from megatron.core import parallel_state as ps

    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes={bucket_bytes} must be > 0")
    chunks = unwrap_chunks(model)
    manifest, local = build_manifest(chunks, arch)
    tp = ps.get_tensor_model_parallel_world_size()
    if shards is not None and (shards.tp != tp or shards.rank != ps.get_tensor_model_parallel_rank()):
        raise ValueError(f"shards for vLLM TP rank {shards.rank} of {shards.tp}, but this is "
                         f"Megatron TP rank {ps.get_tensor_model_parallel_rank()} of {tp}")
    pp = ps.get_pipeline_model_parallel_world_size()
    stage = ps.get_pipeline_model_parallel_rank()
    tp_group = ps.get_tensor_model_parallel_group()
    pp_group = ps.get_pipeline_model_parallel_group()
    pp_ranks = dist.get_process_group_ranks(pp_group) if pp > 1 else None
    device = next(iter(local.values())).device if local else torch.device("cpu")

    tensors: list[tuple[str, torch.Tensor]] = []
    size = sources = got_tp = got_pp = 0
    for e in manifest:
        if tensors and size + e.nbytes > bucket_bytes:
            yield WeightBucket(tensors, size, sources, got_tp, got_pp)
            tensors, size, sources, got_tp, got_pp = [], 0, 0, 0, 0
        as_shard = _travels_as_shard(e, shards)
        shape = e.shard_shape(tp) if as_shard else e.shape
        if e.stage != stage:
            t = torch.empty(shape, dtype=e.dtype, device=device)
        elif as_shard:
            t = local[e.key].detach().contiguous()
        else:
            t, got = _join_tp(local[e.key], e.key, tp_group, tp)
            got_tp += got
        if pp > 1:
            dist.broadcast(t, src=pp_ranks[e.stage], group=pp_group)
            got_pp += t.nbytes if e.stage != stage else 0
        if tuple(t.shape) != shape:
            raise RuntimeError(f"{e.key}: gathered shape {tuple(t.shape)}, planned {shape}")
        tensors.extend(shard_to_hf_frames(e, t, arch, shards) if as_shard
                       else mcore_tensor_to_hf(e.key, t, arch))
        size += e.nbytes
        sources += 1
    if tensors:
        yield WeightBucket(tensors, size, sources, got_tp, got_pp)


# vLLM's DEFAULT_VOCAB_PADDING_SIZE (model_executor/layers/vocab_parallel_embedding.py): it pads
# the vocabulary to a multiple of this and gives each TP rank 1/TP of the padded rows.
VLLM_VOCAB_PADDING = 64


def vllm_vocab_rows(vocab_size: int, tp: int, padding: int = VLLM_VOCAB_PADDING) -> int:
    """vLLM's vocabulary rows per TP rank."""
    return -(-vocab_size // padding) * padding // tp


def sync_traffic(arch: QwenArch, *, tp: int, pp: int, dtype_bytes: int, shards: bool,
                 vocab_multiple: int = 128, vocab_rows: int | None = None) -> list[dict[str, int]]:
    """Bytes one rank of each pipeline stage receives in one sync (index: the stage), as
    :func:`iter_hf_buckets` moves them: ``tp_gather`` ((TP-1)/TP of each TP-sharded tensor of
    its own stage that travels whole), ``pp_broadcast`` (every tensor of the other stages; 1/TP
    of it when it travels as a shard) and ``total``. ``shards``: the shard path (Megatron TP ==
    vLLM TP); ``vocab_rows``: vLLM's vocabulary rows per rank (default: vLLM's padding at ``tp``).
    Megatron's parameters in ``dtype_bytes``, layers split evenly over the stages."""
    h, d, f = arch.hidden_size, arch.head_dim, arch.intermediate_size
    qkv = (arch.num_heads + 2 * arch.num_kv_heads) * d
    # (elements, TP-sharded) per decoder layer: qkv, proj, fc1, fc2, the two norms, bias, q/k norms
    layer = [(qkv * h, True), (h * arch.num_heads * d, True), (2 * f * h, True), (h * f, True),
             (h, False), (h, False)] + [(qkv, True)] * arch.qkv_bias + [(d, False)] * (2 * arch.qk_norm)
    padded = arch.padded_vocab_size(vocab_multiple)
    rows = vllm_vocab_rows(arch.vocab_size, tp) if vocab_rows is None else vocab_rows
    vocab_as_shard = shards and rows == padded // tp
    stages = []  # per stage: (elements, TP-sharded, travels as a shard)
    for s in range(pp):
        items = [(n, sharded, shards and sharded) for n, sharded in layer] * (arch.num_layers // pp)
        if s == 0:
            items.append((padded * h, True, vocab_as_shard))
        if s == pp - 1:
            items.append((h, False, False))
            if not arch.tie_word_embeddings:
                items.append((padded * h, True, vocab_as_shard))
        stages.append(items)
    out = []
    for s in range(pp):
        gather = sum(n * (tp - 1) // tp for n, sharded, as_shard in stages[s] if sharded and not as_shard)
        bcast = sum(n // tp if as_shard else n
                    for other, items in enumerate(stages) if other != s for n, _, as_shard in items)
        out.append({"tp_gather": gather * dtype_bytes, "pp_broadcast": bcast * dtype_bytes,
                    "total": (gather + bcast) * dtype_bytes})
    return out
