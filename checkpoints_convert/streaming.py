"""Streaming torch_dist I/O: write chunks produced on demand, read regions of tensors.

megatron-core's ``dist_checkpointing.save`` does the bookkeeping (factories, common.pt,
metadata.json, validation); its torch_dist strategy then hands the tensors to PyTorch
Distributed Checkpoint. Here the sharded state dict holds *meta* tensors (shapes and dtypes
only) and the DCP planner asks ``produce(key, global_offset, sizes)`` for the real data of
each chunk just before the file writer serialises it, one chunk at a time. Peak memory is
therefore one tensor (plus the HF sources it is computed from), whatever the model size.

The files written are exactly those megatron's own strategy writes: the checkpoint loads
with ``dist_checkpointing.load`` at any TP/PP.

Reading back, :class:`CheckpointRegionReader` asks DCP for one layer's slice of each
layer-stacked tensor; DCP assembles it from whatever TP/PP chunks the writer stored.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from megatron.core.dist_checkpointing.strategies.torch import (
    MCoreSavePlanner,
    TorchDistSaveShardedStrategy,
    _replace_state_dict_keys_with_sharded_keys,
    mcore_to_pyt_state_dict,
)
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint import load as dcp_load
from torch.distributed.checkpoint import save as dcp_save
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

Producer = Callable[[str, tuple[int, ...], tuple[int, ...]], torch.Tensor]


class _LazySavePlanner(MCoreSavePlanner):
    def __init__(self, produce: Producer, on_item: Callable[[int], None] | None = None, **kw):
        super().__init__(**kw)
        self._produce = produce
        self._on_item = on_item

    def resolve_data(self, write_item):
        if write_item.type == WriteItemType.BYTE_IO:
            return super().resolve_data(write_item)
        chunk = write_item.tensor_data.chunk
        data = self._produce(write_item.index.fqn, tuple(chunk.offsets), tuple(chunk.sizes))
        if tuple(data.shape) != tuple(chunk.sizes):
            raise RuntimeError(f"producer gave {tuple(data.shape)} for {write_item.index.fqn} "
                               f"chunk {tuple(chunk.sizes)}")
        if self._on_item is not None:
            self._on_item(data.numel() * data.element_size())
        return data


class StreamingTorchDistSaveStrategy(TorchDistSaveShardedStrategy):
    """Single-process torch_dist writer whose tensors come from ``produce``."""

    def __init__(self, produce: Producer, on_item: Callable[[int], None] | None = None):
        super().__init__("torch_dist", 1, keep_only_main_replica=True, thread_count=1)
        self._produce = produce
        self._on_item = on_item

    def save(self, sharded_state_dict, checkpoint_dir: Path):
        state, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, True)
        pyt_state = mcore_to_pyt_state_dict(state, False)
        # thread_count=1 makes DCP resolve, serialise and drop one chunk at a time.
        writer = FileSystemWriter(str(checkpoint_dir), single_file_per_rank=True,
                                  thread_count=1, sync_files=True)
        planner = _LazySavePlanner(self._produce, self._on_item, flatten_state_dict=False,
                                   dedup_replicated_tensors=False)
        dcp_save(pyt_state, storage_writer=writer, planner=planner)

    def async_save(self, sharded_state_dict, checkpoint_dir):  # pragma: no cover - guard
        raise NotImplementedError("the streaming strategy saves synchronously")


class _RegionLoadPlanner(DefaultLoadPlanner):
    """Reads given regions of global tensors, assembling them from whatever chunks
    (TP/PP shards of any layout) the checkpoint stores."""

    def __init__(self, regions: dict[str, tuple[tuple[int, ...], tuple[int, ...]]]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.regions = regions
        self.out: dict[str, torch.Tensor] = {}

    def create_local_plan(self) -> LoadPlan:
        items = []
        for fqn, (offsets, sizes) in self.regions.items():
            md = self.metadata.state_dict_metadata.get(fqn)
            if md is None:
                raise KeyError(fqn)
            self.out[fqn] = torch.empty(sizes, dtype=md.properties.dtype)
            chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
            items += create_read_items_for_chunk_list(fqn, md, [chunk])
        return LoadPlan(items)

    def resolve_tensor(self, read_item):
        view = self.out[read_item.dest_index.fqn]
        for dim, (offset, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            view = view.narrow(dim, offset, length)
        return view


class CheckpointRegionReader:
    """Random access to a torch_dist checkpoint: whole tensors or one layer of a stacked one."""

    def __init__(self, model_dir: str | Path):
        self.dir = str(model_dir)
        self.metadata = FileSystemReader(self.dir).read_metadata()

    def shape(self, key: str) -> tuple[int, ...]:
        md = self.metadata.state_dict_metadata.get(key)
        if md is None or not hasattr(md, "size"):
            raise KeyError(f"{self.dir}: no tensor {key!r} in the checkpoint")
        return tuple(md.size)

    def dtype(self, key: str) -> torch.dtype:
        self.shape(key)  # the same error for a missing key
        return self.metadata.state_dict_metadata[key].properties.dtype

    def read(self, regions: dict[str, tuple[tuple[int, ...], tuple[int, ...]]]) -> dict:
        planner = _RegionLoadPlanner(regions)
        dcp_load({}, storage_reader=FileSystemReader(self.dir), planner=planner, no_dist=True)
        return planner.out

    def read_layer(self, keys: list[str], layer: int) -> dict[str, torch.Tensor]:
        """Layer ``layer`` of layer-stacked keys ``[num_layers, ...]``, without the layer axis."""
        regions = {}
        for k in keys:
            shape = self.shape(k)
            regions[k] = ((layer,) + (0,) * (len(shape) - 1), (1,) + shape[1:])
        return {k: v.squeeze(0) for k, v in self.read(regions).items()}

    def read_whole(self, keys: list[str]) -> dict[str, torch.Tensor]:
        return self.read({k: ((0,) * len(self.shape(k)), self.shape(k)) for k in keys})
