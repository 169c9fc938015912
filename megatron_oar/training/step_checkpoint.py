"""Training checkpoints: everything a bit-exact resume needs, written atomically, verified on resume.

Layout (``checkpoint.dir``)::

    step_00000010/
      oar_checkpoint.json   model metadata (the converter and ``model.path`` accept this dir)
      model/                megatron dist checkpoint of the weights (torch_dist; any TP/PP)
      optim/                megatron dist checkpoint of the optimizer (Adam moments, fp32 masters)
      hf/                   config.json and tokenizer files (for HF export)
      rng/rank_00000.pt     python / numpy / torch / megatron-tracker RNG states, one per rank
      trainer_state.json    step, LR scheduler, prompt sampler position, guard counters, the
                            layout (``tp pp dp world_size distributed_optimizer``), the optimizer
                            format, and the integrity manifest; written last, it marks the save complete
    latest                  the name of the newest saved step directory

Saving. A save goes to ``.step_XXXXXXXX.tmp``. Once every rank has written its shards and RNG
state, the ranks CRC32 the files in parallel (rank r takes files i with i % world == r, the
results are all-gathered) and rank 0 writes ``trainer_state.json`` with the manifest
(``{"model/__0_0.distcp": {"size": 4096, "crc32": "1a2b3c4d"}, ...}``: every other file of the
checkpoint), renames the directory into place and updates ``latest``. The save's phases end in
an agreement (an all_gather of each rank's error, if any), so a rank that fails outside a
collective does not leave the others waiting: if any rank failed (no space left, an I/O error,
an ``OAR_FAULTS`` fault), the temp directory is removed and every rank raises the same
:class:`CheckpointWriteError`; ``latest`` and the earlier checkpoints are untouched. A rank
killed mid-save leaves the ``.tmp`` directory, which nothing resumes from and the next save
removes. Re-saving an existing step (a run resumed from an earlier one) first moves the old
directory to ``.step_XXXXXXXX.old``: at every instant one of the two is complete,
:func:`complete_checkpoints` lists the ``.old`` one while the step directory is missing, and the
next save puts it back or deletes it. ``keep_last`` prunes the checkpoints older than the one
just saved (newer ones, left by a run that resumed from an earlier step, are left alone),
renaming each away before deleting it so that a half-deleted checkpoint is never listed.

Resuming. :func:`resolve_resume` verifies before it chooses (:func:`verify_checkpoint`:
``trainer_state.json`` parses and every file of the manifest is there with its size and CRC32;
collective when torch.distributed is initialised: ranks check disjoint files and agree on the
result). ``auto`` takes the newest checkpoint that verifies, logging a warning naming the file
and the fault for each newer one that does not; an explicit path that does not verify is an
error. A checkpoint saved before manifests existed is accepted, unverified, if its
``trainer_state.json`` parses. After a torchrun restart (``restarted``) the run's own newest
verified checkpoint wins over ``checkpoint.resume``. Loading is not retried on older checkpoints:
a chosen checkpoint that fails to load is an error.

Another layout. Weights reload at any layout. The optimizer is saved in one of megatron's
formats (``checkpoint.optim_sharding``): ``dp_reshardable`` (the default; fully parallel, no
gathers) reloads at the same TP/PP and any DP; ``fully_reshardable`` gathers each model shard's
optimizer state over its DP group at the save (in host memory, on every DP rank) and reloads at
any TP/PP/DP (each rank reads its model shard's whole state, then keeps its DP part). A resume
that changes TP, PP or the distributed optimizer against a ``dp_reshardable`` checkpoint (or a
non-distributed optimizer's) is refused before anything loads (:class:`CheckpointError`: what
changed and what may). RNG states are restored only at the layout they were saved at (same TP,
PP, DP and world size); otherwise the ranks keep their fresh seeds (logged).
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import threading
import zlib
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import CheckpointException

from megatron_oar.config import OPTIM_SHARDINGS
from megatron_oar.fileio import atomic_write_text
from megatron_oar.models.model_checkpoint import (
    HF_DIR,
    MODEL_DIR,
    CheckpointError,
    CheckpointMeta,
    copy_hf_side_files,
    dist_save,
    load_model,
)
from megatron_oar.models.parallel import barrier, rank
from megatron_oar.testing import faults

log = logging.getLogger(__name__)

OPTIM_DIR = "optim"
RNG_DIR = "rng"
STATE_FILE = "trainer_state.json"
MANIFEST_KEY = "manifest"  # in trainer_state.json
LATEST_FILE = "latest"
_CRC_CHUNK = 16 << 20
_STEP_DIR = re.compile(r"^step_(\d{8})$")
_OLD_DIR = re.compile(r"^\.(step_\d{8})\.old$")  # a step being re-saved (see _commit)
_LEFTOVER = re.compile(r"^\.step_\d{8}\.(tmp|deleting(-\d+)?)$")  # an interrupted save or prune


class CheckpointWriteError(OSError):
    """A save failed on some rank; every rank raises it, after the partial save is removed.

    An ``OSError`` (with the ``errno`` of the failure when there was one), not a
    :class:`CheckpointError`: nothing is wrong with any checkpoint on disk (the previous one is
    kept); the filesystem or a rank failed, and code that handles disk errors with
    ``except OSError`` should see it.
    """


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step_{step:08d}"


def complete_checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    """``(step, dir)`` of every complete checkpoint under ``root`` (``trainer_state.json`` there),
    oldest first. Unverified: a listing, cheap enough for ``oar eval`` to pick the newest.

    A step whose directory is not complete but whose ``.step_XXXXXXXX.old`` is (a crash while that
    step was being re-saved) is listed with the ``.old`` directory.
    """
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _STEP_DIR.match(p.name)
        old = _OLD_DIR.match(p.name)
        if old and not (root / old.group(1) / STATE_FILE).is_file():
            m = _STEP_DIR.match(old.group(1))
        if m and (p / STATE_FILE).is_file():
            found.append((int(m.group(1)), p))
    return sorted(found)


def find_latest(root: str | Path) -> Path | None:
    """The newest complete checkpoint under ``root`` (unverified), or None."""
    found = complete_checkpoints(root)
    return found[-1][1] if found else None


# ------------------------------------------------------------------------ collectives

def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _all_gather(obj) -> list:
    """Every rank's ``obj``, in rank order (``[obj]`` without a process group)."""
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _from_rank0(obj):
    """Rank 0's ``obj`` on every rank."""
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


# -------------------------------------------------------------------- manifest, verify

def _crc32(path: Path) -> tuple[int, str]:
    """``(size, CRC32 as 8 hex digits)`` of a file, read in 16 MiB chunks."""
    buf = bytearray(_CRC_CHUNK)
    view = memoryview(buf)
    crc = size = 0
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            crc = zlib.crc32(view[:n], crc)
            size += n
    return size, f"{crc:08x}"


def _list_files(ckpt: Path) -> list[str]:
    """Every file of a checkpoint but ``trainer_state.json``, as sorted relative POSIX paths."""
    return sorted(rel for p in ckpt.rglob("*") if p.is_file()
                  and (rel := p.relative_to(ckpt).as_posix()) != STATE_FILE)


def _checksums(ckpt: Path, files: list[str]) -> dict[str, dict]:
    out = {}
    for rel in files:
        size, crc = _crc32(ckpt / rel)
        out[rel] = {"size": size, "crc32": crc}
    return out


def _check_file(ckpt: Path, rel: str, entry: dict) -> str | None:
    """What is wrong with one manifest file (``"step_.../rel: ..."``), or None."""
    where = f"{ckpt.name}/{rel}"
    try:
        size = (ckpt / rel).stat().st_size
        if size != entry["size"]:
            return f"{where}: {size} bytes, the manifest says {entry['size']}"
        _, crc = _crc32(ckpt / rel)
    except FileNotFoundError:
        return f"{where}: missing (the manifest lists it with {entry['size']} bytes)"
    except OSError as e:
        return f"{where}: unreadable ({e})"
    if crc != entry["crc32"]:
        return f"{where}: CRC32 {crc}, the manifest says {entry['crc32']} (same size: corrupted bytes)"
    return None


def _read_state(ckpt: Path) -> tuple[dict | None, str | None]:
    """``(trainer state, None)`` or ``(None, what is wrong with trainer_state.json)``."""
    where = f"{ckpt.name}/{STATE_FILE}"
    try:
        state = json.loads((ckpt / STATE_FILE).read_text())
    except FileNotFoundError:
        return None, f"{where}: missing (not a complete training checkpoint)"
    except (OSError, ValueError) as e:
        return None, f"{where}: unreadable ({e})"
    if not isinstance(state, dict) or "step" not in state:
        return None, f"{where}: not a trainer state (no step)"
    manifest = state.get(MANIFEST_KEY)
    if manifest is not None and not (isinstance(manifest, dict) and all(
            isinstance(e, dict) and {"size", "crc32"} <= e.keys() for e in manifest.values())):
        return None, f"{where}: malformed manifest"
    return state, None


def verify_checkpoint(path: str | Path) -> list[str]:
    """What is wrong with the checkpoint at ``path``, one line per fault, e.g.
    ``"step_00000004/optim/__1_0.distcp: 812 bytes, the manifest says 4096"``; empty if it verifies.

    Verifies means: ``trainer_state.json`` parses and every file in its manifest is present with
    the recorded size and CRC32. Collective when torch.distributed is initialised (call it on
    every rank with the same path): rank r checks manifest files i with i % world == r, and every
    rank returns the same list. A checkpoint without a manifest (saved before manifests existed)
    verifies if ``trainer_state.json`` parses; that is logged at INFO.
    """
    path = Path(path)
    state, problem = _read_state(path)
    mine = [problem] if problem else []
    manifest = (state or {}).get(MANIFEST_KEY)
    files = sorted(manifest or {})
    mine += [p for rel in files[rank()::_world()] if (p := _check_file(path, rel, manifest[rel]))]
    problems = sorted({p for part in _all_gather(mine) for p in part})
    if not problems and manifest is None and rank() == 0:
        log.info("%s has no integrity manifest (saved before manifests existed): accepted unverified, "
                 "its %s parses", path, STATE_FILE)
    return problems


def _summary(problems: list[str]) -> str:
    more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
    return "; ".join(problems[:3]) + more


def _newest_verified(root: str | Path) -> Path | None:
    """Collective: the newest checkpoint under ``root`` that verifies, None if there is none.

    Each newer one that does not verify is logged (WARNING, naming the file and the fault).
    Raises :class:`CheckpointError` when there are checkpoints but none verifies.
    """
    found = _from_rank0([str(p) for _, p in complete_checkpoints(root)] if rank() == 0 else None)
    skipped = []
    for path in map(Path, reversed(found)):
        problems = verify_checkpoint(path)
        if not problems:
            if skipped and rank() == 0:
                log.warning("resuming from %s, the newest checkpoint that verifies (skipped: %s)",
                            path, ", ".join(skipped))
            return path
        skipped.append(path.name)
        if rank() == 0:
            log.warning("checkpoint %s fails verification, falling back to an older one: %s",
                        path, _summary(problems))
    if found:
        raise CheckpointError(f"{root}: none of its {len(found)} checkpoints verifies (see the warnings "
                              f"above); delete the damaged ones or start afresh with checkpoint.resume=none")
    return None


def resolve_resume(resume: str, root: str | Path, *, restarted: bool = False) -> Path | None:
    """The checkpoint to resume from, verified (:func:`verify_checkpoint`), or None to start afresh.

    ``resume`` (``checkpoint.resume``): ``auto``, the newest checkpoint under ``root`` that
    verifies (each newer one that does not is skipped with a WARNING naming the file and the
    fault; None if ``root`` has none; :class:`CheckpointError` if it has some but none verifies);
    ``none``; or a step directory, which must verify (:class:`CheckpointError` naming the file
    otherwise). ``restarted`` (torchrun restarted the group): the newest verified checkpoint under
    ``root`` is used whatever ``resume`` says, so a run started afresh or from another run's
    checkpoint continues from its own progress; ``resume`` applies only when ``root`` has none.
    Collective when torch.distributed is initialised: every rank gets the same answer.
    """
    if restarted:
        path = _newest_verified(root)
        if path is not None:
            if rank() == 0:
                log.info("torchrun restart: resuming from this run's newest verified checkpoint %s "
                         "(checkpoint.resume=%s applies to a fresh start only)", path, resume)
            return path
    if resume == "none":
        return None
    if resume == "auto":
        return None if restarted else _newest_verified(root)
    path = Path(resume)
    problems = verify_checkpoint(path)
    if problems:
        raise CheckpointError(f"checkpoint.resume={resume}: the checkpoint fails verification: "
                              f"{_summary(problems)}")
    return path


# ------------------------------------------------------------------------------------ RNG

def rng_state() -> dict:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    return {"python": random.getstate(), "numpy": np.random.get_state(),
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
            "tracker": get_cuda_rng_tracker().get_states()}


def _set_rng_state(state: dict) -> None:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    get_cuda_rng_tracker().set_states(state["tracker"])


# --------------------------------------------------------------------------------- layout

# trainer_state.json's layout (ep / etp: expert parallel and expert TP sizes, 1 / tp for a dense model)
# cp: context parallel size (the optimizer shards over DP x CP: a change of CP is one of DP x CP)
LAYOUT_KEYS = ("tp", "pp", "cp", "ep", "etp", "dp", "world_size", "distributed_optimizer")


def _layout(policy) -> dict:
    """What decides this run's shard shapes: the parallel sizes and the distributed optimizer."""
    from megatron.core import parallel_state as ps

    return {"tp": ps.get_tensor_model_parallel_world_size(), "pp": ps.get_pipeline_model_parallel_world_size(),
            "cp": ps.get_context_parallel_world_size(), "ep": ps.get_expert_model_parallel_world_size(),
            "etp": ps.get_expert_tensor_parallel_world_size(),
            "dp": ps.get_data_parallel_world_size(), "world_size": _world(),
            "distributed_optimizer": bool(policy.model.ddp_config.use_distributed_optimizer)}


def _describe_layout(layout: dict) -> str:
    return " ".join(f"{k}={layout.get(k, '?')}" for k in LAYOUT_KEYS)


def _check_layout(path: Path, saved: dict, now: dict, sharding: str) -> None:
    """Raises :class:`CheckpointError` when this run's layout cannot load the optimizer state at
    ``path``, naming what changed and what may change."""
    fixed = ["distributed_optimizer"]
    if sharding != "fully_reshardable" or not now["distributed_optimizer"]:
        fixed += ["tp", "pp", "ep", "etp"]  # dp_reshardable, or a non-distributed optimizer's state
    changed = [f"{k} {saved[k]} -> {now[k]}" for k in fixed if k in saved and saved[k] != now[k]]
    if changed:
        raise CheckpointError(
            f"{path}: saved at {_describe_layout(saved)}, this run is {_describe_layout(now)} "
            f"({', '.join(changed)}): its optimizer state ({OPTIM_DIR}/, {sharding}) reloads only at the "
            f"same parallel.tp, parallel.pp, parallel.ep, parallel.etp and "
            f"optim.use_distributed_optimizer; the data-parallel and world sizes may change. Resume at "
            f"the saved layout, or resume there once with checkpoint.optim_sharding=fully_reshardable "
            f"and let it save: that checkpoint reloads at any parallel.tp / parallel.pp (with the "
            f"distributed optimizer)")


# ----------------------------------------------------------------------------------- save

def _describe(error: BaseException, what: str) -> list[tuple[str, bool]]:
    """``("rank R, WHAT: Type: message", has the cause)`` lines for one rank's failure.

    Megatron's shard writes run in forked processes; a failed write comes back as a
    ``CheckpointException`` whose details only the coordinator has (the other ranks get an empty
    one, which says no more than "failed elsewhere": ``False``).
    """
    if isinstance(error, CheckpointException):
        lines = [(f"rank {r}, {what}: {type(e).__name__}: {e}", True)
                 for r, (e, _) in sorted(error.failures.items())]
        return lines or [(f"rank {rank()}, {what}: the shard write failed on another rank", False)]
    return [(f"rank {rank()}, {what}: {type(error).__name__}: {error}", True)]


def _write_error(root: Path, step: int, lines: list[tuple[str, bool]]) -> CheckpointWriteError:
    """The error every rank raises; the same text on every rank."""
    causes = list(dict.fromkeys(text for text, cause in lines if cause)) or [text for text, _ in lines]
    code = next((int(m.group(1)) for t in causes if (m := re.search(r"\[Errno (\d+)\]", t))), None)
    previous = find_latest(root)
    kept = (f"the previous checkpoint {previous.name} is kept and {LATEST_FILE} is unchanged" if previous
            else f"there is no earlier checkpoint under {root}")
    reason = os.strerror(code) if code is not None else "a rank failed"
    err = CheckpointWriteError(
        f"checkpoint step {step} was not saved to {step_dir(root, step)}: {reason} ({'; '.join(causes)}). "
        f"The partial save {_tmp_dir(root, step).name} was removed; {kept}")
    err.errno = code  # not strerror: OSError's str() would become "[Errno N] strerror"
    return err


def _phase(root: Path, step: int, what: str, fn: Callable[[], object]) -> list:
    """Collective: runs ``fn`` on every rank and returns every rank's result, in rank order.

    If ``fn`` raised on any rank, rank 0 removes the temp directory and every rank raises the
    same :class:`CheckpointWriteError` (the ranks agree through an all_gather here, so a rank that
    failed outside a collective does not leave the others waiting in one).
    """
    result = error = None
    try:
        result = fn()
    except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
        error = e
    reports = _all_gather((result, None if error is None else _describe(error, what)))
    failed = [line for _, lines in reports if lines for line in lines]
    if not failed:
        return [r for r, _ in reports]
    if rank() == 0 and _tmp_dir(root, step).exists():
        _delete_later(_tmp_dir(root, step))
    barrier()
    raise _write_error(root, step, failed) from error


def _tmp_dir(root: Path, step: int) -> Path:
    return root / f".{step_dir(root, step).name}.tmp"


# rank 0's deletions in progress (path -> thread): deleting a checkpoint of a large model takes
# minutes on a network file system, and the other ranks must not wait for it in a collective of
# the default group (whose timeout, parallel.timeout_minutes, is sized for collectives)
_deleting: dict[str, threading.Thread] = {}


def _delete_later(path: Path) -> None:
    """Rank 0: renames ``path`` (a step directory, or a ``.tmp`` / ``.old`` one) to a
    ``.step_N.deleting`` name, which no listing takes for a checkpoint and no save writes to, and
    deletes it in a background thread. A deletion cut short (the process ended) leaves it for
    the next save's :func:`_clean_leftovers`."""
    running = _deleting.get(str(path))
    if running is not None and running.is_alive():
        return
    if not path.name.endswith(".deleting") and ".deleting-" not in path.name:
        step = re.search(r"step_\d{8}", path.name)
        base = path.parent / f".{step.group(0) if step else path.name}.deleting"
        target, n = base, 0
        while target.exists():
            n += 1
            target = base.with_name(f"{base.name}-{n}")
        try:
            os.replace(path, target)
        except OSError:
            shutil.rmtree(path, ignore_errors=True)  # cannot rename it away: delete it now
            return
        path = target
    thread = threading.Thread(target=shutil.rmtree, args=(path,), kwargs={"ignore_errors": True},
                              name=f"oar-delete-{path.name}", daemon=True)
    _deleting[str(path)] = thread
    thread.start()


def wait_for_deletions(timeout_s: float | None = None) -> bool:
    """Waits for rank 0's background deletions (:func:`_delete_later`); True when none is left."""
    for key, thread in list(_deleting.items()):
        thread.join(timeout_s)
        if not thread.is_alive():
            _deleting.pop(key, None)
    return not _deleting


def _clean_leftovers(root: Path) -> None:
    """Rank 0, before a save: removes the ``.tmp`` / ``.deleting`` directories of interrupted saves
    and prunes (in the background, :func:`_delete_later`), and settles a ``.old`` one (put back in
    place if its step directory is not complete, deleted otherwise)."""
    for p in sorted(root.iterdir()):
        running = _deleting.get(str(p))
        if running is not None and running.is_alive():
            continue  # being deleted
        old = _OLD_DIR.match(p.name)
        if old and (p / STATE_FILE).is_file() and not (root / old.group(1) / STATE_FILE).is_file():
            log.warning("restoring %s from %s, left by a save interrupted while replacing it",
                        old.group(1), p.name)
            if (root / old.group(1)).exists():
                _delete_later(root / old.group(1))
            os.replace(p, root / old.group(1))
        elif old or _LEFTOVER.match(p.name):
            log.info("removing %s, left by an interrupted save", p)
            _delete_later(p)


def _prepare(root: Path, tmp: Path) -> None:
    root.mkdir(parents=True, exist_ok=True)
    _clean_leftovers(root)
    for sub in (MODEL_DIR, OPTIM_DIR, RNG_DIR):
        (tmp / sub).mkdir(parents=True)


def _save_model(policy, tmp: Path, step: int) -> None:
    dist_save(policy.gpt.sharded_state_dict(), tmp / MODEL_DIR)
    faults.inject("checkpoint.shards", step=step)  # tests: a kill / ENOSPC between the shard saves


def _save_optimizer(policy, tmp: Path, sharding: str) -> None:
    optim_sd = policy.optimizer.sharded_state_dict(
        policy.gpt.sharded_state_dict(), metadata={"distrib_optim_sharding_type": sharding})
    dist_save(optim_sd, tmp / OPTIM_DIR)


def _save_rng_and_side_files(tmp: Path, meta: CheckpointMeta, hf_files_from: str | Path,
                             layout: dict, rng: dict | None, extra: dict[str, bytes] | None) -> None:
    torch.save(rng_state() if rng is None else rng, tmp / RNG_DIR / f"rank_{rank():05d}.pt")
    if rank() == 0:
        for name, data in (extra or {}).items():
            (tmp / name).write_bytes(data)
        copy_hf_side_files(hf_files_from, tmp / HF_DIR)
        replace(meta, written_tp=layout["tp"], written_pp=layout["pp"], written_ep=layout["ep"],
                written_etp=layout["etp"]).write(tmp)


def _commit(tmp: Path, final: Path, state: dict) -> None:
    """Rank 0: writes ``trainer_state.json`` (the completeness marker) and renames ``tmp`` to ``final``.

    An existing ``final`` (a run resumed from an earlier step reaches this step again) is moved to
    ``.old`` first, put back if the rename fails, and deleted after it: a crash between the renames
    leaves a complete ``.old``, which :func:`complete_checkpoints` lists and the next save restores.
    """
    atomic_write_text(tmp / STATE_FILE, json.dumps(state, indent=1) + "\n")
    old = final.parent / f".{final.name}.old"
    if final.exists():
        os.replace(final, old)
    try:
        os.replace(tmp, final)
    except BaseException:
        if old.exists() and not final.exists():
            os.replace(old, final)
        raise
    if old.exists():
        _delete_later(old)


def _publish(root: Path, final: Path, step: int, keep_last: int) -> None:
    """Rank 0, after the commit: points ``latest`` at ``final`` and prunes to ``keep_last``
    checkpoints up to ``step`` (each renamed away, then deleted in the background: the other ranks
    wait at a barrier meanwhile). Never raises: the new checkpoint is saved whatever happens
    here, and resume finds checkpoints by listing."""
    found = complete_checkpoints(root)
    older = [(s, p) for s, p in found if s < step]
    try:
        atomic_write_text(root / LATEST_FILE, final.name + "\n")
        for s, path in older[:max(len(older) - keep_last + 1, 0)] if keep_last > 0 else []:
            _delete_later(path)
    except OSError as e:
        log.warning("%s is saved, but updating %s or pruning older checkpoints failed: %s", final, LATEST_FILE, e)
    newer = [p.name for s, p in found if s > step]
    if newer:
        log.warning("%s: checkpoints newer than step %d (%s) remain from before this run resumed at an "
                    "earlier step; resume=auto picks them until this run saves past them",
                    root, step, ", ".join(newer))


def save_checkpoint(root: str | Path, step: int, policy, trainer_state: dict, meta: CheckpointMeta,
                    hf_files_from: str | Path, keep_last: int = 0,
                    optim_sharding: str = OPTIM_SHARDINGS[0], rng: dict | None = None,
                    extra: dict[str, bytes] | None = None) -> Path:
    """Collective: writes ``step_{step}`` under ``root`` with its manifest, atomically; returns its path.
    ``rng``: this rank's RNG states to save (:func:`rng_state` taken earlier), instead of now's.
    ``extra``: more files for rank 0 to write at the checkpoint's top level (name -> bytes), in
    the manifest like the rest.

    Either every rank returns, with the checkpoint complete and ``latest`` naming it, or every
    rank raises :class:`CheckpointWriteError` with the temp directory removed and ``latest`` and
    the earlier checkpoints untouched. A rank killed mid-save leaves only a ``.tmp`` directory,
    which is never resumed from and which the next save removes. ``optim_sharding``: megatron's
    optimizer format (``OPTIM_SHARDINGS``; the module docstring says what each reloads at).
    """
    if optim_sharding not in OPTIM_SHARDINGS:
        raise ValueError(f"checkpoint.optim_sharding={optim_sharding!r}: must be one of {OPTIM_SHARDINGS}")
    root = Path(root)
    layout = _layout(policy)
    final, tmp = step_dir(root, step), _tmp_dir(root, step)

    def phase(what: str, fn: Callable[[], object]) -> list:
        return _phase(root, step, what, fn)

    phase("preparing the directory", lambda: _prepare(root, tmp) if rank() == 0 else None)
    phase("model shards", lambda: _save_model(policy, tmp, step))
    phase("optimizer shards", lambda: _save_optimizer(policy, tmp, optim_sharding))
    phase("RNG state and side files",
          lambda: _save_rng_and_side_files(tmp, meta, hf_files_from, layout, rng, extra))
    files = phase("listing the files", lambda: _list_files(tmp) if rank() == 0 else None)[0]
    parts = phase("checksums", lambda: _checksums(tmp, files[rank()::_world()]))
    manifest = {rel: part[rel] for part in parts for rel in part}
    state = {**trainer_state, "step": step, "layout": layout, "optim_sharding": optim_sharding,
             "scheduler": policy.scheduler.state_dict(), MANIFEST_KEY: dict(sorted(manifest.items()))}
    phase("trainer_state.json and rename", lambda: _commit(tmp, final, state) if rank() == 0 else None)
    if rank() == 0:
        _publish(root, final, step, keep_last)
    barrier()
    return final


# ----------------------------------------------------------------------------------- load

def _torch_adams(optimizer):
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            yield inner


def _restore_adam_steps(optimizer, steps: int) -> None:
    """Sets torch Adam's per-parameter ``step`` to the number of applied updates.

    Megatron's distributed optimizer does not round-trip torch Adam's ``step`` (it comes back as
    the placeholder, and as one tensor shared by every parameter, which torch would advance once
    per parameter per update), so the bias correction would restart after a resume. The trainer
    steps the LR scheduler exactly when Adam steps, so its count is the right value.
    """
    for inner in _torch_adams(optimizer):
        for state in inner.state.values():
            if state:
                state["step"] = torch.tensor(float(steps), dtype=torch.float32)


def _init_torch_adam_state(optimizer) -> None:
    """Gives a fresh torch Adam(W) the state entries a loaded state will overwrite.

    Without Transformer Engine / Apex, megatron wraps ``torch.optim.AdamW``, and its distributed
    optimizer's ``state_dict()`` reads every parameter's ``step`` (asserting one value) before its
    loading path initialises any state, so a never-stepped optimizer cannot be loaded into. TE's
    and Apex's fused Adam keep ``step`` elsewhere and do not need this.
    """
    for inner in _torch_adams(optimizer):
        for group in inner.param_groups:
            for p in group["params"]:
                if not inner.state[p]:
                    inner.state[p] = {"step": torch.zeros((), dtype=torch.float32),
                                      "exp_avg": torch.zeros_like(p.data),
                                      "exp_avg_sq": torch.zeros_like(p.data)}


def _load_optimizer(optimizer, loaded) -> None:
    """``optimizer.load_state_dict(loaded)``, each distributed optimizer's ``fully_reshardable``
    parameter state loaded apart: with torch's Adam(W) (no TE or Apex, e.g. on CPU) megatron's
    ``load_state_dict`` gives every parameter a ``step`` state, which its fully_reshardable loader
    then expects among the checkpoint's tensors (``KeyError: 'step'``; the format does not save it).
    The steps are dropped for that load and set afterwards (:func:`_restore_adam_steps`)."""
    opts = getattr(optimizer, "chained_optimizers", [optimizer])
    states = [loaded] if len(opts) == 1 else [loaded[i] for i in range(len(opts))]
    param_states = [sd.pop("param_state") if sd.get("param_state_sharding_type") == "fully_reshardable"
                    else None for sd in states]
    optimizer.load_state_dict(loaded)
    for opt, param_state in zip(opts, param_states):
        if param_state is not None:
            for inner in _torch_adams(opt):
                for state in inner.state.values():
                    state.pop("step", None)
            opt.load_parameter_state_from_fully_reshardable(param_state)


def load_checkpoint(path: str | Path, policy) -> dict:
    """Collective: restores weights, optimizer, LR schedule and RNG from ``path``; returns the
    trainer state (``step``, ``sampler``, ...). Raises :class:`CheckpointError`, before loading
    anything, when this run's layout cannot load the optimizer state (the module docstring says
    which changes each format allows)."""
    from megatron.core import dist_checkpointing

    path = Path(path)
    state = json.loads((path / STATE_FILE).read_text())
    sharding = state.get("optim_sharding", OPTIM_SHARDINGS[0])
    saved = state.get("layout") or {"world_size": state.get("world_size")}  # older: the world size only
    now = _layout(policy)
    _check_layout(path, saved, now, sharding)
    load_model(policy.gpt, path)
    _init_torch_adam_state(policy.optimizer)
    optim_sd = policy.optimizer.sharded_state_dict(
        policy.gpt.sharded_state_dict(), is_loading=True, metadata={"distrib_optim_sharding_type": sharding})
    loaded = dist_checkpointing.load(optim_sd, str(path / OPTIM_DIR))
    with torch.no_grad():  # fp32 main params are views of the (grad-requiring) model params
        _load_optimizer(policy.optimizer, loaded)
    policy.scheduler.load_state_dict(state["scheduler"])
    _restore_adam_steps(policy.optimizer, policy.scheduler.num_steps)
    rng = path / RNG_DIR / f"rank_{rank():05d}.pt"
    differ = [k for k in ("tp", "pp", "cp", "dp", "world_size") if saved.get(k, 1 if k == "cp" else None) != now[k]]
    if not differ and rng.is_file():
        _set_rng_state(torch.load(rng, weights_only=False))
    elif rank() == 0:
        log.warning("%s was saved at %s, this run is %s: RNG states are not restored (%s differ; "
                    "each rank keeps its fresh seed)", path, _describe_layout(saved), _describe_layout(now),
                    ", ".join(differ) or f"no {RNG_DIR}/ file")
    return state
