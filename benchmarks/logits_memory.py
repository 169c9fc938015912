"""``oar bench logits-memory``: peak memory and time of the old-logprob pass and of the update,
chunked logits (``train.logits_chunk_tokens``) against each micro-batch's whole logits.

    oar bench logits-memory [--hidden 512 --layers 8 ... --vocab 151936] [--responses 2048,4096,8192]
                            [--prompt 32] [--chunk 4096] [--repeats 1] [--out bench_out]
                            [--update-benchmarks]

One process (a gloo world of one, ``benchmarks/random_model.py``): the suite's random Qwen2
(hidden 512, 8 layers) with Qwen's 151,936-token vocabulary, and per ``--responses`` length one
sequence of a ``--prompt``-token prompt and that many response tokens, as one micro-batch (the
token budget is the sequence). For each length, the trainer's old-logprob pass (log-probs and
entropies) and one ``update_step`` (PPO loss with an entropy term) run with ``--chunk`` and with 0
(each micro-batch's logits whole), ``--repeats`` times each, alternating.

Peak memory on CPU: a thread samples the process's resident set (``/proc/self/statm``) every
millisecond while the pass runs; the figure is the highest sample minus the resident set just
before the pass (after a garbage collection). Tensors this large are ``mmap``-ed by the C
allocator and unmapped when freed, so each pass starts from the same floor. On CUDA the same
figure is ``torch.cuda.max_memory_allocated`` minus the allocation before the pass.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import statistics
import sys
import threading
import time
from pathlib import Path

from benchmarks.random_model import add_model_args, describe, random_batch, random_policy

SUITE = "logits_memory"
QWEN_VOCAB = 151936


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@contextlib.contextmanager
def peak_memory(result: dict):
    """``result["peak_bytes"]``: the block's peak memory above its start (module doc)."""
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        yield
        torch.cuda.synchronize()
        result["peak_bytes"] = torch.cuda.max_memory_allocated() - base
        return
    base = _rss()
    peak, stop = [base], threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(0.001)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        result["peak_bytes"] = max(peak[0], _rss()) - base


def _run(policy, batch, args, chunk: int) -> dict:
    from megatron_oar.algorithms import PolicyLossConfig
    from megatron_oar.training.policy_passes import old_logprob_pass, update_step

    kw = {"batching": "token_budget", "max_tokens": int(batch.lengths.max()), "logits_chunk": chunk}
    out = {}
    for name in ("logprob", "update"):
        res: dict = {}
        with peak_memory(res):
            t = time.perf_counter()
            if name == "logprob":
                batch.old_logprobs, batch.entropy, _ = old_logprob_pass(policy.model, batch, args.vocab, 1, **kw)
            else:
                batch.advantages = batch.seq_adv[:, None] * batch.loss_mask
                update_step(policy, batch, PolicyLossConfig(entropy_coef=0.001), args.vocab, 1, **kw)
            res["seconds"] = time.perf_counter() - t
        out[name] = res
    return out


def measure(args) -> dict:
    steps = 2 * len(args.responses) * args.repeats + 4
    with random_policy(args, args.prompt + max(args.responses) + 64, steps) as (policy, _):
        out = {"params": sum(p.numel() for p in policy.gpt.parameters()), "lengths": {}}
        warm = random_batch(args.prompt, [64], args.vocab, seed=0)  # first calls, allocator: not counted
        for chunk in (args.chunk, 0):
            _run(policy, warm, args, chunk)
        for response in args.responses:
            batch = random_batch(args.prompt, [response], args.vocab, seed=response)
            runs = {0: [], args.chunk: []}
            for _ in range(args.repeats):
                for chunk in (args.chunk, 0):  # alternating, so a drift of the machine hits both
                    runs[chunk].append(_run(policy, batch, args, chunk))
            out["lengths"][response] = {
                "tokens": int(batch.lengths.max()),
                **{("chunked" if c else "whole"): {p: {k: statistics.median(r[p][k] for r in rs)
                                                       for k in ("seconds", "peak_bytes")}
                                                   for p in ("logprob", "update")}
                   for c, rs in runs.items()}}
        return out


def render(res: dict, args) -> str:
    gib = 2**30
    lines = [f"Model: {describe(args, res['params'])}. Per response length one sequence of a {args.prompt}-token "
             f"prompt and the response, as one micro-batch; chunked: `train.logits_chunk_tokens={args.chunk}`, "
             f"whole: `0` (each micro-batch's logits at once). Median of {args.repeats} run(s), chunked and "
             "whole alternating. Peak = highest resident set sampled every 1 ms during the pass minus the "
             "resident set before it (`/proc/self/statm`; on CUDA `torch.cuda.max_memory_allocated`).", "",
             "| response tokens | pass | whole: peak GiB | chunked: peak GiB | peak ratio | whole s | chunked s "
             "| time ratio |",
             "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for response, r in res["lengths"].items():
        for name, label in (("logprob", "old-logprob"), ("update", "update")):
            w, c = r["whole"][name], r["chunked"][name]
            ratio = w["peak_bytes"] / c["peak_bytes"] if c["peak_bytes"] > 0 else float("inf")
            lines.append(f"| {response} | {label} | {w['peak_bytes'] / gib:.2f} | {c['peak_bytes'] / gib:.2f} | "
                         f"{ratio:.1f}x | {w['seconds']:.2f} | {c['seconds']:.2f} | "
                         f"{c['seconds'] / w['seconds']:.2f} |")
    lines += ["", "Peak ratio = whole over chunked (larger: the chunked pass needs less); time ratio = chunked "
              "seconds over whole (below 1: chunked is faster). The peak includes everything the pass "
              "allocates (activations, gradients), not the logits alone."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="oar bench logits-memory", description=__doc__.split("\n\n")[1])
    add_model_args(p)
    p.set_defaults(vocab=QWEN_VOCAB)
    p.add_argument("--responses", default="2048,4096,8192", help="response lengths, comma-separated")
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--chunk", type=int, default=4096, help="train.logits_chunk_tokens of the chunked runs")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--out", type=Path, default=Path("bench_out"))
    p.add_argument("--update-benchmarks", action="store_true", help="rewrite BENCHMARKS.md's section")
    args = p.parse_args(argv)
    try:
        args.responses = [int(x) for x in args.responses.split(",") if x]
    except ValueError:
        p.error(f"--responses {args.responses!r}: comma-separated integers")
    if not args.responses or min(args.responses) < 1 or args.chunk < 1 or args.repeats < 1:
        p.error("need --responses >= 1 each, --chunk >= 1 and --repeats >= 1")
    from benchmarks import common

    return common.run_and_publish(args, argv, suite=SUITE, prog="oar bench logits-memory",
                                  title="Logits memory: chunked vs whole-micro-batch logits",
                                  measure=measure, render=render)


if __name__ == "__main__":
    sys.exit(main())
