"""``oar``: the megatron-oar command line.

    oar train --config X.yaml [--nproc-per-node N] [--resume auto|none|DIR] [key=value ...]
    oar launch --config X.yaml [--executor local|slurm] [--dryrun] [key=value ...]
                                   validate for the cluster, then start via nemo-run (torchrun/Slurm)
    oar plan --config X.yaml [--nodes N --gpus-per-node G --gpu-mem-gib M] [--response-tokens T]
             [--oar-p-max-cost X] [--table [--lengths ...]] [key=value ...]
                                   memory per GPU, FLOPs and step time; does it fit?
    oar eval [--config X.yaml] eval.model=M eval.data_dir=D [eval.n=32 eval.k=[1,32] ...] [--nproc-per-node N]
                                   pass@k per benchmark + average, Markdown (Table 1) and JSON
    oar analyze oracle --config X.yaml --model M [--trajectories 500] [--out DIR]
                                   causal-token oracle + recall of OAR-P/OAR-G/entropy/random
    oar analyze recall RECORDS.jsonl   the recall table and plot again from saved records
    oar analyze credit RUN_DIR     where a run's credit went (log.credit_records=N): by token kind
                                   and position, the answer's copy source, Figure 6, locus recall
    oar analyze lookahead [--arms ...] [--batches 6] [--steps 1] [--out DIR]
                                   credit schemes after a few updates from one start on the same
                                   rollouts: held-out accuracy paired over batches, with intervals
    oar viz RECORDS.jsonl [--id ID | --index I] [--methods ...] [--out DIR]
                                   token-importance maps (HTML + PNG), OAR-P/OAR-G/entropy/oracle
    oar plot RUN_DIR [--out PNG]   training curves from RUN_DIR/logs/metrics.jsonl
    oar repro [--out DIR] [--grid default|full|losses|credit|tiny] [--jobs 2] [--report-only]
                                   every credit method x seeds on the chain testbed (--grid credit:
                                   the credit testbed), ablations, the oracle: Table 1, Figures
                                   3/5/6/7, learning-curve measures in DIR/repro.md
    oar demo [--out DIR]           tiny end-to-end demo: SFT warm-up, then OAR-G GRPO at TP=2
    oar info                       versions, device and which fused kernels megatron-core will use
    oar bench attribution ...      attribution cost vs GRPO: sweep and end-to-end ratios (Fig. 7)
    oar bench screening RECORDS    screened OAR-P against exact OAR-P (quality and cost vs q)
    oar bench rollout ...          generation tokens/s and weight-sync time vs model size
    oar bench placement ...        step time colocated vs separate rollouts (staleness 0 / 1)
    oar bench convert ...          converter peak memory vs model and layer size
    oar bench batching ...         padding and sweep time, padded vs token-budget micro-batches
    oar bench attribution-flops ...  attribution cost vs GRPO on a 57.7M model, 128-512-token
                                   responses, against the forward-equivalent floor
    oar bench logits-memory ...    peak memory and time of the old-logprob pass and the update,
                                   chunked vs whole-micro-batch logits (151,936-token vocabulary)
    oar bench vs-hf ...            the old-logprob pass, the update and OAR-G against a plain
                                   transformers + SDPA loop on the same batch (seconds, MFU, memory)
    oar bench vs-trl ...           a whole GRPO / OAR-G / screened OAR-P step of oar train against
                                   TRL's GRPOTrainer on the same work (s/step, phases, memory)

"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import NoReturn

from megatron_oar.log_setup import backend_notices, quiet_backend_notices

# `oar bench SUITE`: the module in benchmarks/ (results in BENCHMARKS.md)
BENCH_SUITES = {"attribution": "attribution", "rollout": "rollout", "screening": "screening",
                "convert": "convert_memory", "batching": "batching", "attribution-flops": "attribution_flops",
                "logits-memory": "logits_memory", "vs-hf": "vs_hf", "placement": "placement",
                "vs-trl": "vs_trl"}


def _demo(args: argparse.Namespace) -> int:
    from megatron_oar.commands.demo import run_demo

    return run_demo(args.out, steps=args.steps, sft_steps=args.sft_steps)


def _train(args: argparse.Namespace) -> int:
    """Runs megatron_oar.commands.train in this process (inside torchrun, or one process), or becomes
    torchrun with ``--nproc-per-node`` processes and the config's restart budget
    (``launch.max_restarts``; each restart resumes from the newest checkpoint). The config is
    validated for that world first: a config error is one line and exit status 2, before torchrun
    starts; a rank's own config error is not restarted (``commands/torchrun.py``)."""
    import os

    from megatron_oar.commands import train

    argv = ["--config", str(args.config), *(["--resume", args.resume] if args.resume else []),
            *args.overrides]
    if args.nproc_per_node > 1 and "LOCAL_RANK" not in os.environ:
        from megatron_oar.commands.launch import elastic_env
        from megatron_oar.config import ConfigError

        try:  # a config error stops here, before torchrun starts, validated for its world
            cfg = train.config_from_args(train.parse_args(argv))
            train.validate_for_world(cfg, world=args.nproc_per_node, quiet=True)
        except ConfigError as e:
            print(f"config error: {e}", file=sys.stderr)
            return 2
        for key, value in elastic_env(cfg.launch).items():
            os.environ.setdefault(key, value)
        # what torchrun gives each worker when it is unset, without its 4-line banner saying so
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        # torchrun, but a rank's config error (exit 2) is not restarted (commands/torchrun.py)
        cmd = [sys.executable, "-m", "megatron_oar.commands.torchrun", "--standalone",
               f"--nproc-per-node={args.nproc_per_node}", f"--max-restarts={cfg.launch.max_restarts}",
               "-m", "megatron_oar.commands.train", *argv]
        sys.stdout.flush()
        sys.stderr.flush()
        os.execv(sys.executable, cmd)  # signals (SIGTERM, SIGUSR1) go straight to torchrun
    return train.main(argv)


def _info() -> int:
    import torch

    import megatron_oar
    from megatron_oar.runtime.kernels import kernel_report

    try:
        from importlib.metadata import version

        mcore = version("megatron-core")
    except Exception:  # pragma: no cover
        mcore = "not installed"
    print(f"megatron-oar {megatron_oar.__version__}, torch {torch.__version__}, "
          f"megatron-core {mcore}")
    print(kernel_report().line())
    notices = backend_notices()  # the other commands filter them (log_setup.quiet_backend_notices)
    if notices:
        print("megatron-core fallbacks (hidden from the other commands):")
        for notice in notices:
            print(f"  {notice}")
    return 0


def main(argv: list[str] | None = None) -> int:
    quiet_backend_notices()  # before anything imports megatron-core (oar info lists them)
    parser = argparse.ArgumentParser(prog="oar", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="tiny end-to-end demo on CPU")
    d.add_argument("--out", type=Path, default=Path("demo_out"), help="output directory (replaced)")
    d.add_argument("--steps", type=int, default=None, help="RL steps (default: the example's)")
    d.add_argument("--sft-steps", type=int, default=None, help="warm-up steps (default: 300)")
    t = sub.add_parser("train", help="RL training (GRPO / OAR-G / OAR-P / baselines)")
    t.add_argument("--config", required=True, type=Path, help="YAML config (see examples/)")
    t.add_argument("--nproc-per-node", type=int, default=1,
                   help="processes to start with torchrun (1: run in this process)")
    t.add_argument("--resume", default=None, help="auto | none | a checkpoint step directory")
    t.add_argument("overrides", nargs="*", help="key=value config overrides")
    # these hand every argument, --flags included, to their module's own main()
    forwarded = {
        "launch": ("megatron_oar.commands.launch", "validate a config for its cluster, start it via nemo-run"),
        "plan": ("megatron_oar.commands.plan", "memory per GPU and step time of a config on its cluster"),
        "eval": ("megatron_oar.eval.run_eval", "pass@k on AIME24/25, AMC23, MATH500, GSM8K (Table 1)"),
        "viz": ("megatron_oar.eval.viz.cli", "token-importance maps (HTML + PNG) from oracle records"),
        "repro": ("megatron_oar.repro.runner", "the paper's tables and figures in miniature on CPU"),
    }
    analyses = {"oracle": "megatron_oar.eval.oracle", "recall": "megatron_oar.eval.recall",
                "credit": "megatron_oar.eval.credit_profile", "lookahead": "megatron_oar.repro.lookahead"}
    an = sub.add_parser("analyze", help="oracle: causal-token oracle and recall of importance "
                        "signals (paper Sec. 5.1); recall: the table again from its records; "
                        "credit: where a run's credit went (log.credit_records); lookahead: credit "
                        "schemes compared after a few updates on shared rollouts, paired over batches")
    an.add_argument("analysis", choices=list(analyses))
    an.add_argument("args", nargs=argparse.REMAINDER)
    for name, (_, text) in forwarded.items():
        fp = sub.add_parser(name, help=text, prefix_chars="+", add_help=False)
        fp.add_argument("args", nargs=argparse.REMAINDER, help=f"(oar {name} --help)")
    pl = sub.add_parser("plot", help="training curves of a run to PNG")
    pl.add_argument("args", nargs=argparse.REMAINDER, help="RUN_DIR [--out PNG] [--keys ...]")
    sub.add_parser("info", help="versions and kernels")
    b = sub.add_parser("bench", help="benchmarks (suite name, then its own options)")
    b.add_argument("suite", choices=list(BENCH_SUITES))
    b.add_argument("args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if args.command == "demo":
        return _demo(args)
    if args.command == "train":
        return _train(args)
    if args.command == "analyze":
        import importlib

        return importlib.import_module(analyses[args.analysis]).main(args.args)
    if args.command in forwarded:
        import importlib

        return importlib.import_module(forwarded[args.command][0]).main(args.args)
    if args.command == "plot":
        from megatron_oar.commands import plot

        return plot.main(args.args)
    if args.command == "bench":
        import importlib

        return importlib.import_module(f"benchmarks.{BENCH_SUITES[args.suite]}").main(args.args) or 0
    return _info()


def console_main() -> NoReturn:
    """The ``oar`` console script (``setup.py``) and ``python -m megatron_oar.cli``: :func:`main`,
    the process then ending as :func:`megatron_oar.process_exit.exit_after` ends it."""
    from megatron_oar.process_exit import exit_after

    exit_after(main)


if __name__ == "__main__":
    console_main()
