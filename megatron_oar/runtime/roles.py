"""The separate placement's world split (``rollout.placement=separate``): training ranks and
rollout ranks, each role with its own default process group, and the groups that span both.

torchrun starts one world of ``N`` processes. Megatron's ``parallel_state`` and vLLM's
``external_launcher`` both lay their groups out over *the default process group* (and create
them with collective ``new_group`` calls over it), so each role gets a default group of its own:

* ranks ``[0, N - R)`` train: their default group is the training world (megatron's TP/PP/DP
  over it, as colocated over the whole world), rank 0 of it is the world's rank 0 (logging);
* ranks ``[N - R, N)`` (``R = rollout.ranks``) roll out: their default group is the rollout
  world, vLLM's external launcher lays out ``ExternalDP x rollout.tp`` over it.

``RANK`` / ``WORLD_SIZE`` are set to the role's rank and size (vLLM and ``init_runtime`` read
them); ``OAR_GLOBAL_RANK`` / ``OAR_GLOBAL_WORLD_SIZE`` keep torchrun's. The groups spanning both
roles are built from the same rendezvous store (torch's ``env://``, torchrun's agent store where
there is one), under their own key prefixes, as process-group objects used directly rather than
registered with ``torch.distributed`` (a registered group is made by a collective over the
caller's default group, which the other role does not share):

* ``weights``: training rank 0 and every rollout rank; the trainer's requests (gloo), and at
  PP 1 the weight broadcast (``weights_device``: nccl on CUDA, gloo on CPU);
* ``senders[s]``: pipeline stage ``s``'s first training rank and every rollout rank (stage 0's:
  the ``weights`` group): each stage sends its own share of the weights
  (``rollout/stage_send.py``; ``senders_device[s]`` the bytes);
* ``results``: rollout rank 0 and training rank 0; finished batches (gloo);
* ``everyone``: all ranks (gloo), for the start and end of the run.

Waiting for the other role is not bounded by a collective timeout: a trainer converting a
checkpoint, loading a large policy or exporting it, a long step at ``max_staleness=0`` or a long
generation may take hours while the other role waits. The gloo groups spanning the roles are
made with :data:`CROSS_TIMEOUT` (a week), and every wait on them polls instead: each process
beats a counter in the rendezvous store every ``heartbeat_s`` seconds (:class:`Heartbeat`, a
daemon thread), and a wait raises :class:`PeerLost` once a member's counter has not moved for
``stale_s`` seconds (a process that died closes its sockets, and gloo fails the wait at once;
the heartbeat finds what does not close them: a lost node, a stopped process). A rank that is
alive but stuck is the training ranks' phase watchdog's (``train.phase_timeout_s``). The NCCL
``weights`` group carries ``parallel.timeout_minutes``: its broadcasts are posted only once
both sides are in the sync (the bucket's header came over gloo).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field, replace
from datetime import timedelta

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

TRAIN, ROLLOUT = "train", "rollout"
# the tests' check of NCCL's rules (``testing/nccl_rules.py``) on a group that is NCCL on a GPU:
# called with (what, tensors) before each of its collectives; None in runs
DEVICE_GROUP_CHECK = None

CROSS_TIMEOUT = timedelta(days=7)  # the cross-role gloo groups' own: liveness is the heartbeat's
HEARTBEAT_S = 5.0  # how often each process beats
STALE_S = 120.0    # a member whose beat has not moved for this long is lost
HEARTBEAT_KEY = "oar/alive/"  # + global rank: a counter in the rendezvous store


class PeerLost(RuntimeError):
    """A member of a cross-role group stopped beating (``stale_s``) while this process waited."""


class Heartbeat:
    """Beats this process's counter in ``store`` every ``period`` seconds (a daemon thread), and
    tells when another process's counter stopped moving (``stale_s``, measured here: no clocks
    compared across hosts)."""

    def __init__(self, store, rank: int, *, period: float = HEARTBEAT_S, stale_s: float = STALE_S):
        self.store, self.rank, self.period, self.stale_s = store, rank, period, stale_s
        # a client connection of its own: a TCPStore client serialises its operations, and the
        # main thread may block in a store wait (a group being made) for longer than stale_s
        self._beat_store = store.clone() if hasattr(store, "clone") else store
        self._seen: dict[int, tuple[int, float]] = {}  # rank -> (its counter, when it last moved)
        self.lost: str | None = None  # set once a member was found lost (its operations are stuck)
        self._stop = threading.Event()
        self.beat()
        self._thread = threading.Thread(target=self._run, name="oar-heartbeat", daemon=True)
        self._thread.start()

    def beat(self) -> None:
        self._beat_store.add(f"{HEARTBEAT_KEY}{self.rank}", 1)

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            try:
                self.beat()
            except Exception as e:  # the store's host is gone: the run is over; the waits find it
                log.warning("separate placement: heartbeat stopped (%s)", e)
                return

    def check(self, ranks, doing: str = "waiting") -> None:
        """Raises :class:`PeerLost` naming the first of ``ranks`` (global) whose counter has not
        moved for ``stale_s`` seconds since this process first looked."""
        now = time.monotonic()
        for r in ranks:
            if r == self.rank:
                continue
            count = self.store.add(f"{HEARTBEAT_KEY}{r}", 0)
            last = self._seen.get(r)
            if last is None or last[0] != count:
                self._seen[r] = (count, now)
            elif now - last[1] > self.stale_s:
                self.lost = (f"global rank {r} has not beaten for {now - last[1]:.0f} s (its process "
                             f"is stopped or its host is unreachable) while this rank was {doing}")
                raise PeerLost(self.lost)

    def close(self) -> None:
        self._stop.set()


@dataclass
class CrossGroup:
    """A process group over some global ranks, used through its own methods; ``rank`` is this
    process's rank in it, ``members`` the global ranks in its order."""

    pg: object
    rank: int
    members: tuple[int, ...]
    heartbeat: Heartbeat | None = None  # None: wait as the group's timeout allows (nccl)
    nccl: bool = False  # NCCL where CUDA is (the ``weights_device`` group; on CPU gloo's twin of ``weights``)

    @property
    def size(self) -> int:
        return len(self.members)

    def wait(self, work, doing: str = "waiting for the other role") -> None:
        """``work`` done (raises its error); while it is not, the members' heartbeats are
        checked every beat period (:class:`PeerLost`). Polled with a back-off from 1 ms, so a
        quick operation costs about what ``work.wait()`` does."""
        if self.heartbeat is None:
            work.wait()
            return
        pause, next_check = 0.001, time.monotonic() + self.heartbeat.period
        while not work.is_completed():
            time.sleep(pause)
            pause = min(pause * 2, 0.1)
            if time.monotonic() >= next_check:
                self.heartbeat.check(self.members, doing)
                next_check = time.monotonic() + self.heartbeat.period
        work.wait()

    def broadcast(self, tensor: torch.Tensor, root: int, *, wait: bool = True):
        """``tensor`` from member ``root`` (its rank in this group) to every member; returns the
        work when ``wait`` is false (keep ``tensor`` alive until it completes)."""
        if self.nccl and DEVICE_GROUP_CHECK is not None:
            DEVICE_GROUP_CHECK("CrossGroup.broadcast (weights_device)", [tensor])
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = root, 0
        work = self.pg.broadcast([tensor], opts)
        if wait:
            self.wait(work)
            return None
        return work

    def barrier(self) -> None:
        flag = torch.zeros(1)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        self.wait(self.pg.allreduce([flag], opts))

    def all_max(self, value: float) -> float:
        t = torch.tensor([float(value)])
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MAX
        self.wait(self.pg.allreduce([t], opts))
        return float(t.item())


@dataclass
class Roles:
    """This process's role in the separate placement and the groups spanning the roles."""

    role: str
    global_rank: int
    global_size: int
    rollout_ranks: int
    weights: CrossGroup | None = None   # training rank 0 + the rollout ranks (gloo)
    weights_device: CrossGroup | None = None  # the same ranks on nccl (CUDA), else ``weights``
    # per pipeline stage: its first training rank (member 0, the sender) + the rollout ranks, for
    # its share of the weights: headers (gloo) and bytes (nccl on CUDA); stage 0's are
    # ``weights`` / ``weights_device``; None where this process is not a member
    senders: tuple = ()
    senders_device: tuple = ()
    stage_senders: tuple[int, ...] = (0,)  # global ranks: pipeline stage s's first training rank
    results: CrossGroup | None = None   # rollout rank 0 + training rank 0 (gloo)
    everyone: CrossGroup | None = None  # all ranks (gloo)
    store: object = field(default=None, repr=False)
    heartbeat: Heartbeat | None = field(default=None, repr=False)

    @property
    def train_size(self) -> int:
        return self.global_size - self.rollout_ranks

    @property
    def role_rank(self) -> int:
        return self.global_rank if self.role == TRAIN else self.global_rank - self.train_size

    @property
    def is_trainer_leader(self) -> bool:
        return self.global_rank == 0

    @property
    def is_rollout_leader(self) -> bool:
        return self.global_rank == self.train_size

    def close(self) -> None:
        """Collective over every rank: waits for all (so the store's host, global rank 0, is the
        last to go), then drops the cross-role groups. After a member was lost (its heartbeat
        stopped), the groups' operations with it are stuck in gloo's threads, which cannot be
        cancelled and which a group's destructor would join: those groups are left to the
        process's exit instead."""
        lost = self.heartbeat is not None and self.heartbeat.lost
        if self.everyone is not None and not lost:
            try:
                self.everyone.barrier()
            except RuntimeError as e:  # a rank died (the run already failed): nothing to wait for
                log.warning("separate placement: not every rank reached the end (%s)", e)
        if self.heartbeat is not None and self.heartbeat.lost:
            log.warning("separate placement: leaving the groups across the roles to the process's exit "
                        "(%s)", self.heartbeat.lost)
            groups = [getattr(self, n) for n in ("weights", "weights_device", "results", "everyone")]
            for group in [*groups, *self.senders, *self.senders_device]:
                if group is not None:
                    _abandon(group.pg)
        for name in ("weights", "weights_device", "results", "everyone"):
            setattr(self, name, None)
        if self.heartbeat is not None:
            self.heartbeat.close()
            self.heartbeat = None
        self.senders = self.senders_device = ()
        self.store = None


_ROLES: Roles | None = None
_ABANDONED: list = []


def _abandon(pg) -> None:
    """Never destroys ``pg`` (its destructor would wait for an operation with a lost member):
    one reference more than anything will release."""
    import ctypes

    if not any(p is pg for p in _ABANDONED):
        _ABANDONED.append(pg)
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(pg))


def current_roles() -> Roles | None:
    """The split made by :func:`split_world` in this process (None: colocated / not split)."""
    return _ROLES


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "")
    return int(value) if value else default


def stage_senders(train_size: int, pp: int) -> tuple[int, ...]:
    """Each pipeline stage's first training rank (TP, DP, EP rank 0 of the stage) in megatron's
    rank order (``tp-cp-ep-dp-pp``: the pipeline dimension outermost, stage ``s`` holds training
    ranks ``[s * n, (s + 1) * n)``, ``n = train_size / pp``)."""
    if pp < 1 or train_size % pp:
        raise ValueError(f"parallel.pp={pp} does not divide the {train_size} training ranks")
    return tuple(s * (train_size // pp) for s in range(pp))


def split_world(rollout_ranks: int, *, timeout_minutes: float = 30, pipeline_stages: int = 1,
                heartbeat_s: float = HEARTBEAT_S, stale_s: float = STALE_S) -> Roles:
    """Collective over torchrun's whole world: this process joins its role's default process
    group and the groups spanning the roles (module docstring). Idempotent per process.
    ``pipeline_stages``: the training ranks' ``parallel.pp`` (each stage's first rank sends its
    share of the weights). ``timeout_minutes``: the roles' own groups and the NCCL ``weights``
    groups; waits across the roles end on a lost member (``heartbeat_s``, ``stale_s``:
    :class:`Heartbeat`) instead."""
    global _ROLES
    if _ROLES is not None:
        return _ROLES
    if dist.is_initialized():
        raise RuntimeError("rollout.placement=separate: the world must be split before "
                           "torch.distributed is initialised (split_world before init_runtime)")
    rank = _env_int("OAR_GLOBAL_RANK", _env_int("RANK", 0))
    size = _env_int("OAR_GLOBAL_WORLD_SIZE", _env_int("WORLD_SIZE", 1))
    if not 1 <= rollout_ranks < size:
        raise ValueError(f"rollout.ranks={rollout_ranks}: the world of {size} ranks needs at least "
                         "one training rank and one rollout rank")
    timeout = timedelta(minutes=timeout_minutes)
    store, _, _ = next(dist.rendezvous("env://", rank=rank, world_size=size, timeout=timeout))
    train_size = size - rollout_ranks
    role = TRAIN if rank < train_size else ROLLOUT
    role_rank, role_size = (rank, train_size) if role == TRAIN else (rank - train_size, rollout_ranks)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(_env_int("LOCAL_RANK", 0))
    dist.init_process_group("nccl" if cuda else "gloo", store=dist.PrefixStore(f"oar/{role}/", store),
                            rank=role_rank, world_size=role_size, timeout=timeout)
    os.environ.update(OAR_GLOBAL_RANK=str(rank), OAR_GLOBAL_WORLD_SIZE=str(size),
                      RANK=str(role_rank), WORLD_SIZE=str(role_size))
    roles = Roles(role=role, global_rank=rank, global_size=size, rollout_ranks=rollout_ranks, store=store,
                  heartbeat=Heartbeat(store, rank, period=heartbeat_s, stale_s=stale_s))

    def group(name: str, members: list[int], backend: str = "gloo") -> CrossGroup | None:
        return cross_group(store, name, members, rank, backend=backend, timeout=timeout,
                           heartbeat=roles.heartbeat)

    roles.everyone = group("everyone", list(range(size)))
    roles.weights = group("weights", [0, *range(train_size, size)])
    roles.weights_device = group("weights_nccl", [0, *range(train_size, size)], "nccl") if cuda \
        else None if roles.weights is None else replace(roles.weights, nccl=True)  # gloo's, checked as NCCL
    roles.stage_senders = stage_senders(train_size, pipeline_stages)
    senders, senders_device = [roles.weights], [roles.weights_device]
    for s, first in enumerate(roles.stage_senders[1:], 1):
        members = [first, *range(train_size, size)]
        senders.append(group(f"stage{s}", members))
        senders_device.append(group(f"stage{s}_nccl", members, "nccl") if cuda
                              else None if senders[-1] is None else replace(senders[-1], nccl=True))
    roles.senders, roles.senders_device = tuple(senders), tuple(senders_device)
    roles.results = group("results", [train_size, 0])
    roles.everyone.barrier()  # every group exists on every member before anyone uses one
    _ROLES = roles
    return roles


def cross_group(store, name: str, members: list[int], rank: int, *, backend: str = "gloo",
                timeout: timedelta, heartbeat: Heartbeat | None = None) -> CrossGroup | None:
    """The group ``name`` over the global ranks ``members`` (None where ``rank`` is not one):
    gloo with :data:`CROSS_TIMEOUT` and ``heartbeat`` watching its waits, or nccl with
    ``timeout`` (its broadcasts run only inside a sync both sides are in)."""
    if rank not in members:
        return None
    prefixed = dist.PrefixStore(f"oar/cross/{name}/", store)
    index = members.index(rank)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return CrossGroup(dist.ProcessGroupNCCL(prefixed, index, len(members), options), index, tuple(members),
                          nccl=True)
    pg = dist.ProcessGroupGloo(prefixed, index, len(members), CROSS_TIMEOUT)
    return CrossGroup(pg, index, tuple(members), heartbeat)


def forget_roles() -> None:
    """Drops this process's split (after ``destroy_runtime``; the worlds' teardown)."""
    global _ROLES
    if _ROLES is not None:
        _ROLES.close()
    _ROLES = None
    for name, global_name in (("RANK", "OAR_GLOBAL_RANK"), ("WORLD_SIZE", "OAR_GLOBAL_WORLD_SIZE")):
        if global_name in os.environ:
            os.environ[name] = os.environ.pop(global_name)
