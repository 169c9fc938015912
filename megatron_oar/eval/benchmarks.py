"""The paper's evaluation benchmarks (Table 1): where their files are and how to read them.

``oar eval eval.data_dir=DIR`` looks for each benchmark's file in ``DIR`` under the names below, in
this order, with the extensions ``.jsonl``, ``.json``, ``.parquet``, ``.jsonl.gz``, ``.json.gz``
(case-insensitive), then as ``DIR/<name>/test.<ext>``::

    aime24   aime24, aime2024, aime_2024, aime-2024      preset aime2024   ks 1, 32
    aime25   aime25, aime2025, aime_2025, aime-2025      preset aime2025   ks 1, 32
    amc23    amc23, amc2023, amc_2023, amc-2023, amc     preset amc23      ks 1, 32
    math500  math500, math_500, math-500                 preset math500    ks 1
    gsm8k    gsm8k, gsm8k_test, gsm8k-test               preset gsm8k      ks 1

``eval.benchmarks=[NAME=PATH]`` reads an explicit file instead. Records are read with the named preset
of ``megatron_oar.data.PRESETS`` (AIME: ``problem``/``Problem``/``question`` and
``answer``/``Answer``; AMC23: ``question``/``problem`` and ``answer``, floats such as ``27.0``
become ``27``; MATH500: ``problem``, ``answer``; GSM8K: ``question`` and the number after
``####`` in ``answer``). The ks are the paper's: P@1 and P@32 for AIME and AMC, P@1 otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from megatron_oar.data import Example, ReadStats, read_examples

EXTENSIONS = (".jsonl", ".json", ".parquet", ".jsonl.gz", ".json.gz")
PAPER_ORDER = ("aime25", "aime24", "amc23", "math500", "gsm8k")  # Table 1's columns


class BenchmarkError(ValueError):
    """An unknown benchmark or a missing / unreadable benchmark file; the message says which."""


@dataclass(frozen=True)
class Benchmark:
    name: str               # what eval.benchmarks takes and the output files are called
    title: str              # the column header (as in the paper's Table 1)
    preset: str             # megatron_oar.data.PRESETS key
    stems: tuple[str, ...]  # file names looked up in eval.data_dir, without extension
    ks: tuple[int, ...]     # the paper's reported P@k


BENCHMARKS: dict[str, Benchmark] = {b.name: b for b in (
    Benchmark("aime24", "AIME24", "aime2024", ("aime24", "aime2024", "aime_2024", "aime-2024"), (1, 32)),
    Benchmark("aime25", "AIME25", "aime2025", ("aime25", "aime2025", "aime_2025", "aime-2025"), (1, 32)),
    Benchmark("amc23", "AMC23", "amc23", ("amc23", "amc2023", "amc_2023", "amc-2023", "amc"), (1, 32)),
    Benchmark("math500", "MATH500", "math500", ("math500", "math_500", "math-500"), (1,)),
    Benchmark("gsm8k", "GSM8K", "gsm8k", ("gsm8k", "gsm8k_test", "gsm8k-test"), (1,)),
)}


def parse_benchmarks(spec: str) -> list[tuple[Benchmark, Path | None]]:
    """``eval.benchmarks=[aime24, math500=/data/m.jsonl]`` -> ``[(benchmark, explicit path or None)]``."""
    out: list[tuple[Benchmark, Path | None]] = []
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        name, sep, path = item.partition("=")
        name = name.strip().lower()
        if name not in BENCHMARKS:
            raise BenchmarkError(f"eval.benchmarks: unknown benchmark {name!r}; "
                                 f"choose from {', '.join(BENCHMARKS)}")
        if any(b.name == name for b, _ in out):
            raise BenchmarkError(f"eval.benchmarks: {name} is listed twice")
        if sep and not path.strip():
            raise BenchmarkError(f"eval.benchmarks: {item!r} names no file after '='")
        out.append((BENCHMARKS[name], Path(path.strip()) if sep else None))
    if not out:
        raise BenchmarkError("eval.benchmarks: no benchmark given")
    return out


def candidate_names(bench: Benchmark) -> list[str]:
    """File names tried in ``eval.data_dir``, in order."""
    names = [stem + ext for stem in bench.stems for ext in EXTENSIONS]
    return names + [f"{bench.name}/test{ext}" for ext in EXTENSIONS]


def find_file(bench: Benchmark, data_dir: str | Path) -> Path:
    """The first of :func:`candidate_names` present in ``data_dir`` (names compared without case)."""
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise BenchmarkError(f"eval.data_dir={data_dir}: not a directory (looking for {bench.name})")
    entries = {p.name.lower(): p for p in data_dir.iterdir()}
    sub = entries.get(bench.name)
    sub_entries = {p.name.lower(): p for p in sub.iterdir()} if sub is not None and sub.is_dir() else {}
    tried = candidate_names(bench)
    for name in tried:
        folder, _, base = name.rpartition("/")
        path = (sub_entries if folder else entries).get(base.lower())
        if path is not None and path.is_file():
            return path
    raise BenchmarkError(f"benchmark {bench.name}: no data file in eval.data_dir={data_dir}; tried "
                         f"{{{','.join(bench.stems)}}}{{{','.join(EXTENSIONS)}}} and "
                         f"{bench.name}/test{{{','.join(EXTENSIONS)}}} (or set eval.benchmarks=["
                         f"{bench.name}=PATH])")


def load_benchmark(bench: Benchmark, path: Path, *, tokenizer=None, template: str = "answer_tag",
                   max_prompt_tokens: int | None = None,
                   limit: int | None = None) -> tuple[list[Example], ReadStats]:
    """The benchmark's problems from ``path``: malformed rows are skipped (counted), prompts whose
    rendered ``template`` exceeds ``max_prompt_tokens`` dropped (counted), the first ``limit`` kept."""
    if not path.is_file():
        raise BenchmarkError(f"benchmark {bench.name}: data file {path} not found")
    examples, stats = read_examples(path, bench.preset, tokenizer=tokenizer, template=template,
                                    max_prompt_tokens=max_prompt_tokens, source=bench.name,
                                    limit=limit)
    if not examples:
        raise BenchmarkError(f"benchmark {bench.name}: no usable problems in {path} ({stats.rows} "
                             f"rows, {stats.malformed} malformed, {stats.too_long} too long for the "
                             "context; see rollout.max_new_tokens / rollout.max_model_len)")
    return examples, stats
