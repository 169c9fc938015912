"""``oar bench vs-hf``: the project's Megatron passes against a plain ``transformers`` + SDPA loop,
on the same batch and device, in one process.

    oar bench vs-hf [--preset qwen2.5-1.5b | qwen2.5-7b-width | ... | --hidden ... --layers ...] [--dtype bf16]
                    [--batch short --batch long | --rows 8 --median-response 256 ...]
                    [--ours sdpa,unfused,te,te-fp8] [--max-tokens-per-micro-batch 8192]
                    [--hf-update-tokens 4096] [--repeats 1] [--profile] [--out bench_out] [--update-benchmarks]

A random Qwen2 of the shape (``--preset qwen2.5-1.5b``: hidden 1536, 28 layers, 12/2 heads, ffn
8960, vocab 151,936, tied) is written as an HF checkpoint and converted as a user's model would
be; ``qwen2.5-7b-width``, ``-14b-width`` and ``-32b-width`` keep those models' layers at 4, 4 and 2
of their 28, 48 and 64 (:data:`LAYER_WIDTH_PRESETS`: what one 80 GB GPU holds). Per batch and per
variant of ours (``--ours``: the local spec with SDPA, its default, or with megatron's ``unfused``
attention; the Transformer Engine spec in bf16, ``te``, or with FP8, ``te-fp8`` delayed and
``te-fp8-tensorwise``; ``sdpa-recompute`` and ``te-recompute``, those under full activation
recompute, ``model.recompute=full``, whose OAR-G the table compares with its base variant's: time
and peak memory), the trainer's passes of one step run with token-budget
micro-batches (``--max-tokens-per-micro-batch``, the trainer's ``train.max_tokens_per_micro_batch``):

- **old-logprob**: ``old_logprob_pass`` (forward, log-probs and entropy of the response tokens);
- **update**: ``update_step`` (forward, backward, megatron's distributed optimizer step);
- **OAR-G**: ``compute_importance`` (a noisy forward and an input-gradient backward per scored
  row, the output layer at the probe positions only), with its sweep (old-logprob + OAR-G +
  update) over GRPO's (old-logprob + update) against its FLOP floor.

The baseline is what a plain loop does: ``AutoModelForCausalLM`` with
``attn_implementation="sdpa"``, fp32 parameters under bf16 autocast (with ``--dtype bf16``), the
same micro-batches right-padded with no attention mask (causal attention keeps pads after every
real token, so SDPA may use its flash kernels), log-probs from the full logits, and for the
update a PPO-style token loss, backward and a fused AdamW step (its own token budget,
``--hf-update-tokens``, where its full logits would not fit).

Per pass: seconds (median of ``--repeats`` after a warm-up), MFU (model FLOPs of the real tokens,
``models/flops.py``, over the seconds and the GPU's dense bf16 peak), peak memory
(``torch.cuda.max_memory_allocated`` during the pass, the other framework's model freed first),
and how far ours and the baseline's old log-probs differ (and each variant's from the first's, e.g.
FP8 from bf16). ``--profile``: one more run of each pass under torch's profiler, summarized as kernel
time against wall time (``benchmarks/profile_summary.py``). A pass that runs out of memory is
reported as such. On the CPU the suite runs at a small shape (tests/test_bench.py): no MFU or
peak memory there.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.random_model import add_model_args

SUITE = "vs_hf"
PRESETS = {  # --preset: the shapes of released models (random weights)
    "qwen2.5-1.5b": dict(hidden=1536, layers=28, heads=12, kv_heads=2, ffn=8960, vocab=151936, tied=True),
    "qwen2.5-0.5b": dict(hidden=896, layers=24, heads=14, kv_heads=2, ffn=4864, vocab=151936, tied=True),
    # the layer widths of the larger models at a depth one 80 GB GPU holds (LAYER_WIDTH_PRESETS)
    "qwen2.5-7b-width": dict(hidden=3584, layers=4, heads=28, kv_heads=4, ffn=18944, vocab=152064, tied=False),
    "qwen2.5-14b-width": dict(hidden=5120, layers=4, heads=40, kv_heads=8, ffn=13824, vocab=152064, tied=False),
    "qwen2.5-32b-width": dict(hidden=5120, layers=2, heads=40, kv_heads=8, ffn=27648, vocab=152064, tied=False),
}
# The -width presets keep a released model's layer (hidden, FFN, heads, vocabulary) and cut its depth
# (full depth: 28, 48, 64 layers) to the largest power of two whose update fits one 80 GB GPU with a
# quarter to spare (update_peak_gib() <= FIT_FRACTION x 80 GB; the spare covers what the estimate
# leaves out: allocator fragmentation, TE / FP8 workspaces and weight copies, the logits chunks, the
# CUDA context). The estimate: TRAIN_BYTES_PER_PARAM bytes per parameter (ours: bf16 weights, fp32
# main gradients, fp32 master weights and Adam's two moments; HF: fp32 weights, gradients and
# AdamW's moments, plus autocast's bf16 weight copies), plus the bf16 tensors a layer saves for its
# backward, about 10 x hidden + 4 x FFN values per token (norm inputs, QKV, attention output,
# projection input; FC1 input, gate and up outputs, their product), for an 8192-token micro-batch.
# 7B-width: 4 layers, 2.02B parameters (the untied 152k-token embedding and output layer 1.09B of
# them), 33.9 + 6.8 GiB; 14B-width: 4 layers, 2.66B, 44.6 + 6.5 GiB; 32B-width: 2 layers, 2.53B,
# 42.5 + 4.9 GiB; twice the depth would need 63, 76 and 69 GiB (tests/test_bench.py). A layer's time
# and FLOPs do not depend on the depth, so the passes' MFU at these widths is what the full models'
# layers reach, less the output layer's larger share of the FLOPs at this depth (layer_flop_share(),
# reported with the table).
LAYER_WIDTH_PRESETS = {"qwen2.5-7b-width": 28, "qwen2.5-14b-width": 48, "qwen2.5-32b-width": 64}
FIT_FRACTION = 0.75
FIT_TOKENS = 8192  # the micro-batch the estimate holds: the vs-hf default token budget
TRAIN_BYTES_PER_PARAM = 18
# --ours: the model options of each variant (model.spec, model.attention, model.fp8, ...)
VARIANTS = {
    "sdpa": dict(spec="local", attention="sdpa"),
    "unfused": dict(spec="local", attention="unfused"),
    "te": dict(spec="te"),
    "te-fp8": dict(spec="te", fp8="hybrid", fp8_recipe="delayed"),
    "te-fp8-tensorwise": dict(spec="te", fp8="hybrid", fp8_recipe="tensorwise"),
    # full activation recompute (model.recompute=full): the update and OAR-G's input-gradient
    # backward keep each layer's input only and rerun the layer (models/recompute.py)
    "sdpa-recompute": dict(spec="local", attention="sdpa", recompute="full"),
    "te-recompute": dict(spec="te", recompute="full"),
}
RECOMPUTE_SUFFIX = "-recompute"  # a variant and its base (the suffix dropped) differ only in it
# --batch NAME: rows, median response, min, max (log-normal lengths, sigma --length-sigma)
BATCHES = {"short": (16, 1024, 256, 2048), "long": (8, 4096, 2048, 8192)}


def preset_arch(shape: dict, layers: int | None = None):
    """The :class:`~megatron_oar.models.arch.QwenArch` of a :data:`PRESETS` entry (``layers``: another depth)."""
    from megatron_oar.models.arch import QwenArch

    return QwenArch(vocab_size=shape["vocab"], hidden_size=shape["hidden"], intermediate_size=shape["ffn"],
                    num_layers=shape["layers"] if layers is None else layers, num_heads=shape["heads"],
                    num_kv_heads=shape["kv_heads"], head_dim=shape["hidden"] // shape["heads"], rms_norm_eps=1e-6,
                    rope_theta=1e6, max_position_embeddings=32768, tie_word_embeddings=shape["tied"])


def param_count(arch) -> int:
    """Parameters of a dense Qwen2: per layer its linears, the q/k/v biases and two norms; the
    embedding (and an untied output layer) and the final norm."""
    from megatron_oar.models.flops import linear_weights

    per_layer = linear_weights(arch) + (arch.num_heads + 2 * arch.num_kv_heads) * arch.head_dim + 2 * arch.hidden_size
    embed = arch.vocab_size * arch.hidden_size * (1 if arch.tie_word_embeddings else 2)
    return arch.num_layers * per_layer + embed + arch.hidden_size


def train_state_gib(arch) -> float:
    """Weights, gradients and optimizer state of an update, at :data:`TRAIN_BYTES_PER_PARAM`."""
    return param_count(arch) * TRAIN_BYTES_PER_PARAM / 2**30


def update_peak_gib(arch, tokens: int = FIT_TOKENS) -> float:
    """The update's estimated peak (GiB): its state (:func:`train_state_gib`) and the bf16
    activations a micro-batch of ``tokens`` saves for the backward."""
    saved = 2 * (10 * arch.hidden_size + 4 * arch.intermediate_size) * tokens * arch.num_layers
    return train_state_gib(arch) + saved / 2**30


def layer_flop_share(arch, lengths) -> float:
    """The decoder layers' share of a forward's FLOPs (the rest: the output layer)."""
    import dataclasses

    from megatron_oar.models.flops import forward_flops

    total = forward_flops(arch, lengths)
    return 1.0 - forward_flops(dataclasses.replace(arch, num_layers=0), lengths) / total


def _sync():
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


class _Timed:
    """Seconds and peak memory (GiB, CUDA only) of one pass; an out-of-memory marks it ``oom``."""

    def __init__(self):
        self.seconds: float | None = None
        self.peak_gib: float | None = None
        self.oom = False

    @contextlib.contextmanager
    def run(self):
        import torch

        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        try:
            yield
            _sync()
            self.seconds = time.perf_counter() - t
        except torch.OutOfMemoryError:
            self.oom = True
        if cuda:
            self.peak_gib = torch.cuda.max_memory_allocated() / 2**30
            if self.oom:
                torch.cuda.empty_cache()


def _repeat(fn, repeats: int) -> dict:
    """``fn`` once to warm up, then ``repeats`` times: median seconds, the largest peak."""
    first = _Timed()
    with first.run():
        fn()
    if first.oom:
        return {"oom": True, "peak_gib": first.peak_gib}
    runs = []
    for _ in range(repeats):
        t = _Timed()
        with t.run():
            fn()
        if t.oom:
            return {"oom": True, "peak_gib": t.peak_gib}
        runs.append(t)
    peaks = [r.peak_gib for r in runs if r.peak_gib is not None]
    return {"oom": False, "seconds": statistics.median(r.seconds for r in runs),
            "all": [r.seconds for r in runs], "peak_gib": max(peaks) if peaks else None}


def _profile(fn, args, name: str) -> dict:
    """One more run of ``fn`` under torch's profiler: its kernel-against-host summary
    (``profile_summary``), and the 30 costliest ops by device time (CPU time without CUDA) to
    ``OUT/profile_<name>.txt``."""
    from benchmarks.profile_summary import profile_pass

    return profile_pass(fn, args.out / f"profile_{name}.txt")


def _free():
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------- ours

def _ours(ckpt: Path, args, variant: str, batches: dict) -> dict:
    """The trainer's passes of ``variant`` (:data:`VARIANTS`) on every batch."""
    from megatron_oar.algorithms import PolicyLossConfig
    from megatron_oar.attribution import AttributionConfig, ProbeConfig, compute_importance, locate_probes
    from megatron_oar.config import ModelConfig, OptimConfig
    from megatron_oar.models import read_hf_config
    from megatron_oar.runtime import ParallelConfig, destroy_runtime, init_runtime
    from megatron_oar.training.policy import build_policy
    from megatron_oar.training.policy_passes import old_logprob_pass, update_step

    budget = args.max_tokens_per_micro_batch
    kw = {"batching": "token_budget", "max_tokens": budget}
    out = {}
    init_runtime(ParallelConfig())
    try:
        hf_config = read_hf_config(ckpt / "hf")
        policy = build_policy(hf_config, ModelConfig(path=str(ckpt), dtype=args.dtype, **VARIANTS[variant]),
                              OptimConfig(lr=1e-7), checkpoint=ckpt,
                              total_optimizer_steps=4 * (1 + args.repeats) * len(batches))
        probe = ProbeConfig(kind="last_token")
        attr_cfg = AttributionConfig(method="oar_g", probe=probe, pad_id=0).resolve(
            batching="token_budget", max_tokens=budget)
        for name, batch in batches.items():
            sites = locate_probes(batch, probe)
            res: dict = {}
            teacher = {}

            def logprob():
                batch.old_logprobs, batch.entropy, teacher["t"] = old_logprob_pass(
                    policy.model, batch, args.vocab, 1, sites=sites, **kw)

            res["logprob"] = _repeat(logprob, args.repeats)
            res["profile"] = {}
            if args.profile and not res["logprob"]["oom"]:
                res["profile"]["logprob"] = _profile(logprob, args, f"logprob_{variant}_{name}")
            if res["logprob"]["oom"]:
                out[name] = res
                _free()
                continue
            res["logprobs"] = batch.old_logprobs.float().cpu()
            work = {}

            def attribution():
                attr = compute_importance(policy.model, batch, attr_cfg, vocab_size=args.vocab,
                                          seq_adv=batch.seq_adv, sites=sites, teacher=teacher["t"],
                                          external_teacher=True)
                work["w"] = attr.work

            res["oar_g"] = _repeat(attribution, args.repeats)
            res["oar_g_work"] = work.get("w")
            if args.profile and not res["oar_g"]["oom"]:
                res["profile"]["oar_g"] = _profile(attribution, args, f"oar_g_{variant}_{name}")
            batch.advantages = batch.seq_adv[:, None] * batch.loss_mask

            def update():
                update_step(policy, batch, PolicyLossConfig(), args.vocab, 1, **kw)

            _free()
            res["update"] = _repeat(update, args.repeats)
            if args.profile and not res["update"]["oom"]:
                res["profile"]["update"] = _profile(update, args, f"update_{variant}_{name}")
            out[name] = res
            _free()
        policy = None  # freed before the baseline runs
    finally:
        destroy_runtime()
        _free()
    return out


# --------------------------------------------------------------------------- the baseline

def _hf(hf_dir: Path, args, batches: dict) -> dict:
    """A plain transformers + SDPA loop: old log-probs, and one PPO-style update with AdamW."""
    import torch
    from transformers import AutoModelForCausalLM

    from megatron_oar.models.micro_batches import micro_batches

    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32,
                                                 attn_implementation="sdpa").to(dev)
    model.config.use_cache = False
    opt = torch.optim.AdamW(model.parameters(), lr=1e-7, fused=dev.type == "cuda")
    autocast = (torch.autocast(dev.type, dtype=torch.bfloat16) if args.dtype == "bf16"
                else contextlib.nullcontext())
    out = {}
    for name, batch in batches.items():
        lengths = batch.lengths.tolist()
        tokens, mask = batch.tokens.to(dev), batch.loss_mask.to(dev)
        adv = batch.seq_adv.to(dev)
        res: dict = {}

        def token_logprobs(rows, width):
            toks = tokens[rows, :width]
            with autocast:
                logits = model(input_ids=toks).logits
            lp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
            return lp.gather(-1, toks[:, 1:, None])[..., 0]  # [m, width - 1]: token t+1 given t

        logprobs = torch.zeros(tokens.shape, device=dev)

        def logprob():
            groups = micro_batches(lengths, batching="token_budget", rows_per_micro=1,
                                   max_tokens=args.max_tokens_per_micro_batch)
            with torch.no_grad():
                for g in groups:
                    width = max(lengths[i] for i in g)
                    logprobs[g, 1:width] = token_logprobs(g, width)

        res["logprob"] = _repeat(logprob, args.repeats)
        res["profile"] = {}
        if not res["logprob"]["oom"]:
            res["logprobs"] = logprobs.cpu()
            if args.profile:
                res["profile"]["logprob"] = _profile(logprob, args, f"logprob_hf_{name}")
        total = mask.sum()

        def update():
            groups = micro_batches(lengths, batching="token_budget", rows_per_micro=1,
                                   max_tokens=args.hf_update_tokens)
            for g in groups:
                width = max(lengths[i] for i in g)
                lp = token_logprobs(g, width)
                m = mask[g, 1:width].float()
                # the PPO ratio's gradient at ratio 1: -A * d logp; token-level mean over the batch
                loss = -(lp * adv[g, None] * m).sum() / total
                loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        _free()
        res["update"] = _repeat(update, args.repeats)
        if args.profile and not res["update"]["oom"]:
            res["profile"]["update"] = _profile(update, args, f"update_hf_{name}")
        out[name] = res
        _free()
    model = opt = None  # freed
    _free()
    return out


# --------------------------------------------------------------------------- measure and render

def measure(args) -> dict:
    import torch

    from benchmarks.attribution_flops import attribution_flops, lognormal_lengths
    from benchmarks.random_model import random_batch
    from checkpoints_convert.convert import hf_to_megatron
    from megatron_oar.models import parse_arch, read_hf_config
    from megatron_oar.models.flops import forward_flops, peak_tflops
    from megatron_oar.models.tiny import make_tiny_qwen2

    if args.memory_cap_gib and torch.cuda.is_available():
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.memory_cap_gib * 2**30 / total))
    specs = {name: lognormal_lengths(rows, median, args.length_sigma, lo, hi, seed=i)
             for i, (name, (rows, median, lo, hi)) in enumerate(args.batches.items())}
    longest = max(max(r) for r in specs.values())
    peak = peak_tflops(torch.cuda.get_device_name()) if torch.cuda.is_available() else None
    with tempfile.TemporaryDirectory() as tmp:
        hf = make_tiny_qwen2(Path(tmp) / "hf", tied=args.tied, vocab_size=args.vocab, hidden_size=args.hidden,
                             intermediate_size=args.ffn, num_hidden_layers=args.layers,
                             num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                             max_position_embeddings=args.prompt + longest + 64)
        ckpt = Path(tmp) / "ckpt"
        hf_to_megatron(hf, ckpt, progress=False)
        arch = parse_arch(read_hf_config(ckpt / "hf"))
        batches = {name: random_batch(args.prompt, r, args.vocab, seed=1) for name, r in specs.items()}
        result = {"peak_tflops": peak, "batches": {}, "ours": {}}
        for variant in args.ours:
            result["ours"][variant] = _ours(ckpt, args, variant, batches)
        result["hf"] = _hf(hf, args, batches)
    for name, batch in batches.items():
        lengths = batch.lengths.tolist()
        forward = forward_flops(arch, lengths)
        b = {"responses": specs[name], "tokens": sum(lengths), "forward_flops": forward,
             "layer_flop_share": layer_flop_share(arch, lengths)}
        valid = batch.loss_mask.bool().cpu()
        hf_lp = result["hf"][name].get("logprobs")
        first = args.ours[0]  # the other variants against it too (e.g. FP8 against TE bf16 or SDPA)
        first_lp = result["ours"][first][name].get("logprobs")
        for a in args.ours[1:]:
            lp = result["ours"][a][name].get("logprobs")
            if lp is not None and first_lp is not None:
                result["ours"][a][name][f"max_abs_logprob_diff_vs_{first}"] = float((lp - first_lp)[valid].abs().max())
        for who, runs in [*((f"ours ({a})", result["ours"][a][name]) for a in args.ours),
                          ("hf", result["hf"][name])]:
            ours_lp = runs.pop("logprobs", None)
            if who != "hf" and ours_lp is not None and hf_lp is not None:
                runs["max_abs_logprob_diff_vs_hf"] = float((ours_lp - hf_lp)[valid].abs().max())
            for pass_name, flops in (("logprob", forward), ("update", 3 * forward)):
                r = runs[pass_name]
                if not r["oom"]:
                    r["tflops"] = flops / r["seconds"] / 1e12
                    r["mfu"] = r["tflops"] / peak if peak else None
            if "oar_g" in runs and not runs["oar_g"]["oom"] and not runs["update"]["oom"]:
                g = runs["oar_g"]
                g["flops"] = attribution_flops(arch, runs.pop("oar_g_work") or [])
                g["tflops"] = g["flops"] / g["seconds"] / 1e12
                g["mfu"] = g["tflops"] / peak if peak else None
                grpo = runs["logprob"]["seconds"] + runs["update"]["seconds"]
                g["sweep_ratio"] = (grpo + g["seconds"]) / grpo
                g["flop_floor"] = 1 + g["flops"] / (4 * forward)
            runs.pop("oar_g_work", None)
        result["batches"][name] = b
    return result


def _cell(r: dict | None) -> str:
    if r is None:
        return "-"
    if r["oom"]:
        peak = f" (at {r['peak_gib']:.1f} GiB)" if r.get("peak_gib") else ""
        return f"**out of memory**{peak}"
    parts = [f"{r['seconds']:.3f} s"]
    if r.get("mfu") is not None:
        parts.append(f"MFU {r['mfu']:.2f}")
    elif r.get("tflops", 0) >= 1:
        parts.append(f"{r['tflops']:.0f} TFLOP/s")
    elif r.get("tflops") is not None:
        parts.append(f"{r['tflops'] * 1e3:.1f} GFLOP/s")
    if r.get("peak_gib") is not None:
        parts.append(f"{r['peak_gib']:.1f} GiB")
    return ", ".join(parts)


def _ratio(ours: dict, hf: dict) -> str:
    if ours is None or hf is None or ours["oom"] or hf["oom"]:
        return "-"
    x = ours["seconds"] / hf["seconds"]
    return f"{x:.2f}x" + (" (slower)" if x > 1 else " (faster)")


def recompute_comparison(res: dict, args, name: str) -> dict[str, dict]:
    """Per ``*-recompute`` variant run with its base: OAR-G's (and the update's) seconds under full
    recompute over without (``time_ratio``), and both peaks (GiB, CUDA only)."""
    out = {}
    for a in args.ours:
        base = a.removesuffix(RECOMPUTE_SUFFIX)
        if a == base or base not in args.ours:
            continue
        cmp = {}
        for pass_name in ("oar_g", "update"):
            with_, without = res["ours"][a][name].get(pass_name), res["ours"][base][name].get(pass_name)
            if with_ is None or without is None or with_["oom"] or without["oom"]:
                cmp[pass_name] = None
                continue
            cmp[pass_name] = {"time_ratio": with_["seconds"] / without["seconds"],
                              "peak_gib": with_.get("peak_gib"), "peak_gib_without": without.get("peak_gib")}
        out[a] = cmp
    return out


def _recompute_lines(res: dict, args, name: str) -> list[str]:
    lines = []
    for a, cmp in recompute_comparison(res, args, name).items():
        parts = []
        for pass_name, label in (("oar_g", "OAR-G"), ("update", "update")):
            c = cmp[pass_name]
            if c is None:
                parts.append(f"{label}: - (out of memory or not run)")
                continue
            peak = (f", peak {c['peak_gib']:.1f} against {c['peak_gib_without']:.1f} GiB"
                    if c["peak_gib"] is not None else "")
            parts.append(f"{label} {c['time_ratio']:.2f}x the time{peak}")
        lines += ["", f"Full recompute ({a} against {a.removesuffix(RECOMPUTE_SUFFIX)}): " + "; ".join(parts) + "."]
    return lines


def render(res: dict, args) -> str:
    shape = (f"random Qwen2, hidden {args.hidden}, {args.layers} layers, {args.heads}/{args.kv_heads} heads, "
             f"ffn {args.ffn}, vocab {args.vocab}, {'tied' if args.tied else 'untied'}, {args.dtype}")
    arch = preset_arch(vars(args))
    shape += f", {param_count(arch) / 1e9:.2f}B parameters"
    if args.preset in LAYER_WIDTH_PRESETS:
        shape += (f" (the layers of {args.preset.removesuffix('-width')} at {args.layers} of its "
                  f"{LAYER_WIDTH_PRESETS[args.preset]}; update state ~{train_state_gib(arch):.0f} GiB)")
    weights = "fp32 weights under bf16 autocast" if args.dtype == "bf16" else "fp32"
    lines = [f"Model: {shape}. Ours: token budget {args.max_tokens_per_micro_batch}; plain HF: "
             f"`attn_implementation=\"sdpa\"`, {weights}, "
             f"old-logprob budget {args.max_tokens_per_micro_batch}, update budget {args.hf_update_tokens}, "
             f"fused AdamW. Median of {args.repeats} after a warm-up."
             + (f" GPU memory capped at {args.memory_cap_gib:g} GiB." if args.memory_cap_gib else ""), ""]
    for name, b in res["batches"].items():
        r = b["responses"]
        share = (f"; the decoder layers carry {b['layer_flop_share']:.0%} of its FLOPs"
                 if "layer_flop_share" in b else "")
        lines += [f"**{name}**: {len(r)} rows, {args.prompt}-token prompts, responses {min(r)}-{max(r)} tokens "
                  f"({b['tokens']:,} tokens{share})", "",
                  "| pass | " + " | ".join(f"ours, {a}" for a in args.ours) + " | plain HF + SDPA | "
                  + " | ".join(f"{a} / HF" for a in args.ours) + " |",
                  "|---|" + "---|" * (2 * len(args.ours) + 1)]
        hf = res["hf"][name]
        for pass_name, label in (("logprob", "old-logprob"), ("update", "update (fwd+bwd+optimizer)")):
            ours = [res["ours"][a][name].get(pass_name) for a in args.ours]
            lines.append(f"| {label} | " + " | ".join(_cell(o) for o in ours) + f" | {_cell(hf[pass_name])} | "
                         + " | ".join(_ratio(o, hf[pass_name]) for o in ours) + " |")
        cells = []
        for a in args.ours:
            g = res["ours"][a][name].get("oar_g")
            if g is None or g["oom"]:
                cells.append(_cell(g))
            else:
                cells.append(f"{_cell(g)}; sweep {g['sweep_ratio']:.2f}x GRPO's, FLOP floor {g['flop_floor']:.2f}x")
        lines.append("| OAR-G attribution | " + " | ".join(cells) + " | - | " + " | ".join("-" for _ in cells) + " |")
        lines += _recompute_lines(res, args, name)
        diffs = [f"{a} {res['ours'][a][name]['max_abs_logprob_diff_vs_hf']:.2e}" for a in args.ours
                 if "max_abs_logprob_diff_vs_hf" in res["ours"][a][name]]
        if diffs:
            lines += ["", "Max |old log-prob ours - HF| over the response tokens: " + ", ".join(diffs) + "."]
        key = f"max_abs_logprob_diff_vs_{args.ours[0]}"
        diffs = [f"{a} {res['ours'][a][name][key]:.2e}" for a in args.ours[1:] if key in res["ours"][a][name]]
        if diffs:
            lines.append(f"Max |old log-prob - ours, {args.ours[0]}|: " + ", ".join(diffs) + ".")
        passes = {"logprob": "old-logprob", "oar_g": "OAR-G", "update": "update"}
        profiles = {f"ours, {a}, {passes[k]}": v for a in args.ours
                    for k, v in res["ours"][a][name].get("profile", {}).items()}
        profiles.update({f"HF, {passes[k]}": v for k, v in hf.get("profile", {}).items()})
        if profiles:
            from benchmarks.profile_summary import render as render_profiles

            lines += ["", render_profiles(profiles)]
        lines.append("")
    lines.append("MFU: model FLOPs of the real tokens (`models/flops.py`; update = 3 forwards) over seconds and "
                 "the GPU's dense bf16 peak. Peak memory: `torch.cuda.max_memory_allocated` during the pass, "
                 "the other framework's model freed. OAR-G sweep = old-logprob + OAR-G + update over "
                 "old-logprob + update; FLOP floor = 1 + OAR-G's model FLOPs over GRPO's (4 forwards).")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="oar bench vs-hf", description=__doc__.split("\n\n")[1])
    add_model_args(p)
    p.add_argument("--tied", action="store_true", help="tie the embeddings (the presets set it)")
    p.add_argument("--preset", choices=sorted(PRESETS), help="a released model's shape (overrides the shape flags)")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--batch", action="append", choices=sorted(BATCHES),
                   help=f"a named batch (repeatable): {BATCHES} as rows, median, min, max response")
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--median-response", type=int, default=64)
    p.add_argument("--length-sigma", type=float, default=0.4)
    p.add_argument("--min-response", type=int, default=16)
    p.add_argument("--max-response", type=int, default=128)
    p.add_argument("--ours", default="sdpa,unfused",
                   help=f"ours: the variants to run, comma-separated ({', '.join(VARIANTS)})")
    p.add_argument("--max-tokens-per-micro-batch", type=int, default=8192)
    p.add_argument("--hf-update-tokens", type=int, default=4096, help="the HF update's token budget")
    p.add_argument("--memory-cap-gib", type=float, default=None,
                   help="CUDA: cap this process's GPU memory (e.g. 79 on an H200 to see what fits an 80 GB H100)")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--profile", action="store_true",
                   help="one more run of each pass (ours: old-logprob, OAR-G, update; HF: old-logprob, update) "
                        "under torch's profiler: kernel time against wall time, top kernels, idle gaps "
                        "(the table in the report, the profiler's tables in --out)")
    p.add_argument("--out", type=Path, default=Path("bench_out"))
    p.add_argument("--update-benchmarks", action="store_true", help="rewrite BENCHMARKS.md's section")
    args = p.parse_args(argv)
    if args.preset:
        for k, v in PRESETS[args.preset].items():
            setattr(args, k, v)
    args.ours = [a for a in args.ours.split(",") if a]
    if not args.ours or set(args.ours) - set(VARIANTS):
        p.error(f"--ours {args.ours}: choose from {', '.join(VARIANTS)}")
    if not 1 <= args.min_response <= args.max_response or args.rows < 1:
        p.error("need --rows >= 1 and 1 <= --min-response <= --max-response")
    args.batches = ({b: BATCHES[b] for b in args.batch} if args.batch else
                    {"batch": (args.rows, args.median_response, args.min_response, args.max_response)})
    from benchmarks import common

    return common.run_and_publish(args, argv, suite=SUITE, prog="oar bench vs-hf",
                                  title="Ours against a plain transformers + SDPA loop", measure=measure,
                                  render=render)


if __name__ == "__main__":
    sys.exit(main())
