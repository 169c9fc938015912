"""``oar analyze lookahead``: a paired screen of credit schemes before a grid spends hours.

    oar analyze lookahead --out look_out [--arms grpo,oar_g,...] [--batches 6] [--steps 1]

From one SFT start (``oar repro``'s, made once in ``--out``) and, per batch ``b``, one set of
step-1 rollouts, each **arm** (a credit scheme and its settings: :data:`ARMS`) trains ``--steps``
RL steps and is evaluated on the held-out problems (the trainer's greedy evaluation). Batch
``b`` is seed ``b`` for the prompts, vLLM's sampling and OAR-G's noise, the same for every arm,
so at ``--steps 1`` every arm updates on the very same rollouts (the report checks it: the
step-1 training reward of every arm must equal GRPO's on the batch) and differs only in how the
credit is spread over them; ``--steps > 1`` continues on-policy, and later rollouts differ.
Per arm: the held-out accuracy after the updates, and the paired difference to the baseline arm
(default GRPO) over batches, mean and 95% Student-t interval (``repro/stats.py``).

A run is ``python -m megatron_oar.commands.train`` on one process (forked from one warm
interpreter on CPU, as ``oar repro``'s), resumable: a finished run (``result.json``) is never
redone. Writes ``lookahead.json`` and ``lookahead.md`` in ``--out``, the runs under
``--out/lookahead/`` (an ``oar repro`` out dir can hold both, sharing its SFT start).

What it is not: a few updates from one start measure the first move of each scheme, not where
it ends. docs/credit-evidence.md has its measurements on the credit testbed beside a few-seed
subset of the 10-step ablation grid (``oar repro --grid credit-ablations --arms ...``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from megatron_oar.fileio import atomic_write_text
from megatron_oar.repro import credit_arms
from megatron_oar.repro.stats import mean_ci, paired_diff_ci

ARMS = credit_arms.ARMS  # the credit schemes and settings compared (repro/credit_arms.py)
RUNS = "lookahead"  # the runs' directory in --out (not oar repro's runs/: the two can share an out dir)
DEFAULT_ARMS = ("grpo", "oar_g", "oar_g tau=0 (boost-only)", "oar_g tau=1 (suppress-only)",
                "oar_g beta=0 (no boost)", "oar_g floor=0.1 (authors' code)",
                "oar_g LT-Logits warm-up", "oar_g sign_aware (ours)")


def slug(arm: str) -> str:
    return re.sub(r"[^A-Za-z0-9.=]+", "_", arm).strip("_").replace("=", "")


def run_overrides(arm: str, batch: int, sft: Path, run_dir: Path, steps: int, extra: list[str]) -> list[str]:
    return [f"model.path={sft}", f"run_dir={run_dir}", "parallel.tp=1", "rollout.tp=1",
            f"train.steps={steps}", f"train.eval_interval={steps}", f"train.seed={batch}",
            f"rollout.seed={batch}", f"attribution.seed={batch}", "checkpoint.interval=0",
            "checkpoint.keep_last=1", "checkpoint.export_hf_at_end=false", "log.console=false",
            "log.tensorboard=false", *extra, *ARMS[arm]]


def result_of(run_dir: Path, steps: int) -> dict:
    """The run's held-out accuracy at step 0 and after ``steps``, and its step-1 training reward."""
    from megatron_oar.training.logger import read_metrics

    recs = read_metrics(run_dir)
    acc = {r["step"]: r["eval/accuracy"] for r in recs if r.get("eval/accuracy") is not None}
    reward = next((r["reward/mean"] for r in recs if r.get("step") == 1 and "reward/mean" in r), None)
    if steps not in acc:
        raise RuntimeError(f"{run_dir}: no eval/accuracy at step {steps} in its metrics")
    return {"start": acc.get(0), "accuracy": acc[steps], "reward_step1": reward}


def one_run(arm: str, batch: int, out: Path, sft: Path, config: Path, steps: int, extra: list[str],
            starter=None) -> dict:
    from megatron_oar.repro.runner import _run_one_process

    run_dir = out / RUNS / f"{slug(arm)}_b{batch}"
    if (run_dir / "result.json").is_file():
        return json.loads((run_dir / "result.json").read_text())
    run_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "megatron_oar.commands.train", "--config", str(config),
           *run_overrides(arm, batch, sft, run_dir, steps, extra)]
    _run_one_process(cmd, run_dir / "train.log", f"lookahead {arm} batch {batch}", starter)
    res = {"arm": arm, "batch": batch, **result_of(run_dir, steps), "seconds": time.perf_counter() - t0}
    atomic_write_text(run_dir / "result.json", json.dumps(res))
    return res


def summarize(results: list[dict], baseline: str = "grpo", steps: int = 1) -> dict:
    """Per arm: accuracy (mean, 95% t-interval over batches), paired difference to ``baseline``,
    and how many batches' step-1 rewards equal the baseline's (shared rollouts at ``steps`` 1)."""
    by: dict[str, dict[int, dict]] = {}
    for r in results:
        by.setdefault(r["arm"], {})[r["batch"]] = r
    base = by.get(baseline, {})
    rows = {}
    for arm, runs in by.items():
        acc = {b: r["accuracy"] for b, r in runs.items()}
        iv = mean_ci(list(acc.values()))
        row = {"batches": sorted(runs), "accuracy": {"mean": iv.mean, "half95": iv.half},
               "seconds": sum(r["seconds"] for r in runs.values()) / len(runs)}
        if arm != baseline and base:
            d = paired_diff_ci(acc, {b: r["accuracy"] for b, r in base.items()})
            row["vs_baseline"] = {"mean": d.mean, "half95": d.half, "n": d.n}
            row["same_rollouts"] = sum(
                1 for b, r in runs.items() if b in base and r["reward_step1"] is not None
                and base[b]["reward_step1"] is not None
                and abs(r["reward_step1"] - base[b]["reward_step1"]) < 1e-9)
        rows[arm] = row
    starts = [r["start"] for r in results if r["start"] is not None]
    return {"baseline": baseline, "steps": steps, "rows": rows,
            "start_accuracy": sum(starts) / len(starts) if starts else None}


def render(s: dict) -> str:
    lines = [f"| arm | batches | held-out accuracy after {s['steps']} step(s) | vs {s['baseline']} (paired) "
             "| step-1 rollouts equal to the baseline's | s per run |", "|---|---:|---:|---:|---:|---:|"]
    for arm, r in s["rows"].items():
        vs = r.get("vs_baseline")
        lines.append(f"| {arm} | {len(r['batches'])} | {_pm(r['accuracy'])} | "
                     f"{_pm(vs) if vs else '-'} | "
                     f"{r['same_rollouts'] if 'same_rollouts' in r else '-'} | {r['seconds']:.0f} |")
    start = s.get("start_accuracy")
    return "\n".join(lines) + ("" if start is None else f"\n\nHeld-out accuracy at the start: {100 * start:.1f}%.")


def _pm(d: dict) -> str:
    half = d.get("half95")
    if half is None or half != half:  # NaN: one batch
        return f"{100 * d['mean']:.1f} (1 batch)"
    return f"{100 * d['mean']:.1f} ± {100 * half:.1f}"


def finished(out: Path) -> list[dict]:
    """The results of the finished runs in ``out`` (an interrupted screen's, too)."""
    return [json.loads(p.read_text()) for p in sorted((out / RUNS).glob("*/result.json"))]


def report(out: Path, steps: int, baseline: str = "grpo") -> dict:
    """``lookahead.json`` / ``lookahead.md`` from the finished runs in ``out``."""
    results = finished(out)
    s = summarize(results, baseline, steps)
    atomic_write_text(out / "lookahead.json", json.dumps({"results": results, "summary": s}, indent=1))
    atomic_write_text(out / "lookahead.md", render(s) + "\n")
    return s


def run(out: Path, arms: list[str], batches: int, steps: int, *, config: Path, jobs: int = 2,
        extra: list[str] = (), sft_steps: int | None = None, baseline: str = "grpo") -> dict:
    from megatron_oar.repro.runner import sft_checkpoint, sft_start
    from megatron_oar.repro.warm_start import WarmStarter

    out.mkdir(parents=True, exist_ok=True)
    import torch

    warm = contextlib.nullcontext() if torch.cuda.is_available() else WarmStarter()
    with warm as starter:
        sft = sft_start(out, config, sft_steps)
        start = sft_checkpoint(out, sft, config, list(extra), starter)
        work = [(a, b) for b in range(batches) for a in arms]
        with ThreadPoolExecutor(max_workers=jobs) as pool:  # batch by batch: a stopped screen
            list(pool.map(lambda ab: one_run(ab[0], ab[1], out, start, config, steps,  # has whole ones
                                             list(extra), starter), work))
    return report(out, steps, baseline)


def main(argv: list[str] | None = None) -> int:
    from megatron_oar import resources
    from megatron_oar.repro.runner import TESTBEDS

    p = argparse.ArgumentParser(prog="oar analyze lookahead", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("lookahead_out"))
    p.add_argument("--testbed", choices=sorted(TESTBEDS), default="credit")
    p.add_argument("--config", type=Path, help="the testbed config (default: the testbed's)")
    p.add_argument("--arms", default=",".join(DEFAULT_ARMS),
                   help=f"comma-separated, from: {'; '.join(ARMS)}")
    p.add_argument("--baseline", default="grpo")
    p.add_argument("--batches", type=int, default=6, help="paired batches (seeds)")
    p.add_argument("--steps", type=int, default=1, help="RL steps per run (1: every arm on the same rollouts)")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--sft-steps", type=int, help="the SFT start's warm-up steps (default: the demo's)")
    p.add_argument("--report-only", action="store_true", help="the table from the finished runs in --out")
    p.add_argument("overrides", nargs="*", help="key=value overrides for every run")
    args = p.parse_args(argv)
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    bad = [a for a in arms if a not in ARMS]
    if bad or args.baseline not in arms:
        print(f"oar analyze lookahead: --arms: unknown {bad} or no baseline {args.baseline!r}; "
              f"choose from {list(ARMS)}", file=sys.stderr)
        return 2
    if args.batches < 2 or args.steps < 1:
        print("oar analyze lookahead: --batches must be >= 2 (an interval) and --steps >= 1", file=sys.stderr)
        return 2
    config = args.config or resources.path(TESTBEDS[args.testbed])
    if args.report_only:
        s = report(args.out, args.steps, args.baseline)
    else:
        s = run(args.out, arms, args.batches, args.steps, config=config, jobs=args.jobs,
                extra=args.overrides, sft_steps=args.sft_steps, baseline=args.baseline)
    print(render(s))
    print(f"\nwritten: {args.out}/lookahead.json, lookahead.md")
    return 0
