"""What ``oar viz`` draws: the records chosen from a file (``--id``, ``--index``,
``--max-records``), each record's panels (``--methods``, or the default), and a record id as a
file name. Bad input raises :class:`VizError`, naming the file or flag."""

from __future__ import annotations

import re
from pathlib import Path

from megatron_oar.eval.records import METHODS, TokenRecord, read_records
from megatron_oar.eval.viz.cells import ORACLE

DEFAULT_METHODS = ("oar_p", "oar_g", "entropy")  # + oracle when present; random only on request
DEFAULT_MAX_RECORDS = 20


class VizError(ValueError):
    """A bad input or flag; the message names the file or flag."""


def resolve_methods(record: TokenRecord, methods: list[str] | None, path: Path) -> list[str]:
    """The panels for ``record``; every requested method must be in it (VizError otherwise)."""
    if methods is None:
        out = [m for m in DEFAULT_METHODS if m in record.scores]
        if not out:
            out = [m for m in (*METHODS, *record.scores) if m in record.scores]
            out = list(dict.fromkeys(out))
        if record.oracle is not None:
            out.append(ORACLE)
        if not out:
            raise VizError(f"{path}: record {record.id!r} has no scores and no oracle to draw")
        return out
    for m in methods:
        if m == ORACLE and record.oracle is None:
            raise VizError(f"--methods: record {record.id!r} in {path} has no oracle labels "
                           f"(oracle is null: run `oar analyze oracle` first)")
        if m != ORACLE and m not in record.scores:
            have = ", ".join([*record.scores, *([ORACLE] if record.oracle is not None else [])])
            raise VizError(f"--methods: record {record.id!r} in {path} has no {m!r} scores "
                           f"(it has: {have or 'none'})")
    return methods


def parse_methods(arg: str | None) -> list[str] | None:
    if arg is None:
        return None
    names = [m.strip().lower().replace("-", "_") for m in re.split(r"[,\s]+", arg) if m.strip()]
    if not names:
        raise VizError("--methods: no method named (e.g. --methods oar_p,oar_g,entropy,oracle)")
    return list(dict.fromkeys(names))


def select_records(path: Path, *, id: str | None = None, index: int | None = None,
                   max_records: int = DEFAULT_MAX_RECORDS) -> list[TokenRecord]:
    """The record with ``id``, the one at ``index`` (0-based), or the first ``max_records``."""
    if not path.is_file():
        raise VizError(f"{path}: no such records file")
    if index is not None and index < 0:
        raise VizError(f"--index {index}: must be >= 0")
    if max_records < 1:
        raise VizError(f"--max-records {max_records}: must be >= 1")
    chosen: list[TokenRecord] = []
    first_ids: list[str] = []
    count = 0
    for i, rec in enumerate(read_records(path)):
        count = i + 1
        if id is None and index is None:
            chosen.append(rec)
            if len(chosen) == max_records:
                break
        elif (id is not None and rec.id == id) or index == i:
            return [rec]
        elif len(first_ids) < 5:
            first_ids.append(rec.id)
    if id is None and index is None:
        if not chosen:
            raise VizError(f"{path}: no records in the file")
        return chosen
    if id is not None:
        raise VizError(f"--id {id!r}: no record with that id in {path} ({count} records; "
                       f"first ids: {', '.join(map(repr, first_ids)) or 'none'})")
    raise VizError(f"--index {index}: {path} has only {count} records")


def safe_name(rid: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", rid).strip("._") or "record"
