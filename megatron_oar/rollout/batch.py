"""What a rollout returns: G completions per prompt with vLLM's logprobs, grouped by prompt."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from megatron_oar.models.sequence_batch import SequenceBatch


def share(dp_rank: int, dp_size: int, n: int) -> range:
    """The items ``[0, n)`` rollout group ``dp_rank`` of ``dp_size`` generates: contiguous, in
    group order, so gathering the groups' outputs gives item order."""
    per = -(-n // dp_size)
    return range(dp_rank * per, min((dp_rank + 1) * per, n))


@dataclass(frozen=True)
class RoutedExperts:
    """vLLM's routed experts of one completion once the rollout groups' batches are joined
    (:func:`~megatron_oar.rollout.engine.gather_rollouts`): the array stays on the ranks of the
    rollout group that generated it (``ranks``; ``array`` there, None elsewhere), every rank
    knows its ``shape`` ``[prompt + response - 1, num_hidden_layers, k]``."""

    ranks: tuple[int, ...]
    shape: tuple[int, ...]
    array: object = None  # the numpy array, on ``ranks`` only

    def __reduce__(self):  # pickled (gathered) without the array
        return RoutedExperts, (self.ranks, self.shape)

    @classmethod
    def held(cls, routed: list[list] | None, ranks: tuple[int, ...]) -> list[list] | None:
        """A batch's ``routed_experts`` (per prompt and completion, arrays or None) as held here
        by the rollout group ``ranks``."""
        if routed is None:
            return None
        return [[None if a is None else cls(ranks, tuple(a.shape), a) for a in group] for group in routed]


@dataclass(frozen=True)
class Completion:
    """Completion ``j`` of prompt ``i`` (a flat view into a :class:`RolloutBatch`)."""

    prompt_index: int
    sample_index: int
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    stop_reason: int | str | None
    text: str
    # vLLM's [tokens, layers, k] array (rollout.return_routed_experts), or where it is held
    # (RoutedExperts) once gathered over the rollout groups
    routed_experts: object = None


@dataclass
class RolloutBatch:
    """Completions grouped by prompt: ``response_ids[i][j]`` is completion ``j`` of prompt ``i``.

    ``logprobs[i][j][t]`` is vLLM's log-probability of ``response_ids[i][j][t]`` (see
    ``logprobs_mode``: raw = temperature-1 log-softmax of the logits, processed = the
    distribution sampled from). ``finish_reasons`` are vLLM's (``stop``: EOS, a stop token or a
    stop string; ``length``: ``max_new_tokens`` reached; ``abort``); ``stop_reasons`` name the stop
    string or token id (``None`` for EOS or length). ``seeds[i]`` is the request seed of prompt
    ``i``; completion ``j`` was sampled with ``seeds[i] + j`` (vLLM's rule for ``n > 1``).
    """

    prompt_ids: list[list[int]]
    response_ids: list[list[list[int]]]
    logprobs: list[list[list[float]]]
    finish_reasons: list[list[str]]
    stop_reasons: list[list[int | str | None]]
    texts: list[list[str]]
    seeds: list[int]
    n: int
    temperature: float
    top_p: float
    top_k: int
    logprobs_mode: str
    gen_seconds: float = 0.0
    meta: dict = field(default_factory=dict)
    # per prompt and completion, vLLM's routed experts [prompt + response - 1, layers, k]
    # (numpy; rollout.return_routed_experts, MoE models; RoutedExperts once gathered), else None
    routed_experts: list[list] | None = None

    def __post_init__(self) -> None:
        p = len(self.prompt_ids)
        for name in ("response_ids", "logprobs", "finish_reasons", "stop_reasons", "texts", "seeds"):
            if len(getattr(self, name)) != p:
                raise ValueError(f"RolloutBatch.{name} has {len(getattr(self, name))} entries, "
                                 f"expected one per prompt ({p})")
        for i in range(p):
            if len(self.response_ids[i]) != self.n:
                raise ValueError(f"prompt {i} has {len(self.response_ids[i])} completions, "
                                 f"expected n={self.n}")
            for j in range(self.n):
                if len(self.logprobs[i][j]) != len(self.response_ids[i][j]):
                    raise ValueError(f"completion ({i}, {j}): {len(self.logprobs[i][j])} logprobs "
                                     f"for {len(self.response_ids[i][j])} tokens")

    @property
    def num_prompts(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_sequences(self) -> int:
        return self.num_prompts * self.n

    @property
    def num_response_tokens(self) -> int:
        return sum(len(r) for group in self.response_ids for r in group)

    @property
    def tokens_per_second(self) -> float:
        return self.num_response_tokens / self.gen_seconds if self.gen_seconds > 0 else 0.0

    def completion(self, i: int, j: int) -> Completion:
        return Completion(i, j, self.prompt_ids[i], self.response_ids[i][j], self.logprobs[i][j],
                          self.finish_reasons[i][j], self.stop_reasons[i][j], self.texts[i][j],
                          None if self.routed_experts is None else self.routed_experts[i][j])

    def completions(self) -> Iterator[Completion]:
        """Every completion, prompt-major: flat index ``i * n + j``."""
        for i in range(self.num_prompts):
            for j in range(self.n):
                yield self.completion(i, j)

    def to_sequences(self, pad_id: int = 0) -> tuple[SequenceBatch, torch.Tensor]:
        """Every completion, prompt-major (row ``i * n + j``), as prompt + response right-padded
        with ``pad_id``, and ``logprobs [B, S]``: vLLM's log-probability of ``tokens[b, t]`` at
        response positions, 0 elsewhere (so a model's log-probs of ``tokens[:, 1:]`` line up with
        ``logprobs[:, 1:]``). Completions that hit the length limit are marked truncated."""
        rows = list(self.completions())
        b = len(rows)
        s = max((len(c.prompt_ids) + len(c.response_ids) for c in rows), default=0)
        tokens = torch.full((b, s), pad_id, dtype=torch.long)
        logprobs = torch.zeros((b, s), dtype=torch.float32)
        for r, c in enumerate(rows):
            p, t = len(c.prompt_ids), len(c.response_ids)
            tokens[r, :p] = torch.tensor(c.prompt_ids, dtype=torch.long)
            if t:
                tokens[r, p:p + t] = torch.tensor(c.response_ids, dtype=torch.long)
                logprobs[r, p:p + t] = torch.tensor(c.logprobs, dtype=torch.float32)
        seqs = SequenceBatch(
            tokens, torch.tensor([len(c.prompt_ids) for c in rows], dtype=torch.long),
            torch.tensor([len(c.prompt_ids) + len(c.response_ids) for c in rows], dtype=torch.long),
            truncated=torch.tensor([c.finish_reason == "length" for c in rows], dtype=torch.bool))
        return seqs, logprobs

    def metrics(self, prefix: str = "rollout/") -> dict[str, float]:
        lengths = [len(r) for group in self.response_ids for r in group]
        reasons = [f for group in self.finish_reasons for f in group]
        count = max(len(lengths), 1)
        return {
            f"{prefix}num_sequences": float(len(lengths)),
            f"{prefix}response_tokens": float(sum(lengths)),
            f"{prefix}response_length_mean": sum(lengths) / count,
            f"{prefix}response_length_max": float(max(lengths, default=0)),
            f"{prefix}truncated_fraction": sum(r == "length" for r in reasons) / count,
            f"{prefix}gen_seconds": self.gen_seconds,
            f"{prefix}tokens_per_second": self.tokens_per_second,
        }

    @classmethod
    def concat(cls, batches: list[RolloutBatch]) -> RolloutBatch:
        """Joins batches of one sampling configuration (e.g. from every rollout group)."""
        if not batches:
            raise ValueError("RolloutBatch.concat needs at least one batch")
        first = batches[0]
        keys = ("n", "temperature", "top_p", "top_k", "logprobs_mode")
        for b in batches[1:]:
            for k in keys:
                if getattr(b, k) != getattr(first, k):
                    raise ValueError(f"cannot concat rollouts with different {k}: "
                                     f"{getattr(first, k)!r} vs {getattr(b, k)!r}")

        def join(name):
            return [x for b in batches for x in getattr(b, name)]

        return cls(
            prompt_ids=join("prompt_ids"), response_ids=join("response_ids"),
            logprobs=join("logprobs"), finish_reasons=join("finish_reasons"),
            stop_reasons=join("stop_reasons"), texts=join("texts"), seeds=join("seeds"),
            n=first.n, temperature=first.temperature, top_p=first.top_p, top_k=first.top_k,
            logprobs_mode=first.logprobs_mode,
            gen_seconds=max(b.gen_seconds for b in batches),
            meta={"parts": [len(b.prompt_ids) for b in batches]},
            routed_experts=None if all(b.routed_experts is None for b in batches) else [
                x for b in batches for x in (b.routed_experts or [[None] * b.n] * len(b.prompt_ids))],
        )
