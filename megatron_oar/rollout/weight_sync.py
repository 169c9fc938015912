"""Megatron TP/PP shards -> full Hugging Face tensors, in buckets of bounded size.

Every rank ends up with every full HF tensor (each rank feeds its own vLLM engine, whose
``weight_loader`` keeps the slice its rollout-TP rank needs), one bucket at a time:

1. The *manifest*: each pipeline stage lists its parameters (megatron name with the global layer
   number, full shape, dtype); one ``all_gather_object`` over the PP group gives every rank the
   same ordered list (stage 0 first).
2. Per parameter, the owning stage all-gathers the TP shards over the TP group along the
   dimension its role splits (column parallel: 0, row parallel: 1; not the parameter's
   ``partition_dim`` mark, which TE sets to 0 on every grouped expert weight: ``_tp_dim``;
   ``linear_fc1`` holds ``[gate_i; up_i]`` per rank, so gate and up are re-joined separately),
   then it broadcasts the full tensor over the PP group.
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

**Experts** (Qwen3-MoE): a rank holds ``num_experts / EP`` experts of each MoE layer, numbered
from 0 (EP rank ``k`` holds global experts ``k * E/EP + j``), each TP-sharded over the expert-TP
group (ETP). The manifest names them by global id; a *unit* is one local slot ``j`` of a layer
(its ``linear_fc1`` or ``linear_fc2``) on every EP rank at once: the owning stage joins the ETP
shards (over ``get_expert_tensor_parallel_group``), then all-gathers the slot over the
expert-parallel group (``get_expert_model_parallel_group``), which gives experts ``j, j + E/EP,
...`` in EP-rank order; other stages receive them by PP broadcast. Each becomes HF's
``mlp.experts.{e}.gate_proj/up_proj/down_proj.weight``; the router goes as ``mlp.gate.weight``
and the MoE layer's own ``pre_mlp_layernorm`` as ``post_attention_layernorm.weight``. Every rank
yields the same names in the same order (vLLM's TP ranks load the same stream). The dense shard
path (``shards``) leaves the experts alone: Megatron's expert shards are vLLM's slices only when
ETP equals vLLM's TP, which the usual layouts (ETP 1) are not.

**Experts cut** (``experts=ExpertTarget(...)``, :func:`expert_target`; independent of Megatron's
TP): vLLM (TP, no expert parallelism) narrows each expert to its TP rank's slice of
``moe_intermediate_size``, so after the ETP join an all-to-all over EP (instead of the all-gather)
gives each rank its own slice of every expert of the slot, the PP broadcast carries slices, and
each goes to vLLM as a *compact frame* (:func:`compact_frame`: full-shaped, the slice where the
loader narrows, about 1/TP of the memory), since vLLM's in-place reload holds a whole FusedMoE
layer of what it was handed until the layer's last expert arrives (:func:`moe_layer_reload_bytes`).

:func:`sync_traffic` computes, from the architecture and the layouts, the bytes each rank
receives; the buckets count what really arrived (``received_tp``, ``received_pp``,
``received_ep``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from megatron_oar.models import QwenArch, hf_mapping
from megatron_oar.models.families.qwen3_moe import PRE_MLP_NORM, expert_name, global_expert_name, parse_expert_name


@dataclass(frozen=True)
class SyncEntry:
    """One megatron parameter as every rank sees it."""

    stage: int  # pipeline rank that owns it
    key: str  # megatron name; decoder layers carry their *global* number
    shape: tuple[int, ...]  # full shape (TP shards joined)
    dtype: torch.dtype
    tp_dim: int | None = None  # the TP split's dimension, by role; None: every TP rank holds it whole
    # an expert's weight: the EP rank that holds it (sharded over the expert-TP group, not TP)
    ep_rank: int | None = None

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


@dataclass(frozen=True)
class ExpertTarget:
    """This rank's vLLM TP slice of every expert: vLLM (TP, no expert parallelism) gives TP rank
    ``rank`` of ``tp`` each expert narrowed to 1/``tp`` of ``moe_intermediate_size`` (FusedMoE's
    ``_load_w13`` / ``_load_w2``). Independent of Megatron's TP: the experts follow EP and ETP."""

    tp: int
    rank: int


def expert_target(*, world_size: int, pp: int, rank: int, vllm_tp: int, moe_intermediate_size: int,
                  enabled: bool = True) -> ExpertTarget | None:
    """The experts' slice for rank ``rank`` (vLLM's TP groups: consecutive ranks), or None where
    they must travel whole: ``enabled`` off (``rollout.sync_shards``), vLLM TP 1, a width vLLM's TP
    does not divide, or pipeline peers (``world_size / pp`` apart in megatron's rank order) that
    are different vLLM TP ranks (the PP broadcast carries one slice to all of them)."""
    if not enabled or vllm_tp <= 1 or moe_intermediate_size % vllm_tp or (world_size // pp) % vllm_tp:
        return None
    return ExpertTarget(tp=vllm_tp, rank=rank % vllm_tp)


@dataclass
class WeightBucket:
    """Full HF tensors ready for ``model.load_weights``; ``sources`` megatron tensors made them."""

    tensors: list[tuple[str, torch.Tensor]]
    nbytes: int
    sources: int
    received_tp: int = 0  # bytes this rank received to build it: TP all-gathers
    received_pp: int = 0  # ... and PP broadcasts from other stages
    received_ep: int = 0  # ... and the experts' all-gathers over expert parallelism
    flat: torch.Tensor | None = None  # the separate placement's send buffer the tensors are views of


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
        rel = _te_name(rel, arch, int(layer_str))
        try:
            return hf_mapping.mcore_to_hf_layer_tensor(arch, int(layer_str), rel, tensor, "te")
        except (KeyError, IndexError):
            raise KeyError(f"no HF name for megatron parameter {key!r} (qkv_bias={arch.qkv_bias}, "
                           f"qk_norm={arch.qk_norm}, num_experts={arch.num_experts})") from None
    hf_name = {hf_mapping.MC_EMBED: hf_mapping.HF_EMBED, hf_mapping.MC_NORM: hf_mapping.HF_NORM,
               hf_mapping.MC_HEAD: hf_mapping.HF_HEAD}.get(key)
    if hf_name is None:
        raise KeyError(f"no HF name for megatron parameter {key!r}")
    return [(hf_name, hf_mapping.mcore_to_hf_global_tensor(lambda _: tensor, arch, hf_name))]


def _te_name(rel: str, arch: QwenArch, i: int) -> str:
    """A layer-relative name of either spec in the TE spec's spelling (what the mapping is asked
    in). A MoE layer's MLP-input norm is ``pre_mlp_layernorm`` under both specs (the dense
    layer's TE name, ``mlp.linear_fc1.layer_norm_weight``, would be wrong there); its experts
    are ``local_experts.{e}.linear_fc1.weight`` locally, ``linear_fc1.weight{e}`` under TE."""
    if arch.is_moe and arch.is_moe_layer(i):
        parsed = parse_expert_name(rel)
        if parsed is not None:
            return expert_name("te", parsed[1], parsed[2])
        if rel == PRE_MLP_NORM:
            return rel
    return hf_mapping.rename_spec(rel, "local", "te")


def _parse_expert(key: str) -> tuple[str, int, str] | None:
    """``(spec, expert id, fc)`` of a megatron name (``decoder.layers.{i}.<rel>``) that is an
    expert's weight, else None."""
    if not key.startswith(hf_mapping.MC_LAYER_PREFIX):
        return None
    return parse_expert_name(key[len(hf_mapping.MC_LAYER_PREFIX):].split(".", 1)[-1])


def _is_fc1(key: str) -> bool:
    """Whether ``key`` is a ``[gate; up]`` weight (a dense MLP's or an expert's)."""
    parsed = _parse_expert(key)
    return key.endswith(hf_mapping.FC1_W) or (parsed is not None and parsed[2] == "linear_fc1")


def _expert_layout() -> tuple[int, int, int]:
    """(EP size, this rank's EP rank, expert-TP size) of the initialised parallel state."""
    from megatron.core import parallel_state as ps

    return (ps.get_expert_model_parallel_world_size(), ps.get_expert_model_parallel_rank(),
            ps.get_expert_tensor_parallel_world_size())


def _local_params(chunks, arch: QwenArch) -> dict[str, torch.nn.Parameter]:
    """This rank's parameters keyed by megatron name with global layer numbers (and global
    expert ids: this EP rank's first expert is ``ep_rank * num_experts / EP``), in order."""
    out: dict[str, torch.nn.Parameter] = {}
    first_expert = 0
    if arch.is_moe:
        ep, ep_rank, _ = _expert_layout()
        first_expert = ep_rank * (arch.num_experts // ep)
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            if name == hf_mapping.MC_HEAD and arch.tie_word_embeddings:
                continue  # the last stage's copy of the tied embedding
            if name.startswith(hf_mapping.MC_LAYER_PREFIX):
                local_str, rel = name[len(hf_mapping.MC_LAYER_PREFIX):].split(".", 1)
                layer = chunk.decoder.layers[int(local_str)].layer_number - 1
                name = f"{hf_mapping.MC_LAYER_PREFIX}{layer}.{global_expert_name(rel, first_expert)}"
            if name in out:
                raise ValueError(f"parameter {name!r} appears twice across model chunks")
            out[name] = p
    return out


# The TP dimension of each TP-sharded weight, by its role: column-parallel layers (and the
# vocabulary-parallel embedding / output layer) split their output rows (dim 0), row-parallel
# ones their input columns (dim 1). Megatron's own checkpointing reads the role too
# (``TEColumnParallelGroupedLinear`` / ``TERowParallelGroupedLinear`` give ``tp_axis_map`` 0 / 1)
# rather than the parameter's ``partition_dim`` mark, which is wrong for TE's grouped experts:
# megatron's ``TEGroupedLinear`` hands TE ``parallel_mode=None`` when EP or expert TP > 1, and
# TE's ``GroupedLinear`` then marks every ``weight{e}`` ``partition_dim=0``, the row-parallel
# ``linear_fc2`` too.
_ROLE_DIM = {hf_mapping.QKV_W: 0, hf_mapping.QKV_B: 0, hf_mapping.FC1_W: 0, hf_mapping.PROJ_W: 1,
             hf_mapping.FC2_W: 1}
_GLOBAL_ROLE_DIM = {hf_mapping.MC_EMBED: 0, hf_mapping.MC_HEAD: 0}
_EXPERT_ROLE_DIM = {"linear_fc1": 0, "linear_fc2": 1}


def _tp_dim(key: str, p: torch.Tensor) -> int | None:
    """The dimension along which the TP (or expert-TP) ranks split parameter ``key`` (megatron
    name), from its role; None where every rank holds it whole (not ``tensor_model_parallel``)."""
    if not getattr(p, "tensor_model_parallel", False):
        return None
    parsed = _parse_expert(key)
    if parsed is not None:
        dim = _EXPERT_ROLE_DIM[parsed[2]]
    elif key.startswith(hf_mapping.MC_LAYER_PREFIX):
        dim = _ROLE_DIM.get(key[len(hf_mapping.MC_LAYER_PREFIX):].split(".", 1)[-1])
    else:
        dim = _GLOBAL_ROLE_DIM.get(key)
    if dim is None:
        raise ValueError(f"{key!r} is TP-sharded (partition_dim={getattr(p, 'partition_dim', None)}) but the "
                         "weight sync knows no role for it (column or row parallel), so not which "
                         "dimension to join")
    return dim


def _full_shape(key: str, p: torch.Tensor, tp: int) -> tuple[int, ...]:
    shape = list(p.shape)
    dim = _tp_dim(key, p)
    if dim is not None:
        shape[dim] *= tp
    return tuple(shape)


def _stage_entries(local: dict[str, torch.nn.Parameter], arch: QwenArch, stage: int) -> list[SyncEntry]:
    """This stage's entries, the same on each of its ranks: an expert slot this rank holds stands
    for the same slot on every EP rank (``EP`` entries, global ids ``k * E/EP + j``, EP rank
    order); the other tensors as they are."""
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    out = []
    if arch.is_moe:
        ep, ep_rank, etp = _expert_layout()
        per_rank = arch.num_experts // ep
    for key, p in local.items():
        parsed = _parse_expert(key)
        if parsed is None:
            out.append(SyncEntry(stage, key, _full_shape(key, p, tp), p.dtype, _tp_dim(key, p)))
            continue
        spec, e, fc = parsed
        layer = key[len(hf_mapping.MC_LAYER_PREFIX):].split(".", 1)[0]
        slot = e - ep_rank * per_rank
        for k in range(ep):  # EP rank k's expert in this slot
            name = f"{hf_mapping.MC_LAYER_PREFIX}{layer}.{expert_name(spec, k * per_rank + slot, fc)}"
            out.append(SyncEntry(stage, name, _full_shape(key, p, etp), p.dtype, _tp_dim(key, p), ep_rank=k))
    return out


def build_manifest(chunks, arch: QwenArch) -> tuple[list[SyncEntry], dict[str, torch.nn.Parameter]]:
    """Collective over the PP group: the ordered list of every megatron tensor to send (every
    expert under its global id, whichever EP rank holds it), and this rank's own parameters."""
    from megatron.core import parallel_state as ps

    pp = ps.get_pipeline_model_parallel_world_size()
    stage = ps.get_pipeline_model_parallel_rank()
    local = _local_params(chunks, arch)
    mine = _stage_entries(local, arch, stage)
    if pp == 1:
        return mine, local
    per_stage: list = [None] * pp
    dist.all_gather_object(per_stage, mine, group=ps.get_pipeline_model_parallel_group())
    return [e for entries in per_stage for e in entries], local


def _join_tp(p: torch.Tensor, key: str, tp_group, tp: int) -> tuple[torch.Tensor, int]:
    """The full tensor and the bytes this rank received for it."""
    shard = p.detach().contiguous()
    dim = _tp_dim(key, p)
    if dim is None or tp == 1:
        return shard, 0
    parts = [torch.empty_like(shard) for _ in range(tp)]
    dist.all_gather(parts, shard, group=tp_group)
    received = (tp - 1) * shard.nbytes
    if _is_fc1(key):  # each rank holds [gate_i; up_i]
        halves = [torch.chunk(x, 2, dim=0) for x in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0), received
    return torch.cat(parts, dim=dim), received


_VOCAB = {hf_mapping.MC_EMBED: hf_mapping.HF_EMBED, hf_mapping.MC_HEAD: hf_mapping.HF_HEAD}


def _travels_as_shard(e: SyncEntry, target: ShardTarget | None) -> bool:
    """Whether ``e`` goes as this rank's shard (same decision on every rank)."""
    if target is None or e.tp_dim is None or e.ep_rank is not None:
        return False  # experts travel whole (module docstring)
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


def _expert_slice(t: torch.Tensor, fc: str, target: ExpertTarget, rank: int) -> torch.Tensor:
    """Expert weight ``t`` (whole: ``linear_fc1`` ``[gate; up]``, ``linear_fc2`` ``[h, f]``) cut
    to vLLM TP rank ``rank``'s slice: ``[gate_r; up_r]`` or the columns ``[r f/T, (r+1) f/T)``
    (the dimension from the weight's role)."""
    if fc == "linear_fc1":
        return torch.cat([x.chunk(target.tp, 0)[rank] for x in t.chunk(2, 0)]).contiguous()
    return t.chunk(target.tp, 1)[rank].contiguous()


def _slice_shape(shape: tuple[int, ...], fc: str, tp: int) -> tuple[int, ...]:
    return (shape[0] // tp, shape[1]) if fc == "linear_fc1" else (shape[0], shape[1] // tp)


def expert_frames(e: SyncEntry, piece: torch.Tensor, arch: QwenArch,
                  target: ExpertTarget) -> list[tuple[str, torch.Tensor]]:
    """An expert's slice (:func:`_expert_slice`) -> its HF tensors, each a full-shaped *compact
    frame* (:func:`compact_frame`) in which vLLM's FusedMoE loader for TP rank ``target.rank``
    finds the slice where it reads (gate/up: rows, down: columns)."""
    local = replace(arch, moe_intermediate_size=arch.moe_intermediate_size // target.tp)
    return [(name, compact_frame(t, 1 if name.endswith("down_proj.weight") else 0, target))
            for name, t in mcore_tensor_to_hf(e.key, piece, local)]


def compact_frame(piece: torch.Tensor, dim: int, target: ExpertTarget) -> torch.Tensor:
    """A 2-D tensor of ``piece``'s shape with ``dim`` ``target.tp`` times longer whose
    ``narrow(dim, rank * n, n)`` is ``piece`` (``n = piece.shape[dim]``), in ``(m + tp - 1) * n``
    elements rather than ``m * tp * n`` (``m``: the other dimension): a strided view with stride
    1 along ``dim`` and ``n`` along the other, so its rows (or columns) overlap in memory and
    positions outside the slice alias other elements of it (or NaN padding).

    vLLM's in-place reload keeps every tensor it is handed until the whole layer has arrived,
    and a FusedMoE layer is all of its experts: full-shaped frames would hold a whole MoE layer
    per rank during a sync (4.8 GB at Qwen3-235B-A22B in bf16), these 1/TP of it. Only loaders
    that read exactly their slice (FusedMoE's ``_load_w13`` / ``_load_w2``) may be handed one."""
    if piece.dim() != 2 or dim not in (0, 1):
        raise ValueError(f"compact_frame: a 2-D piece and dim 0 or 1, got {tuple(piece.shape)} and {dim}")
    n, m = piece.shape[dim], piece.shape[1 - dim]
    buf = piece.new_full(((m + target.tp - 1) * n,), float("nan"))
    at = target.rank * n
    # element (c along dim, o along the other) of the slice at buf[at + c + o * n]
    buf[at:at + m * n].view(m, n).copy_(piece if dim == 1 else piece.t())
    shape = [m, m]
    shape[dim] = n * target.tp
    strides = [n, n]
    strides[dim] = 1
    return buf.as_strided(shape, strides)


def _frame_elements(h: int, f: int, tp: int) -> int:
    """Elements of one expert projection (``[f, h]`` or ``[h, f]``) as vLLM is handed it: whole
    (``tp`` 1) or as TP rank's compact frame (:func:`compact_frame`)."""
    return h * f if tp == 1 else (h + tp - 1) * (f // tp)


def _frame_nbytes(e: SyncEntry, target: ExpertTarget) -> int:
    """What :func:`expert_frames` allocates for expert entry ``e``: gate and up (``linear_fc1``)
    or down (``linear_fc2``)."""
    fc1 = _parse_expert(e.key)[2] == "linear_fc1"
    f, h = (e.shape[0] // 2, e.shape[1]) if fc1 else (e.shape[1], e.shape[0])
    return (2 if fc1 else 1) * _frame_elements(h, f, target.tp) * torch.empty((), dtype=e.dtype).element_size()


def moe_layer_reload_bytes(arch: QwenArch, dtype_bytes: int, expert_tp: int = 1) -> int:
    """What vLLM's in-place reload holds of one MoE layer while it arrives: its layerwise
    reload (``model_loader/reload/layerwise.py``) keeps every tensor it is handed until the
    module's last weight has come, and a FusedMoE module is every expert of the layer, so all
    of them as sent (whole, or compact frames for ``expert_tp`` > 1) are alive at once, next to
    the sync's bucket. 0 for a dense model."""
    if not arch.is_moe:
        return 0
    h, f = arch.hidden_size, arch.moe_intermediate_size
    return arch.num_experts * 3 * _frame_elements(h, f, expert_tp) * dtype_bytes


def _units(manifest: list[SyncEntry]) -> list[list[SyncEntry]]:
    """The manifest in gather units: one entry each, except an expert slot's ``EP`` entries
    (consecutive, EP ranks 0, 1, ...), which one all-gather moves together."""
    units: list[list[SyncEntry]] = []
    for e in manifest:
        if e.ep_rank is not None and e.ep_rank > 0:
            units[-1].append(e)
        else:
            units.append([e])
    return units


def iter_hf_buckets(model, arch: QwenArch, bucket_bytes: int, *,
                    shards: ShardTarget | None = None,
                    experts: ExpertTarget | None = None) -> Iterator[WeightBucket]:
    """Collective generator (every rank must drain it): full HF tensors in bounded buckets.

    A bucket holds the HF tensors of whole gather units (a megatron tensor, or one expert slot on
    every EP rank) whose full sizes add up to at most ``bucket_bytes``; a single unit larger than
    that forms a bucket of its own. With ``shards`` (Megatron TP == vLLM TP, same rank order;
    the same on every rank) the TP-sharded tensors other than experts travel as this rank's
    shard in full-shaped frames (module docstring). Every rank yields the same HF names in the
    same order. With ``experts`` (the same ``tp`` on every rank, see :func:`expert_target`)
    every expert travels as this rank's vLLM TP slice in a frame (:func:`expert_frames`): the
    owning stage joins the ETP shards, an all-to-all over expert parallelism gives each EP rank
    its own slice of every expert of the slot (where the whole-expert path all-gathers them), and
    the PP broadcast carries the slices.
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
    if arch.is_moe:
        ep, ep_rank, etp = _expert_layout()
        ep_group = ps.get_expert_model_parallel_group() if ep > 1 else None
        etp_group = ps.get_expert_tensor_parallel_group() if etp > 1 else None
        if experts is not None:  # each EP rank's vLLM TP rank (vLLM's groups: consecutive ranks)
            ep_vranks = [r % experts.tp for r in dist.get_process_group_ranks(ep_group)] if ep > 1 else [None]
            if pp > 1 and len({r % experts.tp for r in pp_ranks}) > 1:
                raise ValueError(f"experts cut for vLLM TP {experts.tp}: the pipeline peers {pp_ranks} "
                                 "are different vLLM TP ranks (see expert_target)")
    elif experts is not None:
        raise ValueError("experts: the model has no experts")

    tensors: list[tuple[str, torch.Tensor]] = []
    size = sources = got_tp = got_pp = got_ep = 0
    for unit in _units(manifest):
        cut = experts is not None and unit[0].ep_rank is not None
        nbytes = sum(_frame_nbytes(e, experts) if cut else e.nbytes for e in unit)
        if tensors and size + nbytes > bucket_bytes:
            yield WeightBucket(tensors, size, sources, got_tp, got_pp, got_ep)
            tensors, size, sources, got_tp, got_pp, got_ep = [], 0, 0, 0, 0, 0
        e = unit[0]
        if e.ep_rank is not None and experts is not None:  # ETP join, EP all-to-all of slices, PP
            fc = _parse_expert(e.key)[2]
            shape = _slice_shape(e.shape, fc, experts.tp)
            parts = [torch.empty(shape, dtype=e.dtype, device=device) for _ in unit]
            if e.stage == stage:
                t, got = _join_tp(local[unit[ep_rank].key], unit[ep_rank].key, etp_group, etp)
                got_tp += got
                if ep > 1:  # EP rank q gets its vLLM TP rank's slice of this rank's expert
                    dist.all_to_all(parts, [_expert_slice(t, fc, experts, v) for v in ep_vranks], group=ep_group)
                    got_ep += (ep - 1) * parts[0].nbytes
                else:
                    parts = [_expert_slice(t, fc, experts, experts.rank)]
            for x, t in zip(unit, parts):
                if pp > 1:
                    dist.broadcast(t, src=pp_ranks[e.stage], group=pp_group)
                    got_pp += t.nbytes if e.stage != stage else 0
                tensors.extend(expert_frames(x, t, arch, experts))
            size += nbytes
            sources += len(unit)
            continue
        if e.ep_rank is not None:  # an expert slot: ETP join, EP all-gather, PP broadcast
            parts = [torch.empty(x.shape, dtype=x.dtype, device=device) for x in unit]
            if e.stage == stage:
                t, got = _join_tp(local[unit[ep_rank].key], unit[ep_rank].key, etp_group, etp)
                got_tp += got
                if ep > 1:
                    dist.all_gather(parts, t, group=ep_group)
                    got_ep += (ep - 1) * t.nbytes
                else:
                    parts = [t]
            for x, t in zip(unit, parts):
                if pp > 1:
                    dist.broadcast(t, src=pp_ranks[e.stage], group=pp_group)
                    got_pp += t.nbytes if e.stage != stage else 0
                if tuple(t.shape) != x.shape:
                    raise RuntimeError(f"{x.key}: gathered shape {tuple(t.shape)}, planned {x.shape}")
                tensors.extend(mcore_tensor_to_hf(x.key, t, arch))
            size += nbytes
            sources += len(unit)
            continue
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
        yield WeightBucket(tensors, size, sources, got_tp, got_pp, got_ep)


# vLLM's DEFAULT_VOCAB_PADDING_SIZE (model_executor/layers/vocab_parallel_embedding.py): it pads
# the vocabulary to a multiple of this and gives each TP rank 1/TP of the padded rows.
VLLM_VOCAB_PADDING = 64


def vllm_vocab_rows(vocab_size: int, tp: int, padding: int = VLLM_VOCAB_PADDING) -> int:
    """vLLM's vocabulary rows per TP rank."""
    return -(-vocab_size // padding) * padding // tp


def sync_traffic(arch: QwenArch, *, tp: int, pp: int, dtype_bytes: int, shards: bool,
                 vocab_multiple: int = 128, vocab_rows: int | None = None, ep: int = 1,
                 etp: int | None = None, expert_tp: int = 1) -> list[dict[str, int]]:
    """Bytes one rank of each pipeline stage receives in one sync (index: the stage), as
    :func:`iter_hf_buckets` moves them: ``tp_gather`` ((TP-1)/TP of each TP-sharded tensor of
    its own stage that travels whole, and (ETP-1)/ETP of its own experts), ``ep_gather``
    ((EP-1)/EP of its stage's experts), ``pp_broadcast`` (every tensor of the other stages; 1/TP
    of it when it travels as a shard) and ``total``. ``shards``: the shard path (Megatron TP ==
    vLLM TP); ``vocab_rows``: vLLM's vocabulary rows per rank (default: vLLM's padding at
    ``tp``); ``ep`` / ``etp``: expert parallel and expert TP sizes (MoE; ``etp`` None: ``tp``,
    megatron's default); ``expert_tp``: the vLLM TP the experts are cut to before they travel
    (:class:`ExpertTarget`; 1: whole), which divides their EP gather and PP broadcast.
    Megatron's parameters in ``dtype_bytes``, layers split evenly over the stages."""
    etp = tp if etp is None else etp
    h, d = arch.hidden_size, arch.head_dim
    qkv = (arch.num_heads + 2 * arch.num_kv_heads) * d
    # a tensor: (elements, ways Megatron splits it (TP or ETP; 1: replicated), copies: the
    # experts of a layer, which EP spreads); TP-split non-experts go as shards on the shard path
    attn = [(qkv * h, tp, 0), (h * arch.num_heads * d, tp, 0), (h, 1, 0), (h, 1, 0)] \
        + [(qkv, tp, 0)] * arch.qkv_bias + [(d, 1, 0)] * (2 * arch.qk_norm)
    f, fe, e = arch.intermediate_size, arch.moe_intermediate_size, arch.num_experts
    dense = [(2 * f * h, tp, 0), (h * f, tp, 0)]
    moe = [(e * h, 1, 0), (2 * fe * h, etp, e), (h * fe, etp, e)]  # router, experts' fc1 / fc2

    def layer(i: int) -> list[tuple[int, int, int]]:
        return attn + (moe if arch.is_moe and arch.is_moe_layer(i) else dense)

    padded = arch.padded_vocab_size(vocab_multiple)
    rows = vllm_vocab_rows(arch.vocab_size, tp) if vocab_rows is None else vocab_rows
    vocab_as_shard = shards and rows == padded // tp
    per_stage = arch.num_layers // pp
    stages = []  # per stage: (elements, split ways, expert copies, travels as a shard)
    for s in range(pp):
        items = [(n, ways, copies, shards and ways > 1 and not copies)
                 for i in range(s * per_stage, (s + 1) * per_stage) for n, ways, copies in layer(i)]
        if s == 0:
            items.append((padded * h, tp, 0, vocab_as_shard))
        if s == pp - 1:
            items.append((h, 1, 0, False))
            if not arch.tie_word_embeddings:
                items.append((padded * h, tp, 0, vocab_as_shard))
        stages.append(items)
    out = []
    for s in range(pp):
        gather = ep_gather = 0
        for n, ways, copies, as_shard in stages[s]:
            if as_shard:
                continue
            mine = copies // ep if copies else 1  # this rank's experts (or the one tensor)
            gather += mine * (ways - 1) * (n // ways)
            ep_gather += (copies - mine) * n // expert_tp if copies else 0
        bcast = sum(n // tp if as_shard else n * copies // expert_tp if copies else n
                    for other, items in enumerate(stages) if other != s for n, _, copies, as_shard in items)
        out.append({"tp_gather": gather * dtype_bytes, "ep_gather": ep_gather * dtype_bytes,
                    "pp_broadcast": bcast * dtype_bytes,
                    "total": (gather + ep_gather + bcast) * dtype_bytes})
    return out
