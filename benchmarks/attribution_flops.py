"""``oar bench attribution-flops``: attribution cost against GRPO where FLOPs, not Python, decide it.

    oar bench attribution-flops [--hidden 512 --layers 8 ...] [--rows 8] [--prompt 32]
                                [--median-response 256 --length-sigma 0.4 --min-response 128
                                 --max-response 512] [--oar-p-rows 2]
                                [--methods grpo,oar_g,oar_p_screened,oar_p] [--repeats 1]
                                [--out bench_out] [--update-benchmarks]

``oar bench attribution`` runs the real trainer on a 0.4M-parameter model with 19-token
responses, where per-call overheads set the ratios. This suite runs a random Qwen2 of 57.7M
parameters (``benchmarks/random_model.py``) in one process through the trainer's Megatron passes
of one step, generation excluded: the old-logprob pass (which also yields the probe teacher),
the method's attribution (``compute_importance``), and one ``update_step`` over the batch, all
with the default token-budget micro-batches. Response lengths are drawn log-normal (``--median-
response``, ``--length-sigma``) and clipped to ``[--min-response, --max-response]``: reasoning
rollouts' lengths are right-skewed with a long tail. The probe is ``last_token`` (random tokens
have no answer span), so every response token before the last is scored.

Per method: sweep seconds = old-logprob + attribution + update (the paper's Figure 7), its ratio
to GRPO's, the forward-equivalent floor ``(4S + 2G + C) / 4S`` (S: the batch's tokens, one
forward plus one forward+backward; G: tokens of the sequences OAR-G runs, a forward and an
input-gradient backward; C: tokens of OAR-P's masked copies, one forward each) as the small suite
counts it, and the FLOP floor: the passes' model FLOPs (``models/flops.py``) over GRPO's, with the
attribution passes' output layer at the probe positions only, as they run it.

Exact OAR-P runs one forward per scored token, so its cost grows with the square of the response
length; on 2 CPU cores the whole batch would take about half an hour. Its attribution runs on the
first ``--oar-p-rows`` rows only (the others get a zero advantage, so they are not scored) and its
time is scaled to the whole batch by copy tokens (C of all rows over C of those rows); the table
says so. Screened OAR-P runs on every row.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from benchmarks.random_model import add_model_args, describe, random_batch, random_policy
from megatron_oar.config import DEFAULT_BUDGET_ROWS

SUITE = "attribution_flops"
METHODS = ("grpo", "oar_g", "oar_p_screened", "oar_p")


def lognormal_lengths(rows: int, median: int, sigma: float, lo: int, hi: int, seed: int = 0) -> list[int]:
    """``rows`` response lengths drawn log-normal around ``median``, clipped to ``[lo, hi]``."""
    import torch

    g = torch.Generator().manual_seed(seed)
    drawn = torch.exp(torch.randn(rows, generator=g) * sigma) * median
    return drawn.round().clamp(lo, hi).long().tolist()


def response_lengths(args) -> list[int]:
    return lognormal_lengths(args.rows, args.median_response, args.length_sigma, args.min_response,
                             args.max_response)


def floor_ratio(tokens: float, oar_g_tokens: float, copy_tokens: float) -> float:
    """The method's forward-equivalents over GRPO's: ``(4S + 2G + C) / 4S``."""
    return (4 * tokens + 2 * oar_g_tokens + copy_tokens) / (4 * tokens)


def attribution_flops(arch, work: list[tuple[int, float, int]]) -> float:
    """Model FLOPs of the attribution passes from ``Attribution.work`` (length,
    forward-equivalents, probe positions: the output layer runs there only)."""
    from megatron_oar.models.flops import forward_flops

    return sum(fe * forward_flops(arch, [n], probes) for n, fe, probes in work)


def _sweep(policy, batch, sites, method: str, args, seq_adv) -> dict:
    """One step's Megatron passes for ``method``: seconds per pass and the attribution's counts."""
    from megatron_oar.algorithms import PolicyLossConfig
    from megatron_oar.attribution import AttributionConfig, ProbeConfig, compute_importance
    from megatron_oar.training.policy_passes import old_logprob_pass, update_step

    budget = args.max_tokens_per_micro_batch
    kw = {"batching": "token_budget", "max_tokens": budget}
    rows = 1  # rows per micro-batch: batching=padded only, unused here
    times = {}
    t = time.perf_counter()
    batch.old_logprobs, batch.entropy, teacher = old_logprob_pass(
        policy.model, batch, args.vocab, rows, sites=sites, **kw)
    times["logprob"] = time.perf_counter() - t
    stats = {}
    t = time.perf_counter()
    if method != "grpo":
        cfg = AttributionConfig(method=method, probe=ProbeConfig(kind="last_token"), pad_id=0).resolve(
            batching="token_budget", max_tokens=budget)  # null keys: the training budget, as the trainer's
        attr = compute_importance(policy.model, batch, cfg, vocab_size=args.vocab, seq_adv=seq_adv,
                                  sites=sites, teacher=teacher, external_teacher=True)
        stats = {**attr.stats, "work": attr.work}
    times["attribution"] = time.perf_counter() - t
    batch.advantages = batch.seq_adv[:, None] * batch.loss_mask
    t = time.perf_counter()
    update_step(policy, batch, PolicyLossConfig(), args.vocab, rows, **kw)
    times["update"] = time.perf_counter() - t
    return {"seconds": times, "stats": stats}


def measure(args) -> dict:
    from megatron_oar.attribution import ProbeConfig, locate_probes

    responses = response_lengths(args)
    steps = (1 + args.repeats * len(args.methods)) * 2
    from megatron_oar.models.flops import forward_flops

    with random_policy(args, args.prompt + args.max_response + 64, steps) as (policy, arch):
        batch = random_batch(args.prompt, responses, args.vocab, seed=1)
        sites = locate_probes(batch, ProbeConfig(kind="last_token"))
        lengths, scored = batch.lengths.tolist(), sites.score_mask.sum(dim=1).tolist()
        copy_tokens = [n * s for n, s in zip(lengths, scored)]
        grpo_flops = 4 * forward_flops(arch, lengths)  # old-logprob forward, update forward + backward
        out = {"params": sum(p.numel() for p in policy.gpt.parameters()), "responses": responses,
               "tokens": sum(lengths), "scored_tokens": sum(scored), "grpo_flops": grpo_flops, "methods": {}}
        _sweep(policy, batch, sites, "grpo", args, batch.seq_adv)  # warm-up: allocator, first calls
        scales, advs = {}, {}
        for method in args.methods:
            advs[method], scales[method] = batch.seq_adv, 1.0
            if method == "oar_p" and args.oar_p_rows < args.rows:
                advs[method] = batch.seq_adv.clone()
                advs[method][args.oar_p_rows:] = 0  # not scored
                scales[method] = sum(copy_tokens) / sum(copy_tokens[:args.oar_p_rows])
        # round-robin over the methods, so a slow drift of the machine spreads over all of them
        all_runs = {m: [] for m in args.methods}
        for _ in range(args.repeats):
            for method in args.methods:
                all_runs[method].append(_sweep(policy, batch, sites, method, args, advs[method]))
        for method in args.methods:
            runs, scale = all_runs[method], scales[method]
            seconds = {k: statistics.median(r["seconds"][k] for r in runs) for k in runs[0]["seconds"]}
            stats = runs[0]["stats"]
            g = stats.get("oar_g_tokens", 0.0)
            c, copies = stats.get("masked_copy_tokens", 0.0), stats.get("masked_forwards", 0.0)
            work = stats.get("work", [])
            if scale != 1.0:  # the whole batch's copies, counted (the run made those of its rows)
                assert c == sum(copy_tokens[:args.oar_p_rows]), (c, copy_tokens)
                c, copies = float(sum(copy_tokens)), float(sum(scored))
                work = [(n, float(k), 1) for n, k in zip(lengths, scored)]  # last_token: one probe
            out["methods"][method] = {
                "seconds": seconds, "attribution_scale": scale, "all": [r["seconds"] for r in runs],
                "sweep": seconds["logprob"] + seconds["attribution"] * scale + seconds["update"],
                "oar_g_tokens": g, "copy_tokens": c, "copies": copies,
                "floor": floor_ratio(out["tokens"], g, c),
                "attribution_flops": attribution_flops(arch, work),
                "flop_floor": 1.0 + attribution_flops(arch, work) / grpo_flops}
        base = out["methods"]["grpo"]["sweep"] if "grpo" in out["methods"] else None
        for m in out["methods"].values():
            m["ratio"] = m["sweep"] / base if base else None
            sweeps = [r["logprob"] + r["attribution"] * m["attribution_scale"] + r["update"] for r in m["all"]]
            m["sweep_range"] = [min(sweeps), max(sweeps)]
        # achieved rates per pass: the FLOP floor assumes every pass turns FLOPs into time alike
        forward = forward_flops(arch, lengths)
        out["gflops"] = {"logprob": [forward / r["logprob"] / 1e9 for m in out["methods"].values() for r in m["all"]],
                         "update": [3 * forward / r["update"] / 1e9 for m in out["methods"].values() for r in m["all"]]}
        for name, m in out["methods"].items():
            if m["attribution_flops"]:
                out["gflops"][f"attribution ({name})"] = [
                    m["attribution_flops"] / (r["attribution"] * m["attribution_scale"]) / 1e9 for r in m["all"]]
        return out


def render(res: dict, args) -> str:
    r = res["responses"]
    lines = [f"Model: {describe(args, res['params'])}. Batch: {args.rows} sequences of a {args.prompt}-token "
             f"prompt and a response drawn log-normal (median {args.median_response}, sigma {args.length_sigma}) "
             f"clipped to [{args.min_response}, {args.max_response}]: {min(r)}-{max(r)} tokens, mean "
             f"{sum(r) / len(r):.0f}; {res['tokens']} tokens, {res['scored_tokens']} scored (last_token "
             f"probe). Token-budget micro-batches of {args.max_tokens_per_micro_batch} "
             f"tokens (attribution: the same). Median of {args.repeats} run(s) per method, round-robin over "
             "the methods, after one warm-up sweep.", "",
             "| method | sweep s | logprob s | attribution s | update s | sweep ratio | forward-equivalent floor "
             "| FLOP floor | ratio / FLOP floor |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, m in res["methods"].items():
        s = m["seconds"]
        attr = f"{s['attribution'] * m['attribution_scale']:.2f}"
        if m["attribution_scale"] != 1.0:
            attr += f" ({s['attribution']:.2f} x {m['attribution_scale']:.2f})"
        ratio = f"{m['ratio']:.2f}x" if m["ratio"] else "-"
        rel = f"{m['ratio'] / m['flop_floor']:.2f}" if m["ratio"] else "-"
        lines.append(f"| {name} | {m['sweep']:.2f} | {s['logprob']:.2f} | {attr} | {s['update']:.2f} | "
                     f"{ratio} | {m['floor']:.2f}x | {m['flop_floor']:.2f}x | {rel} |")
    lines += ["", "Sweep = old-logprob pass + attribution + update (generation excluded); ratio = the method's "
              "sweep over GRPO's on the same batch. Floor = forward-equivalents over GRPO's, `(4S + 2G + C) / 4S` "
              "(S tokens in the batch: one forward, one forward + backward; G tokens of the sequences OAR-G runs: "
              "a forward and an input-gradient backward; C tokens of OAR-P's masked copies: one forward each). "
              "FLOP floor = the same passes' model FLOPs over GRPO's (`models/flops.py`), where the attribution "
              "passes run the output layer at the probe positions only; with a 32768-token vocabulary the output "
              "layer is a large share of a forward, so this is the floor the attribution passes can reach."]
    rates = ", ".join(f"{k} {statistics.median(v):.1f} ({min(v):.1f}-{max(v):.1f})"
                      for k, v in res["gflops"].items())
    lines += ["", f"Achieved GFLOP/s per pass, median (min-max) over every run: {rates}. A pass that turns "
              "FLOPs into time faster than GRPO's passes puts its method below the FLOP floor, a slower one above.",
              "Sweep seconds per method, min-max over its runs: " + ", ".join(
                  f"{k} {m['sweep_range'][0]:.2f}-{m['sweep_range'][1]:.2f}" for k, m in res["methods"].items()) + "."]
    if "oar_p" in res["methods"] and res["methods"]["oar_p"]["attribution_scale"] != 1.0:
        lines.append(f"Exact OAR-P's attribution ran on the first {args.oar_p_rows} rows and is scaled to "
                     "the batch by copy tokens (its measured seconds x the factor in parentheses).")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="oar bench attribution-flops", description=__doc__.split("\n\n")[1])
    add_model_args(p)
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--median-response", type=int, default=256)
    p.add_argument("--length-sigma", type=float, default=0.4)
    p.add_argument("--min-response", type=int, default=128)
    p.add_argument("--max-response", type=int, default=512)
    p.add_argument("--max-tokens-per-micro-batch", type=int, default=None,
                   help="token budget of every pass's micro-batches (default: as the trainer's null, "
                        "4 x (--prompt + --max-response))")
    p.add_argument("--oar-p-rows", type=int, default=2, help="rows exact OAR-P scores (its time is scaled)")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--out", type=Path, default=Path("bench_out"))
    p.add_argument("--update-benchmarks", action="store_true", help="rewrite BENCHMARKS.md's section")
    args = p.parse_args(argv)
    args.max_tokens_per_micro_batch = (args.max_tokens_per_micro_batch
                                       or DEFAULT_BUDGET_ROWS * (args.prompt + args.max_response))
    args.methods = [m for m in args.methods.split(",") if m]
    unknown = sorted(set(args.methods) - set(METHODS))
    if unknown or "grpo" not in args.methods:
        p.error(f"--methods: {unknown or 'grpo is missing'} (choose from {', '.join(METHODS)}; grpo is the baseline)")
    if not 1 <= args.min_response <= args.max_response or not 1 <= args.oar_p_rows <= args.rows:
        p.error("need 1 <= --min-response <= --max-response and 1 <= --oar-p-rows <= --rows")
    from benchmarks import common

    return common.run_and_publish(args, argv, suite=SUITE, prog="oar bench attribution-flops",
                                  title="Attribution cost where FLOPs dominate", measure=measure, render=render)


if __name__ == "__main__":
    sys.exit(main())
