"""Forward passes through megatron-core's own pipeline schedule.

``forward_map`` runs ``get_forward_backward_func()`` (forward only) over micro-batches and
applies a function to each micro-batch's vocab-parallel logits on the last pipeline stage;
other stages get ``None``. ``forward_logits`` uses it for the full-vocabulary logits (gathered
over TP, padded rows dropped; converter verify, tests), the rollout sync check for token
log-probs. Attribution passes use the same schedule with their own loss functions.

Tokens are right-padded to the model's sequence multiple (``models.padding``) and the logits
trimmed back before ``fn`` sees them; or, with ``batching=packed``, a micro-batch's rows run as
one THD sequence (``models.packing``) and the logits are unpacked to rows. :class:`MicroInput` is
that one difference, for these passes and the update step.

Every pass reaches megatron's schedule through :func:`run_schedule`, which, where the DP ranks
must make equally many model calls (``models.equal_calls``: MoE expert groups spanning DP
ranks, FP8 with a backward), runs filler calls after a short rank's own micro-batches.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

from megatron_oar.models import context_parallel as cpx
from megatron_oar.models import equal_calls
from megatron_oar.models import vocab_parallel as vp
from megatron_oar.models.chunked_logits import full_hidden, hidden_states_out, token_stats
from megatron_oar.models.packing import pack, packed_seq_params, unpack
from megatron_oar.models.padding import pad_to, padded_length, sequence_multiple, trim
from megatron_oar.models.parallel import unwrap


def position_ids_for(tokens: torch.Tensor) -> torch.Tensor:
    return torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand_as(tokens)


@contextlib.contextmanager
def variable_shapes(model, on: bool):
    """Micro-batches of different shapes through megatron's schedule: with pipeline parallelism
    the stages then exchange each activation's shape before it (``variable_seq_lengths``);
    restored afterwards. Without pipeline parallelism shapes may differ anyway."""
    config = unwrap(model).config
    before = config.variable_seq_lengths
    config.variable_seq_lengths = before or (on and parallel_state.get_pipeline_model_parallel_world_size() > 1)
    try:
        yield
    finally:
        config.variable_seq_lengths = before


class MicroInput:
    """A micro-batch ``tokens [m, s]`` as the model runs it: right-padded to ``multiple``, or,
    given the rows' ``lengths`` (``batching=packed``), packed into one sequence ``[1, T]`` with
    megatron's THD ``packed_seq_params``. ``restore`` maps the last stage's logits back to
    ``[m, s, ...]`` (trimmed, or unpacked with zeros past each row's length).

    Under context parallelism (CP > 1; ``multiple`` then includes ``2 x CP``) the model runs
    this CP rank's two chunks of the padded rows (``local_tokens``, with their global
    ``local_positions``: ``models.context_parallel``), and ``restore`` first gathers the ranks'
    outputs back into sample order (the backward keeps this rank's part: every CP rank computes
    the same loss from the gathered output). ``tokens`` stays the whole padded micro-batch (the
    schedule's shapes are of whole sequences; megatron divides them by CP). Packed, each row of
    the THD sequence (padded to a multiple of ``2 x CP`` by ``multiple``) is split on its own
    (Transformer Engine's THD layout, ``context_parallel.thd_local_index``): the rank holds two
    chunks of every row, megatron's THD rotary embedding gives them their positions in the row,
    and the attention (``models.sdpa_attention``) keeps the rows apart at their global offsets."""

    def __init__(self, tokens: torch.Tensor, multiple: int, lengths: list[int] | None = None):
        self.width = tokens.shape[1]
        self.packed = None if lengths is None else pack(tokens, lengths, multiple)
        self.cp = cpx.cp_size()
        self.local_index = self.order = None  # packed under CP: this rank's THD positions
        if self.packed is None:
            self.tokens = pad_to(tokens, padded_length(self.width, multiple))
            self.position_ids = position_ids_for(self.tokens)
        else:
            self.tokens, self.position_ids = self.packed.tokens, self.packed.position_ids
            if self.cp > 1:
                cu, dev = self.packed.cu_seqlens_padded, self.tokens.device
                self.local_index = cpx.thd_local_index(cu, device=dev)
                self.order = cpx.thd_global_order(cu, self.cp, dev)
        self.local_tokens, self.local_positions = (self._local(t) for t in (self.tokens, self.position_ids))

    def _local(self, t: torch.Tensor) -> torch.Tensor:
        """This CP rank's positions of a ``[.., s, ..]`` tensor along dim 1 (all at CP 1)."""
        return cpx.split(t, 1) if self.local_index is None else t.index_select(1, self.local_index)

    def __call__(self, chunk, **kwargs) -> torch.Tensor:
        """``chunk`` (the model) on this CP rank's tokens; ``kwargs`` go to the model's forward
        (e.g. ``decoder_input``: this rank's ``[s / CP, m, h]``)."""
        extra = {} if self.packed is None else {"packed_seq_params": packed_seq_params(self.packed)}
        return chunk(self.local_tokens, self.local_positions, attention_mask=None, **extra, **kwargs)

    def local_valid(self) -> torch.Tensor:
        """``[s / CP]`` bool: which of this CP rank's positions lie inside the micro-batch (not in
        the padding to the sequence multiple; padded, not packed, micro-batches)."""
        return self.local_positions[0] < self.width

    def restore(self, logits: torch.Tensor) -> torch.Tensor:
        logits = cpx.gather(logits, 1, replicated=True, order=self.order)  # [m, s, ...] in sample order (CP > 1)
        return trim(logits, self.width) if self.packed is None else unpack(logits, self.packed, self.width)

    def restore_hidden(self, gpt, hidden: torch.Tensor) -> torch.Tensor:
        """The last stage's ``[s, b, h]`` hidden states (``hidden_states_out``) as ``[m, s, h]``
        rows, gathered over the sequence (``chunked_logits.full_hidden``; and over CP) and
        restored alike."""
        return self.restore(full_hidden(gpt, hidden))

    def local_token_stats(self, gpt, out: torch.Tensor, vocab_size: int, chunk: int,
                          entropy: bool, temperature: float) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(log p, entropy or None)`` ``[m, width - 1]`` of tokens ``1..width-1`` of
        ``softmax(logits / temperature)``, computed from this rank's own output against its
        share of the next tokens, then gathered into sample order (at CP 1 simply the whole
        rows). ``out``: the model's output, the hidden states ``[s/CP, b, h]`` with ``chunk > 0``
        (the output layer and the statistics ``chunk`` positions at a time,
        ``chunked_logits.token_stats``), else the vocab-parallel logits ``[b, s/CP, V/TP]``.
        Under CP only per-token values cross the CP group and the output layer sees this
        rank's positions only (with the hidden states gathered instead, every CP rank would
        run it on, and add the output-weight gradient of, the whole sequence)."""
        # each position's next token (packed: the next in the THD sequence; a row's last real
        # token then reads a pad or the next row, a position no loss reads, as the pads' do)
        targets = self._local(torch.cat([self.tokens[:, 1:], self.tokens[:, :1]], dim=1))  # last: unread
        if chunk:
            lp, ent = token_stats(gpt, full_hidden(gpt, out), targets, vocab_size, chunk, entropy, temperature)
        else:
            logits = out.float() / temperature if temperature != 1.0 else out
            lp = vp.target_logprobs(logits, targets, vocab_size)
            ent = vp.entropy(logits, vocab_size) if entropy else None

        def rows(t):  # [m, width - 1] in sample order
            t = cpx.gather(t, 1, replicated=True, order=self.order)
            return (t if self.packed is None else unpack(t, self.packed, self.width))[:, :self.width - 1]

        lp, ent = (None if t is None else rows(t) for t in (lp, ent))
        return lp, ent if entropy else None


# the statistics a filler call returns to megatron's schedule: run_schedule drops them
_FILLER_STATS: dict = {}
_FILLER = object()  # a filler item in the schedule's data iterator


def schedule_calls(model, n: int, forward_only: bool) -> int:
    """How many model calls a pass of ``n`` micro-batches on this rank runs: ``n``, or the most
    any DP rank runs when the ranks must agree (``models.equal_calls``; collective over DP)."""
    if equal_calls.equal_calls(unwrap(model).config, forward_only):
        return equal_calls.agreed_count(n)
    return n


def run_schedule(model, step, items: list, inputs: list[MicroInput], forward_only: bool, *,
                 num_calls: int | None = None, filler: MicroInput | None = None,
                 call_filler: Callable | None = None) -> list:
    """megatron's schedule over ``items`` (one per micro-batch, ``inputs`` their model inputs):
    shapes announced from the inputs, variable ones exchanged under pipeline parallelism.
    Returns the last stage's records of ``items`` (``loss_func``'s statistics).

    ``num_calls`` (default :func:`schedule_calls`): the model calls to run. Past ``items`` the
    schedule runs filler calls (ranks that must pair collectives with ranks running more,
    ``models.equal_calls``): ``filler`` (default: this rank's input with the fewest tokens; a
    rank without items must give one) through the model by ``call_filler(chunk, filler)``
    (default ``filler(chunk)``), outputs discarded, loss ``0 * sum(output)`` (so gradients are
    exactly 0), and no record. ``step`` never sees them. Megatron divides each micro-batch's loss
    by the number of calls, fillers included: a step that undoes it scales by ``num_calls``."""
    if num_calls is None:
        num_calls = schedule_calls(model, len(items), forward_only)
    extra = num_calls - len(items)
    if extra < 0:
        raise ValueError(f"num_calls={num_calls} is fewer than the {len(items)} micro-batches")
    if num_calls == 0:
        return []
    if extra:
        if filler is None:
            if not inputs:
                raise ValueError("a rank without micro-batches needs a filler input to pair the "
                                 "other DP ranks' model calls")
            filler = min(inputs, key=lambda i: i.tokens.numel())
        inputs = [*inputs, filler]
    call_filler = call_filler or (lambda chunk, inp: inp(chunk))

    def run_step(data_iter, chunk):
        item = next(data_iter)
        if item is not _FILLER:
            return step(iter([item]), chunk)
        return call_filler(chunk, filler), _zero_loss

    shapes = {tuple(i.tokens.shape) for i in inputs}
    with variable_shapes(model, len(shapes) > 1):
        records = get_forward_backward_func()(
            forward_step_func=run_step, data_iterator=iter([*items, *[_FILLER] * extra]), model=[model],
            num_microbatches=num_calls, seq_length=max(w for _, w in shapes),
            micro_batch_size=max(r for r, _ in shapes), forward_only=forward_only)
    return [r for r in records if r is not _FILLER_STATS]


def _zero_loss(out: torch.Tensor):
    return out.sum() * 0, _FILLER_STATS


@torch.no_grad()
def forward_map(model, tokens: torch.Tensor, fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                micro_batch_size: int | None = None, hidden: bool = False,
                raw: bool = False) -> torch.Tensor | None:
    """``cat(fn(logits, micro_tokens))`` over micro-batches of ``tokens [B, S]``, forward only.

    ``logits`` are the vocab-parallel ``[mbs, S, V/TP]`` logits of one micro-batch (the pass runs
    on tokens padded to the model's sequence multiple, trimmed back to ``S`` for ``fn``). Runs in
    eval mode (the previous mode is restored); the result is on the last pipeline stage, else None.
    ``hidden``: ``fn`` gets the final hidden states ``[mbs, S, h]`` instead; ``raw``: the
    output unrestored, and the micro-batch's input (:func:`forward_micros`).
    """
    b = tokens.shape[0]
    mbs = micro_batch_size or b
    if b % mbs:
        raise ValueError(f"batch {b} is not divisible by micro_batch_size {mbs}")
    outputs = forward_micros(model, list(torch.split(tokens, mbs)), fn, hidden=hidden, raw=raw)
    return None if outputs is None else torch.cat(outputs)


@torch.no_grad()
def forward_rows(model, tokens: torch.Tensor, lengths: list[int], groups: list[list[int]],
                 fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 packed: bool = False, hidden: bool = False, raw: bool = False) -> torch.Tensor | None:
    """Like :func:`forward_map`, with micro-batches of the rows ``groups``
    (``models.micro_batches``), each cut to its own longest row (``packed``: run as one THD
    sequence): ``fn`` returns ``[m, ..., s]`` per micro-batch (the sequence last), and the result
    is ``[B, ..., S]`` in row order, zero past each micro-batch's width. On the last pipeline
    stage, else None."""
    micros = [tokens[g, :max(lengths[i] for i in g)] for g in groups]
    outputs = forward_micros(model, micros, fn, [[lengths[i] for i in g] for g in groups] if packed else None,
                             hidden=hidden, raw=raw)
    if outputs is None:
        return None
    full = outputs[0].new_zeros((tokens.shape[0], *outputs[0].shape[1:-1], tokens.shape[1]))
    for g, out in zip(groups, outputs):
        full[torch.tensor(g, device=full.device), ..., :out.shape[-1]] = out
    return full


def forward_micros(model, micros: list[torch.Tensor], fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                   lengths: list[list[int]] | None = None, hidden: bool = False,
                   raw: bool = False) -> list[torch.Tensor] | None:
    """``[fn(logits, micro) for micro in micros]`` through megatron's schedule, forward only, in
    eval mode; each ``micro [m, s]`` runs padded to the sequence multiple (or, given its rows'
    ``lengths``, packed: :class:`MicroInput`), ``fn`` sees the logits ``[m, s, V/TP]``, or with
    ``hidden`` the final hidden states ``[m, s, h]`` (the output layer skipped: the caller applies
    it, e.g. chunk by chunk with ``models.chunked_logits``).
    Micro-batches may differ in shape. The last pipeline stage gets the list, the others None.
    ``raw``: ``fn(output, micro, input)`` gets the model's output as it is (this CP rank's
    positions; ``MicroInput.local_token_stats``) and the micro-batch's :class:`MicroInput`."""
    multiple = sequence_multiple(model.config)
    inputs = [MicroInput(m, multiple, None if lengths is None else lengths[k]) for k, m in enumerate(micros)]
    outputs: list[torch.Tensor] = []

    def step(data_iter, m):
        micro, inp = next(data_iter)

        def collect(out):
            if raw:
                outputs.append(fn(out, micro, inp))
            else:
                outputs.append(fn(inp.restore_hidden(gpt, out) if hidden else inp.restore(out), micro))
            return torch.zeros((), device=out.device), {}

        return inp(m), collect

    was_training = model.training
    model.eval()
    try:
        with hidden_states_out(model, hidden) as gpt:
            run_schedule(model, step, list(zip(micros, inputs)), inputs, forward_only=True)
    finally:
        model.train(was_training)
    return outputs if parallel_state.is_pipeline_last_stage() else None


def forward_logits(model, tokens: torch.Tensor, micro_batch_size: int | None = None,
                   vocab_size: int | None = None) -> torch.Tensor | None:
    """Logits ``[B, S, vocab]`` for ``tokens [B, S]`` (identical on every rank's input)."""

    def gather(out, _):
        full = gather_from_tensor_model_parallel_region(out)
        return full if vocab_size is None else full[..., :vocab_size]

    return forward_map(model, tokens, gather, micro_batch_size)
