"""Streaming access to HF safetensors checkpoints: read one tensor at a time, write shards.

Neither side ever holds more than one shard's worth of tensors: the reader opens files
lazily and returns single tensors; the writer flushes a shard as soon as it passes
``max_shard_bytes`` and names the shards once their count is known.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class HFCheckpointError(ValueError):
    """A missing, incomplete or corrupt HF checkpoint; the message names the file."""


class HFReader:
    """Reads tensors by name from ``model.safetensors`` or an indexed set of shards."""

    def __init__(self, hf_dir: str | Path):
        self.dir = Path(hf_dir)
        if not self.dir.is_dir():
            raise HFCheckpointError(f"--hf {self.dir}: not a directory")
        index = self.dir / INDEX
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise HFCheckpointError(f"{index}: not a valid safetensors index ({e})") from e
        elif (self.dir / SINGLE).is_file():
            weight_map = None
        else:
            raise HFCheckpointError(f"{self.dir}: no {SINGLE} or {INDEX} found")
        if weight_map is None:
            with self._open(SINGLE) as f:
                self.weight_map = {k: SINGLE for k in f.keys()}
        else:
            self.weight_map = dict(weight_map)
            for fname in sorted(set(self.weight_map.values())):
                with self._open(fname) as f:  # validates every header up front
                    keys = set(f.keys())
                missing = [k for k, f in self.weight_map.items() if f == fname and k not in keys]
                if missing:
                    raise HFCheckpointError(f"{self.dir / fname}: lacks {missing[0]!r} "
                                            f"named by {INDEX}")

    def _open(self, fname: str):
        """A fresh handle per use: safetensors mmaps the file, and a long-lived handle would keep
        every page read so far resident (file-backed RSS growing to the model size)."""
        path = self.dir / fname
        if not path.is_file():
            raise HFCheckpointError(f"{path}: missing (named by {INDEX})")
        try:
            return safe_open(str(path), framework="pt")
        except (SafetensorError, OSError, ValueError) as e:
            raise HFCheckpointError(f"{path}: corrupt or unreadable safetensors ({e})") from e

    def names(self) -> set[str]:
        return set(self.weight_map)

    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape from the safetensors header, without reading its data."""
        with self._open(self.weight_map[name]) as f:
            return tuple(f.get_slice(name).get_shape())

    def require(self, shapes: dict[str, tuple[int, ...]]) -> None:
        """Checks every expected tensor is present with the expected shape."""
        missing = [n for n in shapes if n not in self.weight_map]
        if missing:
            raise HFCheckpointError(f"{self.dir}: tensor {missing[0]!r} not found "
                                    f"({len(missing)} expected tensors missing)")
        by_file: dict[str, list[str]] = {}
        for name in shapes:
            by_file.setdefault(self.weight_map[name], []).append(name)
        for fname, names in by_file.items():
            with self._open(fname) as f:  # one header parse per file
                got_shapes = {n: tuple(f.get_slice(n).get_shape()) for n in names}
            for name in names:
                got, expected = got_shapes[name], tuple(shapes[name])
                if got != expected:
                    raise HFCheckpointError(
                        f"{self.dir / fname}: tensor {name!r} has shape {list(got)}, "
                        f"config.json implies {list(expected)}")

    def get(self, name: str) -> torch.Tensor:
        if name not in self.weight_map:
            raise HFCheckpointError(f"{self.dir}: tensor {name!r} not found")
        fname = self.weight_map[name]
        try:
            with self._open(fname) as f:
                return f.get_tensor(name)
        except (SafetensorError, OSError, ValueError) as e:
            raise HFCheckpointError(f"{self.dir / fname}: cannot read {name!r} ({e})") from e

    def dtype(self, name: str) -> torch.dtype:
        return self.get(name).dtype


class ShardedSafetensorsWriter:
    """Writes ``model-XXXXX-of-YYYYY.safetensors`` shards plus the index, streaming."""

    def __init__(self, out_dir: str | Path, max_shard_bytes: int = 2 << 30):
        self.dir = Path(out_dir)
        self.max_shard_bytes = max_shard_bytes
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shards: list[list[str]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        self._pending[name] = tensor.contiguous()
        nbytes = tensor.numel() * tensor.element_size()
        self._pending_bytes += nbytes
        self.total_bytes += nbytes
        if self._pending_bytes >= self.max_shard_bytes:
            self.flush()

    def flush(self) -> None:
        if not self._pending:
            return
        idx = len(self._shards)
        save_file(self._pending, str(self.dir / f".shard-{idx:05d}.tmp"), metadata={"format": "pt"})
        self._shards.append(list(self._pending))
        self._pending, self._pending_bytes = {}, 0

    def finish(self) -> None:
        self.flush()
        n = len(self._shards)
        weight_map = {}
        for idx, names in enumerate(self._shards):
            final = SINGLE if n == 1 else f"model-{idx + 1:05d}-of-{n:05d}.safetensors"
            os.replace(self.dir / f".shard-{idx:05d}.tmp", self.dir / final)
            weight_map.update({name: final for name in names})
        if n > 1:
            index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
            (self.dir / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True))
