"""``oar eval``: pass@k of a model on the paper's math benchmarks (Table 1).

    oar eval [--config X.yaml] eval.model=PATH [eval.data_dir=DIR] [key=value ...] [--nproc-per-node N]
    oar eval --table OUT [OUT ...]    one table, a row per earlier run's eval.out directory
    torchrun --nproc-per-node N -m megatron_oar.eval.run_eval [--config X.yaml] [key=value ...]
                                      the same, ranks split the prompts

    e.g. oar eval --config examples/eval/math_pass_at_k.yaml eval.model=runs/7b/checkpoints
             eval.data_dir=data/eval eval.benchmarks=[aime24,math500] rollout.tp=2 --nproc-per-node 8

The settings are the trainer's config schema (``megatron_oar.config``): its defaults, then the
YAML file (a training config works as it is), then the ``key=value`` overrides in order. The
``eval`` section (``megatron_oar.eval_config.EvalConfig``) holds what only this command reads:
``model``, ``data_dir``, ``benchmarks`` (null: the paper's five), ``n`` (null: 32), ``k`` (null:
the paper's), ``greedy``, ``temperature``, ``top_p``, ``seed``, ``max_prompts``, ``out``, ``name``,
``overwrite``. The rest comes from the sections that already carry it: ``rollout.max_new_tokens``;
``rollout.max_model_len`` (an upper bound on prompt + response; the model's
``max_position_embeddings`` where smaller); the engine's ``rollout.tp``, ``dtype`` (``auto`` here:
the model's ``torch_dtype``), ``gpu_memory_utilization``, ``cpu_kv_cache_gib``, ``enforce_eager``
(always on CPU), ``max_num_seqs``, ``enable_prefix_caching``; the prompt template
``data.template``; ``model.tokenizer``; the verifier ``rewards.*`` (``num_workers`` per rank,
``timeout_s`` per answer; its extractors and format style follow ``data.template``). Errors name
the key and exit with status 2.

``eval.model`` is an HF directory, a megatron-oar checkpoint (``oar_checkpoint.json``: converter
output or a training step directory; exported once to ``OUT/hf_model``), or a training checkpoint
root (its newest complete ``step_*``). Every rank runs one vLLM engine (``rollout.tp`` ranks per
engine); the rollout groups split each benchmark's prompts, every rank verifies a share of the
completions with math-verify, as the trainer's validation does (``training.collect``). Rank 0
alone reads the data and OUT (``eval.out``) and broadcasts the job; with several nodes the model,
the export and OUT must be on a shared file system.

Per benchmark, ``n`` completions per problem give the unbiased pass@k (``megatron_oar.eval.passk``)
for each k (default: the paper's, in ``megatron_oar.eval.benchmarks``; those above ``n`` are left
out with a warning). Sampling seeds depend only on (``eval.seed``, benchmark, problem index in its
file), so reruns, other ``eval.max_prompts`` and other rank counts sample the same completions for
the same problem.

Outputs (each written to a temporary file and renamed into place), percentages throughout::

    OUT/<benchmark>.json           settings, pass@k, per-problem n and correct count, mean response
                                   length, truncation and format rates, verifier statuses, timings
    OUT/<benchmark>.samples.jsonl  one line per problem: prompt, reference, seed, completions with
                                   their verdicts
    OUT/results.json, results.md   the table: a column per (benchmark, k), and Avg over them

Resuming: a benchmark whose ``OUT/<benchmark>.json`` holds identical settings (model, n,
temperature, top-p, seed, max new tokens, template, ks, dtype, max prompts, data file contents) is
read back, not regenerated. Other settings there stop the run with the differences listed, unless
``eval.overwrite=true`` (then those benchmarks are recomputed; delete OUT to redo everything).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from megatron_oar.data import TEMPLATES, DataError, Example, render_prompt
from megatron_oar.eval.benchmarks import (
    PAPER_ORDER,
    Benchmark,
    BenchmarkError,
    find_file,
    load_benchmark,
    parse_benchmarks,
)
from megatron_oar.eval.passk import pass_at_ks
from megatron_oar.fileio import atomic_write_text
from megatron_oar.log_setup import setup_logging

if TYPE_CHECKING:
    from megatron_oar.config import Config
    from megatron_oar.eval_config import EvalConfig
    from megatron_oar.rewards import RewardConfig
    from megatron_oar.rollout.config import RolloutConfig

log = logging.getLogger("megatron_oar.eval")
HF_EXPORT = "hf_model"
EXPORT_MARKER = "oar_export.json"
_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
_FORMAT_STYLE = {"answer_tag": "answer_tag", "think_answer": "think_answer", "boxed": "boxed",
                 "raw": "answer_tag"}


class EvalError(ValueError):
    """A bad setting, input or output directory; the message names the key."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="oar eval", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=Path, default=None, metavar="X.yaml",
                   help="YAML config (a training config works; default: the schema's defaults)")
    p.add_argument("--nproc-per-node", type=int, default=1, metavar="N",
                   help="start torchrun with N ranks (1: run in this process)")
    p.add_argument("--table", type=Path, nargs="+", metavar="OUT",
                   help="instead of evaluating: one table, a row per earlier run's eval.out dir")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="config overrides, e.g. eval.model=PATH eval.n=4 eval.k=[1,4] rollout.tp=2")
    return p


def benchmark_list(ev: EvalConfig) -> list[tuple[Benchmark, Path | None]]:
    """``eval.benchmarks`` (null: the paper's five) -> ``[(benchmark, explicit path or None)]``."""
    names = ev.benchmarks if ev.benchmarks is not None else list(PAPER_ORDER)
    try:
        return parse_benchmarks(",".join(names))
    except BenchmarkError as e:
        raise EvalError(f"eval.benchmarks={names}: {str(e).removeprefix('eval.benchmarks: ')}") from None


def check_config(cfg: Config) -> None:
    """What ``oar eval`` needs beyond the sections' own checks; raises :class:`EvalError` naming
    the key. (``eval.*`` alone is checked by ``EvalConfig.__post_init__`` while loading.)"""
    from megatron_oar.rollout.config import VLLM_DTYPES

    ev, r = cfg.eval, cfg.rollout
    if not ev.model:
        raise EvalError("eval.model: not set (an HF model dir, a megatron-oar checkpoint or a training "
                        "checkpoint root; or --table OUT ... to combine earlier runs)")
    benchmark_list(ev)
    if cfg.data.template not in TEMPLATES:
        raise EvalError(f"data.template={cfg.data.template!r}: expected one of {sorted(TEMPLATES)}")
    dtypes = ["auto", *VLLM_DTYPES]
    if r.dtype not in dtypes:
        raise EvalError(f"rollout.dtype={r.dtype!r}: expected one of {dtypes} (auto: the model's)")
    for key in ("tp", "max_model_len", "max_new_tokens", "max_num_seqs"):
        if getattr(r, key) < 1:
            raise EvalError(f"rollout.{key}={getattr(r, key)}: must be >= 1")
    if not 0 < r.gpu_memory_utilization <= 1:
        raise EvalError(f"rollout.gpu_memory_utilization={r.gpu_memory_utilization}: must be in (0, 1]")
    if not r.cpu_kv_cache_gib > 0:
        raise EvalError(f"rollout.cpu_kv_cache_gib={r.cpu_kv_cache_gib}: must be > 0")
    try:
        reward_config(cfg).validate()
    except ValueError as e:
        raise EvalError(str(e)) from None


def load_eval_config(path: str | Path | None, overrides: list[str]) -> Config:
    """``load_config(path, overrides)`` (the schema's defaults where ``path`` is None), then
    :func:`check_config`; every error is an :class:`EvalError` naming the key."""
    from megatron_oar.config import ConfigError, load_config

    try:
        cfg = load_config(path, overrides)
    except ConfigError as e:
        raise EvalError(str(e)) from None
    check_config(cfg)
    return cfg


def engine_config(cfg: Config, job: EvalJob, cuda: bool) -> RolloutConfig:
    """The vLLM engines' settings: ``rollout.*``, the job's dtype and context, eval's sampling."""
    from megatron_oar.rollout.config import RolloutConfig

    r, ev = cfg.rollout, cfg.eval
    temperature, top_p = ev.sampling
    return RolloutConfig(tp=r.tp, gpu_memory_utilization=r.gpu_memory_utilization,
                         max_model_len=job.max_model_len, max_num_seqs=r.max_num_seqs,
                         enable_prefix_caching=r.enable_prefix_caching, dtype=job.dtype, seed=ev.seed,
                         cpu_kv_cache_gib=r.cpu_kv_cache_gib, load_format="auto", sleep_level=0,
                         enforce_eager=r.enforce_eager or not cuda, n=ev.samples,
                         temperature=temperature, top_p=top_p, max_new_tokens=r.max_new_tokens)


def reward_config(cfg: Config) -> RewardConfig:
    """The verifier: ``rewards.*`` with the extractors and format style of ``data.template``."""
    template = cfg.data.template
    return dataclasses.replace(cfg.rewards, format_style=_FORMAT_STYLE.get(template, "answer_tag"),
                               extractors=["boxed", "answer_tag", "gsm8k"] if template == "boxed"
                               else ["answer_tag", "boxed", "gsm8k"])


# ------------------------------------------------------------------------------ the model


def resolve_model(path: Path) -> tuple[Path, bool]:
    """(resolved path, is a megatron-oar checkpoint)."""
    from megatron_oar.models.model_checkpoint import META_FILE
    from megatron_oar.training.step_checkpoint import find_latest

    path = path.expanduser().resolve()
    if not path.is_dir():
        raise EvalError(f"eval.model={path}: not a directory")
    if (path / META_FILE).is_file():
        return path, True
    if (path / "config.json").is_file():
        return path, False
    latest = find_latest(path)
    if latest is not None:
        log.info("eval.model=%s: a training checkpoint root; evaluating its newest step %s", path, latest.name)
        return latest, True
    raise EvalError(f"eval.model={path}: neither an HF model (config.json), a megatron-oar checkpoint "
                    f"({META_FILE}) nor a training checkpoint root (step_*/)")


def export_checkpoint(ckpt: Path, out: Path, overwrite: bool) -> Path:
    """``OUT/hf_model``: the checkpoint exported once with the converter (reused afterwards)."""
    from checkpoints_convert.convert import ConversionError, megatron_to_hf
    from megatron_oar.models.model_checkpoint import CheckpointError

    dst = out / HF_EXPORT
    marker = dst / EXPORT_MARKER
    if dst.exists():
        source = json.loads(marker.read_text()).get("checkpoint") if marker.is_file() else None
        if source == str(ckpt):
            log.info("reusing %s (exported from %s)", dst, ckpt)
            return dst
        if source is not None and not overwrite:
            raise EvalError(f"eval.out={out}: {dst} was exported from {source}, not {ckpt}; "
                            "set eval.overwrite=true or another eval.out")
        shutil.rmtree(dst)  # an unfinished export (no marker) or eval.overwrite
    log.info("exporting %s to HF format in %s", ckpt, dst)
    try:
        megatron_to_hf(ckpt, dst, progress=False)
    except (ConversionError, CheckpointError) as e:
        raise EvalError(f"eval.model={ckpt}: cannot export to HF: {e}") from e
    marker.write_text(json.dumps({"checkpoint": str(ckpt)}) + "\n")
    return dst


# ------------------------------------------------------------------------------ the job


@dataclass
class Task:
    bench: Benchmark
    path: Path
    examples: list[Example]
    ks: tuple[int, ...]
    settings: dict
    read: dict                              # rows / malformed / too_long of the data file
    result: dict | None = None              # filled when read back or computed
    prompt_lengths: list[int] = field(default_factory=list)


@dataclass
class EvalJob:
    """What every rank runs: the benchmarks (those read back carry their result), the model in HF
    format (None when nothing is left to compute), the engine's dtype and context, the row label."""

    tasks: list[Task]
    hf_dir: Path | None
    tokenizer_dir: Path | None
    dtype: str
    max_model_len: int
    name: str


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _settings_diff(old: dict, new: dict) -> list[str]:
    return [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in sorted(set(old) | set(new))
            if old.get(k) != new.get(k)]


def prepare_job(cfg: Config) -> EvalJob:
    """Rank 0: find and read the benchmarks, check OUT for earlier results, export if needed."""
    from transformers import AutoTokenizer

    from megatron_oar.models import read_hf_config
    from megatron_oar.models.model_checkpoint import HF_DIR

    ev, r, template = cfg.eval, cfg.rollout, cfg.data.template
    n, (temperature, top_p), out = ev.samples, ev.sampling, Path(ev.out)
    model, is_ckpt = resolve_model(Path(ev.model))
    source_dir = model / HF_DIR if is_ckpt else model  # config.json and tokenizer files
    hf = read_hf_config(source_dir)
    dtype = r.dtype
    if dtype == "auto":
        dtype = _DTYPES.get(hf.get("torch_dtype") or hf.get("dtype"), "bf16")
    max_pos = int(hf.get("max_position_embeddings", 4096))
    context = min(r.max_model_len, max_pos)
    if r.max_model_len > max_pos:
        log.info("rollout.max_model_len=%d: above the model's max_position_embeddings=%d, which bounds "
                 "prompt + response instead", r.max_model_len, max_pos)
    if context - r.max_new_tokens < 1:
        raise EvalError(f"rollout.max_new_tokens={r.max_new_tokens} leaves no room for a prompt in the "
                        f"{context}-token context (rollout.max_model_len={r.max_model_len}, the model's "
                        f"max_position_embeddings={max_pos})")
    tokenizer_dir = Path(cfg.model.tokenizer).expanduser().resolve() if cfg.model.tokenizer else source_dir
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    benchmarks = benchmark_list(ev)
    data_dir = Path(ev.data_dir).expanduser()
    if any(explicit is None for _, explicit in benchmarks) and not data_dir.is_dir():
        raise EvalError(f"eval.data_dir={ev.data_dir}: not a directory (where the benchmark files are)")
    out.mkdir(parents=True, exist_ok=True)
    tasks = []
    for bench, explicit in benchmarks:
        path = explicit.expanduser().resolve() if explicit else find_file(bench, data_dir)
        ks = ev.ks or tuple(k for k in bench.ks if k <= n)
        if not ev.ks and ks != bench.ks:
            log.warning("%s: the paper reports P@%s; with eval.n=%d only P@%s is computed", bench.name,
                        ",".join(map(str, bench.ks)), n, ",".join(map(str, ks)))
        settings = dict(model=str(model), n=n, temperature=temperature, top_p=top_p, seed=ev.seed,
                        max_new_tokens=r.max_new_tokens, template=template, ks=list(ks), dtype=dtype,
                        max_prompts=ev.max_prompts, data_sha256=_sha256(path))
        examples, stats = load_benchmark(bench, path, tokenizer=tokenizer, template=template,
                                         max_prompt_tokens=context - r.max_new_tokens,
                                         limit=ev.max_prompts)
        task = Task(bench, path, examples, ks, settings,
                    dict(rows=stats.rows, malformed=stats.malformed, too_long=stats.too_long))
        done = out / f"{bench.name}.json"
        if done.is_file():
            try:
                old = json.loads(done.read_text())
                diff = _settings_diff(old["settings"], settings)
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                diff = [f"unreadable ({e})"]
            if not diff:
                log.info("%s: done already (%s), reading it back", bench.name, done)
                task.result = old
            elif not ev.overwrite:
                raise EvalError(f"eval.out={ev.out}: {done.name} was made with other settings ("
                                f"{'; '.join(diff)}); set eval.overwrite=true to recompute it, or "
                                "another eval.out")
            else:
                log.warning("%s: replacing results made with other settings (%s)", bench.name,
                            "; ".join(diff))
        if task.result is None:
            task.prompt_lengths = [len(tokenizer(render_prompt(ex.prompt, template, tokenizer),
                                                 add_special_tokens=False)["input_ids"]) for ex in examples]
        tasks.append(task)
    todo = [t for t in tasks if t.result is None]
    longest = max((max(t.prompt_lengths) for t in todo), default=0)
    hf_dir = None
    if todo:
        hf_dir = export_checkpoint(model, out, ev.overwrite) if is_ckpt else model
    name = ev.name or (f"{model.parent.name}/{model.name}" if model.name.startswith("step_") else model.name)
    return EvalJob(tasks, hf_dir, tokenizer_dir, dtype, min(context, longest + r.max_new_tokens), name)


def share_job(cfg: Config) -> EvalJob:
    """Collective: rank 0 prepares the job (it alone touches OUT; a Megatron checkpoint is
    exported to HF there, which takes long for a large model); every rank gets it or the error.
    The other ranks wait for rank 0 on a gloo group of their own for up to
    ``checkpoint.convert_timeout_minutes`` (``runtime.on_rank0``), not in a collective of the
    default group, whose timeout is sized for collectives (NCCL ends the process after it)."""
    import torch.distributed as dist

    from megatron_oar.runtime.distributed import on_rank0

    def prepare():
        try:
            return prepare_job(cfg)
        except Exception as e:  # handed to every rank below (a ValueError stays one)
            return e

    if dist.get_world_size() == 1:
        box: list = [prepare()]
    else:
        minutes = cfg.checkpoint.convert_timeout_minutes
        box = [on_rank0(prepare, timeout_minutes=minutes, setting="checkpoint.convert_timeout_minutes",
                        what="preparing the evaluation (the Megatron -> HF export)")]
        dist.broadcast_object_list(box, src=0)  # rank 0 is done: no long wait here
    if isinstance(box[0], BaseException):
        if dist.get_rank() == 0:
            raise box[0]
        raise (box[0] if isinstance(box[0], ValueError) else RuntimeError(f"rank 0 failed: {box[0]!r}"))
    return box[0]


# ------------------------------------------------------------------------------ running


def run_benchmark(task: Task, engine, scorer, tokenizer, cfg: Config) -> dict:
    """Collective: generate, verify, and (rank 0) write the benchmark's two files."""
    import torch.distributed as dist

    from megatron_oar.seeds import BENCHMARK, derive_seed
    from megatron_oar.training.collect import generate_samples, score_samples

    ev, out = cfg.eval, Path(cfg.eval.out)
    name, n, examples = task.bench.name, ev.samples, task.examples
    temperature, top_p = ev.sampling
    seeds = [derive_seed(BENCHMARK, ev.seed, name, ex.index) for ex in examples]
    log.info("%s: %d problems x %d samples", name, len(examples), n)
    t0 = time.perf_counter()
    samples = generate_samples(engine, tokenizer, examples, cfg.data.template, seeds, n=n,
                               temperature=temperature, top_p=top_p,
                               max_new_tokens=cfg.rollout.max_new_tokens)
    t1 = time.perf_counter()
    score_samples(samples, scorer, dist.group.WORLD)
    t2 = time.perf_counter()
    if len(samples) != n * len(examples) or any(s.group != i // n for i, s in enumerate(samples)):
        raise RuntimeError(f"{name}: {len(samples)} completions do not line up with "
                           f"{len(examples)} problems x n={n}")
    groups = [samples[i * n:(i + 1) * n] for i in range(len(examples))]
    counts = [(n, sum(s.accuracy > 0 for s in g)) for g in groups]
    total = len(samples)
    statuses: dict[str, int] = {}
    for s in samples:
        statuses[s.status] = statuses.get(s.status, 0) + 1
    gen_tokens = sum(len(s.response_ids) for s in samples)
    result = dict(
        benchmark=name, title=task.bench.title, settings=task.settings, data_file=str(task.path),
        data=task.read, num_problems=len(examples), n=n,
        pass_at_k={str(k): 100.0 * v for k, v in pass_at_ks(counts, task.ks).items()},
        mean_response_length=gen_tokens / total,
        truncation_rate=100.0 * sum(s.finish_reason == "length" for s in samples) / total,
        format_rate=100.0 * sum(s.format for s in samples) / total,
        statuses=statuses, generation_seconds=t1 - t0, scoring_seconds=t2 - t1,
        tokens_per_second=gen_tokens / max(t1 - t0, 1e-9),
        problems=[dict(index=ex.index, n=cn, correct=c) for ex, (cn, c) in zip(examples, counts)],
    )
    if dist.get_rank() == 0:
        lines = [json.dumps(dict(index=ex.index, prompt=ex.prompt, reference=ex.answer, seed=seed,
                                 n=n, correct=c, completions=[dict(
                                     text=s.text, correct=s.accuracy > 0, status=s.status,
                                     finish_reason=s.finish_reason, num_tokens=len(s.response_ids),
                                     format=s.format) for s in g]), ensure_ascii=False)
                 for ex, seed, g, (_, c) in zip(examples, seeds, groups, counts)]
        atomic_write_text(out / f"{name}.samples.jsonl", "\n".join(lines) + "\n")
        atomic_write_text(out / f"{name}.json", json.dumps(result, indent=1) + "\n")
    log.info("%s: %s (generation %.1fs, verification %.1fs)", name, ", ".join(
        f"P@{k} {v:.1f}" for k, v in result["pass_at_k"].items()), t1 - t0, t2 - t1)
    return result


# ------------------------------------------------------------------------------ the table


def summarize(job: EvalJob) -> dict:
    """results.json's content: one column per (benchmark, k) of the finished benchmarks, and Avg."""
    columns, benchmarks = [], {}
    for t in job.tasks:
        if t.result is None:
            continue
        for k in t.ks:
            columns.append(dict(benchmark=t.bench.name, title=t.bench.title, k=k,
                                value=t.result["pass_at_k"][str(k)]))
        benchmarks[t.bench.name] = dict({f"pass@{k}": v for k, v in t.result["pass_at_k"].items()},
                                        num_problems=t.result["num_problems"], n=t.result["n"],
                                        file=f"{t.bench.name}.json")
    avg = sum(c["value"] for c in columns) / len(columns) if columns else None
    common = {k: v for k, v in job.tasks[0].settings.items() if k not in ("ks", "data_sha256")}
    return dict(name=job.name, settings=common, columns=columns, average=avg, benchmarks=benchmarks,
                pending=[t.bench.name for t in job.tasks if t.result is None])


def table_markdown(summaries: list[dict]) -> str:
    """Table 1's layout: benchmark names, a P@k sub-header, one row per run, Avg; percent, one
    decimal. Columns are the first run's; a run without one of them shows "-"."""
    cols = summaries[0]["columns"]
    names = [c["title"] if i == 0 or cols[i - 1]["benchmark"] != c["benchmark"] else ""
             for i, c in enumerate(cols)]
    rows = [["Method", *names, "Avg"], ["---"] + ["---:"] * (len(cols) + 1),
            ["", *(f"P@{c['k']}" for c in cols), "Avg"]]
    for summary in summaries:
        values = {(c["benchmark"], c["k"]): c["value"] for c in summary["columns"]}
        cells = [values.get((c["benchmark"], c["k"])) for c in cols]
        rows.append([summary["name"], *("-" if v is None else f"{v:.1f}" for v in cells),
                     "" if summary["average"] is None else f"{summary['average']:.1f}"])
    return "\n".join("| " + " | ".join(r) + " |" for r in rows) + "\n"


def combine_tables(out_dirs: list[Path]) -> str:
    """``oar eval --table OUT ...``: the runs' results.json as one table (paper Table 1)."""
    summaries = []
    for d in out_dirs:
        path = d / "results.json"
        if not path.is_file():
            raise EvalError(f"--table {d}: no results.json (not an oar eval eval.out directory)")
        summaries.append(json.loads(path.read_text()))
    if not summaries[0]["columns"]:
        raise EvalError(f"--table {out_dirs[0]}: no finished benchmark")
    return table_markdown(summaries)


def render_markdown(summary: dict) -> str:
    """One run's table and its settings."""
    s = summary["settings"]
    note = (f"\nn={s['n']} samples per problem, temperature {s['temperature']}, top-p {s['top_p']}, "
            f"seed {s['seed']}, max {s['max_new_tokens']} new tokens, template {s['template']}, "
            f"model {s['model']}.\n")
    if summary["pending"]:
        note += f"Not finished: {', '.join(summary['pending'])}.\n"
    return table_markdown([summary]) + note


def write_summary(job: EvalJob, out: Path) -> dict:
    summary = summarize(job)
    atomic_write_text(out / "results.json", json.dumps(summary, indent=1) + "\n")
    atomic_write_text(out / "results.md", render_markdown(summary))
    return summary


def print_table(summary: dict) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # pragma: no cover
        print(render_markdown(summary))
        return
    table = Table(title="pass@k (%)")
    table.add_column("Method")
    for c in summary["columns"]:
        table.add_column(f"{c['title']}\nP@{c['k']}", justify="right")
    table.add_column("Avg", justify="right")
    avg = summary["average"]
    table.add_row(summary["name"], *(f"{c['value']:.1f}" for c in summary["columns"]),
                  "" if avg is None else f"{avg:.1f}")
    Console().print(table)


# ------------------------------------------------------------------------------ main


def _evaluate(cfg: Config) -> dict:
    import torch
    import torch.distributed as dist
    from transformers import AutoTokenizer

    from megatron_oar.rewards import RewardScorer
    from megatron_oar.rollout import RolloutEngine

    if dist.get_world_size() % cfg.rollout.tp:
        raise EvalError(f"rollout.tp={cfg.rollout.tp}: does not divide the {dist.get_world_size()} ranks")
    job = share_job(cfg)
    rank0, out = dist.get_rank() == 0, Path(cfg.eval.out)
    todo = [t for t in job.tasks if t.result is None]
    if todo:
        tokenizer = AutoTokenizer.from_pretrained(str(job.tokenizer_dir))
        engine = scorer = None
        try:
            engine = RolloutEngine(job.hf_dir, engine_config(cfg, job, torch.cuda.is_available()),
                                   tokenizer=job.tokenizer_dir)
            scorer = RewardScorer(reward_config(cfg))
            for task in todo:
                task.result = run_benchmark(task, engine, scorer, tokenizer, cfg)
                if rank0:
                    write_summary(job, out)  # a later crash keeps what is finished
        finally:
            if scorer is not None:
                scorer.close()
            if engine is not None:
                engine.shutdown()
    summary = write_summary(job, out) if rank0 else {}
    if rank0:
        print_table(summary)
        print(f"results in {out}/results.md and results.json")
    return summary


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--"]:
        argv = argv[1:]
    args = build_parser().parse_intermixed_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    setup_logging(rank)
    try:
        if args.table:
            if args.config is not None or args.overrides:
                raise EvalError("--table combines earlier runs' results; it takes no --config or overrides")
            print(combine_tables(args.table), end="")
            return 0
        if args.nproc_per_node < 1:
            raise EvalError(f"--nproc-per-node {args.nproc_per_node}: must be >= 1")
        cfg = load_eval_config(args.config, args.overrides)
        setup_logging(rank, cfg.log.level)
        if args.nproc_per_node > 1 and "LOCAL_RANK" not in os.environ:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc-per-node={args.nproc_per_node}", "-m", "megatron_oar.eval.run_eval",
                   "--", *argv]  # "--": torchrun would read --nproc-per-node as its own option
            return subprocess.call(cmd)
        from megatron_oar.runtime import destroy_runtime, init_runtime

        init_runtime()
        try:
            _evaluate(cfg)
        finally:
            destroy_runtime()
    except (EvalError, BenchmarkError, DataError) as e:
        if rank == 0:
            print(f"oar eval: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    from megatron_oar.process_exit import exit_after

    exit_after(main)
