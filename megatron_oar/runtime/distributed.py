"""Process-group and megatron ``parallel_state`` set-up from torchrun's environment.

``init_runtime`` is the single entry every program (trainer, converter, tests) calls:
nccl on CUDA, gloo on CPU (with :mod:`.cpu_backend`), TP/PP/DP groups, and seeds that are
deterministic per rank. Without torchrun variables it starts a one-process world. Every group,
megatron's (gloo ones included) and those made with :func:`gloo_group`, has the timeout
``parallel.timeout_minutes``.
"""

from __future__ import annotations

import logging
import os
import random
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist

from megatron_oar.runtime import cpu_backend
from megatron_oar.runtime.kernels import log_kernel_report

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass
class ParallelConfig:
    """How the world is split. DP is whatever is left: world_size / (tp * pp * cp).

    ``cp``: context parallelism (megatron's ``context_parallel_size``): every sequence is split
    over ``cp`` ranks in ``2 x cp`` load-balanced chunks (``models.context_parallel``); the CP
    ranks of one DP rank hold the same samples and the same weights.

    ``ep`` / ``etp``: a mixture-of-experts model's expert parallel and expert tensor parallel
    sizes (megatron's ``expert_model_parallel_size`` / ``expert_tensor_parallel_size``; etp null:
    the same as tp). The experts' layout etp x ep x expert-DP x pp must fill the world too."""

    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int | None = None
    sequence_parallel: bool = False
    seed: int = 1234
    timeout_minutes: int = 30  # a collective waiting longer fails (ends its process on NCCL)


@dataclass(frozen=True)
class RuntimeInfo:
    rank: int
    world_size: int
    local_rank: int
    tp: int
    pp: int
    dp: int
    device: torch.device
    backend: str
    cp: int = 1


_SET_BY_US: set[str] = set()  # torchrun variables init_runtime set for a one-process world
_timeout = timedelta(minutes=ParallelConfig.timeout_minutes)  # the last init_runtime's
# torchrun's variables; a child process that saw them would try to join this world (and hang)
LAUNCHER_VARS = frozenset({"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                           "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR",
                           "MASTER_PORT"})


def env_without_launcher() -> dict[str, str]:
    """This process's environment without torchrun's variables (``LAUNCHER_VARS``, ``TORCHELASTIC_*``):
    for a child process that starts a world of its own."""
    return {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS and not k.startswith("TORCHELASTIC_")}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError as e:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from e


def validate_layout(world_size: int, parallel: ParallelConfig) -> int:
    """Returns DP; raises naming the flag when the layout does not fit the world (megatron's
    rules: tp*pp*cp and etp*ep*pp divide the world size)."""
    sizes = [("tp", parallel.tp), ("pp", parallel.pp), ("cp", parallel.cp), ("ep", parallel.ep)]
    if parallel.etp is not None:
        sizes.append(("etp", parallel.etp))
    for name, v in sizes:
        if v < 1:
            raise ValueError(f"parallel.{name} must be >= 1, got {v}")
    mp = parallel.tp * parallel.pp * parallel.cp
    if world_size % mp != 0:
        keys = (f"tp*pp = {parallel.tp}*{parallel.pp}" if parallel.cp == 1 else
                f"parallel.tp*parallel.pp*parallel.cp = {parallel.tp}*{parallel.pp}*{parallel.cp}")
        raise ValueError(f"world size {world_size} is not divisible by {keys}")
    etp = parallel.tp if parallel.etp is None else parallel.etp
    if world_size % (etp * parallel.ep * parallel.pp):
        raise ValueError(
            f"world size {world_size} is not divisible by parallel.etp*parallel.ep*parallel.pp = "
            f"{etp}*{parallel.ep}*{parallel.pp} (the experts' layout; etp defaults to tp)")
    if parallel.sequence_parallel and parallel.tp == 1:
        raise ValueError("parallel.sequence_parallel needs parallel.tp > 1")
    return world_size // mp


def gloo_group(ranks: list[int] | None = None, *, timeout_minutes: float | None = None):
    """Collective: a new gloo group of ``ranks`` (all by default) with ``timeout_minutes``, by
    default ``parallel.timeout_minutes`` (torch's ``new_group`` would give it its own default,
    30 minutes)."""
    timeout = _timeout if timeout_minutes is None else timedelta(minutes=timeout_minutes)
    return dist.new_group(ranks, backend="gloo", timeout=timeout)


def init_runtime(parallel: ParallelConfig | None = None) -> RuntimeInfo:
    """Initialise torch.distributed and megatron's parallel_state (idempotent per layout)."""
    from megatron.core import parallel_state, tensor_parallel

    global _timeout
    parallel = parallel or ParallelConfig()
    _timeout = timedelta(minutes=parallel.timeout_minutes)
    cuda = torch.cuda.is_available()
    if not cuda:
        cpu_backend.enable()

    rank = _env_int("RANK", 0)
    world_size = _env_int("WORLD_SIZE", 1)
    local_rank = _env_int("LOCAL_RANK", 0)
    dp = validate_layout(world_size, parallel)

    if cuda:
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        if world_size == 1:  # a plain `python` run: the variables torchrun would set
            for name, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"),
                                ("LOCAL_WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                                ("MASTER_PORT", None)):
                if name not in os.environ:  # set here, removed by destroy_runtime
                    os.environ[name] = value or str(_free_port())
                    _SET_BY_US.add(name)
        backend = "nccl" if cuda else "gloo"
        dist.init_process_group(
            backend=backend,
            rank=rank,
            world_size=world_size,
            timeout=_timeout,
        )
    backend = dist.get_backend()

    if parallel_state.model_parallel_is_initialized():
        same = (
            parallel_state.get_tensor_model_parallel_world_size() == parallel.tp
            and parallel_state.get_pipeline_model_parallel_world_size() == parallel.pp
            and parallel_state.get_context_parallel_world_size() == parallel.cp
            and parallel_state.get_expert_model_parallel_world_size() == parallel.ep
            and parallel_state.get_expert_tensor_parallel_world_size()
            == (parallel.tp if parallel.etp is None else parallel.etp)
        )
        if not same:
            parallel_state.destroy_model_parallel()
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=parallel.tp,
            pipeline_model_parallel_size=parallel.pp,
            context_parallel_size=parallel.cp,
            expert_model_parallel_size=parallel.ep,
            expert_tensor_parallel_size=parallel.etp,
            distributed_timeout_minutes=parallel.timeout_minutes,
        )

    # Seeds: data-parallel RNG shared across a model-parallel group's shards but differing per
    # pipeline stage (as Megatron-LM does); TP-region RNG differs per TP rank (megatron's tracker).
    seed = parallel.seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:  # pragma: no cover - numpy ships with torch
        pass
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)

    info = RuntimeInfo(
        rank=dist.get_rank(),
        world_size=world_size,
        local_rank=local_rank,
        tp=parallel.tp,
        pp=parallel.pp,
        dp=dp,
        cp=parallel.cp,
        device=torch.device("cuda", local_rank) if cuda else torch.device("cpu"),
        backend=backend,
    )
    if info.rank == 0:
        log.info("runtime: %s", info)
        log_kernel_report()
    return info


def destroy_runtime() -> None:
    from megatron.core import parallel_state

    from megatron_oar.runtime.roles import forget_roles

    forget_roles()  # rollout.placement=separate: every rank of both roles, then the groups go

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
    # child processes must not inherit a one-process world's rendezvous (its port may be reused)
    for name in _SET_BY_US:
        os.environ.pop(name, None)
    _SET_BY_US.clear()


def on_rank0(work: Callable[[], T], *, timeout_minutes: float, setting: str, what: str) -> T | None:
    """Collective: rank 0 runs ``work()`` alone while the other ranks wait for it on a gloo group
    of their own whose timeout is ``timeout_minutes`` (``setting``: the key that sets it), not
    at a barrier of the default group, whose timeout (``parallel.timeout_minutes``, after which
    NCCL ends the process) is sized for collectives, not for rank 0 converting a 72B model.

    ``work`` failing on rank 0 raises on every rank; rank 0 taking longer than the timeout
    raises a ``TimeoutError`` naming ``setting`` on every rank. Returns ``work()``'s result on
    rank 0, None on the others."""
    return on_one_rank(work, src=0, timeout_minutes=timeout_minutes, setting=setting, what=what)


def on_one_rank(work: Callable[[], T], *, src: int, timeout_minutes: float, setting: str, what: str) -> T | None:
    """:func:`on_rank0` for rank ``src`` (the same on every rank) doing the work."""
    group = gloo_group(timeout_minutes=timeout_minutes)
    rank, t0 = dist.get_rank(), time.monotonic()
    late = (f"{what} on rank {src} took longer than {setting}={timeout_minutes:g} minutes; raise "
            "it for a model this size (the other ranks wait that long on a gloo group)")
    try:
        result, error, outcome = None, None, [None]  # outcome: rank src's error, as text
        if rank == src:
            try:
                result = work()
            except Exception as e:  # noqa: BLE001 - told to the other ranks, then raised here
                error, outcome = e, [f"{type(e).__name__}: {e}"]
            if time.monotonic() - t0 >= 60 * timeout_minutes:  # the others have given up
                raise TimeoutError(late) from error
        try:
            dist.broadcast_object_list(outcome, src=src, group=group)
        except RuntimeError as e:  # gloo's timeout, or a peer that died
            if time.monotonic() - t0 >= 60 * timeout_minutes:
                raise TimeoutError(f"rank {rank}: {late}") from e
            raise RuntimeError(f"rank {rank}: waiting for rank {src} ({what}) failed: {e}") from e
        if error is not None:
            raise error
        if outcome[0] is not None:
            raise RuntimeError(f"{what} failed on rank {src}: {outcome[0]}")
        return result
    finally:
        dist.destroy_process_group(group)
