"""Dataset readers: local JSONL / JSON / Parquet files -> ``Example(prompt, answer, source, index)``.

Field mappings (``FieldMap``) are dotted paths into a record; ``a|b`` tries ``a`` then ``b``.
Presets cover the usual math RL sets (``PRESETS``); ``fields="auto"`` picks one from the first
record's keys and says which (``ReadStats.presets``, and an INFO log line).

Malformed rows (bad JSON, missing field, empty answer, wrong types) are skipped and counted, with
a warning naming file and line (JSONL: 1-based line; JSON array: 0-based item; Parquet: 0-based
row); with ``strict=True`` the first one raises ``DataError`` naming file, line/row and field
instead. Prompts longer than ``max_prompt_tokens`` (rendered with the template, counted with the
tokenizer) are dropped and counted in ``ReadStats.too_long``.

Parquet needs ``pyarrow`` (imported only when a ``.parquet`` file is read).
"""

from __future__ import annotations

import gzip
import json
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_oar.rewards.extract import extract_gsm8k, normalize_reference

log = logging.getLogger(__name__)

MAX_LOGGED_PER_FILE = 20  # malformed-row warnings logged individually per file; the rest are counted


class DataError(ValueError):
    """A malformed dataset file or row; the message names file, line/row and field."""


@dataclass(frozen=True)
class Example:
    """One prompt with its reference answer; ``index``: the record's 0-based position in its file."""

    prompt: str
    answer: str
    source: str
    index: int


@dataclass(frozen=True)
class FieldMap:
    """Where a record keeps its prompt and answer.

    ``prompt``/``answer``/``source``: dotted paths (``reward_model.ground_truth``); ``a|b`` means
    "a, else b". A prompt that is a chat list ``[{role, content}, ...]`` becomes the content of
    its last ``user`` message. ``answer_format``: ``plain`` (as is), ``gsm8k`` (the number after
    ``####``) or ``boxed`` (the last ``\\boxed{}`` of a worked solution).
    """

    prompt: str
    answer: str
    source: str | None = None
    answer_format: str = "plain"


PRESETS: dict[str, FieldMap] = {
    "dapo": FieldMap("prompt", "reward_model.ground_truth", source="data_source"),
    "math500": FieldMap("problem", "answer"),
    "math": FieldMap("problem", "solution", answer_format="boxed"),  # Hendrycks MATH train set
    "gsm8k": FieldMap("question", "answer", answer_format="gsm8k"),
    "aime": FieldMap("problem|Problem|question", "answer|Answer"),
    "aime2024": FieldMap("problem|Problem|question", "answer|Answer"),
    "aime2025": FieldMap("problem|Problem|question", "answer|Answer"),
    "amc23": FieldMap("question|problem|Problem", "answer|Answer"),
    "prompt_answer": FieldMap("prompt", "answer", source="source"),  # what write_jsonl writes
}
ANSWER_FORMATS = ("plain", "gsm8k", "boxed")


@dataclass
class ReadStats:
    """Counts from reading: rows seen, kept, skipped as malformed, dropped as too long."""

    rows: int = 0
    kept: int = 0
    malformed: int = 0
    too_long: int = 0
    presets: dict[str, str] = field(default_factory=dict)  # file -> preset used ("gsm8k (auto)")
    messages: list[str] = field(default_factory=list)     # the malformed-row warnings logged


def detect_preset(record: dict) -> str:
    """Names the preset that fits ``record``'s keys; raises ``DataError`` when none does."""
    keys = set(record) if isinstance(record, dict) else set()
    if "prompt" in keys and isinstance(record.get("reward_model"), dict):
        return "dapo"
    if "question" in keys and isinstance(record.get("answer"), str) and "####" in record["answer"]:
        return "gsm8k"
    if {"problem", "answer"} <= keys:
        return "math500"
    if keys & {"Problem", "problem"} and keys & {"Answer", "answer"}:
        return "aime"
    if {"question", "answer"} <= keys:
        return "amc23"
    if {"problem", "solution"} <= keys:
        return "math"
    if {"prompt", "answer"} <= keys:
        return "prompt_answer"
    raise DataError(f"cannot detect the dataset format from keys {sorted(keys)}; pass fields=<preset> "
                    f"({', '.join(PRESETS)}) or a FieldMap")


def _lookup(record: Any, path: str) -> Any:
    """Value at dotted ``path`` (alternatives ``a|b``); raises ``KeyError(path)`` when absent."""
    for alt in path.split("|"):
        value, found = record, True
        for part in alt.split("."):
            if isinstance(value, dict) and part in value:
                value = value[part]
            elif isinstance(value, list) and part.lstrip("-").isdigit() and -len(value) <= int(part) < len(value):
                value = value[int(part)]
            else:
                found = False
                break
        if found and value is not None:
            return value
    raise KeyError(path)


def _prompt_text(value: Any, path: str) -> str:
    if isinstance(value, str):
        text = value
    elif isinstance(value, list):  # chat format: [{role, content}, ...]
        users = [m for m in value if isinstance(m, dict) and m.get("role") == "user"]
        if not users or not isinstance(users[-1].get("content"), str):
            raise TypeError(f"field {path!r} is a list without a user message with string content")
        text = users[-1]["content"]
    else:
        raise TypeError(f"field {path!r} must be a string or a chat list, got {type(value).__name__}")
    if not text.strip():
        raise ValueError(f"field {path!r} is empty")
    return text


def _answer_text(value: Any, path: str, answer_format: str) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise TypeError(f"field {path!r} must be a string or a number, got {type(value).__name__}")
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    text = str(value).strip()
    if answer_format == "gsm8k":
        found = extract_gsm8k(text)
        if found is None:
            raise ValueError(f"field {path!r} has no '#### <number>' final answer")
        text = found.text
    elif answer_format == "boxed":
        text = normalize_reference(text) if "\\boxed" in text or "\\fbox" in text else ""
        if not text:
            raise ValueError(f"field {path!r} has no \\boxed{{}} answer")
    if not text:
        raise ValueError(f"field {path!r} is empty")
    return text


def _rows_json(path: Path) -> Iterator[tuple[str, Any, str | None]]:
    """(where, record, error) per record: JSONL by line (1-based), a JSON array by item (0-based)."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8", errors="replace") as f:
        head = f.read(4096).lstrip()
    if head.startswith("["):
        with opener(path, "rt", encoding="utf-8", errors="replace") as f:
            try:
                records = json.load(f)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{e.lineno}: invalid JSON array ({e.msg})") from None
        for i, rec in enumerate(records):
            yield f"{path} item {i}", rec, None
        return
    with opener(path, "rt", encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield f"{path}:{lineno}", json.loads(line), None
            except json.JSONDecodeError as e:
                yield f"{path}:{lineno}", None, f"invalid JSON ({e.msg} at column {e.colno})"


def _rows_parquet(path: Path) -> Iterator[tuple[str, Any, str | None]]:
    """(where, record, None) per Parquet row (0-based), one record batch at a time."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError(f"reading {path} needs pyarrow, which is not installed "
                          "(pip install pyarrow), or convert the file to JSONL") from None
    row = 0
    for batch in pq.ParquetFile(path).iter_batches(batch_size=4096):
        for rec in batch.to_pylist():
            yield f"{path} row {row}", rec, None
            row += 1


def iter_rows(path: Path) -> Iterator[tuple[str, Any, str | None]]:
    """(where, record, error) for each record of a supported file; ``where`` names file and line/row."""
    name = path.name.lower()
    if name.endswith(".parquet"):
        return _rows_parquet(path)
    if name.endswith((".jsonl", ".jsonl.gz", ".ndjson", ".json", ".json.gz")):
        return _rows_json(path)
    raise DataError(f"{path}: unsupported file type (use .jsonl, .json, .parquet; .gz for JSON)")


def _resolve_fields(fields: str | FieldMap, where: str, first: Any) -> tuple[FieldMap, str]:
    if isinstance(fields, FieldMap):
        return fields, "custom"
    if fields == "auto":
        try:
            name = detect_preset(first)
        except DataError as e:
            raise DataError(f"{where} (first record, fields='auto'): {e}") from None
        log.info("%s: detected dataset format %r from the first record (keys %s)",
                 where, name, sorted(first))
        return PRESETS[name], f"{name} (auto)"
    if fields not in PRESETS:
        raise DataError(f"unknown dataset preset {fields!r}; choose from {sorted(PRESETS)}, 'auto', "
                        "or pass a FieldMap")
    return PRESETS[fields], fields


def read_examples(paths: str | Path | Sequence[str | Path], fields: str | FieldMap = "auto", *,
                  strict: bool = False, tokenizer=None, max_prompt_tokens: int | None = None,
                  template: str = "answer_tag", source: str | None = None,
                  limit: int | None = None) -> tuple[list[Example], ReadStats]:
    """Reads one or more files into ``Example`` records.

    fields: a preset name (``PRESETS``), ``"auto"`` or a ``FieldMap``.
    strict: raise ``DataError`` on the first malformed row instead of skipping it.
    tokenizer, max_prompt_tokens: drop prompts whose rendered ``template`` is longer.
    source: the ``Example.source`` for rows without a source field (default: the file name).
    limit: stop after this many kept examples.
    """
    if isinstance(paths, (str, Path)):
        paths = [paths]
    if max_prompt_tokens is not None and tokenizer is None:
        raise ValueError("max_prompt_tokens needs a tokenizer (data.max_prompt_tokens)")
    if isinstance(fields, FieldMap) and fields.answer_format not in ANSWER_FORMATS:
        raise ValueError(f"FieldMap.answer_format must be one of {ANSWER_FORMATS}, "
                         f"got {fields.answer_format!r}")
    stats = ReadStats()
    examples: list[Example] = []
    for path in map(Path, paths):
        if not path.is_file():
            raise FileNotFoundError(f"dataset file not found: {path}")
        fmap, bad = None, 0
        for nth, (where, record, error) in enumerate(iter_rows(path)):
            if limit is not None and len(examples) >= limit:
                break
            stats.rows += 1
            if fmap is None and error is None:
                fmap, stats.presets[str(path)] = _resolve_fields(fields, where, record)
            try:
                if error is not None:
                    raise ValueError(error)
                if not isinstance(record, dict):
                    raise TypeError(f"record is a {type(record).__name__}, not an object")
                field_name = fmap.prompt
                prompt = _prompt_text(_lookup(record, fmap.prompt), fmap.prompt)
                field_name = fmap.answer
                answer = _answer_text(_lookup(record, fmap.answer), fmap.answer, fmap.answer_format)
                src = source or path.name
                if fmap.source:
                    try:
                        src = str(_lookup(record, fmap.source))
                    except KeyError:
                        pass
            except (KeyError, TypeError, ValueError) as e:
                reason = f"missing field {field_name!r}" if isinstance(e, KeyError) else str(e)
                message = f"{where}: {reason}"
                if strict:
                    raise DataError(f"{message} (strict mode; set strict=False to skip bad rows)") from None
                stats.malformed += 1
                bad += 1
                if bad <= MAX_LOGGED_PER_FILE:
                    log.warning("skipped malformed record %s", message)
                    stats.messages.append(message)
                continue
            if max_prompt_tokens is not None:
                from megatron_oar.data.templates import render_prompt
                n_tokens = len(tokenizer(render_prompt(prompt, template, tokenizer),
                                         add_special_tokens=False)["input_ids"])
                if n_tokens > max_prompt_tokens:
                    stats.too_long += 1
                    continue
            examples.append(Example(prompt, answer, src, nth))
        if bad > MAX_LOGGED_PER_FILE:
            log.warning("%s: %d malformed records skipped in all (%d shown)", path, bad,
                        MAX_LOGGED_PER_FILE)
    stats.kept = len(examples)
    if stats.too_long:
        log.warning("dropped %d prompts longer than max_prompt_tokens=%d", stats.too_long, max_prompt_tokens)
    return examples, stats


def write_jsonl(examples: Sequence[Example], path: str | Path) -> Path:
    """Writes examples as JSONL (``prompt``, ``answer``, ``source``, ``index``); preset ``prompt_answer``."""
    path = Path(path)
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"prompt": ex.prompt, "answer": ex.answer, "source": ex.source,
                                "index": ex.index}, ensure_ascii=False) + "\n" for ex in examples)
    return path
