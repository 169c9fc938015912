"""Token-level analysis records: one scored trajectory per JSONL line.

``oar analyze oracle`` writes them, ``oar viz`` and the recall table read them. A record holds the
response's tokens and, per method, one score per response token::

    {"id": "math500/17#3", "prompt": "...", "reference": "42", "correct": true,
     "token_ids": [...], "tokens": ["The", " answer", ...],      # response tokens, decoded one by one
     "scores": {"oar_p": [...], "oar_g": [...], "entropy": [...], "random": [...]},
     "scored": [true, ...],   # tokens the probe scores (before the answer span); others are not ranked
     "oracle": [0, 1, ...],   # 1: replacing the token flips correctness (a causal pivot); null: not run
     "substitutes": [...],    # the token the oracle put in its place (null: not run)
     "kept_correct": [...]}   # --control: 1 where greedy decoding after the token itself (no
                              # substitution) still verifies correct (null: not run)
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from megatron_oar.fileio import atomic_write

METHODS = ("oar_p", "oar_g", "entropy", "random")  # the oracle's token scorers (megatron_oar.methods)


class RecordError(ValueError):
    """A malformed record file; the message names the file and line."""


@dataclass
class TokenRecord:
    id: str
    prompt: str
    reference: str
    correct: bool
    token_ids: list[int]
    tokens: list[str]
    scores: dict[str, list[float]] = field(default_factory=dict)
    scored: list[bool] | None = None
    oracle: list[int] | None = None
    substitutes: list[int] | None = None
    kept_correct: list[int] | None = None

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        if len(self.tokens) != n:
            raise ValueError(f"record {self.id}: {len(self.tokens)} tokens for {n} token ids")
        for name, values in self.scores.items():
            if len(values) != n:
                raise ValueError(f"record {self.id}: scores[{name!r}] has {len(values)} values "
                                 f"for {n} tokens")
        for name in ("scored", "oracle", "substitutes", "kept_correct"):
            values = getattr(self, name)
            if values is not None and len(values) != n:
                raise ValueError(f"record {self.id}: {name} has {len(values)} values for {n} tokens")

    @property
    def scored_mask(self) -> list[bool]:
        return self.scored if self.scored is not None else [True] * len(self.token_ids)


def write_records(records: Iterable[TokenRecord], path: str | Path) -> Path:
    """Writes JSONL atomically (temp file + rename)."""
    return atomic_write(path, lambda f: f.writelines(json.dumps(asdict(r)) + "\n" for r in records))


def read_records(path: str | Path) -> Iterator[TokenRecord]:
    path = Path(path)
    if not path.is_file():
        raise RecordError(f"{path}: no such file")
    with path.open() as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield TokenRecord(**json.loads(line))
            except (json.JSONDecodeError, TypeError, ValueError) as e:
                raise RecordError(f"{path}:{i}: not a token record ({e})") from None
