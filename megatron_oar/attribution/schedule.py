"""Probe passes through megatron-core's own pipeline schedule.

:func:`run_probe_schedule` runs micro-batches through ``get_forward_backward_func()``. On the
first pipeline stage a callback may supply the decoder input (noisy embeddings for OAR-G); on
the last stage the model returns final-norm hidden states and the output layer is applied at
the probe positions only (``sites.pos``), so the ``[s, b, V/TP]`` logits of the whole sequence
are never formed. A last-stage callback turns the probe output into a scalar objective (OAR-G
differentiates it) and records per-row results. Tokens (and a first-stage decoder input) are
right-padded to the model's sequence multiple (``models.padding``); probe positions lie before
the padding, so it is never read. Under context parallelism (``parallel.cp``) the model runs each
CP rank's two chunks of a micro-batch (``models.forward.MicroInput``, as the training passes),
and the probes read the last stage's hidden states gathered over CP.

:func:`attribution_mode` puts the model in the state every attribution pass needs: eval mode,
parameter gradients off, no gradient scaling/reduction hooks, FP8 autocast off (unless allowed),
and restores all of it afterwards. A pass with a backward (OAR-G) asks for ``recompute``: the
activation recompute the model is configured with (``model.recompute``) then runs as in the
update, though the pass is in eval mode (``models.recompute.eval_recompute``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.tensor_parallel import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
)

from megatron_oar.attribution.probes import ProbeOutput, ProbeSites
from megatron_oar.models import context_parallel as cpx
from megatron_oar.models.chunked_logits import output_weight
from megatron_oar.models.forward import MicroInput, run_schedule, schedule_calls
from megatron_oar.models.padding import sequence_multiple
from megatron_oar.models.parallel import unwrap
from megatron_oar.models.recompute import eval_recompute

# Model-config hooks that belong to training steps; attribution must not fire them.
TRAINING_HOOKS = ("grad_scale_func", "finalize_model_grads_func", "no_sync_func", "grad_sync_func",
                  "param_sync_func")


@contextlib.contextmanager
def attribution_mode(model, allow_fp8: bool = False, recompute: bool = False):
    gpt = unwrap(model)
    config = gpt.config
    saved_hooks = {name: getattr(config, name, None) for name in TRAINING_HOOKS}
    saved_fp8 = config.fp8
    requires = [(p, p.requires_grad) for p in model.parameters()]
    training = model.training
    post_process = gpt.post_process
    try:
        for p, _ in requires:
            p.requires_grad_(False)
        for name in TRAINING_HOOKS:
            setattr(config, name, None)
        if not allow_fp8:
            config.fp8 = None  # bf16 dgrad; TE's amax history stays untouched
        model.eval()
        gpt.post_process = False  # hidden states out of the last stage: logits only at probes
        with eval_recompute(model, on=recompute):
            yield gpt
    finally:
        gpt.post_process = post_process
        model.train(training)
        config.fp8 = saved_fp8
        for name, value in saved_hooks.items():
            setattr(config, name, value)
        for p, flag in requires:
            p.requires_grad_(flag)


def clean_embeddings(gpt, inp: MicroInput) -> torch.Tensor:
    """This CP rank's ``[s / CP, m, h]`` input embeddings of the micro-batch ``inp`` (padded to
    the sequence multiple; its own two chunks under context parallelism, all of it at CP 1),
    detached, gathered over TP under SP (first stage only)."""
    with torch.no_grad():
        emb = gpt.embedding(input_ids=inp.local_tokens, position_ids=inp.local_positions)
        if gpt.config.sequence_parallel:
            emb = gather_from_sequence_parallel_region(emb, tensor_parallel_output_grad=False)
    return emb.detach()


def to_decoder_input(gpt, local: torch.Tensor) -> torch.Tensor:
    """This CP rank's ``[s / CP, b, h]`` (:func:`clean_embeddings`) as the first stage's decoder
    input (scattered under SP; the scatter's backward gathers the gradient back to it)."""
    return scatter_to_sequence_parallel_region(local) if gpt.config.sequence_parallel else local


def probe_logits(gpt, hidden: torch.Tensor, sites: ProbeSites) -> torch.Tensor:
    """Vocab-parallel logits ``[N, V/TP]`` at ``sites``'s positions from last-stage hidden states
    (this CP rank's positions: gathered over CP first, so a probe reads its position wherever it
    lives; every CP rank then computes the same probe, and the gather's backward gives each rank
    the gradient of its own positions, ``models.context_parallel.gather``)."""
    if gpt.config.sequence_parallel:
        hidden = gather_from_sequence_parallel_region(hidden)  # backward: reduce-scatter sums TP parts
    hidden = cpx.gather(hidden, 0, replicated=True)  # [s, b, h] in sample order (CP > 1)
    picked = hidden.transpose(0, 1)[sites.row.to(hidden.device), sites.pos.to(hidden.device)]
    if not gpt.config.sequence_parallel:
        picked = copy_to_tensor_model_parallel_region(picked)  # backward: all-reduce sums TP parts
    return F.linear(picked, output_weight(gpt))


@dataclass
class Micro:
    """One micro-batch: ``tokens [m, s]``, its probe sites, and the batch rows it stands for."""

    tokens: torch.Tensor
    sites: ProbeSites
    rows: list[int]
    extra: object = None  # per-method payload (noise, masked positions)


FirstStageFn = Callable[[object, Micro], torch.Tensor]
LastStageFn = Callable[[Micro, ProbeOutput], torch.Tensor]
# How a schedule call routes on a MoE model: given the batch rows of each of its micro-batches
# (in order), the context it runs in; None: the routers route on their own. The trainer's
# ``training.routing_replay.attribution_route`` replays the routing its teacher's pass replayed.
RouteFn = Callable[[list[list[int]]], contextlib.AbstractContextManager]


def filler_tokens(tokens: torch.Tensor, lengths: list[int], rows: list[int]) -> torch.Tensor:
    """A real row as a filler call's input (``models.equal_calls``): the shortest of ``rows``
    (of every row when ``rows`` is empty), ``[1, length]``."""
    pick = min(rows or range(len(lengths)), key=lambda r: lengths[r], default=None)
    if pick is None:
        raise ValueError("an empty batch has no row for the filler calls that pair other DP ranks' "
                         "model calls (models.equal_calls)")
    return tokens[pick:pick + 1, :lengths[pick]]


def run_probe_schedule(model, micros: list[Micro], vocab_size: int, *, forward_only: bool,
                       last_stage: LastStageFn, first_stage: FirstStageFn | None = None,
                       filler: torch.Tensor | None = None, route: RouteFn | None = None) -> None:
    """Run ``micros`` through megatron's schedule, inside attribution_mode. Micro-batches may
    differ in rows and length (pipeline stages then exchange shapes: ``variable_shapes``).

    ``first_stage(gpt, micro, inp)`` returns the decoder input of ``micro`` as the model runs it
    (``inp``, its :class:`~megatron_oar.models.forward.MicroInput`: padded to the sequence
    multiple, and under context parallelism this CP rank's two chunks of it, ``[s / CP, m, h]``,
    as :func:`clean_embeddings` gives them), or None for the model's own embedding;
    ``last_stage(micro, probe_output)`` returns a scalar whose gradient the backward pass
    propagates (ignored when ``forward_only``); it sees ``micro`` unpadded and the probe read
    from the whole sequence (gathered over CP, :func:`probe_logits`), identical on every CP rank.

    Where the DP ranks must run equally many model calls (``models.equal_calls``) a rank with
    fewer runs filler calls on ``filler`` (tokens ``[1, s]``, :func:`filler_tokens`; default: its
    smallest micro-batch; a rank without micro-batches must give it): the clean embedding in
    (a leaf that takes the backward's gradient), no callback sees it, its loss is 0.

    ``route`` (MoE): the call runs inside ``route([micro.rows for micro in micros])`` (a
    :data:`RouteFn`); filler calls route on their own.
    """
    gpt = unwrap(model)
    multiple = sequence_multiple(gpt.config)
    inputs = [MicroInput(m.tokens, multiple) for m in micros]
    n = schedule_calls(model, len(micros), forward_only)
    # megatron's schedule divides a loss by the number of model calls and multiplies it by the
    # CP size (each CP rank's loss standing for its share of a token average): undo both, so
    # every sequence's gradient is d J_i / d input, whatever the micro-batching and the CP size
    # (every CP rank computes the whole J_i from the gathered output: probe_logits)
    scale = n / cpx.cp_size()

    def step(data_iter, chunk):
        micro, inp = next(data_iter)
        decoder_input = None
        if first_stage is not None and parallel_state.is_pipeline_first_stage():
            decoder_input = to_decoder_input(gpt, first_stage(gpt, micro, inp))
        hidden = inp(chunk, decoder_input=decoder_input)

        def loss(out):
            probe = ProbeOutput.from_position_logits(probe_logits(gpt, out, micro.sites), micro.sites,
                                                     vocab_size)
            return last_stage(micro, probe) * scale, {}

        return hidden, loss

    def call_filler(chunk, inp: MicroInput) -> torch.Tensor:
        decoder_input = None
        if not forward_only and parallel_state.is_pipeline_first_stage():
            decoder_input = to_decoder_input(gpt, clean_embeddings(gpt, inp).requires_grad_(True))
        return inp(chunk, decoder_input=decoder_input)

    with route([m.rows for m in micros]) if route is not None else contextlib.nullcontext():
        run_schedule(model, step, list(zip(micros, inputs)), inputs, forward_only=forward_only, num_calls=n,
                     filler=None if filler is None else MicroInput(filler, multiple), call_filler=call_filler)
