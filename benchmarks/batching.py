"""``oar bench batching``: padding and sweep time of the trainer's Megatron passes, padded vs
token-budget micro-batches (``train.batching``), on responses whose lengths spread.

    oar bench batching [--hidden 512 --layers 8 ...] [--rows 32] [--min-response 128
                       --max-response 512] [--repeats 2] [--out bench_out] [--update-benchmarks]

One process (a gloo world of one): a random Qwen2 of the given shape is converted and wrapped by
``build_policy``; ``--rows`` sequences of a ``--prompt``-token prompt and a response whose length
is drawn uniformly from ``[--min-response, --max-response]`` (4:1 by default, as reasoning
rollouts spread) go through the old-logprob pass and one ``update_step`` (the update sweep), once
with ``padded`` micro-batches of ``--micro-batch-size`` rows and once with token budgets of
``--micro-batch-size x (prompt + max response)`` tokens, ``--repeats`` times each (the first
repeat warms up and is not counted when there are more). Reports the padding fraction of each
pass and the median seconds, and the speed-up of token budgets.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from benchmarks.random_model import add_model_args, describe, random_batch, random_policy

SUITE = "batching"


def measure(args) -> dict:
    import torch

    from megatron_oar.algorithms import PolicyLossConfig
    from megatron_oar.models.micro_batches import micro_batches, padding_fraction
    from megatron_oar.training.policy_passes import old_logprob_pass, update_step

    g = torch.Generator().manual_seed(0)
    responses = torch.randint(args.min_response, args.max_response + 1, (args.rows,), generator=g).tolist()
    with random_policy(args, args.prompt + args.max_response + 64, 4 * args.repeats) as (policy, _):
        params = sum(p.numel() for p in policy.gpt.parameters())
        batch = random_batch(args.prompt, responses, args.vocab, seed=1)
        lengths = batch.lengths.tolist()
        budget = args.max_tokens_per_micro_batch or args.micro_batch_size * (args.prompt + args.max_response)
        mbs = args.micro_batch_size
        out = {"params": params, "tokens": sum(lengths), "budget": budget, "modes": {}}
        for mode in ("padded", "token_budget"):
            groups = micro_batches(lengths, batching=mode, rows_per_micro=mbs, max_tokens=budget)
            width = max(lengths) if mode == "padded" else None
            kw = {"batching": mode, "max_tokens": budget}
            times = {"logprob": [], "update": []}
            for _ in range(args.repeats):
                t = time.perf_counter()
                batch.old_logprobs, batch.entropy, _ = old_logprob_pass(policy.model, batch, args.vocab, mbs, **kw)
                times["logprob"].append(time.perf_counter() - t)
                batch.advantages = batch.seq_adv[:, None] * batch.loss_mask
                t = time.perf_counter()
                update_step(policy, batch, PolicyLossConfig(), args.vocab, mbs, **kw)
                times["update"].append(time.perf_counter() - t)
            counted = {k: v[1:] if len(v) > 1 else v for k, v in times.items()}
            out["modes"][mode] = {
                "micro_batches": len(groups),
                "padding_fraction": padding_fraction(lengths, groups, width=width),
                "seconds": {k: statistics.median(v) for k, v in counted.items()},
                "all_seconds": times}
        return out


def render(res: dict, args) -> str:
    p, b = res["modes"]["padded"], res["modes"]["token_budget"]
    lines = [f"Model: {describe(args, res['params'])}. Batch: {args.rows} sequences of a {args.prompt}-token "
             f"prompt and a response of {args.min_response}-{args.max_response} tokens (uniform), "
             f"{res['tokens']} tokens; padded: {args.micro_batch_size} rows per micro-batch; token budget: "
             f"{res['budget']} tokens. Median of "
             f"{max(1, args.repeats - 1)} timed repeat(s) after a warm-up.", "",
             "| batching | micro-batches | padding (% of processed tokens) | old-logprob pass s | update sweep s |",
             "|---|---:|---:|---:|---:|"]
    for name, m in (("padded", p), ("token_budget", b)):
        lines.append(f"| {name} | {m['micro_batches']} | {100 * m['padding_fraction']:.1f} | "
                     f"{m['seconds']['logprob']:.2f} | {m['seconds']['update']:.2f} |")
    speed = {k: p["seconds"][k] / b["seconds"][k] for k in ("logprob", "update")}
    lines += ["", f"Token budgets vs padded: old-logprob pass {speed['logprob']:.2f}x, "
              f"update sweep {speed['update']:.2f}x faster."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="oar bench batching", description=__doc__.split("\n\n")[0])
    add_model_args(p)
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--min-response", type=int, default=128)
    p.add_argument("--max-response", type=int, default=512)
    p.add_argument("--micro-batch-size", type=int, default=4, help="rows per micro-batch (padded)")
    p.add_argument("--max-tokens-per-micro-batch", type=int, default=None,
                   help="tokens per micro-batch (token_budget; default: --micro-batch-size rows of "
                        "--prompt + --max-response tokens, the padded micro-batch's largest)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", type=Path, default=Path("bench_out"))
    p.add_argument("--update-benchmarks", action="store_true", help="rewrite BENCHMARKS.md's section")
    args = p.parse_args(argv)
    if not 1 <= args.min_response <= args.max_response or args.rows % args.micro_batch_size:
        p.error("need 1 <= --min-response <= --max-response and --rows divisible by --micro-batch-size")
    from benchmarks import common

    return common.run_and_publish(args, argv, suite=SUITE, prog="oar bench batching",
                                  title="Padding and sweep time: padded vs token-budget micro-batches",
                                  measure=measure, render=render)


if __name__ == "__main__":
    sys.exit(main())
