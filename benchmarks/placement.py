"""Step time with the vLLM engines colocated against on a rollout rank of their own, at
``rollout.max_staleness`` 0 and 1 (`oar bench placement`).

    oar bench placement [--model HF_DIR] [--steps 6] [--prompts 8] [--group-size 8]
                        [--max-new-tokens 24] [--timeout-s 900] [--out runs/bench/placement]
                        [--update-benchmarks]

Three ``oar train`` runs of ``examples/tiny_cpu.yaml`` (OAR-G, Megatron TP2 on 2 gloo ranks), each
a fresh ``torchrun``:

* ``colocated``: 2 ranks, a vLLM engine in each (rollout TP1, 2 engines), generation and
  training taking turns;
* ``separate, staleness 0``: 2 training ranks + 1 rollout rank (one engine, awake), generation
  and training still taking turns (`rollout.max_staleness=0`);
* ``separate, staleness 1``: the same ranks, the next step's batch generated while this step
  trains.

Per run, over steps 2..N (step 1 warms up): the median step seconds (without the last step's
checkpoint), the generation seconds (colocated: the ``generate`` phase, rewards included;
separate: the rollout rank's own, ``rollout/generation_seconds``), and the share of generation
hidden behind training (``rollout/overlap``: ``1 - trainer's wait / generation``; 0 colocated).
The model is the demo's untrained tiny Qwen2 (``--model`` takes another HF dir). On a CPU the
processes share the cores: the separate placement's rollout rank competes with the training
ranks for them, which a GPU run does not. Writes ``OUT/placement.json`` and ``OUT/placement.md``
(the BENCHMARKS.md section); ``--update-benchmarks`` rewrites that section of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import common
from megatron_oar import resources

SUITE = "placement"
PROG = "oar bench placement"
RUNS = {  # name -> (processes, overrides)
    "colocated": (2, []),
    "separate, staleness 0": (3, ["rollout.placement=separate", "rollout.ranks=1", "rollout.max_staleness=0"]),
    "separate, staleness 1": (3, ["rollout.placement=separate", "rollout.ranks=1", "rollout.max_staleness=1"]),
}
TABLE_HEADER = ("| placement | processes | step s (median) | vs colocated | generation s | generation "
                "hidden | staleness |")
TABLE_RULE = "|---|---:|---:|---:|---:|---:|---:|"


def summarize_run(records: list[dict]) -> dict:
    """A run's metrics records -> its medians over steps 2..N (the last step's checkpoint left out)."""
    steps = records[1:] or records
    step_s = [r["time/step"] - r.get("time/checkpoint", 0.0) for r in steps]
    gen = [r.get("rollout/generation_seconds", r.get("time/generate", 0.0)) for r in steps]
    return {"steps": len(records), "step_s": statistics.median(step_s), "generation_s": statistics.median(gen),
            "overlap": statistics.median(r.get("rollout/overlap", 0.0) for r in steps),
            "staleness": max((r.get("rollout/staleness_max", 0.0) for r in steps), default=0.0)}


def table(results: dict[str, dict]) -> str:
    base = results.get("colocated", {}).get("step_s")
    rows = [TABLE_HEADER, TABLE_RULE]
    for name, r in results.items():
        ratio = f"{base / r['step_s']:.2f}x faster" if base and name != "colocated" else "-"
        rows.append(f"| {name} | {RUNS[name][0]} | {r['step_s']:.2f} | {ratio} | {r['generation_s']:.2f} | "
                    f"{r['overlap']:.0%} | {r['staleness']:g} |")
    return "\n".join(rows)


def parse_args(argv):
    p = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=None, help="HF dir (default: the demo's untrained tiny Qwen2)")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--prompts", type=int, default=8, help="train.prompts_per_step")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--timeout-s", type=float, default=900.0, help="per run")
    p.add_argument("--out", type=Path, default=Path("runs/bench/placement"))
    p.add_argument("--update-benchmarks", action="store_true")
    p.add_argument("--benchmarks-file", type=Path, default=None)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from megatron_oar.training.logger import read_metrics

    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    machine = common.machine_info()
    model = args.model
    if model is None:
        from megatron_oar.repro.demo_model import make_demo_model

        model = make_demo_model(out / "model")
    env = common.subprocess_env()
    results, t0 = {}, time.perf_counter()
    for name, (procs, overrides) in RUNS.items():
        run_dir = out / name.replace(", ", "_").replace(" ", "_")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(procs),
               "-m", "megatron_oar.commands.train", "--config", str(resources.path("tiny_cpu.yaml")),
               f"model.path={model}",
               f"run_dir={run_dir}", f"train.steps={args.steps}", f"train.prompts_per_step={args.prompts}",
               f"train.group_size={args.group_size}", f"rollout.max_new_tokens={args.max_new_tokens}",
               "train.eval_interval=0", "checkpoint.export_hf_at_end=false", "checkpoint.resume=none",
               "log.console=false", *overrides]
        with open(out / f"{run_dir.name}.log", "w") as log:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=args.timeout_s).returncode
        if rc != 0:
            print(f"[bench] {name}: oar train exited with {rc}; see {out / (run_dir.name + '.log')}", file=sys.stderr)
            return 1
        results[name] = summarize_run(read_metrics(run_dir))
        print(f"[bench] {name}: {results[name]}")
    wall = time.perf_counter() - t0
    cmdline = common.command_line(PROG, argv if argv is not None else sys.argv[1:])
    body = (f"## Rollout placement (`{PROG}`)\n\nCommand: `{cmdline}` ({wall / 60:.1f} min)\n"
            f"{common.machine_line(machine)}\n\n"
            f"`examples/tiny_cpu.yaml` (OAR-G, Megatron TP2), {args.prompts} prompts x {args.group_size} "
            f"completions of up to {args.max_new_tokens} tokens per step, {args.steps} steps, medians over "
            "steps 2..N:\n\n" + table(results) + "\n\nOn a CPU the three processes share the cores, so "
            "the rollout rank's generation slows the training ranks down; on GPUs the roles have "
            "devices of their own (docs/rollout.md, \"Separate placement\").\n")
    ok = common.publish(out, SUITE, {"args": {k: str(v) for k, v in vars(args).items()}, "result": results,
                                     "wall_seconds": wall}, body, update=args.update_benchmarks,
                        benchmarks_file=args.benchmarks_file)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
