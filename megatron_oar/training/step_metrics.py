"""What one training step reports besides the losses it trains on: the DP-reduced batch,
credit, attribution and optimizer metrics, model FLOPs and throughput, and the padding the
micro-batch grouping costs. The trainer (``training/trainer.py``) calls :func:`step_metrics`
once at the end of each step; nothing here changes what the step computes.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from megatron_oar.algorithms import credit_metrics
from megatron_oar.models.arch import QwenArch
from megatron_oar.models.flops import forward_flops, peak_tflops
from megatron_oar.models.micro_batches import micro_batches, token_slots
from megatron_oar.models.padding import padded_length, sequence_multiple
from megatron_oar.training.dp_split import token_imbalance
from megatron_oar.training.inputs import TrainBatch


def step_metrics(trainer, *, data, batch: TrainBatch, credit, updates: list, attr_stats: dict,
                 attr_work: list[tuple[int, float, int]], mismatch: float, sync_seconds: float,
                 sync_gib_per_rank: float,
                 lengths: list[int], split, t0: float, routing=None) -> dict[str, float]:
    """Every metric of one step of ``trainer`` (a :class:`~megatron_oar.training.trainer.Trainer`)
    after its update; ``t0``: the step's start (``time.perf_counter()``); ``routing``: a MoE
    model's :class:`~megatron_oar.training.routing_replay.RoutingLog` (``routing/*``).
    Collective over the world."""
    cfg, policy = trainer.cfg, trainer.policy
    forwards = 1 + (trainer.reference is not None) + 3 * cfg.train.ppo_epochs  # update: fwd + bwd
    model_tflop = model_flops(trainer.arch, batch.lengths.tolist(), attr_work, forwards=forwards) / 1e12
    padding = padding_fractions(batch.lengths.tolist(), cfg.train, cfg.micro_batch_tokens,
                                sequence_multiple(policy.gpt.config))
    metrics = dict(data.metrics)
    metrics.update(batch_metrics(
        batch, credit, updates, attr_stats, model_tflop=model_tflop, padding=padding,
        lr=float(policy.optimizer.param_groups[0]["lr"]), nonfinite_total=trainer.nonfinite_total,
        loss_scale_overflows=trainer.loss_scale_overflows if policy.gpt.config.fp16 else None))
    metrics["rollout/logprob_mismatch"] = mismatch  # the number check_policy_agreement compared
    peak = cfg.train.peak_tflops or (
        peak_tflops(torch.cuda.get_device_name()) if trainer.rt.device.type == "cuda" else None)
    metrics.update(throughput(metrics["perf/model_tflop"],
                              trainer.logger.seconds("logprob", "attribution", "update"), peak))
    metrics["rollout/sync_seconds"] = sync_seconds
    metrics["rollout/sync_gib_per_rank"] = sync_gib_per_rank  # received over TP/PP, the most of any rank
    metrics["perf/dp_token_imbalance"] = token_imbalance(lengths, split)
    metrics["perf/tokens_per_s"] = data.metrics["rollout/gen_tokens"] / (time.perf_counter() - t0)
    if routing is not None:  # agreement between the passes' routings, expert load per layer
        metrics.update(routing.metrics(trainer.rt.device))
    return metrics


def batch_metrics(batch: TrainBatch, credit, updates: list, attr_stats: dict, *, model_tflop: float,
                  padding: dict[str, float], lr: float, nonfinite_total: int,
                  loss_scale_overflows: int | None) -> dict[str, float]:
    """Credit, entropy and loss metrics, averaged over DP ranks (counts summed); this rank's
    ``model_tflop`` and ``padding`` fractions go into the same reduction. Collective over DP."""
    mask = batch.loss_mask
    tokens = mask.sum().clamp_min(1)
    cm = credit_metrics(credit.weights, credit.advantages, mask, batch.seq_adv)
    local = {
        "policy/entropy": (batch.entropy * mask).sum() / tokens,
        **{f"credit/{k}": v for k, v in cm.items()},
        **{f"attribution/{k}": torch.tensor(v) for k, v in attr_stats.items()},
        "tokens/action": mask.sum().float(),  # response tokens with loss
        "tokens/sequence": batch.lengths.sum().float(),
        "tokens/response": (batch.lengths - batch.prompt_lens).sum().float(),
        "tokens/sequences": torch.tensor(float(batch.lengths.numel())),
        **{k: torch.tensor(v) for k, v in padding.items()},
        "perf/model_tflop": torch.tensor(model_tflop),
    }
    keys = sorted(local)
    vec = torch.stack([torch.as_tensor(local[k], dtype=torch.float64).to(mask.device) for k in keys])
    dist.all_reduce(vec, group=ps.get_data_parallel_group())
    out = {k: float(v) / ps.get_data_parallel_world_size() for k, v in zip(keys, vec)}
    summed = ("attribution/", "tokens/", "perf/model_tflop")
    for k in [k for k in out if k.startswith(summed) and k != "attribution/seconds"]:
        out[k] *= ps.get_data_parallel_world_size()  # counts: summed over DP, not averaged
    applied = [r for r in updates if r.applied]
    for key in (applied[0].stats if applied else {}):
        out[f"loss/{key}"] = sum(r.stats[key] for r in applied) / len(applied)
    out["optim/grad_norm"] = sum(r.grad_norm for r in updates) / len(updates)
    out["optim/lr"] = lr
    out["guard/skipped_updates"] = float(sum(not r.applied for r in updates))
    out["guard/nonfinite_total"] = float(nonfinite_total)
    if loss_scale_overflows is not None:  # fp16 only
        out["guard/loss_scale_overflows"] = float(loss_scale_overflows)
    return out


def model_flops(arch: QwenArch, lengths: list[int], attr_work: list[tuple[int, float, int]], *,
                forwards: int) -> float:
    """Model FLOPs of this DP rank's Megatron passes in the step (``models/flops.py``):
    ``forwards`` full passes over rows of ``lengths``, and the attribution passes as
    ``compute_importance`` counted them (logits at the probes only)."""
    return (forwards * forward_flops(arch, lengths)
            + sum(fe * forward_flops(arch, [n], probes) for n, fe, probes in attr_work))


def throughput(model_tflop: float, seconds: float, peak: float | None) -> dict[str, float]:
    """``perf/tflops_per_gpu`` of the step's Megatron passes (``seconds`` of the logprob,
    attribution and update phases; model FLOPs over every GPU of the world) and ``perf/mfu``
    against ``peak`` TFLOPS (``train.peak_tflops``, default the GPU's dense bf16 peak; none on CPU)."""
    if seconds <= 0:
        return {}
    achieved = model_tflop / seconds / dist.get_world_size()
    out = {"perf/tflops_per_gpu": achieved}
    if peak:
        out["perf/mfu"] = achieved / peak
    return out


def padding_fractions(lengths: list[int], train, max_tokens: int, multiple: int) -> dict[str, float]:
    """``perf/padding_fraction_{logprob,update}``: the share of the token slots the two passes
    process that are padding, for rows of ``lengths`` grouped as ``train`` (the config's
    ``train`` section: ``batching``, ``micro_batch_size``, ``mini_batches``) says."""
    kw = {"batching": train.batching, "rows_per_micro": train.micro_batch_size,
          "max_tokens": max_tokens, "multiple": multiple}

    def slots(rows: range) -> tuple[int, int]:  # (processed, real)
        sub = [lengths[i] for i in rows]
        width = padded_length(max(sub), multiple) if train.batching == "padded" else None
        return token_slots(sub, micro_batches(sub, **kw), multiple, width,
                           packed=train.batching == "packed")

    per = len(lengths) // train.mini_batches
    update = [slots(range(m * per, (m + 1) * per)) for m in range(train.mini_batches)]
    logprob = slots(range(len(lengths)))
    return {"perf/padding_fraction_logprob": 1.0 - logprob[1] / logprob[0],
            "perf/padding_fraction_update": 1.0 - sum(r for _, r in update) / sum(p for p, _ in update)}
