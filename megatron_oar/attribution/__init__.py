"""Token importance for OAR, computed inside megatron-core's forward/backward schedule.

.. code-block:: python

    attr = compute_importance(model, batch, AttributionConfig(method="oar_g"), vocab_size=V,
                              seq_adv=seq_adv, step=step, tokenizer=tok)
    credit = assign_credit(ShapingConfig(scheme="oar"), seq_adv, batch.response_mask(),
                           importance=attr.importance, score_mask=attr.score_mask)

- :mod:`.probes`    outcome probes (last_token, answer_mean, answer_joint), warm-up, fallback
- :mod:`.importance_passes`  the clean teacher pass, OAR-G (noisy forward + input-gradient
                    backward), OAR-P (batched [PAD]-masked forwards; a serial mode for cost
                    comparisons), screened OAR-P (exact OAR-P on OAR-G's top ``screen_fraction``
                    tokens); micro-batches by token budget (``batching``) or padded
- :mod:`.schedule`  running probe passes through ``get_forward_backward_func()`` on any TP/PP

Only sequences with a non-zero advantage are scored; the others keep weight 1 (their token
advantages are zero anyway). Importance is returned on every rank of the model-parallel group
(context-parallel ranks included: under ``parallel.cp`` every pass runs each rank's chunks of
every sequence, :mod:`.importance_passes`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import torch

from megatron_oar.attribution.importance_passes import oar_g, oar_p, oar_p_screened, probe_teacher, screen_count
from megatron_oar.attribution.probes import NONE, ProbeConfig, ProbeOutput, ProbeSites, locate_probes
from megatron_oar.attribution.schedule import RouteFn
from megatron_oar.attribution.spans import SpanFinder
from megatron_oar.methods import ATTRIBUTION_METHODS
from megatron_oar.models.equal_calls import equal_calls
from megatron_oar.models.parallel import unwrap
from megatron_oar.models.sequence_batch import SequenceBatch

METHODS = ATTRIBUTION_METHODS
BATCHINGS = ("token_budget", "padded")  # models.micro_batches' groupings that attribution runs


@dataclass
class AttributionConfig:
    method: str = "oar_g"  # oar_g | oar_p | oar_p_screened
    probe: ProbeConfig = field(default_factory=ProbeConfig)
    sigma: float = 1e-3  # OAR-G noise std on the scored tokens' embeddings
    seed: int = 0  # OAR-G noise: seeded per (seed, step, sample id)
    # Micro-batching, as the training keys (null: the training one, Config.attribution_config):
    batching: str | None = None  # token_budget | padded; null: train.batching (packed: token_budget)
    micro_batch_size: int | None = None  # rows per OAR-G/teacher micro-batch; padded only;
    #                                      null: train.micro_batch_size
    perturb_micro_batch_size: int = 16  # masked copies per OAR-P micro-batch; padded only
    max_tokens_per_micro_batch: int | None = None  # tokens per OAR-G/teacher micro-batch;
    #                                      token_budget only; null: chosen by oar train from the memory
    #                                      left (OAR-G; exact OAR-P's teacher: the training budget)
    max_tokens_per_copy_micro_batch: int | None = None  # tokens per OAR-P micro-batch;
    #                                      token_budget only; null: chosen by oar train from the memory
    #                                      left; a config used on its own: train.max_tokens_per_micro_batch
    length_bucket: int = 64  # padded: OAR-P copies are padded up to a multiple of this
    serial: bool = False  # OAR-P one copy at a time (only for the paper's cost comparison)
    pad_id: int | None = None  # OAR-P mask token; None: the tokenizer's pad token
    allow_fp8: bool = False  # run OAR-G's backward under FP8 autocast (default: bf16)
    screen_fraction: float = 0.2  # oar_p_screened: exact OAR-P on this top fraction by OAR-G

    def __post_init__(self) -> None:
        if isinstance(self.probe, dict):
            self.probe = ProbeConfig(**self.probe)
        if self.method not in METHODS:
            raise ValueError(f"attribution.method must be one of {METHODS}, got {self.method!r}")
        if not 0 < self.screen_fraction <= 1:
            raise ValueError(f"attribution.screen_fraction must be in (0, 1], got {self.screen_fraction}")
        if self.sigma <= 0:
            raise ValueError(f"attribution.sigma must be > 0, got {self.sigma}")
        if self.batching is not None and self.batching not in BATCHINGS:
            raise ValueError(f"attribution.batching must be one of {BATCHINGS} or null (train.batching), "
                             f"got {self.batching!r}")
        for name in ("micro_batch_size", "perturb_micro_batch_size", "length_bucket",
                     "max_tokens_per_micro_batch", "max_tokens_per_copy_micro_batch"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"attribution.{name} must be >= 1, got {getattr(self, name)}")

    def resolve(self, *, batching: str = "token_budget", micro_batch_size: int = 4,
                max_tokens: int | None = None) -> AttributionConfig:
        """A copy with the null batching keys filled from the training ones (``batching``:
        ``train.batching``, ``packed`` read as ``token_budget``; ``micro_batch_size``;
        ``max_tokens``: the training token budget, for both budgets). The defaults serve a config
        used on its own (tests, benchmarks): token budgets of ``micro_batch_size`` rows of the
        longest scored row for OAR-G and the teacher, ``perturb_micro_batch_size`` rows of it for
        OAR-P (``importance_passes``, where a token budget is null)."""
        return replace(self, batching=self.batching or ("padded" if batching == "padded" else "token_budget"),
                       micro_batch_size=self.micro_batch_size or micro_batch_size,
                       max_tokens_per_micro_batch=self.max_tokens_per_micro_batch or max_tokens,
                       max_tokens_per_copy_micro_batch=self.max_tokens_per_copy_micro_batch or max_tokens)


@dataclass
class Attribution:
    importance: torch.Tensor  # [B, L] float32, 0 where not scored
    score_mask: torch.Tensor  # [B, L] the tokens that were scored
    kinds: list[str]  # probe used per row (none: not scored)
    stats: dict[str, float]
    # the sequences the passes ran over: (length, forward-equivalents, probe positions), forward
    # = 1, input-gradient-only backward = 1; the output layer ran at the probe positions only
    # (the trainer's model-FLOPs count, models/flops.py)
    work: list[tuple[int, float, int]] = field(default_factory=list)


def resolve_pad_id(cfg: AttributionConfig, tokenizer) -> int:
    if cfg.pad_id is not None:
        return cfg.pad_id
    pad = getattr(tokenizer, "pad_token_id", None) if tokenizer is not None else None
    if pad is None:
        raise ValueError("OAR-P needs attribution.pad_id, or a tokenizer with a pad token")
    return int(pad)


def compute_importance(model, batch: SequenceBatch, cfg: AttributionConfig, *, vocab_size: int,
                       seq_adv: torch.Tensor | None = None, step: int = 0, tokenizer=None,
                       sites: ProbeSites | None = None, teacher: ProbeOutput | None = None,
                       external_teacher: bool = False, teacher_fp8: bool | None = None,
                       route: RouteFn | None = None) -> Attribution:
    """Importance ``[B, L]`` of every scored response token of ``batch`` (any TP/PP layout).

    ``sites`` and ``teacher`` may come from the trainer's old-logprob pass (no extra forward);
    otherwise the sites are located here (``tokenizer`` is needed for answer probes) and the teacher
    is computed by one clean forward-only pass. ``external_teacher=True`` says the caller's
    ``teacher`` is the one to use even where it is None (pipeline stages other than the last,
    which never read it), so no rank runs the teacher pass.

    The teacher P0 and the students must run in the same precision, or OAR-G differentiates
    the precision gap (its scores stay non-zero as ``sigma -> 0``) and OAR-P measures it.
    Students run outside FP8 (OAR-G inside it with ``allow_fp8`` on an FP8 model).
    ``teacher_fp8`` says whether the caller's teacher came from a pass under FP8 autocast;
    default (None): from a plain forward of ``model``, so FP8 iff the model's config has FP8
    on (the trainer's old-logprob pass). A caller's teacher of another precision than a
    student's is not used: that student gets a clean teacher pass in its own precision
    (``stats["teacher_passes"]`` counts them).

    ``route`` (MoE): how every pass here routes (``schedule.RouteFn``; None: on its own). The
    teacher and the students must route alike, or the students' divergence from the teacher is
    not zero without any perturbation: where the caller's teacher came from a pass that replayed
    a routing (``model.routing_replay=rollout``), ``route`` replays it here too
    (``training.routing_replay.attribution_route``).

    ``cfg``'s null batching keys: the trainer passes ``Config.attribution_config()`` (filled from
    the training keys); a config used on its own gets :meth:`AttributionConfig.resolve`'s defaults.
    """
    start = time.perf_counter()
    cfg = cfg.resolve()  # no-op for a resolved config
    if sites is None:
        finder = SpanFinder(tokenizer, cfg.probe.answer_pattern) if tokenizer is not None else None
        sites = locate_probes(batch, cfg.probe, step, finder)
    selected = sites.scored_rows()
    if seq_adv is not None:
        selected &= (seq_adv != 0).cpu()
    rows = selected.nonzero().flatten().tolist()
    score_mask = sites.score_mask & selected.to(sites.score_mask.device).unsqueeze(-1)
    importance = torch.zeros(batch.tokens.shape, dtype=torch.float32, device=batch.tokens.device)
    copies = 0
    own_teachers: dict[bool, ProbeOutput | None] = {}
    # a rank that scores no row still runs the passes where its model calls pair other DP
    # ranks' (models.equal_calls; FP8 matters only to OAR-G's backward under allow_fp8): its
    # passes run filler calls only
    if rows or equal_calls(unwrap(model).config, forward_only=not cfg.allow_fp8):
        model_fp8 = bool(getattr(unwrap(model).config, "fp8", None))
        external = teacher is not None or external_teacher
        sequences = {"batching": cfg.batching, "max_tokens": cfg.max_tokens_per_micro_batch}
        from_caller = model_fp8 if teacher_fp8 is None else bool(teacher_fp8)

        def teacher_in(fp8: bool) -> ProbeOutput | None:
            """P0 in a student's precision (the same decision on every rank: no deadlock)."""
            if external and from_caller == fp8:
                return teacher
            if fp8 not in own_teachers:
                own_teachers[fp8] = probe_teacher(model, batch, sites, rows, vocab_size,
                                                  cfg.micro_batch_size, allow_fp8=fp8, route=route, **sequences)
            return own_teachers[fp8]

        if cfg.method in ("oar_g", "oar_p_screened"):
            importance = oar_g(model, batch, sites, teacher_in(cfg.allow_fp8 and model_fp8), rows,
                               vocab_size, sigma=cfg.sigma, seed=cfg.seed, step=step,
                               micro_batch_size=cfg.micro_batch_size, allow_fp8=cfg.allow_fp8, route=route,
                               **sequences)
        if cfg.method in ("oar_p", "oar_p_screened"):
            exact = dict(pad_id=resolve_pad_id(cfg, tokenizer), micro_batch_size=cfg.perturb_micro_batch_size,
                         length_bucket=cfg.length_bucket, serial=cfg.serial,
                         joint_importance=cfg.probe.joint_importance, batching=cfg.batching,
                         max_tokens=cfg.max_tokens_per_copy_micro_batch, route=route)
            if cfg.method == "oar_p":
                importance, copies = oar_p(model, batch, sites, teacher_in(False), rows, vocab_size,
                                           **exact)
            else:  # the OAR-G importance above is the screen
                importance, copies = oar_p_screened(model, batch, sites, teacher_in(False), rows,
                                                    vocab_size, screen=importance,
                                                    fraction=cfg.screen_fraction, **exact)
    kinds = sites.kinds
    lengths = batch.lengths.cpu()
    if cfg.method == "oar_p_screened":
        row_copies = {i: screen_count(int(sites.score_mask[i].sum()), cfg.screen_fraction) for i in rows}
    else:
        row_copies = {i: int(sites.score_mask[i].sum()) for i in rows} if cfg.method == "oar_p" else {}
    stats = {
        "scored_sequences": float(len(rows)),
        "scored_tokens": float(score_mask.sum()),
        "fallback_last_token": float(sum(k == "last_token" for k in kinds) if cfg.probe.kind != "last_token" else 0),
        "unscored_no_answer": float(sum(k == NONE for k in kinds)),
        "masked_forwards": float(copies),
        "teacher_passes": float(len(own_teachers)),
        # the work, in tokens: OAR-G's noisy forward + input-gradient backward run over whole
        # scored sequences; each OAR-P copy is a forward over its sequence
        "oar_g_tokens": float(sum(int(lengths[i]) for i in rows)) if cfg.method != "oar_p" else 0.0,
        "masked_copy_tokens": float(sum(n * int(lengths[i]) for i, n in row_copies.items())),
        **({"screened_out_tokens": float(score_mask.sum()) - copies}
           if cfg.method == "oar_p_screened" else {}),
        "seconds": time.perf_counter() - start,
    }
    probes = torch.bincount(sites.row.cpu(), minlength=batch.size).tolist()
    work = [(int(lengths[i]), float(len(own_teachers)), probes[i]) for i in rows if own_teachers]
    work += [(int(lengths[i]), 2.0, probes[i]) for i in rows if cfg.method != "oar_p"]
    work += [(int(lengths[i]), float(n), probes[i]) for i, n in row_copies.items()]
    return Attribution(importance * score_mask, score_mask, kinds, stats, work)


__all__ = ["Attribution", "AttributionConfig", "ProbeConfig", "ProbeOutput", "ProbeSites", "SequenceBatch",
           "SpanFinder", "compute_importance", "locate_probes", "probe_teacher"]
