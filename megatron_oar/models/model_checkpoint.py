"""Model checkpoints in megatron-core ``dist_checkpointing`` (torch_dist) format.

Directory layout written by the converter (and, for the model part, the trainer)::

    CKPT/
      oar_checkpoint.json   format version, dtype, vocab sizes, layout it was written at
      model/                megatron-core torch_dist checkpoint; reloads at any TP/PP (and EP)
      hf/                   config.json, generation config and tokenizer files, for export

Saves go to ``CKPT.tmp`` and are renamed into place once complete, so a crash never
leaves a half-written checkpoint under the final name.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from torch.distributed.checkpoint import FileSystemReader

from megatron_oar.models.hf_mapping import HF_SIDE_FILES
from megatron_oar.models.parallel import barrier, rank

META_FILE = "oar_checkpoint.json"
MODEL_DIR = "model"
HF_DIR = "hf"
FORMAT_VERSION = 1


class CheckpointError(ValueError):
    """A checkpoint that cannot be read; the message names the path."""


@dataclass
class CheckpointMeta:
    dtype: str  # fp32 | bf16 | fp16
    vocab_size: int
    padded_vocab_size: int
    tie_word_embeddings: bool
    vocab_multiple: int = 128
    written_tp: int = 1
    written_pp: int = 1
    written_ep: int = 1  # a MoE model's expert parallelism (the checkpoint loads at any EP)
    written_etp: int | None = None  # its expert TP (None: the TP)
    format_version: int = FORMAT_VERSION

    def write(self, ckpt_dir: Path) -> None:
        (Path(ckpt_dir) / META_FILE).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def read(cls, ckpt_dir: str | Path) -> CheckpointMeta:
        path = Path(ckpt_dir) / META_FILE
        if not path.is_file():
            raise CheckpointError(f"{path}: missing; is {ckpt_dir} a megatron-oar checkpoint?")
        try:
            raw = json.loads(path.read_text())
            meta = cls(**raw)
        except (json.JSONDecodeError, TypeError) as e:
            raise CheckpointError(f"{path}: unreadable checkpoint metadata ({e})") from e
        if meta.format_version != FORMAT_VERSION:
            raise CheckpointError(f"{path}: format_version {meta.format_version}, "
                                  f"this build reads {FORMAT_VERSION}")
        return meta


def model_dir(ckpt_dir: str | Path) -> Path:
    path = Path(ckpt_dir) / MODEL_DIR
    for name in ("metadata.json", ".metadata"):
        if not (path / name).is_file():
            raise CheckpointError(f"{path}: incomplete megatron dist checkpoint ({name} missing)")
    return path


def _die_with_parent() -> None:
    """In a child process: SIGKILL when the parent dies (Linux ``PR_SET_PDEATHSIG``)."""
    import ctypes
    import signal

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # 1: PR_SET_PDEATHSIG
    if os.getppid() == 1:  # the parent was gone before the call
        os._exit(0)


def _writer_manager_init() -> None:
    """The checkpoint writer's Manager server (:func:`_results_queue_dies_with_us`): dies with its
    rank, and freezes its heap (``gc.freeze()``: the modules its spawned interpreter imported to
    run this, torch and megatron-core among them) so that its exit skips CPython's full
    collections of it: the rank's own exit waits for that exit (multiprocessing's ``atexit``
    hook shuts the manager down and joins it), 0.4 s of each rank's end before (see
    ``megatron_oar/process_exit.py``)."""
    import gc

    _die_with_parent()
    gc.freeze()


def _results_queue_dies_with_us() -> None:
    """megatron-core's torch_dist writer (``FileSystemWriterAsync``, every save here) sends its
    write results through a ``multiprocessing`` Manager server it spawns on first use
    (``filesystem_async._get_write_results_queue``, module global ``_results_queue``). A rank that
    dies by SIGKILL (OOM, a node fault) or ends in ``os._exit`` (the hang watchdog) leaves that
    server running for good: one 270 MB process per torchrun restart of a days-long run. Start
    the manager here instead, its server set to die with this process. The module global is
    megatron-core's internal (0.16-0.19, setup.py's bound); without it nothing is done."""
    import multiprocessing as mp
    import sys
    from multiprocessing.managers import SyncManager

    if not sys.platform.startswith("linux"):
        return
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", "missing") is not None:  # set, or not this megatron
        return
    manager = SyncManager(ctx=mp.get_context("spawn"))  # megatron's own is spawn's Manager()
    from megatron_oar.runtime.stop_signals import helpers_shielded

    with helpers_shielded():  # a preemption signal to the process group must not end it mid-save
        manager.start(initializer=_writer_manager_init)
    filesystem_async._results_queue = manager.Queue()
    filesystem_async._oar_manager = manager  # keeps it alive with the queue


def dist_save(sharded_state_dict: dict, directory: str | Path, **kwargs) -> None:
    """``megatron.core.dist_checkpointing.save`` with its writer's helper process tied to this one."""
    from megatron.core import dist_checkpointing

    _results_queue_dies_with_us()
    dist_checkpointing.save(sharded_state_dict, str(directory), **kwargs)


def save_model(model, ckpt_dir: str | Path, meta: CheckpointMeta, hf_files_from: str | Path | None = None) -> None:
    """Collective: every rank saves its shards of ``model`` into ``ckpt_dir`` atomically."""
    final = Path(ckpt_dir)
    tmp = final.with_name(final.name + ".tmp")
    if rank() == 0:
        if final.exists():
            raise CheckpointError(f"{final}: already exists; refusing to overwrite")
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / MODEL_DIR).mkdir(parents=True)
    barrier()
    dist_save(model.sharded_state_dict(), tmp / MODEL_DIR)
    barrier()
    if rank() == 0:
        if hf_files_from is not None:
            copy_hf_side_files(hf_files_from, tmp / HF_DIR)
        meta.write(tmp)
        os.replace(tmp, final)
    barrier()


def copy_hf_side_files(src: str | Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for name in HF_SIDE_FILES:
        if (Path(src) / name).is_file():
            shutil.copy2(Path(src) / name, dst / name)


def load_model(model, ckpt_dir: str | Path) -> CheckpointMeta:
    """Collective: loads this rank's shards of ``model`` from ``ckpt_dir`` (any TP/PP/EP: megatron
    maps a MoE layer's local experts onto the checkpoint's global expert ids)."""
    from megatron.core import dist_checkpointing

    meta = CheckpointMeta.read(ckpt_dir)
    path = model_dir(ckpt_dir)
    sharded = model.sharded_state_dict()
    # Transformer Engine modules carry `_extra_state` (FP8 scales and amax history), stored as
    # ShardedObjects under "<key>/shard_..."; a checkpoint written by the converter or by a
    # local-spec model has none, and TE then starts them afresh.
    stored = FileSystemReader(str(path)).read_metadata().state_dict_metadata.keys()
    prefixes = {k.split("/shard_")[0] for k in stored}
    sharded = {k: v for k, v in sharded.items()
               if not (k.endswith("_extra_state") and getattr(v, "key", k) not in prefixes)}
    state = dist_checkpointing.load(sharded, str(path))
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise CheckpointError(f"{path}: state does not match the model "
                              f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    return meta

