"""Training checkpoints: everything a bit-exact resume needs, written atomically.

Layout (``checkpoint.dir``)::

    step_00000010/
      oar_checkpoint.json   model metadata (the converter and ``model.path`` accept this dir)
      model/                megatron dist checkpoint of the weights (torch_dist; any TP/PP)
      optim/                megatron dist checkpoint of the optimizer (Adam moments, fp32 masters)
      hf/                   config.json and tokenizer files (for HF export)
      rng/rank_00000.pt     python / numpy / torch / megatron-tracker RNG states, one per rank
      trainer_state.json    step, LR scheduler, prompt sampler position, guard counters, layout
    latest                  the name of the newest complete step directory

A save goes to ``.step_XXXXXXXX.tmp`` and is renamed into place only when every rank has
finished and ``trainer_state.json`` (written last) is there, so a crash mid-save leaves the
previous checkpoints untouched; ``find_latest`` only ever returns complete directories. After a
successful save all but the newest ``keep_last`` are deleted.

The optimizer is saved in megatron's ``dp_reshardable`` format (fully parallel, no gathers):
it reloads at the same TP/PP and any DP. Weights reload at any layout; with a different world
size the RNG states cannot be matched rank to rank and are re-seeded (logged).
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from megatron_oar.fileio import atomic_write_text
from megatron_oar.models.model_checkpoint import (
    HF_DIR,
    MODEL_DIR,
    CheckpointError,
    CheckpointMeta,
    copy_hf_side_files,
    load_model,
)
from megatron_oar.models.parallel import barrier, rank

log = logging.getLogger(__name__)

OPTIM_DIR = "optim"
RNG_DIR = "rng"
STATE_FILE = "trainer_state.json"
LATEST_FILE = "latest"
OPTIM_SHARDING = "dp_reshardable"
_STEP_DIR = re.compile(r"^step_(\d{8})$")


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step_{step:08d}"


def complete_checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    """``(step, dir)`` of every complete checkpoint under ``root``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and (p / STATE_FILE).is_file():
            found.append((int(m.group(1)), p))
    return sorted(found)


def find_latest(root: str | Path) -> Path | None:
    found = complete_checkpoints(root)
    return found[-1][1] if found else None


def resolve_resume(resume: str, root: str | Path) -> Path | None:
    """``checkpoint.resume``: ``auto`` (newest complete one under ``root``, if any), ``none``, or a
    path to a step directory."""
    if resume == "none":
        return None
    if resume == "auto":
        return find_latest(root)
    path = Path(resume)
    if not (path / STATE_FILE).is_file():
        raise CheckpointError(f"checkpoint.resume={resume}: not a complete training checkpoint "
                              f"({STATE_FILE} missing)")
    return path


# ------------------------------------------------------------------------------------ RNG

def _rng_state() -> dict:
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


# ----------------------------------------------------------------------------------- save

def save_checkpoint(root: str | Path, step: int, policy, trainer_state: dict, meta: CheckpointMeta,
                    hf_files_from: str | Path, keep_last: int = 0) -> Path:
    """Collective: writes ``step_{step}`` under ``root`` atomically; returns its path."""
    from megatron.core import dist_checkpointing

    root = Path(root)
    final = step_dir(root, step)
    tmp = root / f".{final.name}.tmp"
    if rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        for sub in (MODEL_DIR, OPTIM_DIR, RNG_DIR):
            (tmp / sub).mkdir(parents=True)
    barrier()
    model_sd = policy.gpt.sharded_state_dict()
    dist_checkpointing.save(model_sd, str(tmp / MODEL_DIR))
    optim_sd = policy.optimizer.sharded_state_dict(
        policy.gpt.sharded_state_dict(), metadata={"distrib_optim_sharding_type": OPTIM_SHARDING})
    dist_checkpointing.save(optim_sd, str(tmp / OPTIM_DIR))
    torch.save(_rng_state(), tmp / RNG_DIR / f"rank_{rank():05d}.pt")
    barrier()
    if rank() == 0:
        copy_hf_side_files(hf_files_from, tmp / HF_DIR)
        meta.write(tmp)
        state = {**trainer_state, "step": step, "world_size": dist.get_world_size(),
                 "optim_sharding": OPTIM_SHARDING,
                 "scheduler": policy.scheduler.state_dict()}
        atomic_write_text(tmp / STATE_FILE, json.dumps(state, indent=1) + "\n")
        old = root / f".{final.name}.old"
        if final.exists():  # a run resumed from an earlier step reaches this step again
            os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
        atomic_write_text(root / LATEST_FILE, final.name + "\n")
        if keep_last > 0:
            for _, path in complete_checkpoints(root)[:-keep_last]:
                shutil.rmtree(path, ignore_errors=True)
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
            if "step" in state:
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


def load_checkpoint(path: str | Path, policy) -> dict:
    """Collective: restores weights, optimizer, LR schedule and RNG from ``path``; returns the
    trainer state (``step``, ``sampler``, ...)."""
    from megatron.core import dist_checkpointing

    path = Path(path)
    state = json.loads((path / STATE_FILE).read_text())
    load_model(policy.gpt, path)
    _init_torch_adam_state(policy.optimizer)
    optim_sd = policy.optimizer.sharded_state_dict(
        policy.gpt.sharded_state_dict(), is_loading=True,
        metadata={"distrib_optim_sharding_type": state.get("optim_sharding", OPTIM_SHARDING)})
    loaded = dist_checkpointing.load(optim_sd, str(path / OPTIM_DIR))
    with torch.no_grad():  # fp32 main params are views of the (grad-requiring) model params
        policy.optimizer.load_state_dict(loaded)
    policy.scheduler.load_state_dict(state["scheduler"])
    _restore_adam_steps(policy.optimizer, policy.scheduler.num_steps)
    rng = path / RNG_DIR / f"rank_{rank():05d}.pt"
    if state.get("world_size") == dist.get_world_size() and rng.is_file():
        _set_rng_state(torch.load(rng, weights_only=False))
    elif rank() == 0:
        log.warning("%s was written by %s ranks, this run has %d: RNG states are not restored",
                    path, state.get("world_size"), dist.get_world_size())
    return state
