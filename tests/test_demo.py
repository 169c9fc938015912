"""``oar demo`` end to end, shortened: the tiny model, its warm-up, RL at TP=2, export and plot.

``make demo`` itself (100 RL steps, about 4 minutes) is what the README's numbers come from; here
the same code path runs with 40 warm-up steps and 2 RL steps so a broken demo fails the suite.
"""

from __future__ import annotations

import json

import pytest

from megatron_oar import demo_model


def test_demo_task_split_and_targets():
    exs = demo_model.problems(400, seed=3, heldout=False)
    held = demo_model.problems(400, seed=3, heldout=True)
    assert exs and held and not {e.prompt for e in exs} & {e.prompt for e in held}
    ex = exs[0]
    target = demo_model.response_for(ex)
    assert target.endswith(f"<answer>{ex.answer}</answer>") and f"= {ex.answer}." in target


@pytest.mark.slow
def test_demo_runs_end_to_end(tmp_path, capsys):
    from transformers import AutoConfig

    from megatron_oar.cli import main

    out = tmp_path / "demo"
    assert main(["demo", "--out", str(out), "--steps", "2", "--sft-steps", "40"]) == 0
    printed = capsys.readouterr().out
    assert "reward curve" in printed and "held-out greedy accuracy" in printed
    records = [json.loads(line) for line in (out / "run" / "logs" / "metrics.jsonl").open()]
    assert [r["step"] for r in records] == [0, 1, 2]
    assert "eval/accuracy" in records[0] and "eval/accuracy" in records[2]
    assert all(0.0 <= r["reward/mean"] <= 1.0 for r in records[1:])
    hf = out / "run" / "hf" / "step_00000002"
    assert AutoConfig.from_pretrained(hf).num_hidden_layers == 2
    assert (hf / "model.safetensors").is_file() or (hf / "model.safetensors.index.json").is_file()
    png = out / "run" / "plots" / "training_curves.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "run" / "checkpoints" / "latest").exists()
