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
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field, replace
from datetime import timedelta

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

TRAIN, ROLLOUT = "train", "rollout"
# the tests' check of NCCL's rules (``testing/nccl_rules.py``) on a group that is NCCL on a GPU:
# called with (what, tensors) before each of its collectives; None in runs
DEVICE_GROUP_CHECK = None


@dataclass
class CrossGroup:
    """A process group over some global ranks, used through its own methods; ``rank`` is this
    process's rank in it, ``members`` the global ranks in its order."""

    pg: object
    rank: int
    members: tuple[int, ...]
    nccl: bool = False  # NCCL where CUDA is (the ``weights_device`` group; on CPU gloo's twin of ``weights``)

    @property
    def size(self) -> int:
        return len(self.members)

    def broadcast(self, tensor: torch.Tensor, root: int, *, wait: bool = True):
        """``tensor`` from member ``root`` (its rank in this group) to every member; returns the
        work when ``wait`` is false (keep ``tensor`` alive until it completes)."""
        if self.nccl and DEVICE_GROUP_CHECK is not None:
            DEVICE_GROUP_CHECK("CrossGroup.broadcast (weights_device)", [tensor])
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = root, 0
        work = self.pg.broadcast([tensor], opts)
        if wait:
            work.wait()
            return None
        return work

    def barrier(self) -> None:
        flag = torch.zeros(1)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        self.pg.allreduce([flag], opts).wait()

    def all_max(self, value: float) -> float:
        t = torch.tensor([float(value)])
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MAX
        self.pg.allreduce([t], opts).wait()
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
        last to go), then drops the cross-role groups."""
        if self.everyone is not None:
            try:
                self.everyone.barrier()
            except RuntimeError as e:  # a rank died (the run already failed): nothing to wait for
                log.warning("separate placement: not every rank reached the end (%s)", e)
        for name in ("weights", "weights_device", "results", "everyone"):
            setattr(self, name, None)
        self.senders = self.senders_device = ()
        self.store = None


_ROLES: Roles | None = None


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


def split_world(rollout_ranks: int, *, timeout_minutes: float = 30, pipeline_stages: int = 1) -> Roles:
    """Collective over torchrun's whole world: this process joins its role's default process
    group and the groups spanning the roles (module docstring). ``pipeline_stages``: the
    training ranks' ``parallel.pp`` (each stage's first rank sends its share of the weights).
    Idempotent per process."""
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
    roles = Roles(role=role, global_rank=rank, global_size=size, rollout_ranks=rollout_ranks, store=store)

    def group(name: str, members: list[int], backend: str = "gloo") -> CrossGroup | None:
        if rank not in members:
            return None
        prefixed = dist.PrefixStore(f"oar/cross/{name}/", store)
        index = members.index(rank)
        if backend == "nccl":
            pg = dist.ProcessGroupNCCL(prefixed, index, len(members))
        else:
            pg = dist.ProcessGroupGloo(prefixed, index, len(members), timeout)
        return CrossGroup(pg, index, tuple(members), nccl=backend == "nccl")

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


def forget_roles() -> None:
    """Drops this process's split (after ``destroy_runtime``; the worlds' teardown)."""
    global _ROLES
    if _ROLES is not None:
        _ROLES.close()
    _ROLES = None
    for name, global_name in (("RANK", "OAR_GLOBAL_RANK"), ("WORLD_SIZE", "OAR_GLOBAL_WORLD_SIZE")):
        if global_name in os.environ:
            os.environ[name] = os.environ.pop(global_name)
