"""Outcome probes (paper Section 6.2): where the model's final answer is read, and how.

=============== ================================================================= =============
probe           output                                                            divergence
=============== ================================================================= =============
``last_token``  next-token distribution at the last position (LT-Logits)         KL(P0 || P)
``answer_mean`` softmax of the mean logits over the positions that predict the   KL(P0 || P)
                answer span (AS-Mean, the paper's best)
``answer_joint`` mean log-likelihood of the answer span's tokens (AS-Joint)       score drop
=============== ================================================================= =============

A :class:`ProbeSites` lists, for a batch, the positions whose logits each sequence's probe reads
(``row``, ``pos``) and the tokens they predict (``target``), plus ``score_mask``: the tokens to
score. Those are the reasoning tokens only: the response before the answer's opening tag
(``<answer>``, ``\\boxed{``; :meth:`SpanFinder.locate`), and never a probe position (a probe
reads its own position's embedding, so scoring it would measure the probe, not the reasoning).
The tag, the span and what follows keep weight 1.

Where ``last_token`` (LT-Logits) reads: at the position that predicts the answer's first token
(the last token of the opening tag) when the response has an answer, else at the last content
token, the one before the response's EOS (``eos_ids``), whose distribution is the model's
prediction at the end of its reasoning; the distribution after EOS predicts nothing. A response
truncated at the length limit (``SequenceBatch.truncated``) has no such point: without an answer
it is not scored. ``last_token`` scores the response tokens before its probe position.

Warm-up: for the first ``warmup_steps`` steps every sequence uses ``last_token``. A sequence
without an answer span falls back to ``last_token`` (``no_answer="fallback"``) or is not scored
and keeps uniform weights (``no_answer="uniform"``). A sequence with nothing to score (the
answer opens the response, one content token) is not scored either (kind ``none``).

Probe outputs are computed from vocab-parallel logits at the probe positions only; the
distributions stay vocab-parallel (each TP rank holds its slice of log-probs).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from megatron_oar.attribution.spans import DEFAULT_PATTERN, SpanFinder
from megatron_oar.models import vocab_parallel as vp
from megatron_oar.models.sequence_batch import SequenceBatch

PROBES = ("last_token", "answer_mean", "answer_joint")
NO_ANSWER = ("fallback", "uniform")
JOINT_IMPORTANCE = ("drop", "abs")
NONE = "none"  # a sequence that is not scored


@dataclass
class ProbeConfig:
    kind: str = "answer_mean"
    answer_pattern: str = DEFAULT_PATTERN  # regex with one group, or "boxed"
    warmup_steps: int = 0  # last_token for steps < warmup_steps
    no_answer: str = "fallback"  # fallback (last_token) | uniform (sequence not scored)
    joint_importance: str = "drop"  # answer_joint: max(S0 - S, 0) | abs: |S0 - S|

    def __post_init__(self) -> None:
        for name, value, allowed in (("kind", self.kind, PROBES), ("no_answer", self.no_answer, NO_ANSWER),
                                     ("joint_importance", self.joint_importance, JOINT_IMPORTANCE)):
            if value not in allowed:
                raise ValueError(f"probe.{name} must be one of {allowed}, got {value!r}")
        if self.warmup_steps < 0:
            raise ValueError(f"probe.warmup_steps must be >= 0, got {self.warmup_steps}")


@dataclass
class ProbeSites:
    """Where each row's outcome probe reads (positions and target tokens) and which of its tokens
    are scored (``locate_probes``)."""

    kinds: list[str]  # per row: last_token | answer_mean | answer_joint | none
    row: torch.Tensor  # [N] batch row of each probe position
    pos: torch.Tensor  # [N] position whose next-token logits are read
    target: torch.Tensor  # [N] the token at pos + 1
    score_mask: torch.Tensor  # [B, L] tokens to score

    @property
    def size(self) -> int:
        return len(self.kinds)

    def joint(self) -> torch.Tensor:
        return torch.tensor([k == "answer_joint" for k in self.kinds])

    def scored_rows(self) -> torch.Tensor:
        return torch.tensor([k != NONE for k in self.kinds]) & self.score_mask.any(dim=-1).cpu()

    def take(self, rows: list[int]) -> ProbeSites:
        """The sites of the sub-batch ``rows`` (repeats allowed), rows renumbered 0..len-1."""
        parts_row, parts_pos, parts_target = [], [], []
        for new, old in enumerate(rows):
            sel = self.row == old
            parts_row.append(torch.full((int(sel.sum()),), new, dtype=torch.long))
            parts_pos.append(self.pos[sel])
            parts_target.append(self.target[sel])
        return ProbeSites([self.kinds[r] for r in rows], torch.cat(parts_row), torch.cat(parts_pos),
                         torch.cat(parts_target), self.score_mask[rows])


def _eos_set(eos_ids, finder: SpanFinder | None) -> set[int]:
    if eos_ids is None:
        eos = getattr(finder.tokenizer, "eos_token_id", None) if finder is not None else None
        eos_ids = [] if eos is None else [eos]
    elif isinstance(eos_ids, int):
        eos_ids = [eos_ids]
    return {int(e) for e in eos_ids}


def locate_probes(batch: SequenceBatch, cfg: ProbeConfig, step: int = 0,
                finder: SpanFinder | None = None, eos_ids: int | Iterable[int] | None = None) -> ProbeSites:
    """Probe positions and scored tokens for every row of ``batch``.

    ``finder`` (a :class:`SpanFinder` over the tokenizer) is needed for the answer probes; with
    it, ``last_token`` (also in the warm-up and as the no-answer fallback) reads before the
    answer too. ``eos_ids``: the token ids that end a response (EOS, stop tokens); a response's
    final token in this set is stepped over by ``last_token``. Default: the finder tokenizer's
    ``eos_token_id`` (none without a finder). Rows of ``batch.truncated`` without an answer are
    not scored.
    """
    response = batch.response_mask()
    kinds, rows, positions, score = [], [], [], torch.zeros_like(response)
    warm = step < cfg.warmup_steps or cfg.kind == "last_token"
    if not warm and finder is None:
        raise ValueError(f"probe.kind={cfg.kind!r} needs a tokenizer to find the answer span")
    eos = _eos_set(eos_ids, finder)
    truncated = batch.truncated.tolist()
    nothing = torch.zeros(0, dtype=torch.long)
    for i in range(batch.size):
        start, end = int(batch.prompt_lens[i]), int(batch.lengths[i])
        ids = batch.response_ids(i)
        found = finder.locate(ids) if finder is not None and ids else None
        kind, pos, reasoning_end = NONE, nothing, start
        if found is not None:
            t0, k0, k1 = found
            kind = "last_token" if warm else cfg.kind
            a0, a1 = start + k0, start + k1  # the answer's tokens
            # positions a0 - 1 .. a1 - 2 predict the span; last_token reads the first of them
            pos = torch.tensor([a0 - 1]) if kind == "last_token" else torch.arange(a0 - 1, a1 - 1)
            reasoning_end = min(start + t0, a0 - 1)  # before the opening tag, before any probe
        elif (warm or cfg.no_answer == "fallback") and not truncated[i]:
            kind = "last_token"
            last = end - 1 - int(ids[-1] in eos) if ids else start - 1  # the last content token
            pos = torch.tensor([last])
            reasoning_end = last
        if reasoning_end <= start:
            kind, pos = NONE, nothing  # nothing before the probe to score
        score[i, start:reasoning_end] = True
        kinds.append(kind)
        positions.append(pos)
        rows.append(torch.full((len(pos),), i, dtype=torch.long))
    pos = torch.cat(positions)
    row = torch.cat(rows)
    targets = batch.tokens.cpu()[row, (pos + 1).clamp(max=batch.tokens.shape[1] - 1)]
    return ProbeSites(kinds, row, pos, targets, score.to(batch.tokens.device))


@dataclass
class ProbeOutput:
    """Per row: local log-prob slice of the probe distribution, and the joint score."""

    logp: torch.Tensor  # [B, V/TP] (rows of distribution probes)
    score: torch.Tensor  # [B] mean answer log-likelihood (answer_joint rows)

    @classmethod
    def from_position_logits(cls, logits: torch.Tensor, sites: ProbeSites, vocab_size: int) -> ProbeOutput:
        """From vocab-parallel logits ``[N, V/TP]`` at ``sites``'s positions (in sites order)."""
        b, dev, f64 = sites.size, logits.device, torch.float64  # [B, V/TP]: float64 costs nothing
        row = sites.row.to(dev)
        count = torch.zeros(b, dtype=f64, device=dev).index_add_(0, row, torch.ones_like(row, dtype=f64))
        count = count.clamp_min(1)
        mean_logits = torch.zeros(b, logits.shape[-1], dtype=f64, device=dev).index_add(0, row, logits.to(f64))
        logp = vp.log_softmax(mean_logits / count.unsqueeze(-1), vocab_size, f64)
        token_lp = vp.target_logprobs(logits, sites.target.to(dev), vocab_size, f64)
        score = torch.zeros(b, dtype=f64, device=dev).index_add(0, row, token_lp) / count
        return cls(logp, score)

    def take(self, rows: list[int]) -> ProbeOutput:
        return ProbeOutput(self.logp[rows], self.score[rows])


def divergence(teacher: ProbeOutput, student: ProbeOutput, sites: ProbeSites,
               joint_importance: str = "drop", clamp: bool = True) -> torch.Tensor:
    """Per row: KL(P0 || P) for distribution probes, the score drop for ``answer_joint``.

    ``clamp=False`` returns the raw drop ``S0 - S`` (differentiable; OAR-G uses it).
    """
    kl = vp.kl_divergence(teacher.logp, student.logp)
    drop = teacher.score - student.score
    if clamp:
        drop = drop.abs() if joint_importance == "abs" else drop.clamp_min(0.0)
    joint = sites.joint().to(kl.device)
    out = torch.where(joint, drop, kl)
    scored = torch.tensor([k != NONE for k in sites.kinds], device=kl.device)
    return torch.where(scored, out, torch.zeros_like(out))
