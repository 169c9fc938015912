"""Attribution cost against GRPO (`oar bench attribution`): the paper's Figure 7, measured two ways.

    oar bench attribution [--methods grpo,entropy,oar_g,oar_p,oar_p_serial,oar_p_screened]
                          [--steps 6] [--warmup 1] [--repeats 1]
                          [--model HF_DIR | --hidden H --layers L [--ffn F] [--sft-steps N]]
                          [--config CONFIG.yaml] [--nproc-per-node N]
                          [--out runs/bench/attribution] [--update-benchmarks] [key=value ...]

Each method is a short training run of the real trainer (``megatron_oar.training.trainer.Trainer``, under
torchrun like ``oar train``), with the same config, model, seeds, batch and lengths; only
``credit`` (and ``attribution.serial=true`` for the serial OAR-P baseline) differs. The trainer
already times every phase and counts the step's work into ``RUN_DIR/logs/metrics.jsonl``
(summed over DP ranks):

* ``tokens/action``: response tokens that get loss; ``tokens/sequence``, ``tokens/response``,
  ``tokens/sequences``: the step's batch;
* ``attribution/oar_g_tokens``: tokens of the sequences OAR-G ran (noisy forward +
  input-gradient backward; screened OAR-P's screen too);
* ``attribution/masked_copy_tokens``, ``attribution/masked_forwards``: OAR-P's [PAD]-masked
  copies (one forward each over its sequence; serial and screened included).

Per measured step (the first ``--warmup`` steps of each run are dropped: engine start, first
sync, allocator warm-up):

* sweep seconds = ``time/logprob + time/attribution + time/update`` (old-logprob pass,
  attribution, policy forward/backward: the paper's update sweep; generation excluded);
* end-to-end seconds = ``time/step`` (generation, rewards, sync included);
* each divided by the step's action tokens, then by GRPO's median over its measured steps: the
  sweep and end-to-end ratios, reported as median (min-max) over the steps;
* forward-equivalents per action token, counted (not timed), forward = 1, full backward = 2,
  input-gradient-only backward = 1:  ``[S (1 + 3E + R) + 2 G + C] / A`` with S sequence tokens,
  E PPO epochs (``train.ppo_epochs``), R = 1 with a reference model (``loss.kl_coef > 0``),
  G = ``attribution/oar_g_tokens``, C = ``attribution/masked_copy_tokens``, A = action tokens.
  Its ratio to GRPO's is the floor of the measured ratios if compute were all that cost.

The default config is ``tiny_cpu.yaml``, shipped in the package (``megatron_oar/resources/``;
``examples/tiny_cpu.yaml`` links to it), so the suite runs from any directory and after any install;
the runs start in the current directory, where a relative ``--config`` is read. The model is
converted to a Megatron checkpoint once (``OUT/init_checkpoint``), which every run starts from.

Writes ``OUT/attribution.json`` (every measured step, the summaries, the machine) and
``OUT/attribution.md`` (the BENCHMARKS.md section); ``--update-benchmarks`` rewrites that section
of BENCHMARKS.md in place. A method whose ``credit`` the config does not accept (e.g.
``oar_p_screened`` before it exists) is skipped with a line saying so.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks import common
from megatron_oar import resources

SUITE = "attribution"
PROG = "oar bench attribution"
TABLE_HEADER = "| method | sweep ratio | end-to-end ratio | forward-equivalents per action token |"
TABLE_RULE = "|---|---|---|---|"
SWEEP_KEYS = ("time/logprob", "time/attribution", "time/update")
# The default --config as reports name it; main() reads the package's copy (resources.path).
DEFAULT_CONFIG = "examples/tiny_cpu.yaml"


@dataclass(frozen=True)
class Method:
    label: str                  # the table's method column
    credit: str
    overrides: tuple[str, ...] = ()


METHODS: dict[str, Method] = {
    "grpo": Method("grpo", "grpo"),
    "entropy": Method("entropy", "entropy"),
    "oar_g": Method("oar_g", "oar_g"),
    "oar_p": Method("oar_p (batched)", "oar_p"),
    "oar_p_serial": Method("oar_p (serial)", "oar_p", ("attribution.serial=true",)),
    "oar_p_screened": Method("oar_p_screened", "oar_p_screened"),
}
# Every run: no evaluation, no intermediate checkpoints or HF export, a fresh start, no TB files.
BASE_OVERRIDES = ("train.eval_interval=0", "checkpoint.interval=0",
                  "checkpoint.export_hf_at_end=false", "checkpoint.resume=none",
                  "log.tensorboard=false", "log.wandb=false")


# =========================================================================== accounting

def forward_equivalents(rec: dict, ppo_epochs: int = 1, reference: bool = False) -> dict | None:
    """Forward-equivalents per action token of one step record: ``policy`` (old-logprob
    forward, reference forward, ``ppo_epochs`` x update forward+backward), ``attribution``
    (OAR-G 2 per token of its sequences, OAR-P 1 per token of each masked copy) and ``total``.
    None when the record has no counts."""
    a = rec.get("tokens/action")
    s = rec.get("tokens/sequence")
    if not a or s is None:
        return None
    policy = s * (1.0 + 3.0 * ppo_epochs + float(reference))
    attribution = (2.0 * (rec.get("attribution/oar_g_tokens") or 0.0)
                   + (rec.get("attribution/masked_copy_tokens") or 0.0))
    return {"policy": policy / a, "attribution": attribution / a, "total": (policy + attribution) / a}


def step_times(rec: dict, ppo_epochs: int = 1, reference: bool = False) -> dict | None:
    """Sweep and end-to-end seconds of one step record, and per action token. None when the
    record lacks the timings or the counts (e.g. a step-0 evaluation record)."""
    a = rec.get("tokens/action")
    if not a or rec.get("time/step") is None or rec.get("time/update") is None:
        return None
    sweep = sum(rec.get(k) or 0.0 for k in SWEEP_KEYS)
    fe = forward_equivalents(rec, ppo_epochs, reference)
    return {"step": rec.get("step"), "action_tokens": a, "sweep_s": sweep, "step_s": rec["time/step"],
            "sweep_per_token": sweep / a, "step_per_token": rec["time/step"] / a,
            "generate_s": rec.get("time/generate"), "attribution_s": rec.get("time/attribution") or 0.0,
            "fe_total": fe["total"] if fe else None, "fe_attribution": fe["attribution"] if fe else None,
            "masked_forwards": rec.get("attribution/masked_forwards"),
            "scored_sequences": rec.get("attribution/scored_sequences"),
            "sequences": rec.get("tokens/sequences"), "sequence_tokens": rec.get("tokens/sequence"),
            "response_tokens": rec.get("tokens/response")}


def measured_steps(records: list[dict], warmup: int, ppo_epochs: int = 1,
                   reference: bool = False) -> list[dict]:
    """:func:`step_times` of the records after the first ``warmup`` training steps."""
    out = []
    for rec in records:
        if not isinstance(rec.get("step"), int) or rec["step"] <= warmup:
            continue
        t = step_times(rec, ppo_epochs, reference)
        if t is not None:
            out.append(t)
    return out


def summarize_method(steps: list[dict], baseline: list[dict]) -> dict:
    """Ratios of ``steps`` against the ``baseline`` (GRPO) steps: per step, seconds per action
    token over GRPO's median seconds per action token; min/median/max over the steps. Also the
    forward-equivalents per action token (median) and their ratio to GRPO's (the floor)."""
    base_sweep = common.summarize(s["sweep_per_token"] for s in baseline)["median"]
    base_step = common.summarize(s["step_per_token"] for s in baseline)["median"]
    base_fe = common.summarize(s["fe_total"] for s in baseline)["median"]
    fe = common.summarize(s["fe_total"] for s in steps)
    return {
        "steps": len(steps),
        "sweep_ratio": common.summarize(s["sweep_per_token"] / base_sweep for s in steps)
        if base_sweep else common.summarize([]),
        "end_to_end_ratio": common.summarize(s["step_per_token"] / base_step for s in steps)
        if base_step else common.summarize([]),
        "forward_equivalents": fe,
        "forward_equivalents_ratio": fe["median"] / base_fe if base_fe and fe["median"] else None,
        "sweep_ms_per_action_token": common.summarize(1e3 * s["sweep_per_token"] for s in steps),
        "step_ms_per_action_token": common.summarize(1e3 * s["step_per_token"] for s in steps),
        "action_tokens": common.summarize(s["action_tokens"] for s in steps),
        "attribution_s": common.summarize(s["attribution_s"] for s in steps),
        "generate_s": common.summarize(s["generate_s"] for s in steps),
        "masked_forwards": common.summarize(s["masked_forwards"] for s in steps),
        "scored_sequences": common.summarize(s["scored_sequences"] for s in steps),
    }


def fmt_fe(summary: dict) -> str:
    """``"7.12 (1.25x)"``: forward-equivalents per action token (median over the steps) and
    their ratio to GRPO's."""
    fe = summary["forward_equivalents"]["median"]
    if fe is None:
        return "-"
    ratio = summary.get("forward_equivalents_ratio")
    return f"{fe:.2f}" + (f" ({common.fmt_ratio(ratio)})" if ratio is not None else "")


def table(rows: list[tuple[str, dict]]) -> str:
    """The Markdown table: one ``(label, summarize_method(...))`` per row."""
    lines = [TABLE_HEADER, TABLE_RULE]
    for label, s in rows:
        lines.append(f"| {label} | {common.fmt_range(s['sweep_ratio'])} | "
                     f"{common.fmt_range(s['end_to_end_ratio'])} | {fmt_fe(s)} |")
    return "\n".join(lines)


def _num(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def details_table(rows: list[tuple[str, dict]]) -> str:
    lines = ["| method | sweep ms / action token | step ms / action token | action tokens / step "
             "| attribution s / step | generate s / step | scored sequences | masked forwards |",
             "|---|---|---|---|---|---|---|---|"]
    for label, s in rows:
        med = {k: s[k]["median"] for k in ("sweep_ms_per_action_token", "step_ms_per_action_token",
                                            "action_tokens", "attribution_s", "generate_s",
                                            "scored_sequences", "masked_forwards")}
        lines.append(f"| {label} | {_num(med['sweep_ms_per_action_token'], '.3f')} | "
                     f"{_num(med['step_ms_per_action_token'], '.3f')} | {_num(med['action_tokens'], '.0f')} | "
                     f"{_num(med['attribution_s'], '.2f')} | {_num(med['generate_s'], '.2f')} | "
                     f"{_num(med['scored_sequences'], '.0f')} | {_num(med['masked_forwards'], '.0f')} |")
    return "\n".join(lines)


FORMULA = (
    "Forward-equivalents per action token are counted from each step's own token counts, not "
    "timed (forward = 1, full backward = 2, input-gradient-only backward = 1): "
    "`[S (1 + 3E + R) + 2G + C] / A`, where S = prompt + response tokens of the step's sequences "
    "(one old-logprob forward, then E = `train.ppo_epochs` policy forward + backward; R = 1 with a "
    "reference model, else 0), G = tokens of the sequences OAR-G scores (one noisy forward + one "
    "input-gradient backward each; only sequences with a non-zero advantage), C = tokens of "
    "OAR-P's [PAD]-masked copies (one forward per scored token, each its sequence's full length: "
    "quadratic in response length whatever the batching; the serial mode runs the same copies), "
    "A = action tokens (response tokens with loss). GRPO and entropy: `S (1 + 3E + R) / A`; "
    "OAR-G adds `2G / A`; OAR-P adds `C / A`; screened OAR-P adds both (C over its selected "
    "tokens only). In parentheses: its ratio to GRPO's, i.e. what the measured ratios would be if "
    "every forward-equivalent took the same time (the compute floor once the model is large "
    "enough for matrix multiplies to dominate). Padding (micro-batches padded to their longest "
    "sequence, OAR-P copies to `attribution.length_bucket`) is not counted. On a tiny model a "
    "measured ratio can fall below it: attribution passes run without autograd, compute logits "
    "only at the probe positions, and OAR-P batches many copies per call, so a token costs less "
    "there than in the update pass, while fixed per-call overheads (schedule, TP all-reduces) "
    "weigh more.")

RATIO_NOTE = (
    "Ratios: per measured step, the method's seconds per action token divided by GRPO's median "
    "seconds per action token; median (min-max) over the steps. Sweep = `time/logprob + "
    "time/attribution + time/update` (old-logprob pass, attribution, policy forward/backward; "
    "generation and weight sync excluded, the paper's Figure 7 definition); end-to-end = "
    "`time/step` (a whole training step: generation, rewards, sync included). Every method runs "
    "the same config, model, seeds, batch and lengths; only `credit` differs (and "
    "`attribution.serial=true` for the serial baseline), so the steps after the first see "
    "different samples: times are compared per action token.")


def render_markdown(report: dict) -> str:
    """The BENCHMARKS.md section of a report (see :func:`main` for its fields)."""
    meta = report["meta"]
    rows = [(m["label"], m["summary"]) for m in report["methods"] if m["status"] == "ok"]
    out = ["## Attribution cost (`oar bench attribution`)", ""]
    if meta.get("note"):
        out += [f"**{meta['note']}**", ""]
    out += [f"Command: `{meta['command']}`", "",
            f"Machine: {common.machine_line(meta['machine'])}", "",
            f"Model and lengths: {meta['model_line']}", "",
            table(rows), "", RATIO_NOTE, "", FORMULA, ""]
    others = [m for m in report["methods"] if m["status"] != "ok"]
    for m in others:
        out.append(f"- {m['label']}: {m['status']}: {m['reason']}")
    if others:
        out.append("")
    out += ["Medians per step:", "", details_table(rows), ""]
    return "\n".join(out)


# =========================================================================== the driver

def prepare_model(args, out: Path) -> tuple[Path, dict]:
    """``--model`` as given, or the demo model (tiny Qwen2 + task tokenizer, SFT warm-up) built
    once into ``OUT/model`` (reused while its shape and warm-up steps are the same)."""
    if args.model:
        hf = Path(args.model)
        cfg = json.loads((hf / "config.json").read_text())
        return hf, {"source": f"`{hf}`", "arch": _arch_of(cfg)}
    from megatron_oar.repro import demo_model

    arch = {}
    if args.hidden:
        heads = args.heads or max(2, args.hidden // 64)
        arch.update(hidden_size=args.hidden, num_attention_heads=heads, head_dim=args.hidden // heads,
                    num_key_value_heads=args.kv_heads or min(heads, 2),
                    intermediate_size=args.ffn or 2 * args.hidden)
    elif args.ffn:
        arch["intermediate_size"] = args.ffn
    if args.layers:
        arch["num_hidden_layers"] = args.layers
    hf = out / "model"
    want = {"arch": arch, "sft_steps": args.sft_steps, "seed": 0}
    stamp = hf / "bench_model.json"
    if stamp.is_file() and json.loads(stamp.read_text()).get("built") == want:
        info = json.loads(stamp.read_text())
        print(f"[bench] reusing the model in {hf}", flush=True)
    else:
        print(f"[bench] building the demo model in {hf} (SFT warm-up {args.sft_steps} steps)", flush=True)
        demo_model.make_demo_model(hf, seed=0, **arch)
        sft = demo_model.sft_warmup(hf, steps=args.sft_steps)
        info = {"built": want, "sft": sft}
        stamp.write_text(json.dumps(info, indent=2))
    cfg = json.loads((hf / "config.json").read_text())
    return hf, {"source": "the demo model (`megatron_oar.repro.demo_model`) built by the suite",
                "arch": _arch_of(cfg), "sft_steps": args.sft_steps,
                "sft_final_loss": info.get("sft", {}).get("final_loss")}


def start_checkpoint(hf: Path, out: Path, dtype: str) -> Path:
    """The runs' start: ``hf`` converted to a Megatron checkpoint once per invocation, here (an
    oar checkpoint as it is), so that every run does not convert it again in a process of its
    own (``training/policy.py: init_checkpoint``). Not timed: it precedes the runs' steps."""
    from checkpoints_convert.convert import hf_to_megatron
    from megatron_oar.models.model_checkpoint import META_FILE

    if (hf / META_FILE).is_file():
        return hf
    ckpt = out / "init_checkpoint"
    shutil.rmtree(ckpt, ignore_errors=True)  # the model may have been rebuilt since
    print(f"[bench] converting {hf} to {ckpt} (once, for every run)", flush=True)
    hf_to_megatron(hf, ckpt, dtype=dtype, progress=False)
    return ckpt


def _arch_of(cfg: dict) -> dict:
    keys = ("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads",
            "num_key_value_heads", "vocab_size", "tie_word_embeddings")
    return {k: cfg.get(k) for k in keys}


def _n_params(arch: dict) -> int | None:
    try:
        h, f, n_layers, v = (arch["hidden_size"], arch["intermediate_size"], arch["num_hidden_layers"],
                      arch["vocab_size"])
        heads, kv = arch["num_attention_heads"], arch["num_key_value_heads"]
        d = h // heads
        layer = h * h + 2 * h * kv * d + (h + 2 * kv * d) + h * h + 3 * h * f + 2 * h
        return n_layers * layer + (1 if arch.get("tie_word_embeddings") else 2) * v * h + h
    except (KeyError, TypeError, ZeroDivisionError):
        return None


def _check_config(config: str, overrides: list[str]) -> str | None:
    """None when the config loads with these overrides, else the config error's text."""
    from megatron_oar.config import ConfigError, load_config

    try:
        load_config(config, overrides)
    except ConfigError as e:
        return str(e)
    except ValueError as e:  # a component's own validation (e.g. an unknown attribution method)
        return str(e)
    return None


def _last_error(log: Path) -> str:
    try:
        lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "no log"
    for ln in reversed(lines):
        if "config error" in ln or "Error" in ln:
            return ln[:300]
    return lines[-1][:300] if lines else "empty log"


def run_method(name: str, method: Method, *, config: str, hf: Path, run_dir: Path, steps: int,
               nproc: int, overrides: list[str], timeout: float, threads: int | None) -> dict:
    """One training run from ``hf`` (``model.path``: an HF directory or a Megatron checkpoint);
    returns ``{"status", "reason", "records", "log", "seconds"}``."""
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    ov = [f"credit={method.credit}", *method.overrides, f"model.path={hf}", f"run_dir={run_dir}",
          f"train.steps={steps}", *BASE_OVERRIDES, *overrides]
    log = run_dir.with_suffix(".log")
    err = _check_config(config, ov)
    if err is not None:
        return {"status": "skipped", "reason": f"config does not accept it ({err})", "records": [],
                "log": None, "seconds": 0.0, "overrides": ov}
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={nproc}", "-m", "megatron_oar.commands.train"]
    else:
        cmd = [sys.executable, "-m", "megatron_oar.commands.train"]
    cmd += ["--config", config, *ov]
    t0 = time.perf_counter()
    with open(log, "w") as f:
        f.write(" ".join(cmd) + "\n")
        f.flush()
        try:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT,
                                env=common.subprocess_env(threads), timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = None
    seconds = time.perf_counter() - t0
    from megatron_oar.training.logger import read_metrics

    try:
        records = read_metrics(run_dir)
    except (FileNotFoundError, ValueError):
        records = []
    if rc == 0:
        return {"status": "ok", "reason": "", "records": records, "log": str(log),
                "seconds": seconds, "overrides": ov}
    reason = f"timed out after {timeout:.0f}s" if rc is None else f"exit {rc}: {_last_error(log)}"
    status = "skipped" if rc == 2 else "failed"  # 2: a config error the trainer reported
    return {"status": status, "reason": f"{reason} (log: {log})", "records": records,
            "log": str(log), "seconds": seconds, "overrides": ov}


def _model_line(model: dict, cfg, nproc: int, steps: list[dict], n_steps: int, warmup: int,
                repeats: int, config: str, overrides: list[str]) -> str:
    arch = model["arch"]
    n = _n_params(arch)
    shape = (f"Qwen2 hidden {arch['hidden_size']}, {arch['num_hidden_layers']} layers, FFN "
             f"{arch['intermediate_size']}, {arch['num_attention_heads']} heads / "
             f"{arch['num_key_value_heads']} KV, vocab {arch['vocab_size']}"
             + (f", {n / 1e6:.2f}M parameters" if n else ""))
    src = model["source"]
    if model.get("sft_steps") is not None:
        src += f", SFT warm-up {model['sft_steps']} steps"
        if model.get("sft_final_loss") is not None:
            src += f", final loss {model['sft_final_loss']:.3f}"
    t, r = cfg.train, cfg.rollout
    seqs = sum(s["sequences"] or 0 for s in steps)
    resp = sum(s["response_tokens"] or 0 for s in steps)
    tot = sum(s["sequence_tokens"] or 0 for s in steps)
    lengths = (f"; measured: mean prompt {(tot - resp) / seqs:.1f} tokens, mean response "
               f"{resp / seqs:.1f} tokens" if seqs else "")
    dp = nproc // (cfg.parallel.tp * cfg.parallel.pp)
    over = " ".join(overrides)
    return (f"{shape}; {src}; config `{config}`{f' with `{over}`' if over else ''}: "
            f"{t.prompts_per_step} prompts x {t.group_size} completions per step, at most "
            f"{r.max_new_tokens} new tokens{lengths}; {t.mini_batches} mini-batch(es) x "
            f"{t.ppo_epochs} PPO epoch(s), micro-batches of "
            f"{f'{t.micro_batch_size} rows' if t.batching == 'padded' else f'{cfg.micro_batch_tokens} tokens'}"
            f"; Megatron TP"
            f"{cfg.parallel.tp} PP{cfg.parallel.pp} DP{dp} over {nproc} process(es) (gloo on CPU), "
            f"vLLM rollout TP{r.tp} in the same processes ({r.dtype}); {n_steps} steps per run, the "
            f"first {warmup} dropped as warm-up, {repeats} run(s) per method")


def parse_args(argv: list[str] | None):
    p = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", default=",".join(METHODS),
                   help=f"comma-separated, from {', '.join(METHODS)} (grpo is always run: the "
                        "baseline)")
    p.add_argument("--config", default=None, help=f"training config (default: {DEFAULT_CONFIG}, "
                   "the copy shipped in the package)")
    p.add_argument("--steps", type=int, default=6, help="training steps per run (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=1,
                   help="first steps of each run not measured (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=1,
                   help="runs per method, interleaved method by method (default: %(default)s)")
    p.add_argument("--nproc-per-node", type=int, default=None,
                   help="processes per run (default: parallel.tp x parallel.pp of the config)")
    p.add_argument("--threads", type=int, default=None,
                   help="OMP_NUM_THREADS per process (default: as set, else 1)")
    p.add_argument("--model", default=None, help="an HF model dir with tokenizer (default: build "
                   "the demo model into OUT/model)")
    p.add_argument("--hidden", type=int, default=None, help="demo model hidden size (default 128; "
                   "head_dim 64, so hidden/64 heads)")
    p.add_argument("--layers", type=int, default=None, help="demo model layers (default 2)")
    p.add_argument("--ffn", type=int, default=None, help="demo model FFN size (default 2 x hidden)")
    p.add_argument("--heads", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--kv-heads", type=int, default=None, help="demo model KV heads (default 2)")
    p.add_argument("--sft-steps", type=int, default=300, help="demo model warm-up steps (default: "
                   "%(default)s)")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per run (default: "
                   "%(default)s)")
    p.add_argument("--out", type=Path, default=Path("runs/bench/attribution"),
                   help="raw JSON, Markdown, runs and logs (default: %(default)s)")
    p.add_argument("--note", default=None, help="a line printed above the table (e.g. "
                   "'preliminary: busy machine')")
    p.add_argument("--update-benchmarks", action="store_true",
                   help="rewrite this suite's section of BENCHMARKS.md")
    p.add_argument("--benchmarks-file", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("overrides", nargs="*", help="key=value config overrides for every run")
    args = p.parse_args(argv)
    names = [m.strip() for m in args.methods.split(",") if m.strip()]
    bad = [m for m in names if m not in METHODS]
    if bad:
        p.error(f"unknown method(s) {bad}; choose from {list(METHODS)}")
    args.method_names = ["grpo"] + [m for m in dict.fromkeys(names) if m != "grpo"]
    owned = [o for o in args.overrides
             if o.split("=", 1)[0] in ("credit", "run_dir", "model.path", "train.steps")]
    if owned:
        p.error(f"{owned}: the suite sets these per run (use --methods, --out, --model, --steps)")
    if args.warmup < 0 or args.steps <= args.warmup:
        p.error(f"--steps ({args.steps}) must exceed --warmup ({args.warmup})")
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    from megatron_oar.config import load_config

    machine = common.machine_info()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    config = str(Path(args.config)) if args.config else str(resources.path("tiny_cpu.yaml"))
    label = args.config or DEFAULT_CONFIG  # how the report names it
    hf, model = prepare_model(args, out)
    base_cfg = load_config(config, [f"model.path={hf}", *args.overrides])
    start = start_checkpoint(hf, out, base_cfg.model.dtype)
    nproc = args.nproc_per_node or base_cfg.parallel.tp * base_cfg.parallel.pp
    epochs, reference = base_cfg.train.ppo_epochs, base_cfg.loss.kl_coef > 0

    runs: dict[str, list[dict]] = {name: [] for name in args.method_names}
    for rep in range(args.repeats):
        for name in args.method_names:
            if runs[name] and runs[name][-1]["status"] == "skipped":
                continue
            method = METHODS[name]
            run_dir = out / "runs" / (name if args.repeats == 1 else f"{name}_r{rep}")
            print(f"[bench] {name} ({method.label}), run {rep + 1}/{args.repeats}: "
                  f"{args.steps} steps, {nproc} process(es), log {run_dir.with_suffix('.log')}",
                  flush=True)
            res = run_method(name, method, config=config, hf=start, run_dir=run_dir, steps=args.steps,
                             nproc=nproc, overrides=args.overrides, timeout=args.timeout,
                             threads=args.threads)
            runs[name].append(res)
            if res["status"] == "ok":
                print(f"[bench] {name}: done in {res['seconds']:.0f}s", flush=True)
            else:
                print(f"[bench] {name}: {res['status'].upper()}: {res['reason']}", flush=True)

    steps_of = {name: [s for r in rs if r["status"] == "ok"
                       for s in measured_steps(r["records"], args.warmup, epochs, reference)]
                for name, rs in runs.items()}
    baseline = steps_of["grpo"]
    methods, failed = [], False
    for name in args.method_names:
        rs = runs[name]
        bad = [r for r in rs if r["status"] != "ok"]
        entry = {"name": name, "label": METHODS[name].label, "credit": METHODS[name].credit,
                 "overrides": list(METHODS[name].overrides),
                 "runs": [{k: r[k] for k in ("status", "reason", "log", "seconds")} for r in rs],
                 "steps": steps_of[name]}
        if bad:
            entry["status"], entry["reason"] = bad[0]["status"], bad[0]["reason"]
            failed |= bad[0]["status"] == "failed"
        elif not steps_of[name]:
            entry["status"], entry["reason"] = "failed", "no measured steps in metrics.jsonl"
            failed = True
        elif not baseline:
            entry["status"], entry["reason"] = "failed", "no GRPO baseline"
            failed = True
        else:
            entry["status"], entry["reason"] = "ok", ""
            entry["summary"] = summarize_method(steps_of[name], baseline)
        methods.append(entry)

    all_steps = [s for v in steps_of.values() for s in v]
    meta = {"suite": SUITE, "command": common.command_line(PROG, argv), "machine": machine,
            "model": model, "config": label, "overrides": args.overrides, "nproc": nproc,
            "steps": args.steps, "warmup": args.warmup, "repeats": args.repeats, "note": args.note,
            "model_line": _model_line(model, base_cfg, nproc, all_steps, args.steps, args.warmup,
                                      args.repeats, label, args.overrides)}
    report = {"meta": meta, "methods": methods}
    published = common.publish(out, SUITE, report, render_markdown(report),
                               update=args.update_benchmarks, benchmarks_file=args.benchmarks_file,
                               blocked=None if baseline else "no GRPO baseline")
    return 1 if failed or not published else 0


if __name__ == "__main__":
    sys.exit(main())
