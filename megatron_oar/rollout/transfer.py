"""What travels between the roles of the separate placement (``runtime/roles.py``): small
objects (requests, finished batches) and the policy's weights as HF-layout buckets.

Objects are pickled into a byte tensor and broadcast from one member of a
:class:`~megatron_oar.runtime.roles.CrossGroup` (its length first). A weight bucket is a header
object (names, dtypes, shapes, byte offsets) and one flat byte tensor holding every tensor of the
bucket, each at an offset aligned to 16 bytes, so the receiver's tensors are views of one buffer.
In training, each pipeline stage's first rank builds its stage's buckets in their flat buffer and
sends them itself (``rollout/stage_send.py``; the receiver is :func:`recv_buckets`, once per
stage). :func:`send_buckets` sends buckets of separate tensors (the colocated sync's
:func:`~megatron_oar.rollout.weight_sync.iter_hf_buckets`) by the same protocol: the tests use it
as the reference the stage senders are measured against.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from megatron_oar.rollout.weight_sync import WeightBucket

ALIGN = 16  # bytes; a view of the flat buffer at a multiple of it suits every dtype


@dataclass
class Pending:
    """Sends still in flight: their works and the tensors they read (kept alive until done)."""

    works: list
    tensors: list
    group: object = None  # the CrossGroup: its wait watches the members' heartbeats

    def done(self) -> bool:
        return all(w.is_completed() for w in self.works)

    def wait(self) -> None:
        for w in self.works:
            if self.group is not None and hasattr(self.group, "wait"):
                self.group.wait(w)
            else:
                w.wait()
        self.works, self.tensors = [], []


def send_object(group, obj, root: int, *, wait: bool = True) -> Pending | None:
    """Broadcast ``obj`` (picklable) from member ``root`` (this process) to the group."""
    payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    size = torch.tensor([payload.numel()], dtype=torch.int64)
    pending = Pending([group.broadcast(size, root, wait=False), group.broadcast(payload, root, wait=False)],
                      [size, payload], group)
    if wait:
        pending.wait()
        return None
    return pending


def recv_object(group, root: int):
    """The object member ``root`` sends with :func:`send_object`."""
    size = torch.zeros(1, dtype=torch.int64)
    group.broadcast(size, root)
    payload = torch.empty(int(size.item()), dtype=torch.uint8)
    group.broadcast(payload, root)
    return pickle.loads(payload.numpy().tobytes())


def _layout(tensors: list[tuple[str, torch.Tensor]]) -> tuple[list[tuple], int]:
    entries, offset = [], 0
    for name, t in tensors:
        nbytes = t.numel() * t.element_size()
        entries.append((name, t.dtype, tuple(t.shape), offset, nbytes))
        offset += -(-nbytes // ALIGN) * ALIGN
    return entries, offset


def send_buckets(control, data, buckets: Iterable[WeightBucket], *, version: int) -> dict[str, int]:
    """Training rank 0 (member 0 of both groups): every bucket's header on ``control`` (gloo)
    and its bytes on ``data`` (gloo, or nccl with device tensors), then an end marker carrying
    ``version``. Returns counts (bytes, tensors, buckets, the largest bucket)."""
    counts = {"bytes": 0, "tensors": 0, "buckets": 0, "max": 0}
    for bucket in buckets:
        entries, total = _layout(bucket.tensors)
        device = bucket.tensors[0][1].device if bucket.tensors else torch.device("cpu")
        flat = torch.empty(total, dtype=torch.uint8, device=device)
        for (_, t), (_, _, _, offset, nbytes) in zip(bucket.tensors, entries):
            flat[offset:offset + nbytes] = t.detach().contiguous().view(-1).view(torch.uint8)
        send_object(control, {"entries": entries, "total": total, "sources": bucket.sources}, 0)
        data.broadcast(flat, 0)
        counts["bytes"] += bucket.nbytes
        counts["tensors"] += len(bucket.tensors)
        counts["buckets"] += 1
        counts["max"] = max(counts["max"], bucket.nbytes)
    send_object(control, {"end": True, "version": version}, 0)
    return counts


def recv_buckets(control, data, device: torch.device, end: dict) -> Iterator[WeightBucket]:
    """A rollout rank: the buckets :func:`send_buckets` sends, as :class:`WeightBucket`s of views
    into one received buffer each (``received_pp`` counts the bytes). Fills ``end`` with the
    end marker (the version) once the last bucket has come."""
    while True:
        header = recv_object(control, 0)
        if header.get("end"):
            end.update(header)
            return
        flat = torch.empty(header["total"], dtype=torch.uint8, device=device)
        data.broadcast(flat, 0)
        tensors = [(name, flat[offset:offset + nbytes].view(dtype).view(shape))
                   for name, dtype, shape, offset, nbytes in header["entries"]]
        nbytes = sum(e[4] for e in header["entries"])
        yield WeightBucket(tensors=tensors, nbytes=nbytes, sources=header["sources"], received_pp=header["total"])
