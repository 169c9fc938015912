"""``oar plan``: will a config fit its cluster, and how long will a step take?

The command line over :mod:`megatron_oar.commands.plan` (the model is described there)."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from megatron_oar.commands.plan.budget_search import at_length
from megatron_oar.commands.plan.hardware import Hardware
from megatron_oar.commands.plan.planner import OAR_P_MAX_COST, plan_config
from megatron_oar.commands.plan.report import (
    SUMMARY_HEADER,
    TABLE_HEADER,
    TABLE_LENGTHS,
    length_rows,
    render,
    summary_row,
)


def main(argv: list[str] | None = None) -> int:
    from megatron_oar.config import ConfigError, load_config, validate
    from megatron_oar.models import ModelConfigError
    from megatron_oar.models.presets import resolve_hf_config

    p = argparse.ArgumentParser(prog="oar plan", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, nargs="+",
                   help="YAML config(s); with several, one summary table")
    p.add_argument("--nodes", type=int, help="default: the config's launch.nodes")
    p.add_argument("--gpus-per-node", type=int, help="default: launch.gpus_per_node")
    p.add_argument("--gpu-mem-gib", type=float, help="default: launch.gpu_mem_gib")
    p.add_argument("--arch", help="a preset (models/presets.py: Qwen2.5, Qwen3, Qwen3-MoE) when "
                   "model.path has no config.json here")
    p.add_argument("--mfu", type=float, default=Hardware.mfu)
    p.add_argument("--peak-tflops", type=float, default=Hardware.peak_tflops)
    p.add_argument("--hbm-tb-s", type=float, default=Hardware.hbm_tb_s)
    p.add_argument("--response-tokens", type=int,
                   help="plan responses of this many tokens: rollout.max_new_tokens (and "
                   "rollout.max_model_len raised to hold the prompt and them); default: the config's")
    p.add_argument("--oar-p-max-cost", type=float, default=OAR_P_MAX_COST,
                   help="warn when exact OAR-P's step costs more than this many GRPO steps")
    p.add_argument("--table", action="store_true",
                   help="one row per config and response length (--lengths): fits, peak, budgets, "
                   "the knob it needs otherwise")
    p.add_argument("--lengths", type=int, nargs="+", default=list(TABLE_LENGTHS),
                   help="response lengths of --table")
    p.add_argument("--json", action="store_true", help="print the plan(s) as JSON")
    p.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = p.parse_args(argv)
    # `--config a.yaml b.yaml key=value`: nargs="+" also takes the overrides
    overrides = [c for c in args.config if "=" in c] + args.overrides
    plans, table = [], []
    for path in (Path(c) for c in args.config if "=" not in c):
        try:
            cfg = load_config(path, overrides)
            if args.response_tokens is not None:
                cfg = at_length(cfg, args.response_tokens)
            nodes = args.nodes or cfg.launch.nodes
            gpn = args.gpus_per_node or cfg.launch.gpus_per_node
            hf, source = resolve_hf_config(cfg.model.path, args.arch)
            validate(cfg, world_size=nodes * gpn, hf_config=hf)
        except (ConfigError, ModelConfigError) as e:
            print(f"oar plan: {e}", file=sys.stderr)
            return 2
        hw = Hardware(gpu_mem_gib=args.gpu_mem_gib or cfg.launch.gpu_mem_gib, mfu=args.mfu,
                      peak_tflops=args.peak_tflops, hbm_tb_s=args.hbm_tb_s)
        kw = dict(nodes=nodes, gpus_per_node=gpn, hw=hw, source=source, oar_p_max_cost=args.oar_p_max_cost)
        if args.table:
            table.extend(length_rows(path.stem, cfg, hf, lengths=args.lengths, **kw))
            continue
        plans.append((path.stem, plan_config(cfg, hf, **kw)))
    if args.table:
        print(TABLE_HEADER)
        print("\n".join(table))
        return 0
    if args.json:
        print(json.dumps({n: asdict(pl) for n, pl in plans}, indent=2))
    elif len(plans) == 1:
        print(render(plans[0][1], plans[0][0]))
    else:
        print(SUMMARY_HEADER)
        print("\n".join(summary_row(n, pl) for n, pl in plans))
    return 0 if all(pl.fits for _, pl in plans) else 1

