"""The separate placement (``rollout.placement=separate``): vLLM engines on rollout ranks of
their own, the trainer talking to them through :class:`RemoteRollout`.

The rollout ranks run :class:`RolloutServer`: their :class:`~megatron_oar.rollout.RolloutEngine`
stays awake for the whole run and executes the trainer's requests in the order training rank 0
sent them (``runtime/roles.py``'s ``weights`` group):

* ``sync``: receive the policy's HF-layout buckets (``rollout/transfer.py``) into vLLM and take
  their policy version;
* ``generate``: each rollout group generates its share of the prompts (in segments, with
  ``rollout.partial_tokens``: ``rollout/partial.py``), the groups' batches are joined, and
  rollout rank 0 sends the batch, tagged with the policy version it came from
  (``batch.meta["policy_version"]``, and each token's, ``["token_versions"]``, in segments), to
  training rank 0 (the ``results`` group) without waiting for it to be read (each result's
  send stays posted until the trainer reads it, so up to ``max_staleness`` of them are in
  flight while the rollout ranks go on to the next request: a sync in between never waits for
  a read);
* ``stop``.

Rollout ranks outlive a stop signal (SIGTERM / SIGUSR1, which torchrun forwards to every
worker): they log it and serve on, for the training ranks checkpoint first (reading the results
in flight) and then send ``stop``. A checkpoint and the shutdown survive rollout ranks that are
already gone: the checkpoint keeps the results read so far, and the shutdown logs the loss.

On the training ranks :class:`RemoteRollout` stands in for the engine (``generate``, ``gather``,
``sync_weights``, ``sleep``/``wake_up`` as no-ops), so the trainer's loop is the colocated one.
:meth:`RemoteRollout.prefetch` sends a request without waiting for its result; a later
``generate`` with the same arguments takes that result. With ``rollout.max_staleness`` = k the
trainer prefetches the first round of the next k steps right after its own generation (the
rollout ranks then generate them while the trainer trains, from the weights they hold: up to k
updates old), and at ``max_staleness=0`` it prefetches nothing, so every step generates from the
weights it trains, as colocated.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import time
from collections.abc import Iterator
from dataclasses import replace

import torch
import torch.distributed as dist

from megatron_oar.rollout.batch import share
from megatron_oar.rollout.engine import SyncStats
from megatron_oar.rollout.stage_send import recv_stages, send_stage, sum_counts
from megatron_oar.rollout.sync_check import WeightSyncError
from megatron_oar.rollout.transfer import recv_object, send_object
from megatron_oar.runtime.roles import CROSS_TIMEOUT, Roles
from megatron_oar.runtime.stop_signals import STOP_SIGNALS, helpers_shielded, start_resource_tracker_shielded
from megatron_oar.testing import faults

log = logging.getLogger(__name__)

# the store's count of weight syncs training rank 0 has announced (partial rollouts compare it,
# between two segments, with the loads done)
SYNCS_ANNOUNCED = "oar/syncs_announced"


# in a checkpoint of the separate placement: the rollouts generated ahead of it, not trained on yet
AHEAD_FILE = "rollouts_ahead.pt"

TRAINER, ROLLOUT_LEADER = 0, 1  # members of the `weights` group: training rank 0, rollout rank 0
RESULTS_SENDER = 0  # the `results` group: [rollout rank 0, training rank 0]


class RolloutRankError(RuntimeError):
    """A rollout rank of the separate placement died, stopped beating (``runtime/roles.py``'s
    heartbeat: a lost host), or broke the protocol; raised on every training rank. One alive
    but stuck is the phase watchdog's (``train.phase_timeout_s``)."""


class RolloutServer:
    """The rollout ranks' loop (collective over the rollout world)."""

    def __init__(self, engine, roles: Roles):
        self.engine, self.roles = engine, roles
        self.version: int | None = None
        self.served = 0  # generation requests so far
        self.syncs = 0  # weight loads so far (against the store's SYNCS_ANNOUNCED)
        self._queued: list[dict] = []  # requests read while looking for a sync (partial rollouts)
        self._pending: list = []  # batches sent, until training rank 0 has read them
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
            else torch.device("cpu")

    def serve(self) -> None:
        """Executes requests until ``stop``; a failed weight load stops it (raised here, told to
        the trainer first)."""
        w = self.roles.weights
        while True:
            request = self._queued.pop(0) if self._queued else recv_object(w, TRAINER)
            kind = request["kind"]
            if kind == "stop":
                break
            if kind == "sync":
                self._sync(request)
            elif kind == "generate":
                self._generate(request)
            else:  # pragma: no cover - a newer trainer
                raise RuntimeError(f"unknown rollout request {kind!r}")
        for pending in self._pending:  # the trainer read them all before its stop
            pending.wait()
        self._pending = []

    def _sync(self, request: dict) -> None:
        end: dict = {}
        error = None
        try:
            self.engine.load_buckets(recv_stages(self.roles, self.device, end), step=request.get("step"))
        except WeightSyncError as e:
            error = e
        failed = self.roles.weights.all_max(0.0 if error is None else 1.0)
        if failed and self.roles.is_rollout_leader:
            send_object(self.roles.weights, str(error) if error else "a rollout rank failed", ROLLOUT_LEADER)
        if error is not None:
            raise error
        if failed:
            raise WeightSyncError("weight load failed on another rollout rank")
        self.version = None if int(end["version"]) < 0 else int(end["version"])  # -1: not given
        self.syncs += 1

    def _at_boundary(self) -> int | None:
        """Between two segments of a partial rollout: when the trainer has announced its next
        sync (``SYNCS_ANNOUNCED`` past the loads done; any rollout rank seeing it counts, so all
        agree), reads the requests queued before it, loads the weights and returns their
        version; else None."""
        seen = self.roles.store.add(SYNCS_ANNOUNCED, 0) > self.syncs
        if not self.engine_world_max(float(seen)):
            return None
        while True:
            request = recv_object(self.roles.weights, TRAINER)
            if request["kind"] == "sync":
                self._sync(request)
                return self.version
            self._queued.append(request)  # a later generation (or stop): after this one

    def engine_world_max(self, value: float) -> float:
        t = torch.tensor([value])
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.engine._world_gloo)
        return float(t.item())

    def _generate(self, request: dict) -> None:
        engine = self.engine
        self.served += 1
        faults.inject("rollout.generate", step=self.served)
        prompts, seeds = request["prompt_ids"], request["seeds"]
        mine = share(engine.dp_rank, engine.dp_size, len(prompts))
        t0 = time.perf_counter()
        ids, own_seeds = [prompts[i] for i in mine], [seeds[i] for i in mine]
        versions, start_version = None, self.version
        if request.get("partial_tokens"):  # the trainer's rollout.partial_tokens
            from megatron_oar.rollout.partial import generate_in_segments

            def at_boundary():  # fault point for tests: the step the batch is for (prefetched)
                faults.inject("rollout.segment", step=request.get("step"))
                return self._at_boundary()

            batch, versions = generate_in_segments(engine, ids, own_seeds, request["sampling"],
                                                   segment_tokens=request["partial_tokens"], version=self.version,
                                                   at_boundary=at_boundary)
        else:
            batch = engine.generate(ids, seeds=own_seeds, **request["sampling"])
        batch = engine.gather(batch)
        if versions is not None:  # every rollout group's, in group order (as the batches)
            parts: list = [None] * engine.world_size
            dist.all_gather_object(parts, versions if engine.is_group_leader else None, group=engine._world_gloo)
            batch.meta["token_versions"] = [v for part in parts if part is not None for v in part]
        batch.gen_seconds = time.perf_counter() - t0
        batch.meta["policy_version"] = start_version  # partial rollouts: the oldest of its tokens
        batch.meta["request"] = request["id"]
        if self.roles.is_rollout_leader:
            # not waiting for the earlier results to be read: at max_staleness >= 2 the trainer
            # reads them only after its next sync, which needs this rank to receive it
            self._pending = [p for p in self._pending if not p.done()]
            self._pending.append(send_object(self.roles.results, batch, RESULTS_SENDER, wait=False))


@contextlib.contextmanager
def outliving_stop_signals() -> Iterator[None]:
    """A rollout rank's :data:`STOP_SIGNALS` only logged in the block: torchrun forwards the
    launcher's SIGTERM to every worker, and the rollout ranks must live until the training ranks
    have checkpointed (reading the rollouts in flight) and sent ``stop``."""
    def note(signum, frame):
        log.warning("rollout rank: received %s; serving on until the training ranks have checkpointed "
                    "and stop this rank", signal.Signals(signum).name)

    previous = {}
    try:
        for sig in STOP_SIGNALS:
            previous[sig] = signal.signal(sig, note)
    except ValueError:  # not the main thread (a test's)
        log.warning("rollout rank: stop signals not handled (not the main thread)")
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def serve_rollouts(cfg, roles: Roles) -> None:
    """A rollout rank's whole run: its engine, awake (``sleep_level`` 0), serving the trainer
    until it sends ``stop`` (stop signals only logged: :func:`outliving_stop_signals`)."""
    from megatron_oar.rollout import RolloutEngine

    # the engine's world is the rollout world, all of it generating (placement-wise "colocated")
    own = replace(cfg.rollout, sleep_level=0, placement="colocated", ranks=0, max_staleness=0,
                  partial_tokens=None)
    with outliving_stop_signals():
        start_resource_tracker_shielded()  # as a training rank's helpers: they outlive the signal too
        with helpers_shielded():  # a signal while vLLM starts: pending until the handler can log it
            engine = RolloutEngine(cfg.model.hf_dir(), own, tokenizer=cfg.model.tokenizer_dir())
        try:
            RolloutServer(engine, roles).serve()
        finally:
            engine.shutdown()


class RemoteRollout:
    """The training ranks' handle on the rollout ranks, with the engine's interface (collective
    over the training world: every training rank makes the same calls; training rank 0 talks
    to the rollout ranks and shares the results)."""

    sleep_supported = False
    is_sleeping = False
    dp_rank, dp_size = 0, 1  # the trainer asks for every prompt; the rollout ranks split them
    is_group_leader = True

    def __init__(self, cfg, roles: Roles, arch):
        self.config, self.roles, self.arch = cfg.rollout, roles, arch
        self.tp = cfg.rollout.tp
        self.rank = dist.get_rank()
        # the training world, for sharing results: its ranks wait on it while training rank 0
        # waits for the rollout ranks (a generation may be long), so not with the collective
        # timeout; training rank 0's waits find a lost rollout rank (roles.py's heartbeat)
        self._control = dist.new_group(backend="gloo", timeout=CROSS_TIMEOUT)
        self._requests = 0
        self._outstanding: list[tuple[int, tuple]] = []  # sent, result not read: (id, key)
        self._stash: dict[tuple, object] = {}  # results read before they were asked for
        self.synced_version: int | None = None
        self._synced_model = None  # the model the rollout ranks hold synced_version of
        self.syncs = {"sent": 0, "skipped": 0}  # sync_weights calls: broadcast, or already held
        self._closed = False
        self._lost_error: str | None = None  # the rollout ranks were lost (RolloutRankError)
        self._timing = {"generation": 0.0, "wait": 0.0}  # since the last take_timing()

    # -- the engine's interface -------------------------------------------------------------

    def sleep(self) -> None:
        """Rollout engines on their own ranks never sleep."""

    def wake_up(self, tags=None) -> None:
        """Rollout engines on their own ranks never sleep."""

    def gather(self, batch):
        return batch  # already every rollout group's, on every training rank

    def _request(self, prompt_ids, n, temperature, top_p, top_k, max_new_tokens, stop, stop_token_ids,
                 seeds) -> dict:
        c = self.config
        sampling = dict(n=c.n if n is None else n, temperature=c.temperature if temperature is None else temperature,
                        top_p=c.top_p if top_p is None else top_p, top_k=c.top_k if top_k is None else top_k,
                        max_new_tokens=c.max_new_tokens if max_new_tokens is None else max_new_tokens,
                        stop=list(c.stop if stop is None else stop),
                        stop_token_ids=list(c.stop_token_ids if stop_token_ids is None else stop_token_ids))
        if seeds is None or any(s is None for s in seeds):
            raise ValueError("rollout.placement=separate: every prompt needs an explicit seed")
        return {"kind": "generate", "prompt_ids": [[int(t) for t in p] for p in prompt_ids],
                "seeds": [int(s) for s in seeds], "sampling": sampling,
                "partial_tokens": c.partial_tokens}

    @staticmethod
    def _key(request: dict) -> tuple:
        s = request["sampling"]
        return (tuple(map(tuple, request["prompt_ids"])), tuple(request["seeds"]),
                tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in sorted(s.items())))

    def _check_open(self) -> None:
        if self._lost_error is not None:
            raise RolloutRankError(self._lost_error)

    def _send(self, request: dict) -> tuple:
        self._check_open()
        request = {**request, "id": self._requests}
        self._requests += 1
        key = self._key(request)
        error = None
        if self.rank == 0:
            try:
                send_object(self.roles.weights, request, TRAINER)
            except RuntimeError as e:
                error = self._lost(e, "sending a generation request")
        self._raise_everywhere(error)
        self._outstanding.append((request["id"], key))
        return key

    def _lost(self, error: Exception, doing: str) -> str:
        r = self.roles
        return (f"the rollout ranks (global ranks {r.train_size}-{r.global_size - 1}, "
                f"rollout.placement=separate) stopped answering while {doing}: {type(error).__name__}: "
                f"{error}. A rollout rank died, stopped beating (a lost host), or failed; the run "
                "stops as for a failed training rank (torchrun restarts it from the last checkpoint "
                "where launch.max_restarts allows)")

    def _raise_everywhere(self, error: str | None) -> None:
        """Collective over the training world: training rank 0's ``error`` raised on every rank."""
        box = [error]
        dist.broadcast_object_list(box, src=0, group=self._control)
        if box[0] is not None:
            self._lost_error = box[0]  # nothing more to say to the rollout ranks
            raise RolloutRankError(box[0])

    def prefetch(self, prompt_ids, *, n=None, temperature=None, top_p=None, top_k=None, max_new_tokens=None,
                 stop=None, stop_token_ids=None, seeds=None, step: int | None = None) -> None:
        """Send a generation request now; a later :meth:`generate` with the same arguments takes
        its result (generated from whatever weights the rollout ranks hold when they reach it).
        ``step``: the training step it is for (logs and fault injection)."""
        request = self._request(prompt_ids, n, temperature, top_p, top_k, max_new_tokens, stop, stop_token_ids, seeds)
        key = self._key(request)
        if key in self._stash or any(k == key for _, k in self._outstanding):
            return
        self._send({**request, "step": step})

    def generate(self, prompt_ids, *, n=None, temperature=None, top_p=None, top_k=None, max_new_tokens=None,
                 stop=None, stop_token_ids=None, seeds=None):
        """The rollout ranks' completions (a :class:`RolloutBatch` with
        ``meta["policy_version"]``), on every training rank."""
        request = self._request(prompt_ids, n, temperature, top_p, top_k, max_new_tokens, stop, stop_token_ids, seeds)
        key = self._key(request)
        t0 = time.perf_counter()
        if key not in self._stash and not any(k == key for _, k in self._outstanding):
            self._send(request)
        while key not in self._stash:
            self._receive_next()
        batch = self._stash.pop(key)
        self._timing["wait"] += time.perf_counter() - t0
        self._timing["generation"] += batch.gen_seconds
        return batch

    def results_ahead(self) -> list[tuple[tuple, object]]:
        """Collective over the training world: waits for every request in flight and returns the
        results not handed out yet, ``(key, batch)`` in request order. A checkpoint keeps them
        (:data:`AHEAD_FILE`) so that a resumed run trains the next steps on the samples this run
        would have: at ``rollout.max_staleness`` >= 1 they were generated from weights older than
        the checkpoint's, which the resumed run no longer has.

        Rollout ranks that are gone (or go while it waits) do not fail the checkpoint: it keeps
        the results read so far, and a resumed run generates the rest from its own weights."""
        try:
            while self._outstanding and self._lost_error is None:
                self._receive_next()
        except RolloutRankError as e:
            if self.rank == 0:
                log.warning("checkpointing without the %d rollout(s) still in flight: %s",
                            len(self._outstanding), e)
        if self._lost_error is not None:
            self._outstanding.clear()
        return list(self._stash.items())

    def restore_ahead(self, items: list[tuple[tuple, object]]) -> None:
        """The results a checkpoint kept (:meth:`results_ahead`): a later :meth:`generate` or
        :meth:`prefetch` with the same arguments takes them instead of asking the rollout ranks."""
        for key, batch in items:
            self._stash[tuple(key)] = batch

    def take_timing(self) -> dict[str, float]:
        """Since the last call: the rollout ranks' generation seconds for the batches handed out,
        the seconds the trainer waited on the rollout ranks (for results, and in weight syncs,
        which wait for the generation in flight to end and include the transfer), and the share
        of generation hidden behind training, ``1 - wait / generation`` (0 when the trainer
        waited throughout, as at ``max_staleness=0``)."""
        t, self._timing = self._timing, {"generation": 0.0, "wait": 0.0}
        hidden = max(0.0, 1.0 - t["wait"] / t["generation"]) if t["generation"] > 0 else 0.0
        return {"rollout/generation_seconds": t["generation"], "rollout/wait_seconds": t["wait"],
                "rollout/overlap": hidden}

    def _receive_next(self) -> None:
        """The oldest outstanding result, on every training rank."""
        rid, key = self._outstanding.pop(0)
        batch = error = None
        if self.rank == 0:
            try:
                batch = recv_object(self.roles.results, RESULTS_SENDER)
            except RuntimeError as e:
                error = self._lost(e, f"the trainer waited for the result of request {rid}")
            else:
                if batch.meta.get("request") != rid:
                    error = f"rollout result for request {batch.meta.get('request')}, expected {rid}"
        self._raise_everywhere(error)
        box = [batch]
        dist.broadcast_object_list(box, src=0, group=self._control)
        self._stash[key] = box[0]

    def sync_weights(self, model, *, step: int | None = None, version: int | None = None) -> SyncStats:
        """Collective over the training world: Megatron's weights, as full HF tensors in
        ``rollout.bucket_mb`` buckets, broadcast to every rollout rank by each pipeline stage's
        first rank for its stage (``rollout/stage_send.py``); they load them after the requests
        sent before. ``version``: the policy
        version (updates so far) the rollouts generated from these weights record. Raises
        ``WeightSyncError`` on every training rank when a rollout rank failed to load.

        The rollout ranks never sleep, so a sync of the ``version`` of ``model`` they already
        hold (an evaluation's, then the next step's, of the same weights) sends nothing and
        waits for nothing (``self.syncs["skipped"]``)."""
        t0 = time.perf_counter()
        if version is not None and version == self.synced_version and model is self._synced_model:
            self.syncs["skipped"] += 1
            return SyncStats(seconds=0.0, bytes=0, num_tensors=0, num_buckets=0, max_bucket_bytes=0)
        self._check_open()
        message = lost = None
        if self.rank == 0:
            try:
                self.roles.store.add(SYNCS_ANNOUNCED, 1)  # partial rollouts: take it at a boundary
                send_object(self.roles.weights, {"kind": "sync", "step": step, "id": None}, TRAINER)
            except RuntimeError as e:
                lost = self._lost(e, "the trainer sent the weights")
        # each pipeline stage's first rank sends its stage (rollout/stage_send.py); every rank
        # takes part in its stage's gathers, after a failure too
        mine, failed = send_stage(model, self.arch, self.roles, self.config.bucket_bytes,
                                  version=-1 if version is None else version)
        counts = sum_counts({**mine, "failed": int(failed is not None)}, self._control)
        if self.rank == 0 and lost is None:
            try:
                if counts["failed"]:
                    raise RuntimeError(failed or "a pipeline stage's sender lost the rollout ranks")
                if self.roles.weights.all_max(0.0):
                    message = recv_object(self.roles.weights, ROLLOUT_LEADER)
            except RuntimeError as e:
                lost = self._lost(e, "the trainer sent the weights")
        self._raise_everywhere(lost)
        box = [message]
        dist.broadcast_object_list(box, src=0, group=self._control)
        if box[0] is not None:
            raise WeightSyncError(f"separate placement: {box[0]}")
        self.synced_version, self._synced_model = version, model
        self.syncs["sent"] += 1
        # a sync waits for the generation in flight to end: counted as waiting (take_timing)
        self._timing["wait"] += time.perf_counter() - t0
        return SyncStats(seconds=time.perf_counter() - t0, bytes=counts["bytes"],
                         num_tensors=counts["tensors"], num_buckets=counts["buckets"],
                         max_bucket_bytes=counts["max"], max_received_bytes=counts["bytes"],
                         received_tp_bytes=mine["received_tp"], received_ep_bytes=mine["received_ep"])

    def check_sync(self, model, batch, *, micro_batch_size: int = 1):
        """:func:`~megatron_oar.rollout.sync_check.logprob_agreement` of ``batch`` (already every
        rollout group's) against ``model``."""
        from megatron_oar.rollout.sync_check import logprob_agreement

        return logprob_agreement(model, batch, self.arch.vocab_size, micro_batch_size=micro_batch_size)

    def shutdown(self, *, stop: bool = True) -> None:
        """Collective over the training world: reads the results still in flight, then stops the
        rollout ranks (``stop``; false leaves them serving, for another handle). Rollout ranks
        already gone are logged, not raised: the run's outcome is the training ranks'."""
        if self._closed:
            return
        self._closed = True
        try:
            while self._outstanding and self._lost_error is None:
                self._receive_next()
        except RolloutRankError:
            pass  # logged below, on rank 0
        self._stash.clear()
        self._outstanding.clear()
        if self._lost_error is not None:
            if self.rank == 0:
                log.warning("separate placement: the rollout ranks were already gone at the end of "
                            "the run: %s", self._lost_error)
            return
        if stop and self.rank == 0:
            try:
                send_object(self.roles.weights, {"kind": "stop", "id": None}, TRAINER)
            except RuntimeError as e:
                log.warning("separate placement: the rollout ranks did not take the stop request "
                            "(already gone): %s", e)
