"""The RL training loop, top to bottom (DESIGN.md section 1).

.. code-block:: python

    cfg = load_config("examples/tiny_cpu.yaml", ["train.steps=20"])
    Trainer(cfg).run()           # inside torchrun; or `oar train --config ...`

One step (the phases of ``training/phases.py``, one logger phase and console line each)::

    vLLM wakes its weights --sync--> the policy's weights; vLLM wakes its KV cache
    prompts --rollout (vLLM)--> completions --verify--> rewards;  vLLM sleeps
      --Eq. 2--> A_i
      --old-logprob pass--> log-probs, entropy, probe teacher P0   (one Megatron forward)
      (every pass's log-probs and entropies at rollout.temperature: softmax(logits / T))
      (MoE, model.routing_replay: it records the routing, or replays vLLM's; the update replays it)
      (vLLM's log-probs must agree with these: rollout.max_logprob_mismatch)
      --attribution (oar_g / oar_p)--> importance I_t              (only rows with A_i != 0)
      (MoE: routed as the teacher's pass, so with rollout replay vLLM's routing replayed again)
      --credit (Eqs. 14-17 / random / entropy)--> A_t
      --PPO-clip updates (mini-batches x epochs, megatron optimizer)--> theta
    [eval every train.eval_interval: vLLM wakes, syncs, evaluates, sleeps];
    checkpoint (every checkpoint.interval, or when a rank got SIGTERM / SIGUSR1: then stop;
    signalled before the update, at the next phase's entry, the step is dropped instead);  log

Every rank runs the same code on the same step data; each DP rank trains on its rows
``d, d + DP, ...`` of the step's ``prompts_per_step * group_size`` completions. Each phase runs
under the hang watchdog (``train.phase_timeout_s``); docs/running-for-days.md has the faults.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from megatron_oar.algorithms import assign_credit, group_advantages
from megatron_oar.attribution import SpanFinder, compute_importance, locate_probes
from megatron_oar.config import Config, save_config, validate
from megatron_oar.models import read_hf_config
from megatron_oar.models.model_checkpoint import CheckpointMeta
from megatron_oar.rollout.sync_check import check_policy_agreement
from megatron_oar.runtime.distributed import on_rank0
from megatron_oar.runtime.roles import current_roles
from megatron_oar.runtime.stop_signals import start_resource_tracker_shielded
from megatron_oar.seeds import RANDOM_CREDIT, derive_seed
from megatron_oar.testing import faults
from megatron_oar.training import step_checkpoint as ckpt
from megatron_oar.training.collect import collect, prefetch
from megatron_oar.training.credit_records import record_rows, write_credit_records
from megatron_oar.training.dp_split import dp_assignment
from megatron_oar.training.evaluate import evaluate, load_eval_examples
from megatron_oar.training.inputs import TrainBatch, build_train_batch, load_examples
from megatron_oar.training.logger import MetricsLogger
from megatron_oar.training.policy import build_policy, build_reference, init_checkpoint
from megatron_oar.training.policy_passes import no_grad_fp8, old_logprob_pass, reference_logprobs, update_step
from megatron_oar.training.preemption import Preemption, StepDropped
from megatron_oar.training.routing_replay import RoutingLog, attach_rollout_routing, attribution_route
from megatron_oar.training.run_context import start_run
from megatron_oar.training.step_metrics import step_metrics
from megatron_oar.training.watchdog import PhaseWatchdog

log = logging.getLogger(__name__)


class NonFiniteError(RuntimeError):
    """Too many consecutive steps with a non-finite loss or gradient norm."""


@dataclass(frozen=True)
class StepStart:
    """What a dropped step rewinds to: the prompt sampler and this rank's RNG states."""

    sampler: dict
    rng: dict


class Trainer:
    """Builds everything from a :class:`Config`; :meth:`run` trains. Collective: every torchrun
    rank constructs one. ``engine`` lets a caller share a running :class:`RolloutEngine`."""

    def __init__(self, cfg: Config, *, engine=None):
        self.cfg = cfg
        start_resource_tracker_shielded()  # before a library starts it, unshielded (stop_signals.py)
        hf_dir = cfg.model.hf_dir()
        hf_config = read_hf_config(hf_dir / "config.json")
        roles = current_roles()  # rollout.placement=separate: this is one of the training ranks
        world = (roles.global_size if roles is not None and cfg.rollout.separate else
                 dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1)))
        if cfg.rollout.separate and roles is None:
            raise RuntimeError("rollout.placement=separate: split the world first "
                               "(megatron_oar.runtime.roles.split_world; `oar train` does)")
        validate(cfg, world_size=world, hf_config=hf_config)  # before any work
        ctx = start_run(cfg, hf_config)
        self.rt, self.rank, self.arch = ctx.rt, ctx.rt.rank, ctx.arch
        self.tokenizer, self.pad_id, self.control = ctx.tokenizer, ctx.pad_id, ctx.control
        self.attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)  # torchrun restarts so far
        self.watchdog = PhaseWatchdog(cfg.train.phase_timeout_s, rank=self.rank, attempt=self.attempt,
                                      dump_dir=Path(cfg.run_dir) / "hangs")
        self.preemption = Preemption()
        self.preempted = False  # run() stopped early on SIGTERM / SIGUSR1 (after a checkpoint)
        self._build(hf_dir, hf_config, engine)  # unwatched: its collectives have the group's timeout

    def _build(self, hf_dir: Path, hf_config: dict, engine) -> None:
        """The data, the policy (and reference), a resumed state, the vLLM engine and the logger."""
        from megatron_oar.data import PromptSampler
        from megatron_oar.rewards import RewardScorer
        from megatron_oar.rollout import RolloutEngine

        cfg = self.cfg
        self.finder = SpanFinder(self.tokenizer, cfg.attribution.probe.answer_pattern)
        train_examples = load_examples(cfg, self.tokenizer)
        self.sampler = PromptSampler(train_examples, cfg.train.prompts_per_step, seed=cfg.train.seed)
        self.eval_examples = load_eval_examples(cfg, self.tokenizer, train_examples)
        t = cfg.train
        self.optimizer_steps_per_step = t.mini_batches * t.ppo_epochs
        start = init_checkpoint(cfg.model.path, cfg.run_dir, cfg.model.dtype,
                                timeout_minutes=cfg.checkpoint.convert_timeout_minutes)
        self.meta = CheckpointMeta.read(start)
        self.policy = build_policy(hf_config, cfg.model, cfg.optim, checkpoint=start,
                                   total_optimizer_steps=t.steps * self.optimizer_steps_per_step)
        self.reference = build_reference(hf_config, cfg.model, start) if cfg.loss.kl_coef > 0 else None
        self.hf_files = start / "hf" if (start / "hf").is_dir() else hf_dir
        self.step = 0
        self.updated = False  # no update in this process yet: delayed FP8 scales still TE's initial ones
        self.nonfinite_in_row = 0
        self.nonfinite_total = 0
        self.loss_scale_overflows = 0  # fp16 only: skipped updates the dynamic loss scale handles
        # a torchrun restart (launch.max_restarts) continues from the run's own newest checkpoint
        resume = ckpt.resolve_resume(cfg.checkpoint.resume, cfg.checkpoint.dir, restarted=self.attempt > 0)
        if resume is not None:
            state = ckpt.load_checkpoint(resume, self.policy)
            self.step = int(state["step"])
            self.sampler.load_state_dict(state["sampler"])
            self.nonfinite_in_row = int(state.get("nonfinite_in_row", 0))
            self.nonfinite_total = int(state.get("nonfinite_total", 0))
            self.loss_scale_overflows = int(state.get("loss_scale_overflows", 0))
            if self.rank == 0:
                log.info("resumed from %s at step %d", resume, self.step)
        if self.rank == 0:
            save_config(cfg, Path(cfg.run_dir) / "config.yaml")
        self.own_engine = engine is None
        if engine is None and cfg.rollout.separate:  # the engines run on the rollout ranks
            from megatron_oar.rollout.remote import RemoteRollout

            engine = RemoteRollout(cfg, current_roles(), self.arch)
        self.engine = engine or RolloutEngine(hf_dir, cfg.rollout, tokenizer=cfg.model.tokenizer_dir())
        if resume is not None:
            self._restore_rollouts_ahead(Path(resume))
        self.engine.sleep()  # asleep between generations; the loop wakes it (wake_rollout)
        self.scorer = RewardScorer(cfg.rewards)
        self.logger = MetricsLogger(cfg.log, run_name=Path(cfg.run_dir).name, total_steps=t.steps,
                                    start_step=self.step, enabled=self.rank == 0, hparams=asdict(cfg))
        self.last_checkpoint: Path | None = resume

    # ---------------------------------------------------------------------------- the loop

    def run(self) -> dict[str, float]:
        """Trains from ``self.step`` to ``train.steps``; returns the last step's metrics. On
        SIGTERM / SIGUSR1 it stops with a checkpoint and sets ``self.preempted``
        (``training/preemption.py``): signalled before the step's update, the step is dropped
        (the checkpoint is of the step before, the prompt sampler and RNGs as they were when the
        dropped step began); signalled later, the step is finished and saved."""
        cfg, metrics = self.cfg, {}
        self.preemption.install()
        try:
            if self.step == 0 and cfg.train.eval_interval:
                self.logger.log(0, self.evaluate())  # the baseline, before any update
            while self.step < cfg.train.steps and not self.preempted:
                start = StepStart(self.sampler.state_dict(), ckpt.rng_state())
                try:
                    metrics = self.train_step()
                except StepDropped as e:
                    self.preempted = True
                    if self.rank == 0:
                        log.warning("stop signal before the update of step %d: the step is dropped "
                                    "(phase %r not started); saving step %d", self.step + 1, e.phase,
                                    self.step)
                    self.sampler.load_state_dict(start.sampler)
                    self.save(rng=start.rng)
                    break
                self.step += 1
                every = cfg.train.eval_interval
                if every and (self.step % every == 0 or self.step == cfg.train.steps):
                    metrics.update(self.evaluate())
                self.preempted = self.preemption.requested(self.control)  # any rank signalled
                interval = cfg.checkpoint.interval
                if (self.step == cfg.train.steps or (interval and self.step % interval == 0)
                        or self.preempted):
                    self.save()
                self.logger.log(self.step, metrics)
            self.preempted &= self.step < cfg.train.steps  # a signal during the last step stops nothing
            if self.preempted and self.rank == 0:
                log.warning("stopped on a signal after step %d of %d; checkpoint: %s. Run the same "
                            "command (checkpoint.resume=auto) to continue", self.step, cfg.train.steps,
                            self.last_checkpoint)
            elif not self.preempted and cfg.checkpoint.export_hf_at_end and self.last_checkpoint is not None:
                self.export_hf(self.last_checkpoint)
        finally:
            self.preemption.uninstall()
            self.close()
        return metrics

    @contextlib.contextmanager
    def phase(self, name: str, step: int):
        """One phase of the loop (``training/phases.py``) in step ``step``: its console line and
        time (the logger), the hang watchdog's deadline, and the test-only fault point ``name``.

        Entering a phase of the step in progress (``step`` is ``self.step + 1``: each of them up
        to and including the update) first asks every rank whether a stop signal came (one
        small all-reduce); if one did, the step is dropped (:class:`StepDropped`): a signal costs
        at most one phase, not the rest of the step, before the save starts."""
        if step == self.step + 1 and self.preemption.requested(self.control):
            raise StepDropped(name)
        with self.logger.phase(name), self.watchdog.phase(name, step):
            faults.inject(name, step=step)
            yield

    def train_step(self) -> dict[str, float]:
        cfg, step = self.cfg, self.step
        n = step + 1  # the step being computed, as the logs and checkpoints number it
        t0 = time.perf_counter()

        sync = self.wake_rollout(n)  # wake_weights, sync, wake_kv_cache
        r = cfg.rollout  # sampled at these settings; every Megatron pass below at its temperature
        with self.phase("generate", n):  # and rewards (dynamic sampling may generate again)
            data = collect(self.engine, self.scorer, self.sampler, self.tokenizer, step=step,
                           group_size=cfg.train.group_size, template=cfg.data.template,
                           seed=r.seed, dynamic_sampling=cfg.train.dynamic_sampling,
                           max_refill_rounds=cfg.train.max_refill_rounds, group=self.control,
                           sampling={"temperature": r.temperature, "top_p": r.top_p, "top_k": r.top_k})
            ahead = min(r.max_staleness, cfg.train.steps - n)
            if ahead > 0:  # the next steps' rollouts, generated while this step trains
                prefetch(self.engine, self.sampler, self.tokenizer, step=step, ahead=ahead,
                         template=cfg.data.template, seed=r.seed,
                         sampling={"temperature": r.temperature, "top_p": r.top_p, "top_k": r.top_k})
        with self.phase("sleep", n):  # every Megatron pass below runs while vLLM sleeps
            self.engine.sleep()
        rewards = torch.tensor([s.reward for s in data.samples])
        seq_adv = group_advantages(rewards, group_size=cfg.train.group_size,
                                   std_normalize=cfg.advantage.std_normalize, eps=cfg.advantage.eps)
        lengths = [len(s.prompt_ids) + len(s.response_ids) for s in data.samples]
        split = dp_assignment(lengths, ps.get_data_parallel_world_size(), cfg.train.mini_batches,
                              balance=cfg.train.balance_dp_tokens)
        batch = build_train_batch(data.samples, split[ps.get_data_parallel_rank()], seq_adv,
                                  pad_id=self.pad_id, overlong_filter=cfg.train.overlong_filter,
                                  device=self.rt.device)
        mbs = cfg.train.micro_batch_size
        vocab = self.arch.vocab_size
        # MoE: what the passes do with the routing (model.routing_replay), and its metrics
        routing = RoutingLog(cfg.model.routing_replay) if self.arch.is_moe else None
        if routing is not None and routing.mode == "rollout":  # vLLM's routing, replayed
            attach_rollout_routing(self.policy.model, batch, data.samples, group=self.control)

        sites = None
        if cfg.uses_attribution:
            sites = locate_probes(batch, cfg.attribution.probe, step, self.finder,
                                  eos_ids={self.tokenizer.eos_token_id, *cfg.rollout.stop_token_ids})
        grouping = {"batching": cfg.train.batching, "max_tokens": cfg.micro_batch_tokens,
                    "logits_chunk": cfg.train.logits_chunk_tokens, "temperature": r.temperature}
        logprob_fp8 = no_grad_fp8(self.policy.model, trained=self.updated)  # bf16 before the first update
        with self.phase("logprob", n):
            batch.old_logprobs, batch.entropy, teacher = old_logprob_pass(
                self.policy.model, batch, vocab, mbs, sites=sites, fp8=logprob_fp8, routing=routing,
                **grouping)
            if self.reference is not None:
                batch.ref_logprobs = reference_logprobs(self.reference, batch, vocab, mbs, **grouping)
        mismatch = check_policy_agreement(batch.rollout_logprobs, batch.old_logprobs, batch.loss_mask,
                                          limit=cfg.rollout.max_logprob_mismatch, step=n, group=self.control)

        importance = score_mask = None
        attr_stats: dict[str, float] = {}
        attr_work: list[tuple[int, float, int]] = []
        if cfg.uses_attribution:
            with self.phase("attribution", n):
                attr = compute_importance(self.policy.model, batch, cfg.attribution_config(), vocab_size=vocab,
                                          seq_adv=batch.seq_adv, step=step, tokenizer=self.tokenizer,
                                          sites=sites, teacher=teacher, external_teacher=True,
                                          teacher_fp8=logprob_fp8,  # the logprob pass's
                                          # routed as that pass (R3: vLLM's routing replayed)
                                          route=attribution_route(self.policy.model, batch, routing))
            importance, score_mask, attr_stats, attr_work = attr.importance, attr.score_mask, attr.stats, attr.work
        credit = assign_credit(cfg.shaping, batch.seq_adv, batch.loss_mask, importance=importance,
                               entropy=batch.entropy, score_mask=score_mask,
                               generator=self._generator())
        batch.advantages = credit.advantages
        if cfg.log.credit_records and n % cfg.log.credit_records == 0:
            self._record_credit(n, data.samples, batch, credit, importance, score_mask)

        with self.phase("update", n):
            updates = self.update(batch, routing)
            self.updated = True  # its forwards ran under FP8 autocast with grad: scales set

        return step_metrics(self, data=data, batch=batch, credit=credit, updates=updates,
                            attr_stats=attr_stats, attr_work=attr_work, mismatch=mismatch,
                            sync_seconds=sync.seconds,
                            sync_gib_per_rank=sync.max_received_bytes / 2**30, lengths=lengths, split=split, t0=t0,
                            routing=routing) | self._placement_metrics(data)

    def _record_credit(self, n: int, samples, batch: TrainBatch, credit, importance, score_mask) -> None:
        """``log.credit_records``: this DP replica's rollouts of step ``n`` with their credit
        (``training/credit_records.py``), written by its first TP rank on the last stage."""
        if ps.get_tensor_model_parallel_rank() != 0 or not ps.is_pipeline_last_stage():
            return
        rows = record_rows(samples, batch, credit, importance=importance, score_mask=score_mask,
                           tokenizer=self.tokenizer, step=n, method=self.cfg.credit,
                           shaping=self.cfg.shaping)
        write_credit_records(self.cfg.run_dir, n, ps.get_data_parallel_rank(), rows)

    def _placement_metrics(self, data) -> dict[str, float]:
        """``rollout.placement=separate``: how many updates old the step's samples are (the
        policy version each was generated with, against the ``self.step`` updates trained), and
        how much of their generation the trainer did not wait for (``RemoteRollout.take_timing``)."""
        if not self.cfg.rollout.separate:
            return {}
        timing = self.engine.take_timing() if hasattr(self.engine, "take_timing") else {}
        lags = [self.step - (self.step if s.version is None else s.version) for s in data.samples]
        return {"rollout/policy_version": float(self.step - max(lags, default=0)),
                "rollout/staleness_mean": sum(lags) / max(len(lags), 1),
                "rollout/staleness_max": float(max(lags, default=0)),
                # rollout.partial_tokens: completions whose tokens came from more than one version
                "rollout/partial_fraction": sum(len(set(s.token_versions or ())) > 1 for s in data.samples)
                / max(len(data.samples), 1), **timing}

    def wake_rollout(self, step: int):
        """Collective: vLLM back on the GPU with the current policy (phases.WAKE): its weights
        first, then the sync into them, then its KV cache, so the sync's buckets never compete
        with the KV cache for memory. Returns the sync's :class:`SyncStats`."""
        with self.phase("wake_weights", step):
            self.engine.wake_up(["weights"])
        with self.phase("sync", step):  # separate placement: with the policy version it sends
            version = {"version": self.step} if self.cfg.rollout.separate else {}
            sync = self.engine.sync_weights(self.policy.model, step=step, **version)
        with self.phase("wake_kv_cache", step):
            self.engine.wake_up(["kv_cache"])
        return sync

    def evaluate(self) -> dict[str, float]:
        """Collective: ``eval/*`` of the current weights (phases.EVAL: vLLM wakes with them,
        evaluates, and sleeps again)."""
        t = self.cfg.train
        self.wake_rollout(self.step)
        with self.phase("eval", self.step):
            metrics = evaluate(self.engine, self.scorer, self.tokenizer, self.eval_examples,
                               template=self.cfg.data.template, n=t.eval_n,
                               temperature=t.eval_temperature, seed=self.cfg.rollout.seed,
                               group=self.control)
        with self.phase("sleep", self.step):
            self.engine.sleep()
        return metrics

    def update(self, batch: TrainBatch, routing: RoutingLog | None = None) -> list:
        """``ppo_epochs`` passes of ``mini_batches`` optimizer steps; the non-finite guard."""
        t = self.cfg.train
        per = batch.size // t.mini_batches
        results = []
        for _ in range(t.ppo_epochs):
            for m in range(t.mini_batches):
                mini = batch.select(list(range(m * per, (m + 1) * per)))
                results.append(update_step(self.policy, mini, self.cfg.loss, self.arch.vocab_size,
                                           t.micro_batch_size, batching=t.batching,
                                           max_tokens=self.cfg.micro_batch_tokens, routing=routing,
                                           logits_chunk=t.logits_chunk_tokens,
                                           temperature=self.cfg.rollout.temperature))
        skipped = sum(not r.applied and not r.overflow for r in results)
        self.loss_scale_overflows += sum(r.overflow for r in results)
        self.nonfinite_total += skipped
        self.nonfinite_in_row = self.nonfinite_in_row + 1 if skipped else 0
        if self.nonfinite_in_row >= t.max_nonfinite_steps:
            raise NonFiniteError(
                f"step {self.step + 1}: non-finite loss or gradient norm in {self.nonfinite_in_row} "
                f"steps in a row (train.max_nonfinite_steps={t.max_nonfinite_steps}; last grad norm "
                f"{results[-1].grad_norm}); the updates were skipped. Lower optim.lr, check "
                "model.dtype and the data; resume from the last checkpoint once fixed")
        if skipped and self.rank == 0:
            log.warning("step %d: %d of %d updates skipped (non-finite loss or gradient norm)",
                        self.step + 1, skipped, len(results))
        return results

    def _generator(self) -> torch.Generator:
        """Per-step generator (random credit): reproducible and independent of resumes."""
        seed = derive_seed(RANDOM_CREDIT, self.cfg.train.seed, self.step, ps.get_data_parallel_rank())
        return torch.Generator(device=self.rt.device).manual_seed(seed)

    # ------------------------------------------------------------------ checkpoints, export

    def save(self, rng: dict | None = None) -> Path:
        """Collective: a checkpoint of ``self.step``; ``rng``: the RNG states to save (this
        rank's, as :func:`step_checkpoint.rng_state` took them), instead of the current ones."""
        state = {"sampler": self.sampler.state_dict(), "nonfinite_in_row": self.nonfinite_in_row,
                 "nonfinite_total": self.nonfinite_total,
                 "loss_scale_overflows": self.loss_scale_overflows, "credit": self.cfg.credit,
                 "policy_version": self.step}  # updates in these weights (the rollouts' versions count them)
        with self.phase("checkpoint", self.step):
            extra = {}
            # separate placement at max_staleness >= 1: the rollouts generated ahead, from weights
            # older than these, go with the checkpoint (a resumed run trains on them)
            ahead = self.engine.results_ahead() if hasattr(self.engine, "results_ahead") else []
            if ahead:
                from megatron_oar.rollout.remote import AHEAD_FILE

                state["rollouts_ahead"] = len(ahead)
                if self.rank == 0:
                    buffer = io.BytesIO()
                    torch.save(ahead, buffer)
                    extra[AHEAD_FILE] = buffer.getvalue()
            self.last_checkpoint = ckpt.save_checkpoint(
                self.cfg.checkpoint.dir, self.step, self.policy, state, self.meta, self.hf_files,
                keep_last=self.cfg.checkpoint.keep_last, optim_sharding=self.cfg.checkpoint.optim_sharding,
                rng=rng, extra=extra)
        return self.last_checkpoint

    def _restore_rollouts_ahead(self, checkpoint: Path) -> None:
        """The rollouts a checkpoint of the separate placement kept (:meth:`save`), handed to the
        engine; a run in another placement or at ``max_staleness=0`` generates its own."""
        from megatron_oar.rollout.remote import AHEAD_FILE

        path = checkpoint / AHEAD_FILE
        if not path.is_file():
            return
        r = self.cfg.rollout
        if not (r.separate and r.max_staleness > 0 and hasattr(self.engine, "restore_ahead")):
            if self.rank == 0:
                log.warning("%s holds rollouts generated ahead of it from older weights; this run "
                            "(rollout.placement=%s, rollout.max_staleness=%d) generates its own",
                            path, r.placement, r.max_staleness)
            return
        items = torch.load(path, weights_only=False)
        self.engine.restore_ahead(items)
        if self.rank == 0:
            log.info("resumed with %d rollout batch(es) generated ahead of %s", len(items), checkpoint.name)

    def export_hf(self, checkpoint: Path) -> Path:
        """Rank 0 writes ``{run_dir}/hf/<step dir>`` (HF safetensors) with the converter, while the
        others wait up to ``checkpoint.convert_timeout_minutes`` (``runtime.on_rank0``), under a
        watchdog deadline of that much and a minute (not ``train.phase_timeout_s``)."""
        from checkpoints_convert.convert import megatron_to_hf

        out = Path(self.cfg.run_dir) / "hf" / checkpoint.name

        def export() -> None:
            if out.exists():
                return
            out.parent.mkdir(parents=True, exist_ok=True)
            megatron_to_hf(checkpoint, out, progress=False)
            log.info("exported %s -> %s", checkpoint, out)

        minutes = self.cfg.checkpoint.convert_timeout_minutes
        limit = (60 * minutes + 60, f"checkpoint.convert_timeout_minutes={minutes:g} min (and a minute)")
        with self.watchdog.phase("export_hf", self.step, limit=limit):
            on_rank0(export, timeout_minutes=minutes, setting="checkpoint.convert_timeout_minutes",
                     what=f"exporting {checkpoint} to {out}")
        return out

    def close(self) -> None:
        """Collective: closes the logger and verifier pool, and the vLLM engine if this trainer
        made it (a shared engine stays up for its owner). Rank 0 waits for its pruned
        checkpoints' deletion (done in the background while the run went on)."""
        if self.rank == 0:
            ckpt.wait_for_deletions()
        self.watchdog.close()
        self.logger.close()
        self.scorer.close()
        if self.own_engine:
            self.engine.shutdown()
