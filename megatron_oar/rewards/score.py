"""Batch reward scoring: extraction (in process), verification (worker pool), format, combination.

    reward = accuracy_weight * accuracy + format_weight * format
             + unparseable_penalty    if the status is no_answer or parse_error
    reward = 0                        if the status is timeout or error

Per-item status: ``ok`` (answer verified, right or wrong), ``no_answer`` (no extractor found
one), ``parse_error`` (found but not parseable, too long or too deeply nested), ``timeout``
(verification ran past ``timeout_s``; its worker was killed and replaced), ``error`` (the
verifier raised or its worker died).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from megatron_oar.rewards.extract import (
    EXTRACTORS,
    extract_answer,
    nesting_depth,
    normalize_answer,
    normalize_reference,
    sanitize,
)
from megatron_oar.rewards.format_reward import FORMAT_STYLES, format_score
from megatron_oar.rewards.pool import STATUSES, VerifierPool


@dataclass
class RewardConfig:
    """Reward options (config section ``rewards``)."""

    extractors: list[str] = field(default_factory=lambda: ["answer_tag", "boxed", "gsm8k"])
    accuracy_weight: float = 1.0
    format_weight: float = 0.0
    unparseable_penalty: float = 0.0   # added to the reward for no_answer / parse_error
    format_style: str = "answer_tag"   # answer_tag | think_answer | boxed
    format_pattern: str | None = None  # regex (fullmatch, DOTALL) that replaces format_style
    verifier: str = "math_verify"      # or "package.module:function" -> fn(pred, gold) -> bool
    float_rounding: int = 6            # math-verify options
    numeric_precision: int = 15
    strict: bool = True
    timeout_s: float = 5.0             # hard limit per answer (the worker is killed after it)
    batch_timeout_s: float | None = None  # optional limit for a whole score_batch call
    num_workers: int = 4
    start_method: str = "forkserver"   # forkserver | spawn
    worker_memory_mb: int | None = 4096  # address-space limit per worker (None: no limit)
    startup_timeout_s: float = 120.0
    max_tail_chars: int = 8192         # extraction only looks at the last N characters
    max_answer_chars: int = 1000       # longer extracted answers -> parse_error, not parsed
    max_nesting: int = 32              # deeper ()[]{} nesting -> parse_error, not parsed

    def validate(self) -> None:
        """Raises ``ValueError`` naming the offending ``rewards.*`` field."""
        bad = [e for e in self.extractors if e not in EXTRACTORS]
        if not self.extractors or bad:
            raise ValueError(f"rewards.extractors: unknown {bad} (choose from {sorted(EXTRACTORS)})"
                             if bad else "rewards.extractors must name at least one extractor")
        if self.format_pattern is None and self.format_style not in FORMAT_STYLES:
            raise ValueError(f"rewards.format_style must be one of {FORMAT_STYLES}, "
                             f"got {self.format_style!r}")
        if self.format_pattern is not None:
            format_score("", pattern=self.format_pattern)  # compiles; raises naming the field
        module, sep, fn = self.verifier.partition(":")
        if self.verifier != "math_verify" and not (sep and module and fn and " " not in self.verifier):
            raise ValueError(f"rewards.verifier must be 'math_verify' or 'package.module:function', "
                             f"got {self.verifier!r}")
        if self.start_method not in ("forkserver", "spawn"):
            raise ValueError(f"rewards.start_method must be 'forkserver' or 'spawn', got {self.start_method!r}")
        for name in ("timeout_s", "startup_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"rewards.{name} must be > 0, got {getattr(self, name)}")
        if self.batch_timeout_s is not None and not self.batch_timeout_s > 0:
            raise ValueError(f"rewards.batch_timeout_s must be > 0 or null, got {self.batch_timeout_s}")
        for name in ("num_workers", "max_tail_chars", "max_answer_chars", "max_nesting"):
            if getattr(self, name) < 1:
                raise ValueError(f"rewards.{name} must be >= 1, got {getattr(self, name)}")

    def make_pool(self) -> VerifierPool:
        """A ``VerifierPool`` with these settings (close it, or use ``with``)."""
        self.validate()
        options = dict(float_rounding=self.float_rounding, numeric_precision=self.numeric_precision,
                       strict=self.strict)
        return VerifierPool(self.num_workers, self.timeout_s, verifier=self.verifier,
                            verifier_options=options, start_method=self.start_method,
                            memory_limit_mb=self.worker_memory_mb,
                            startup_timeout_s=self.startup_timeout_s)


@dataclass
class RewardBatch:
    """Scores for a batch of responses (tensors are float32, one entry per response)."""

    rewards: torch.Tensor  # noqa: F821
    accuracy: torch.Tensor  # noqa: F821
    format: torch.Tensor  # noqa: F821
    status: list[str]
    answers: list[str | None]                    # normalized extracted answer
    answer_spans: list[tuple[int, int] | None]   # [start, end) of the answer in the response
    details: list[str]                           # verifier messages (errors, timeouts)
    counts: dict[str, int]                       # items per status, all statuses present
    worker_restarts: int = 0                     # workers killed and replaced in this batch

    def metrics(self, prefix: str = "reward/") -> dict[str, float]:
        """Scalars for logging: means, and counts of timeouts / failures per status."""
        n = max(1, len(self.status))
        out = {f"{prefix}mean": float(self.rewards.mean()) if len(self.status) else 0.0,
               f"{prefix}accuracy": float(self.accuracy.sum()) / n,
               f"{prefix}format": float(self.format.sum()) / n,
               f"{prefix}worker_restarts": float(self.worker_restarts)}
        out.update({f"{prefix}{status}": float(c) for status, c in self.counts.items()})
        return out


def _prepare(response: str, cfg: RewardConfig):
    """(answer or None, span, status or None when it needs verifying, detail) for one response."""
    found = extract_answer(response, cfg.extractors, tail_chars=cfg.max_tail_chars)
    if found is None:
        return None, None, "no_answer", ""
    answer = normalize_answer(found.text)
    span = (found.start, found.end)
    if not answer:
        return None, span, "no_answer", ""
    if len(answer) > cfg.max_answer_chars:
        return answer[:cfg.max_answer_chars], span, "parse_error", (
            f"answer longer than rewards.max_answer_chars={cfg.max_answer_chars}")
    if nesting_depth(answer) > cfg.max_nesting:
        return answer, span, "parse_error", f"nesting deeper than rewards.max_nesting={cfg.max_nesting}"
    return answer, span, None, ""


def score_batch(responses: list[str], references: list[str], cfg: RewardConfig | None = None,
                pool: VerifierPool | None = None) -> RewardBatch:
    """Scores ``responses`` against ``references`` (same length).

    ``pool``: a running ``VerifierPool`` to reuse (training keeps one open, see
    ``RewardScorer``); without it a pool is started and closed for this call.
    Identical (answer, reference) pairs are verified once.
    """
    import torch

    cfg = cfg or RewardConfig()
    cfg.validate()
    if len(responses) != len(references):
        raise ValueError(f"score_batch: {len(responses)} responses but {len(references)} references")
    n = len(responses)
    status: list[str | None] = [None] * n
    answers: list[str | None] = [None] * n
    spans: list[tuple[int, int] | None] = [None] * n
    details = [""] * n
    fmt = [0.0] * n
    unique: dict[tuple[str, str], list[int]] = {}
    for i, (resp, ref) in enumerate(zip(responses, references)):
        if not isinstance(resp, str):
            raise TypeError(f"score_batch: responses[{i}] is {type(resp).__name__}, not str")
        resp = sanitize(resp)
        fmt[i] = format_score(resp, cfg.format_style, cfg.format_pattern)
        answers[i], spans[i], status[i], details[i] = _prepare(resp, cfg)
        if status[i] is None:
            gold = normalize_reference(ref)
            if not gold:
                status[i], details[i] = "error", "empty reference answer"
                continue
            unique.setdefault((answers[i], gold[:cfg.max_answer_chars]), []).append(i)

    acc = [0.0] * n
    restarts = 0
    if unique:
        keys = list(unique)
        if pool is None:
            with cfg.make_pool() as own:
                results = own.map(keys, cfg.batch_timeout_s)
                restarts = own.restarts
        else:
            before = pool.restarts
            results = pool.map(keys, cfg.batch_timeout_s)
            restarts = pool.restarts - before
        for key, res in zip(keys, results):
            for i in unique[key]:
                status[i], details[i] = res.status, res.detail
                acc[i] = 1.0 if (res.status == "ok" and res.correct) else 0.0

    rewards = []
    for i in range(n):
        if status[i] in ("timeout", "error"):
            rewards.append(0.0)
            continue
        r = cfg.accuracy_weight * acc[i] + cfg.format_weight * fmt[i]
        if status[i] in ("no_answer", "parse_error"):
            r += cfg.unparseable_penalty
        rewards.append(r)
    counts = Counter(status)
    return RewardBatch(
        rewards=torch.tensor(rewards, dtype=torch.float32),
        accuracy=torch.tensor(acc, dtype=torch.float32),
        format=torch.tensor(fmt, dtype=torch.float32),
        status=list(status), answers=answers, answer_spans=spans, details=details,
        counts={s: counts.get(s, 0) for s in STATUSES}, worker_restarts=restarts)


class RewardScorer:
    """Keeps a ``VerifierPool`` open across training steps: ``with RewardScorer(cfg) as s: s(resps, refs)``."""

    def __init__(self, cfg: RewardConfig | None = None):
        self.cfg = cfg or RewardConfig()
        self.pool = self.cfg.make_pool()

    def __call__(self, responses: list[str], references: list[str]) -> RewardBatch:
        if self.pool.closed:  # map() closes the pool after an interrupt; start a fresh one
            self.pool = self.cfg.make_pool()
        return score_batch(responses, references, self.cfg, pool=self.pool)

    def close(self) -> None:
        self.pool.close()

    def __enter__(self) -> RewardScorer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
