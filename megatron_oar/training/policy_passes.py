"""The trainer's two Megatron passes over this DP rank's sequences.

* :func:`old_logprob_pass`: one forward-only pass under theta_old that yields the log-probs of the
  sampled tokens, their entropies, and (when probe sites are given) the outcome-probe teacher P0
  from the logits at the probe positions, so attribution needs no clean pass of its own.
* :func:`update_step`: one optimizer step on a mini-batch: the policy loss (``loss.policy_loss``,
  with vLLM's log-probs for ``loss.rollout_correction``) forward/backward through megatron's
  schedule, gradient checks (the non-finite guard), clipping and Adam.

On an FP8 model the forward-only passes run under FP8 autocast only where its scales are
meaningful (:func:`no_grad_fp8`): under delayed scaling the reference model runs in bf16, and so
does the old-logprob pass until the policy's first update in the process.

Log-probs and entropies are of ``softmax(logits / temperature)``, ``rollout.temperature``: the
distribution vLLM sampled from (the probe teacher's logits are the model's own).

Every ``[B, L]`` tensor is aligned with ``tokens``: column ``t`` holds the value for token ``t``
(computed from the logits at ``t - 1``); column 0 is never a response token. Both passes run
on tokens right-padded to the model's sequence multiple (``models.padding``: sequence
parallelism, FP8) and trim the logits back before anything reads them; with ``batching=packed``
each micro-batch runs as one THD sequence and the logits are unpacked to its rows instead
(``models.forward.MicroInput``), so everything after the model is the same as ``token_budget``.

On a MoE model ``routing`` (a :class:`~megatron_oar.training.routing_replay.RoutingLog`) says
what the passes do with the routing (``model.routing_replay``): the old-logprob pass records it
(``training``) or replays vLLM's (``rollout``) into ``batch.routed_experts``, the update replays
that, and both count the routing metrics (``training/routing_replay.py``).

The DP ranks run equally many model calls in a pass where collectives pair across them
(``models.equal_calls``: a MoE model whose expert groups span DP ranks, in every pass; FP8 in
the update, where Transformer Engine's delayed scaling all-reduces amax over TP x DP): short
ranks run filler calls that add nothing (``models.forward.run_schedule``).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, fields

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from megatron_oar.algorithms import PolicyLossConfig, policy_loss
from megatron_oar.attribution.probes import ProbeOutput, ProbeSites
from megatron_oar.models import context_parallel as cpx
from megatron_oar.models import vocab_parallel as vp
from megatron_oar.models.chunked_logits import DEFAULT_CHUNK_TOKENS, hidden_states_out, output_weight, token_stats
from megatron_oar.models.forward import MicroInput, forward_map, forward_rows, run_schedule, schedule_calls
from megatron_oar.models.micro_batches import micro_batches
from megatron_oar.models.padding import pad_to, sequence_multiple
from megatron_oar.models.parallel import broadcast_from_stage, unwrap
from megatron_oar.training.inputs import TrainBatch
from megatron_oar.training.routing_replay import RoutingLog, RoutingPass


def no_grad_fp8(model, *, trained: bool) -> bool:
    """Whether a forward-only pass of ``model`` may run under its FP8 autocast. Under delayed
    scaling, TE updates the scales from the amax history only when the outermost autocast exits
    with grad enabled (``FP8GlobalStateManager.autocast_exit`` tests ``torch.is_grad_enabled()``),
    so forward-only passes never update them: a model that has run no training forward in this
    process (``trained``) still has TE's initial scales (1.0, with which E4M3 flushes small
    weights and activations), and a frozen reference model never gets others. Current-scaling
    recipes (tensorwise, mxfp8, blockwise) scale each tensor from itself as it is cast."""
    config = unwrap(model).config
    return bool(config.fp8) and (trained or config.fp8_recipe != "delayed")


@contextlib.contextmanager
def _precision(model, fp8: bool):
    """``fp8=False``: the block runs outside FP8 autocast (bf16) on an FP8 model (megatron enters
    TE's autocast only where ``config.fp8`` is set)."""
    config = unwrap(model).config
    saved = config.fp8
    if not fp8:
        config.fp8 = None
    try:
        yield
    finally:
        config.fp8 = saved


def _shifted(values: torch.Tensor) -> torch.Tensor:
    """``[m, S-1]`` values for tokens 1..S-1 -> ``[m, S]`` aligned with the tokens (0 at column 0)."""
    return torch.cat([values.new_zeros(values.shape[0], 1), values], dim=1)


def _next_token_stats(gpt, out: torch.Tensor, tokens: torch.Tensor, vocab_size: int, chunk: int,
                      entropy: bool = True, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(log p, entropy or None)`` of tokens ``1..s-1`` of ``tokens [m, s]``, ``[m, s-1]`` each,
    from a pass's output ``out``: the final hidden states ``[m, s, h]`` with ``chunk > 0`` (the
    output layer and the statistics ``chunk`` positions at a time: ``models.chunked_logits``),
    else the vocab-parallel logits ``[m, s, V/TP]``. The distribution is
    ``softmax(logits / temperature)``: the one vLLM samples from at that temperature."""
    if chunk:
        lp, ent = token_stats(gpt, out[:, :-1], tokens[:, 1:], vocab_size, chunk, entropy, temperature)
        return lp, ent if entropy else None
    logits = out[:, :-1]
    if temperature != 1.0:
        logits = logits.float() / temperature
    lp = vp.target_logprobs(logits, tokens[:, 1:], vocab_size)
    return lp, vp.entropy(logits, vocab_size) if entropy else None


@torch.no_grad()
def old_logprob_pass(model, batch: TrainBatch, vocab_size: int, micro_batch_size: int, *,
                     sites: ProbeSites | None = None, batching: str = "padded",
                     max_tokens: int | None = None, fp8: bool = True,
                     routing: RoutingLog | None = None,
                     logits_chunk: int = DEFAULT_CHUNK_TOKENS,
                     temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, ProbeOutput | None]:
    """``(logprobs [B, L], entropy [B, L], teacher)`` under the current weights, forward only,
    in micro-batches as :func:`update_step` groups them; ``fp8=False`` runs it outside FP8
    autocast on an FP8 model (the trainer: :func:`no_grad_fp8`).

    Log-probs and entropies are returned on every pipeline stage (broadcast from the last);
    the teacher (vocab-parallel, ``sites`` order) exists on the last stage only, else None.
    ``routing``: on a MoE model, the step's routing mode and metrics; with ``training`` this
    pass sets ``batch.routed_experts`` (its routing), with ``rollout`` it replays them.
    ``logits_chunk`` (``train.logits_chunk_tokens``): positions whose logits exist at a time
    (``models.chunked_logits``); 0 forms each micro-batch's logits whole. ``temperature``
    (``rollout.temperature``): log-probs and entropies are of ``softmax(logits / temperature)``,
    the distribution vLLM sampled from; the teacher's logits stay as the model gives them
    (attribution compares the model's outcome distributions, at temperature 1).
    """
    with _precision(model, fp8):
        return _old_logprobs(model, batch, vocab_size, micro_batch_size, sites, batching, max_tokens,
                             routing, logits_chunk, temperature)


def _old_logprob_routing(model, batch: TrainBatch, groups: list[list[int]],
                         routing: RoutingLog | None) -> RoutingPass | None:
    if routing is None:
        return None
    replay = batch.routed_experts if routing.mode == "rollout" else None
    if routing.mode == "rollout" and replay is None:
        raise ValueError("model.routing_replay=rollout: the batch has no routed experts from vLLM")
    return RoutingPass(model, groups, batch.lengths.tolist(), batch.tokens.shape[1],
                       record=routing.mode == "training", replay=replay, log=routing,
                       agree="rollout_old", load=True)


def _old_logprobs(model, batch: TrainBatch, vocab_size: int, micro_batch_size: int,
                  sites: ProbeSites | None, batching: str, max_tokens: int | None,
                  routing: RoutingLog | None = None, chunk: int = 0, temperature: float = 1.0):
    groups = _groups(model, batch, micro_batch_size, batching, max_tokens)
    gpt = unwrap(model)
    route = _old_logprob_routing(model, batch, groups, routing)
    picked: list[tuple[torch.Tensor, torch.Tensor]] = []  # (site indices, their logits)
    counter = [0]

    def per_micro(out: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        rows = groups[counter[0]]
        counter[0] += 1
        if sites is not None:  # the teacher's logits: at the probe positions only
            local = {r: j for j, r in enumerate(rows)}
            idx = [k for k, r in enumerate(sites.row.tolist()) if r in local]
            at = torch.tensor([local[int(sites.row[k])] for k in idx], dtype=torch.long, device=out.device)
            pos = sites.pos[idx].to(out.device)
            at_sites = out[at, pos]
            if chunk:
                at_sites = torch.nn.functional.linear(at_sites, output_weight(gpt))
            picked.append((torch.tensor(idx, dtype=torch.long), at_sites.float()))
        lp, ent = _next_token_stats(gpt, out, tokens, vocab_size, chunk, temperature=temperature)
        return torch.stack([_shifted(lp.float()), _shifted(ent.float())], dim=1)

    def per_micro_local(out: torch.Tensor, tokens: torch.Tensor, inp) -> torch.Tensor:
        lp, ent = inp.local_token_stats(gpt, out, vocab_size, chunk, True, temperature)
        return torch.stack([_shifted(lp.float()), _shifted(ent.float())], dim=1)

    # under CP the statistics come from each rank's own positions (MicroInput.local_token_stats);
    # the teacher's probe sites read the gathered output
    local = cpx.cp_size() > 1 and sites is None
    with route or contextlib.nullcontext():
        out = _run_grouped(model, batch, groups, batching, per_micro_local if local else per_micro,
                           hidden=chunk > 0, raw=local)
    if route is not None and route.record:
        batch.routed_experts = route.routed
    if out is None:  # not the last pipeline stage
        out = torch.zeros(batch.size, 2, batch.tokens.shape[1], dtype=torch.float32,
                          device=batch.tokens.device)
    out = broadcast_from_stage(out.contiguous(), first=False)
    teacher = None
    if sites is not None and ps.is_pipeline_last_stage():
        order = torch.cat([i for i, _ in picked]).argsort()  # back to the sites' order
        positions = torch.cat([x for _, x in picked])
        positions = positions[order.to(positions.device)]
        teacher = ProbeOutput.from_position_logits(positions, sites, vocab_size)
    return out[:, 0], out[:, 1], teacher


def reference_logprobs(ref_model, batch: TrainBatch, vocab_size: int, micro_batch_size: int, *,
                       batching: str = "padded", max_tokens: int | None = None,
                       logits_chunk: int = DEFAULT_CHUNK_TOKENS, temperature: float = 1.0) -> torch.Tensor:
    """``[B, L]`` log-probs of the sampled tokens under the frozen reference model (in bf16 under
    delayed FP8 scaling: it never trains, so its scales would stay TE's initial ones);
    ``logits_chunk`` and ``temperature`` as in :func:`old_logprob_pass`."""
    gpt = unwrap(ref_model)
    with _precision(ref_model, no_grad_fp8(ref_model, trained=False)):
        groups = _groups(ref_model, batch, micro_batch_size, batching, max_tokens)
        if cpx.cp_size() > 1:  # each CP rank's own positions (MicroInput.local_token_stats)
            out = _run_grouped(ref_model, batch, groups, batching,
                               lambda out, tokens, inp: _shifted(inp.local_token_stats(
                                   gpt, out, vocab_size, logits_chunk, False, temperature)[0].float()),
                               hidden=logits_chunk > 0, raw=True)
        else:
            out = _run_grouped(ref_model, batch, groups, batching,
                               lambda out, tokens: _shifted(_next_token_stats(
                                   gpt, out, tokens, vocab_size, logits_chunk, entropy=False,
                                   temperature=temperature)[0].float()),
                               hidden=logits_chunk > 0)
    if out is None:
        out = torch.zeros(batch.tokens.shape, dtype=torch.float32, device=batch.tokens.device)
    return broadcast_from_stage(out.contiguous(), first=False)


def _groups(model, batch: TrainBatch, micro_batch_size: int, batching: str,
            max_tokens: int | None) -> list[list[int]]:
    return micro_batches(batch.lengths.tolist(), batching=batching, rows_per_micro=micro_batch_size,
                         max_tokens=max_tokens, multiple=sequence_multiple(model.config))


def _run_grouped(model, batch: TrainBatch, groups: list[list[int]], batching: str, fn, hidden: bool = False,
                 raw: bool = False):
    """The forward pass over ``groups``: the padded path runs consecutive rows at the batch's
    full width (``forward_map``), token budgets each group at its own (``forward_rows``), packed
    ones each group as one THD sequence. ``hidden``: ``fn`` gets the final hidden states;
    ``raw``: the model's output unrestored and the ``MicroInput`` (``forward_micros``)."""
    if batching == "padded":
        return forward_map(model, batch.tokens, fn, len(groups[0]), hidden=hidden, raw=raw)
    return forward_rows(model, batch.tokens, batch.lengths.tolist(), groups, fn, packed=batching == "packed",
                        hidden=hidden, raw=raw)


@dataclass
class StepResult:
    applied: bool          # False: the update was skipped (non-finite, or an fp16 overflow)
    grad_norm: float
    stats: dict[str, float]  # loss statistics, token-weighted over the mini-batch (all ranks)
    overflow: bool = False   # fp16 loss-scale overflow: skipped, and not a non-finite failure


def _global_counts(mask: torch.Tensor, group) -> tuple[int, int]:
    counts = torch.tensor([float(mask.sum()), float(mask.any(dim=-1).sum())], dtype=torch.float64,
                          device=mask.device)
    dist.all_reduce(counts, group=group)
    return int(counts[0]), int(counts[1])


def update_step(policy, batch: TrainBatch, loss_cfg: PolicyLossConfig, vocab_size: int,
                micro_batch_size: int, *, batching: str = "padded",
                max_tokens: int | None = None, routing: RoutingLog | None = None,
                logits_chunk: int = DEFAULT_CHUNK_TOKENS, temperature: float = 1.0) -> StepResult:
    """One optimizer step on ``batch`` (this DP rank's share of one mini-batch).

    Micro-batches as ``models.micro_batches`` groups them (``batching``: ``padded``, rows of
    ``micro_batch_size`` padded to the longest; ``token_budget``, at most ``max_tokens`` padded
    tokens each, padded to their own longest; ``packed``, grouped alike, each run as one THD
    sequence). The loss is the exact mini-batch loss of ``loss_cfg.policy_loss``
    (token / sequence counts are global over DP; every micro-batch holds whole rows, so GSPO's
    sequence ratio and a sequence-level rollout correction see all of a row's tokens), so the
    grouping and DP change nothing but rounding. Where the DP ranks must run equally many
    (``models.equal_calls``: FP8, or expert groups spanning DP ranks) each runs as many as the
    one with the most, the others adding filler calls that add nothing
    (``models.forward.run_schedule``). With ``routing`` in a replay mode the forward (hence the
    backward) uses ``batch.routed_experts``.
    ``logits_chunk`` > 0: the loss reads log-probs and entropies computed ``logits_chunk``
    positions at a time from the hidden states, the logits recomputed in the backward
    (``models.chunked_logits``); 0: from each micro-batch's whole logits. ``temperature``: the
    log-probs and entropies are of ``softmax(logits / temperature)``, as in the old-logprob pass
    (the ratio compares the same tempered policy). Collective over the world.
    """
    model, optimizer = policy.model, policy.optimizer
    multiple = sequence_multiple(model.config)
    groups = micro_batches(batch.lengths.tolist(), batching=batching, rows_per_micro=micro_batch_size,
                           max_tokens=max_tokens, multiple=multiple)
    micros = [batch.select(g) for g in groups]  # each trimmed to its own longest row
    dp_group = ps.get_data_parallel_group()
    if batching == "padded":
        width = max(m.tokens.shape[1] for m in micros)
        micros = [_pad_to(m, width) for m in micros]
    # model calls, filler calls included (models.equal_calls): megatron divides by all of them
    n_micro = schedule_calls(model, len(micros), False)
    inputs = [MicroInput(m.tokens, multiple, m.lengths.tolist() if batching == "packed" else None)
              for m in micros]
    num_tokens, num_seqs = _global_counts(batch.loss_mask, dp_group)
    # megatron's schedule divides each micro-batch loss by n_micro and DDP averages over DP; the
    # loss below is already normalised by the global counts, so undo both.
    scale = n_micro * ps.get_data_parallel_world_size()
    want_entropy = loss_cfg.entropy_coef > 0
    sums = torch.zeros(2, dtype=torch.float64, device=batch.tokens.device)  # loss, finite flag

    def step(data_iter, chunk):
        micro, inp = next(data_iter)

        def loss_func(out):
            # the padding to the sequence multiple never enters the loss
            if inp.cp > 1:  # this CP rank's positions through the output layer, gathered after
                lp, ent = inp.local_token_stats(gpt, out, vocab_size, logits_chunk, want_entropy,
                                                temperature)
            else:
                out = inp.restore_hidden(gpt, out) if logits_chunk else inp.restore(out)
                lp, ent = _next_token_stats(gpt, out, micro.tokens, vocab_size, logits_chunk, want_entropy,
                                            temperature)
            lp, ent = _shifted(lp), None if ent is None else _shifted(ent)
            loss, stats = policy_loss(
                lp, micro.old_logprobs.to(lp.dtype), micro.advantages, micro.loss_mask, loss_cfg,
                rollout_logprobs=micro.rollout_logprobs, ref_logprobs=micro.ref_logprobs, entropy=ent,
                num_tokens=num_tokens, num_seqs=num_seqs)
            sums[0] += loss.detach().double()
            stats["num_tokens"] = micro.loss_mask.sum().to(lp.dtype)
            return loss * scale, stats

        return inp(chunk), loss_func

    route = contextlib.nullcontext()
    if routing is not None and routing.mode != "none":
        if batch.routed_experts is None:
            raise ValueError(f"model.routing_replay={routing.mode}: the batch has no routed experts "
                             "(the old-logprob pass records them, or vLLM returns them)")
        route = RoutingPass(model, groups, batch.lengths.tolist(), batch.tokens.shape[1],
                            replay=batch.routed_experts, log=routing,
                            agree="old_update" if routing.mode == "training" else "rollout_update")

    model.zero_grad_buffer()
    optimizer.zero_grad()
    with route, hidden_states_out(model, logits_chunk > 0) as gpt:
        records = run_schedule(model, step, list(zip(micros, inputs)), inputs, forward_only=False,
                               num_calls=n_micro)

    # megatron's optimizer.step(), split so the non-finite guard sits between gradient
    # preparation and the update. prepare_grads runs once: with fp16 it unscales the gradients
    # and reports a loss-scale overflow (the dynamic scaler has already lowered the scale).
    overflow = bool(optimizer.prepare_grads())
    grad_norm = float(optimizer.get_grad_norm())
    finite = math.isfinite(grad_norm) and bool(torch.isfinite(sums[0]))
    sums[1] = 0.0 if (finite and not overflow) else 1.0
    dist.all_reduce(sums[1:])  # every rank takes the same decision
    applied = bool(sums[1] == 0)
    if applied:
        _clip_and_step(optimizer, grad_norm)
        policy.scheduler.step(increment=1)
    else:
        model.zero_grad_buffer()
        optimizer.zero_grad()
    return StepResult(applied, grad_norm, _reduce_stats(records, sums[0], batch.tokens.device),
                      overflow=overflow)


def _clip_and_step(optimizer, grad_norm: float) -> None:
    """The rest of megatron's ``optimizer.step()`` once gradients are prepared: clip every
    (chained) optimizer's gradients by the known global norm, then step."""
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if getattr(opt, "is_stub_optimizer", False) or opt.config.clip_grad <= 0:
            continue
        params = opt.get_parameters()
        if params:
            clip_grad_by_total_norm_fp32(
                params, max_norm=opt.config.clip_grad, total_norm=grad_norm,
                use_decoupled_grad=opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8)
    optimizer.step_with_ready_grads()


def _pad_to(batch: TrainBatch, length: int) -> TrainBatch:
    """Right-pads every ``[B, L]`` tensor to ``length`` (the micro-batches' common width)."""
    out = {}
    for f in fields(batch):
        t = getattr(batch, f.name)
        out[f.name] = pad_to(t, length) if t is not None and t.dim() == 2 else t
    return TrainBatch(**out)


def _reduce_stats(records: list[dict], loss_sum: torch.Tensor, device) -> dict[str, float]:
    """Token-weighted means of the micro-batch statistics, over the micro-batches and DP; the
    loss is summed over micro-batches (and DP). Statistics exist on the last pipeline stage and
    are shared with the other stages."""
    keys = [k for k in sorted(records[0]) if k != "num_tokens"] if records else []
    if ps.get_pipeline_model_parallel_world_size() > 1:  # the other stages hold no records
        box = [keys]
        dist.broadcast_object_list(box, src=ps.get_pipeline_model_parallel_last_rank(),
                                   group=ps.get_pipeline_model_parallel_group())
        keys = box[0]
    maxed = {"ratio_max"}
    values = torch.zeros(len(keys) + 2, dtype=torch.float64, device=device)
    peak = torch.zeros(max(len(keys), 1), dtype=torch.float64, device=device)
    last = ps.is_pipeline_last_stage()
    # one rank of each TP (and CP: every CP rank computes the same loss) group counts its records
    if last and ps.get_tensor_model_parallel_rank() == 0 and ps.get_context_parallel_rank() == 0:
        for rec in records:
            n = float(rec["num_tokens"])
            for i, k in enumerate(keys):
                if k in maxed:
                    peak[i] = max(peak[i], float(rec[k]))
                else:
                    values[i] += float(rec[k]) * n
            values[-2] += n
        values[-1] = loss_sum
    dist.all_reduce(values)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    tokens = max(float(values[-2]), 1.0)
    out = {k: (float(peak[i]) if k in maxed else float(values[i]) / tokens) for i, k in enumerate(keys)}
    out["loss"] = float(values[-1])
    return out
