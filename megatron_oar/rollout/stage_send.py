"""The separate placement's weight broadcast: each pipeline stage sends its own share.

The colocated sync (:func:`~megatron_oar.rollout.weight_sync.iter_hf_buckets`) gives *every*
rank every full HF tensor (each feeds its own vLLM engine): TP all-gathers, then PP broadcasts
of every stage to every stage, in every DP replica. In the separate placement only the rollout
ranks need them, so here:

* each pipeline stage's first training rank (:func:`~megatron_oar.runtime.roles.stage_senders`:
  TP, DP and EP rank 0 of the stage) is its *sender*; stage ``s`` goes out from it, after stage
  ``s - 1``'s, over its own groups (``roles.senders[s]``: headers on gloo, bytes on
  ``senders_device[s]``; only the sender and the rollout ranks are members);
* a TP-sharded tensor is *gathered* (``dist.gather``, not an all-gather) to the sender over its
  TP group; an expert slot over the expert-TP group, then the EP group. Only the ranks of the
  stage's first replica (DP rank 0; expert-DP rank 0 for the experts) take part; no PP
  broadcast and no other DP replica moves a byte;
* the sender converts each tensor to HF straight into the bucket's flat send buffer (no second
  copy of the bucket), in ``rollout.bucket_bytes`` buckets (a tensor larger than that forms a
  bucket of its own, as in the colocated sync).

:func:`separate_sync_traffic` gives the bytes each training rank receives per sync from the
architecture and the layout; ``tests/test_separate_rollout.py`` checks it against a count.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist

from megatron_oar.models import QwenArch
from megatron_oar.rollout.transfer import ALIGN, recv_buckets, send_object
from megatron_oar.rollout.weight_sync import (
    SyncEntry,
    WeightBucket,
    _expert_layout,
    _is_fc1,
    _local_params,
    _stage_entries,
    _units,
    mcore_tensor_to_hf,
    unwrap_chunks,
)

HF_PIECES = 3  # the most HF tensors one megatron tensor becomes (qkv -> q, k, v)


class FlatBucket:
    """A bucket built in its send buffer: each HF tensor copied once, at a 16-byte aligned offset."""

    def __init__(self, capacity: int, device) -> None:
        self.flat = torch.empty(capacity, dtype=torch.uint8, device=device)
        self.entries: list[tuple] = []  # (name, dtype, shape, offset, nbytes), as transfer's headers
        self.used = self.nbytes = self.sources = 0

    def add(self, name: str, t: torch.Tensor) -> None:
        n = t.numel() * t.element_size()
        if self.used + n > self.flat.numel():
            raise RuntimeError(f"{name}: {n} bytes past the bucket's {self.flat.numel()}")
        if n:
            self.flat[self.used:self.used + n].view(t.dtype).view(t.shape).copy_(t)
        self.entries.append((name, t.dtype, tuple(t.shape), self.used, n))
        self.used += -(-n // ALIGN) * ALIGN

    def bucket(self) -> WeightBucket:
        tensors = [(name, self.flat[o:o + n].view(dtype).view(shape)) for name, dtype, shape, o, n in self.entries]
        return WeightBucket(tensors, self.nbytes, self.sources)


def _gather_to_first(t: torch.Tensor, group, size: int, first: bool) -> list[torch.Tensor] | None:
    """``t`` of every rank of ``group`` on its first member (rank order), None elsewhere."""
    if size == 1:
        return [t]
    dst = dist.get_process_group_ranks(group)[0]
    parts = [torch.empty_like(t) for _ in range(size)] if first else None
    dist.gather(t, parts, dst=dst, group=group)
    return parts


def _join(parts: list[torch.Tensor], key: str, dim: int | None) -> torch.Tensor:
    if len(parts) == 1 or dim is None:
        return parts[0]
    if _is_fc1(key):  # each rank holds [gate_i; up_i]
        halves = [torch.chunk(x, 2, dim=0) for x in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(parts, dim=dim)


def iter_stage_buckets(model, arch: QwenArch, bucket_bytes: int, *,
                       sender: bool | None = None) -> Iterator[WeightBucket]:
    """Collective over this pipeline stage's first replica (module docstring); a generator every
    training rank drains. Yields this stage's full HF tensors in bounded buckets on the stage's
    sender (whose buckets hold their flat send buffer: ``bucket.flat``), nothing elsewhere;
    ``sender``: whether the caller planned this rank as the sender (checked).
    ``received`` on the buckets counts what the sender received (``received_tp`` /
    ``received_ep``)."""
    from megatron.core import parallel_state as ps

    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes={bucket_bytes} must be > 0")
    chunks = unwrap_chunks(model)
    local = _local_params(chunks, arch)
    stage = ps.get_pipeline_model_parallel_rank()
    entries = _stage_entries(local, arch, stage)
    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    tp_group = ps.get_tensor_model_parallel_group()
    dense_part = ps.get_data_parallel_rank() == 0
    ep = ep_rank = etp = 1
    expert_part = etp_first = False
    if arch.is_moe:
        ep, ep_rank, etp = _expert_layout()
        expert_part = ps.get_expert_data_parallel_rank() == 0
        etp_first = ps.get_expert_tensor_parallel_rank() == 0
        ep_group, etp_group = ps.get_expert_model_parallel_group(), ps.get_expert_tensor_parallel_group()
    first = dense_part and tp_rank == 0 and (not arch.is_moe or (expert_part and etp_first and ep_rank == 0))
    if sender is not None and sender != first:
        raise ValueError(f"training rank {dist.get_rank()}: the stage's first rank in megatron's order "
                         f"({'is' if first else 'is not'} this one) is not the planned sender "
                         "(runtime.roles.stage_senders): a rank order other than tp-cp-ep-dp-pp?")
    sender = first
    if not (dense_part or expert_part):
        return
    device = next(iter(local.values())).device if local else torch.device("cpu")
    units = _units(entries)
    bucket: FlatBucket | None = None
    got_tp = got_ep = 0

    def capacity(start: int) -> int:  # the bucket starting at unit ``start``: its units' bytes
        size, end = 0, start
        while end < len(units):
            n = sum(e.nbytes for e in units[end])
            if size and size + n > bucket_bytes:
                break
            size, end = size + n, end + 1
        return size + ALIGN * HF_PIECES * sum(len(u) for u in units[start:end])

    for i, unit in enumerate(units):
        e = unit[0]
        nbytes = sum(x.nbytes for x in unit)
        if sender and bucket is not None and bucket.nbytes and bucket.nbytes + nbytes > bucket_bytes:
            out = bucket.bucket()
            out.received_tp, out.received_ep = got_tp, got_ep
            out.flat = bucket.flat[:bucket.used]
            yield out
            bucket, got_tp, got_ep = None, 0, 0
        if sender and bucket is None:
            bucket = FlatBucket(capacity(i), device)
        full: list[tuple[SyncEntry, torch.Tensor]] = []
        if e.ep_rank is not None:  # an expert slot: ETP gather, then EP gather, to the sender
            if not expert_part:
                continue
            x = unit[ep_rank]
            shard = local[x.key].detach().contiguous()
            parts = _gather_to_first(shard, etp_group, etp, etp_first)
            if etp_first:
                t = _join(parts, x.key, x.tp_dim)
                got_tp += (etp - 1) * shard.nbytes if sender else 0
                slot = _gather_to_first(t, ep_group, ep, ep_rank == 0)
                if sender:
                    got_ep += (ep - 1) * t.nbytes
                    full = list(zip(unit, slot))
        else:
            if not dense_part:
                continue
            shard = local[e.key].detach().contiguous()
            if e.tp_dim is None or tp == 1:
                full = [(e, shard)] if sender else []
            else:
                parts = _gather_to_first(shard, tp_group, tp, tp_rank == 0)
                if sender:
                    got_tp += (tp - 1) * shard.nbytes
                    full = [(e, _join(parts, e.key, e.tp_dim))]
        for x, t in full:
            if tuple(t.shape) != x.shape:
                raise RuntimeError(f"{x.key}: gathered shape {tuple(t.shape)}, planned {x.shape}")
            for name, hf in mcore_tensor_to_hf(x.key, t, arch):
                bucket.add(name, hf)
        if sender:
            bucket.nbytes += nbytes
            bucket.sources += len(unit)
    if sender and bucket is not None and bucket.entries:
        out = bucket.bucket()
        out.received_tp, out.received_ep = got_tp, got_ep
        out.flat = bucket.flat[:bucket.used]
        yield out


def send_stage(model, arch: QwenArch, roles, bucket_bytes: int, *, version: int) -> tuple[dict[str, int], str | None]:
    """Collective over the training world: this stage's sender sends its buckets (headers on
    ``roles.senders[stage]``, bytes on ``roles.senders_device[stage]``) then an end marker carrying
    ``version``; the stage's first replica gathers for it. Returns this rank's counts (bytes,
    tensors, buckets, the largest bucket, the bytes the gathers brought here: ``received_tp``,
    ``received_ep``) and the error a send
    raised here (a rollout rank gone), or None. Every rank drains its gathers even after a
    failed send, so that its stage's peers are not left waiting."""
    counts = {"bytes": 0, "tensors": 0, "buckets": 0, "max": 0, "received_tp": 0, "received_ep": 0}
    error = None
    me = roles.global_rank
    stage = roles.stage_senders.index(me) if me in roles.stage_senders else None
    for bucket in iter_stage_buckets(model, arch, bucket_bytes, sender=stage is not None):
        counts["received_tp"] += bucket.received_tp
        counts["received_ep"] += bucket.received_ep
        if error is not None or stage is None:
            continue
        try:  # the sender is member 0 of its stage's groups
            send_object(roles.senders[stage], {"entries": bucket_entries(bucket), "total": bucket.flat.numel(),
                                               "sources": bucket.sources}, 0)
            roles.senders_device[stage].broadcast(bucket.flat, 0)
        except RuntimeError as e:
            error = f"{type(e).__name__}: {e}"
            continue
        counts["bytes"] += bucket.nbytes
        counts["tensors"] += len(bucket.tensors)
        counts["buckets"] += 1
        counts["max"] = max(counts["max"], bucket.nbytes)
    if stage is not None and error is None:
        try:
            send_object(roles.senders[stage], {"end": True, "version": version}, 0)
        except RuntimeError as e:
            error = f"{type(e).__name__}: {e}"
    return counts, error


def bucket_entries(bucket: WeightBucket) -> list[tuple]:
    """The header entries (name, dtype, shape, offset, nbytes) of a bucket built in its flat buffer."""
    base = bucket.flat.data_ptr()
    return [(name, t.dtype, tuple(t.shape), t.data_ptr() - base, t.numel() * t.element_size())
            for name, t in bucket.tensors]


def recv_stages(roles, device: torch.device, end: dict) -> Iterator[WeightBucket]:
    """A rollout rank: every stage's buckets (:func:`send_stage`), stage 0 first, as
    :class:`WeightBucket`s of views into one received buffer each (``received_pp`` counts the
    bytes). Fills ``end`` with the last stage's end marker (the version)."""
    for control, data in zip(roles.senders, roles.senders_device):
        yield from recv_buckets(control, data, device, end)  # each stage's, as transfer sends them


def sum_counts(counts: dict[str, int], group) -> dict[str, int]:
    """The training world's counts (``max``: the largest), on every rank (collective over ``group``)."""
    out: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, counts, group=group)
    total = {k: sum(c[k] for c in out) for k in counts}
    total["max"] = max(c["max"] for c in out)
    return total


def separate_sync_traffic(arch: QwenArch, *, tp: int, pp: int, dtype_bytes: int, vocab_multiple: int = 128,
                          ep: int = 1, etp: int | None = None) -> dict[str, int]:
    """Bytes per sync of the separate placement's broadcast (:func:`send_stage`), layers split
    evenly over the stages: ``sender_gather`` (the most a stage's sender receives: (TP-1)/TP of
    its stage's TP-sharded tensors, (ETP-1)/ETP and (EP-1)/EP of its experts, as the colocated
    sync's gathers give each rank), ``other_ranks`` (0: no other training rank receives
    anything), ``rollout_rank`` (every megatron tensor once, whole, the vocabulary padded: what
    the buckets each rollout rank receives hold) and ``largest_tensor``
    (:func:`largest_unit_bytes`)."""
    from megatron_oar.rollout.weight_sync import sync_traffic

    stages = sync_traffic(arch, tp=tp, pp=pp, dtype_bytes=dtype_bytes, shards=False, vocab_multiple=vocab_multiple,
                          ep=ep, etp=etp)
    return {"sender_gather": max(s["tp_gather"] + s["ep_gather"] for s in stages), "other_ranks": 0,
            "rollout_rank": model_sync_bytes(arch, dtype_bytes, vocab_multiple),
            "largest_tensor": largest_unit_bytes(arch, dtype_bytes, vocab_multiple, ep=ep)}


def model_sync_bytes(arch: QwenArch, dtype_bytes: int, vocab_multiple: int = 128) -> int:
    """Every megatron tensor the sync sends, once and whole (the vocabulary padded; a tied
    embedding once): with one layer per stage, each stage receives the others' tensors by PP
    broadcast (``sync_traffic``), so the stages together receive the model ``layers - 1`` times."""
    from megatron_oar.rollout.weight_sync import sync_traffic

    n = arch.num_layers
    if n < 2:
        raise ValueError("model_sync_bytes: a model of at least 2 layers")
    stages = sync_traffic(arch, tp=1, pp=n, dtype_bytes=dtype_bytes, shards=False, vocab_multiple=vocab_multiple)
    return sum(s["pp_broadcast"] for s in stages) // (n - 1)


def largest_unit_bytes(arch: QwenArch, dtype_bytes: int, vocab_multiple: int = 128, *, ep: int = 1) -> int:
    """The largest gather unit of the weight sync (a bucket of its own when past
    ``rollout.bucket_mb``): the (padded) embedding or output layer, a layer's ``linear_qkv`` or
    dense ``linear_fc1``, or an expert slot (``ep`` experts' ``linear_fc1`` at once)."""
    h = arch.hidden_size
    qkv = (arch.num_heads + 2 * arch.num_kv_heads) * arch.head_dim * h
    dense = not arch.is_moe or not all(arch.is_moe_layer(i) for i in range(arch.num_layers))
    fc1 = 2 * arch.intermediate_size * h if dense else 0
    expert = ep * 2 * arch.moe_intermediate_size * h if arch.is_moe else 0
    return max(arch.padded_vocab_size(vocab_multiple) * h, qkv, fc1, expert) * dtype_bytes
