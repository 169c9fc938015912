"""The attribution passes: the clean probe teacher, OAR-G, OAR-P and screened OAR-P.

Where results live (pipeline parallelism): the teacher ``ProbeOutput`` is on the last stage
only (it is vocab-parallel, one slice per TP rank). OAR-G's input gradients exist on the first
stage and OAR-P's divergences on the last; both importance tensors are broadcast over the
pipeline group, so every rank of the model-parallel group returns the same ``[B, L]`` tensor.

Context parallelism (``parallel.cp``): every pass runs each micro-batch (OAR-P: each micro-batch
of masked copies) split over the CP ranks as the training passes do (``models.forward.MicroInput``),
and reads its probes from the last stage's output gathered over CP (``schedule.probe_logits``),
so every CP rank holds the same teacher and OAR-P divergences; OAR-G's per-position scores are
each CP rank's own, summed over the CP group.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_oar.attribution.probes import ProbeOutput, ProbeSites, divergence
from megatron_oar.attribution.schedule import (
    Micro,
    RouteFn,
    attribution_mode,
    clean_embeddings,
    filler_tokens,
    output_weight,
    run_probe_schedule,
)
from megatron_oar.models import context_parallel as cpx
from megatron_oar.models.equal_calls import agreed_count, equal_calls
from megatron_oar.models.forward import MicroInput
from megatron_oar.models.micro_batches import micro_batches
from megatron_oar.models.padding import padded_length, sequence_multiple
from megatron_oar.models.parallel import broadcast_from_stage, unwrap
from megatron_oar.models.sequence_batch import SequenceBatch
from megatron_oar.seeds import OAR_G_NOISE, derive_seed


def sample_noise(seed: int, length: int, hidden: int, sigma: float,
                 device: torch.device | str = "cpu") -> torch.Tensor:
    """``N(0, sigma^2)`` noise ``[length, hidden]`` (float32) from a dedicated generator on
    ``device``: the embeddings' device, so the noise of a long micro-batch is not drawn by the CPU
    and copied over on every OAR-G micro-batch (docs/gpu-validation.md has the cost). CUDA's
    generator draws other numbers than the CPU's for a seed; on one kind of device the noise
    depends on the seed alone, not on the layout."""
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(length, hidden, generator=g, device=device) * sigma


def _budget(lengths: list[int], size: int, max_tokens: int | None, multiple: int) -> int:
    """A micro-batch's token budget: ``max_tokens``, or by default ``size`` rows of the longest
    (so no micro-batch is larger than the padded path's)."""
    return max_tokens or size * padded_length(max(lengths), multiple)


def _row_groups(lengths: list[int], rows: list[int], size: int, batching: str, max_tokens: int | None,
                multiple: int) -> list[list[int]]:
    """``rows`` grouped into micro-batches: ``padded``, ``size`` consecutive rows (the last may be
    smaller); ``token_budget`` (``models.micro_batches``), longest first within the budget."""
    if batching == "padded":
        return [rows[i:i + size] for i in range(0, len(rows), size)]
    sub = [lengths[r] for r in rows]
    groups = micro_batches(sub, batching="token_budget", rows_per_micro=size,
                           max_tokens=_budget(sub, size, max_tokens, multiple), multiple=multiple)
    return [[rows[j] for j in g] for g in groups]


def _sequence_micros(batch: SequenceBatch, sites: ProbeSites, rows: list[int], size: int, batching: str,
                     max_tokens: int | None, multiple: int) -> list[Micro]:
    """Micro-batches of whole scored sequences: ``padded``, each at the longest of ``rows``;
    ``token_budget``, each cut to its own longest row."""
    if not rows:  # a rank that scores nothing (it may still run filler calls)
        return []
    lengths = batch.lengths.tolist()
    width = max(lengths[r] for r in rows) if batching == "padded" else None
    return [Micro(batch.tokens[g, :width or max(lengths[r] for r in g)], sites.take(g), g)
            for g in _row_groups(lengths, rows, size, batching, max_tokens, multiple)]


def probe_teacher(model, batch: SequenceBatch, sites: ProbeSites, rows: list[int], vocab_size: int,
                  micro_batch_size: int, allow_fp8: bool = False, *, batching: str = "token_budget",
                  max_tokens: int | None = None, route: RouteFn | None = None) -> ProbeOutput | None:
    """The clean probe output P0 (and S0) of ``rows``; on the last stage, else None.

    The trainer can skip this pass by building the teacher from its old-logprob forward with
    ``ProbeOutput.from_position_logits`` at the same sites positions, when that forward ran in
    the students' precision (``compute_importance`` checks). ``allow_fp8``: as the student's.
    Micro-batches as OAR-G's (``batching``, ``max_tokens``); ``route``: how a MoE model routes
    (``schedule.run_probe_schedule``).
    """
    outputs: dict[int, ProbeOutput] = {}
    micros = _sequence_micros(batch, sites, rows, micro_batch_size, batching, max_tokens,
                              sequence_multiple(model.config))

    def last_stage(micro: Micro, probe: ProbeOutput) -> torch.Tensor:
        for j, r in enumerate(micro.rows):
            outputs[r] = probe.take([j])
        return probe.score.sum() * 0

    with attribution_mode(model, allow_fp8), torch.no_grad():
        run_probe_schedule(model, micros, vocab_size, forward_only=True, last_stage=last_stage,
                           filler=_filler(batch, rows), route=route)
    if not parallel_state.is_pipeline_last_stage():
        return None
    width = output_weight(unwrap(model)).shape[0]  # V/TP
    # float64, as ProbeOutput.from_position_logits makes it (zeros for rows not scored, and for
    # every row of a rank that scores none but runs the pass to pair the others' calls)
    logp = torch.zeros(batch.size, width, dtype=torch.float64, device=batch.tokens.device)
    score = torch.zeros(batch.size, dtype=torch.float64, device=batch.tokens.device)
    for r, out in outputs.items():
        logp[r], score[r] = out.logp[0], out.score[0]
    return ProbeOutput(logp, score)


def oar_g(model, batch: SequenceBatch, sites: ProbeSites, teacher: ProbeOutput | None, rows: list[int],
          vocab_size: int, *, sigma: float, seed: int, step: int, micro_batch_size: int,
          allow_fp8: bool = False, batching: str = "token_budget", max_tokens: int | None = None,
          route: RouteFn | None = None) -> torch.Tensor:
    """OAR-G importance ``I_t = |<dJ/de_t, e_t>|`` with ``J = KL(P0 || P_noisy)`` (or the score
    drop for answer_joint), noise ``N(0, sigma^2)`` on the scored tokens' embeddings, one backward
    through the schedule with parameter gradients off, under the model's activation recompute
    (``model.recompute``: full or selective, as the update; ``models.recompute``). Micro-batches of whole sequences:
    ``padded``, ``micro_batch_size`` rows at the longest scored row; ``token_budget``, at most
    ``max_tokens`` padded tokens (default: ``micro_batch_size`` x the longest), each at its own
    longest row. ``route``: how a MoE model routes (``schedule.run_probe_schedule``).

    Under context parallelism each CP rank holds the (noisy) embeddings of its own two chunks of
    every row (the noise drawn for the whole row, as at CP 1, and split), the probe is read from
    the output gathered over CP (the answer span may live on another rank), and the backward
    through that gather and through attention's K/V gather brings each rank the gradient of its
    own positions; their scores are summed over the CP group into the whole row.
    Returns ``[B, L]`` on every stage and CP rank."""
    importance = torch.zeros(batch.tokens.shape, dtype=torch.float32, device=batch.tokens.device)
    micros = _sequence_micros(batch, sites, rows, micro_batch_size, batching, max_tokens,
                              sequence_multiple(model.config))
    lengths, sample_ids = batch.lengths.tolist(), batch.sample_ids.tolist()  # one device sync

    def first_stage(gpt, micro: Micro, inp: MicroInput) -> torch.Tensor:
        # this CP rank's positions of the padded micro-batch (all of them at CP 1); zeros past
        # the micro-batch's rows, as the padding to the sequence multiple
        emb = clean_embeddings(gpt, inp)  # [s / CP, m, h]
        valid = inp.local_valid()
        emb = emb * valid[:, None, None].to(emb.dtype)
        noise = torch.zeros(emb.shape, dtype=torch.float32, device=emb.device)
        width, h = inp.tokens.shape[1], emb.shape[-1]
        for j, r in enumerate(micro.rows):
            # the row's whole noise (the generator is sequential), this rank's positions of it
            n = int(lengths[r])
            full = torch.zeros(width, h, dtype=torch.float32, device=emb.device)
            full[:n] = sample_noise(derive_seed(OAR_G_NOISE, seed, step, sample_ids[r]), n, h, sigma,
                                    device=emb.device)
            full[:n] *= micro.sites.score_mask[j, :n].unsqueeze(-1).to(emb.device)
            noise[:, j] = cpx.split(full, 0)
        x = (emb + noise.to(emb.dtype)).requires_grad_(True)
        micro.extra = (x, emb, inp.local_positions[0][valid], valid)
        return x

    def last_stage(micro: Micro, probe: ProbeOutput) -> torch.Tensor:
        return divergence(teacher.take(micro.rows), probe, micro.sites, clamp=False).sum()

    # the input-gradient backward under the model's activation recompute (model.recompute), as
    # the update's: with it only each layer's input is kept, each layer re-run in the backward
    with attribution_mode(model, allow_fp8, recompute=True):
        run_probe_schedule(model, micros, vocab_size, forward_only=False, first_stage=first_stage,
                           last_stage=last_stage, filler=_filler(batch, rows), route=route)
    if parallel_state.is_pipeline_first_stage():
        for micro in micros:
            x, emb, positions, valid = micro.extra
            grad = x.grad if x.grad is not None else torch.zeros_like(x)
            scores = (grad.float() * emb.float()).sum(dim=-1).abs().T  # [m, s / CP]
            at = torch.tensor(micro.rows, device=importance.device)[:, None]
            importance[at, positions.to(importance.device)[None, :]] = scores[:, valid].to(importance.device)
        # each CP rank scored its own positions: summed, every rank holds every position's
        # score (one rank's value plus zeros: exact)
        if cpx.cp_size() > 1:
            dist.all_reduce(importance, group=parallel_state.get_context_parallel_group())
    importance *= sites.score_mask
    return broadcast_from_stage(importance, first=True)


def _copy_micros(batch: SequenceBatch, sites: ProbeSites, copies: list[tuple[int, int]], size: int,
                 pad_id: int, *, batching: str = "token_budget", max_tokens: int | None = None,
                 bucket: int = 64, multiple: int = 1) -> list[list[Micro]]:
    """OAR-P's masked copies (``(row, position)``), longest rows first, as micro-batches grouped
    into schedule calls. ``token_budget``: one call, micro-batches of at most ``max_tokens``
    padded tokens (default: ``size`` copies of the longest), each cut to its own longest row.
    ``padded``: one call per padded length (a row's length rounded up to ``bucket``, not past the
    batch width), micro-batches of ``size`` copies."""
    lengths = batch.lengths.tolist()
    copies = sorted(copies, key=lambda c: (-lengths[c[0]], c))
    if batching == "padded":
        full = batch.tokens.shape[1]
        by_width: dict[int, list[tuple[int, int]]] = {}
        for i, t in copies:
            by_width.setdefault(min(padded_length(lengths[i], bucket), full), []).append((i, t))
        calls = [(width, [group[k:k + size] for k in range(0, len(group), size)])
                 for width, group in by_width.items()]
    else:
        sub = [lengths[i] for i, _ in copies]
        groups = micro_batches(sub, batching="token_budget", rows_per_micro=size,
                               max_tokens=_budget(sub, size, max_tokens, multiple), multiple=multiple)
        calls = [(None, [[copies[j] for j in g] for g in groups])]
    out = []
    for width, chunks in calls:
        micros = []
        for chunk in chunks:
            rows, positions = [i for i, _ in chunk], [t for _, t in chunk]
            tokens = batch.tokens[rows, :width or max(lengths[i] for i in rows)].clone()
            tokens[torch.arange(len(chunk)), torch.tensor(positions)] = pad_id
            micros.append(Micro(tokens, sites.take(rows), rows, positions))
        out.append(micros)
    return out


def oar_p(model, batch: SequenceBatch, sites: ProbeSites, teacher: ProbeOutput | None, rows: list[int],
          vocab_size: int, *, pad_id: int, micro_batch_size: int, length_bucket: int = 64,
          serial: bool = False, joint_importance: str = "drop", positions: torch.Tensor | None = None,
          batching: str = "token_budget", max_tokens: int | None = None,
          route: RouteFn | None = None) -> tuple[torch.Tensor, int]:
    """OAR-P importance ``I_t = KL(P_final || P_final^(t))`` (score drop for answer_joint) with
    token t replaced by ``pad_id``: one forward-only copy per scored token, batched as
    :func:`_copy_micros` groups them (``micro_batch_size`` copies, or ``max_tokens`` tokens, per
    micro-batch); ``serial``: one copy per schedule call, the paper's naive baseline.
    ``positions`` (``[B, L]`` bool) restricts the copies to those scored tokens; the others stay
    0. ``route``: how a MoE model routes (``schedule.run_probe_schedule``; a copy stands for its
    row). Returns ``[B, L]`` on every stage and the number of copies run."""
    importance = torch.zeros(batch.tokens.shape, dtype=torch.float32, device=batch.tokens.device)
    mask = sites.score_mask if positions is None else sites.score_mask & positions.to(sites.score_mask.device)
    copies = [(i, int(t)) for i in rows for t in mask[i].nonzero().flatten()]
    multiple = sequence_multiple(model.config)
    if not copies:
        calls = []
    elif serial:
        calls = [m for c in copies for m in _copy_micros(batch, sites, [c], 1, pad_id, batching="padded", bucket=1)]
    else:
        calls = _copy_micros(batch, sites, copies, micro_batch_size, pad_id, batching=batching,
                             max_tokens=max_tokens, bucket=length_bucket, multiple=multiple)

    def last_stage(micro: Micro, probe: ProbeOutput) -> torch.Tensor:
        d = divergence(teacher.take(micro.rows), probe, micro.sites, joint_importance)
        importance[micro.rows, micro.extra] = d.to(importance.device, importance.dtype)
        return d.sum() * 0

    if equal_calls(unwrap(model).config, forward_only=True):  # every rank runs as many schedules
        calls += [[] for _ in range(agreed_count(len(calls)) - len(calls))]
    with attribution_mode(model), torch.no_grad():
        for micros in calls:
            run_probe_schedule(model, micros, vocab_size, forward_only=True, last_stage=last_stage,
                               filler=_filler(batch, rows), route=route)
    return broadcast_from_stage(importance, first=False), len(copies)


def _filler(batch: SequenceBatch, rows: list[int]) -> torch.Tensor | None:
    """The input of a pass's filler calls, if it runs any (``schedule.filler_tokens``; None for
    an empty batch)."""
    if not batch.size:
        return None
    return filler_tokens(batch.tokens, batch.lengths.tolist(), rows)


def screen_count(n: int, fraction: float) -> int:
    """How many of a row's ``n`` scored tokens get an exact copy: ``ceil(fraction * n)``, at
    least 1 (rounded to 9 digits first, so 0.2 * 15 is 3, not 4)."""
    return min(n, max(1, math.ceil(round(fraction * n, 9)))) if n else 0


def screen_positions(screen: torch.Tensor, score_mask: torch.Tensor, rows: list[int],
                     fraction: float) -> torch.Tensor:
    """``[B, L]`` bool: per row, the ``screen_count`` scored tokens with the highest ``screen``
    score (ties: the earlier position first)."""
    selected = torch.zeros(score_mask.shape, dtype=torch.bool)
    for i in rows:
        pos = score_mask[i].nonzero().flatten().cpu()
        order = torch.sort(screen[i, pos].cpu(), descending=True, stable=True).indices
        selected[i, pos[order[:screen_count(len(pos), fraction)]]] = True
    return selected.to(score_mask.device)


def merge_screened(exact: torch.Tensor, screen: torch.Tensor, selected: torch.Tensor,
                   score_mask: torch.Tensor) -> torch.Tensor:
    """Screened importance: ``exact`` on the ``selected`` tokens; every other scored token gets
    its ``screen`` score rescaled into ``[0, m)``, ``m`` the row's smallest selected exact value:
    ``min(m * g_t / g_cut, the largest float32 below m)``, ``g_cut`` the smallest screen score
    among the selected (``g_t <= g_cut`` by construction). So unselected tokens keep the
    screen's order (up to float32 rounding; ties stay ties) and rank below every selected one.
    Degenerate rows: ``g_cut == 0`` -> the unselected get 0; ``m <= 0`` -> [0, m) is empty and the
    unselected get 0 (tied with the smallest selected); nothing unselected -> exact as is."""
    out = exact.clone()
    for i in range(exact.shape[0]):
        sel, rest = selected[i], score_mask[i] & ~selected[i]
        if not sel.any() or not rest.any():
            continue
        m = exact[i, sel].min().clamp_min(0)
        g_cut = screen[i, sel].min().double()
        scaled = (m.double() * screen[i, rest].double() / g_cut).float() if g_cut > 0 \
            else torch.zeros_like(screen[i, rest])
        out[i, rest] = torch.minimum(scaled, torch.nextafter(m, torch.zeros_like(m)))
    return out


def oar_p_screened(model, batch: SequenceBatch, sites: ProbeSites, teacher: ProbeOutput | None,
                   rows: list[int], vocab_size: int, *, screen: torch.Tensor, fraction: float,
                   **oar_p_kwargs) -> tuple[torch.Tensor, int]:
    """Screened OAR-P: exact OAR-P copies only for each row's top ``fraction`` of scored tokens
    by ``screen`` (OAR-G importance, ``[B, L]``), the rest ranked below them by
    :func:`merge_screened`. Returns ``[B, L]`` on every stage and the number of copies run."""
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        # every TP rank must mask the same tokens: take TP rank 0's screen (rounding-proof)
        dist.broadcast(screen, src=parallel_state.get_tensor_model_parallel_src_rank(),
                       group=parallel_state.get_tensor_model_parallel_group())
    selected = screen_positions(screen, sites.score_mask, rows, fraction)
    exact, copies = oar_p(model, batch, sites, teacher, rows, vocab_size, positions=selected,
                          **oar_p_kwargs)
    # rows outside ``rows`` have nothing selected, so merge_screened leaves them as they are (0)
    return merge_screened(exact, screen, selected.to(exact.device),
                          sites.score_mask.to(exact.device)), copies
