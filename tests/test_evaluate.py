"""Validation during training (megatron_oar.training.evaluate): the eval set and its metrics.

The vLLM engine and the verifier are replaced by fakes that answer what the trainer's engine and
scorer answer, so the metric arithmetic, the seeds and the eval-set split are checked exactly;
tests/test_trainer.py runs the real ones (evaluations in a resumed run equal the uninterrupted).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from megatron_oar.config import ConfigError, load_config
from megatron_oar.data import Example, write_jsonl
from megatron_oar.rollout.batch import RolloutBatch
from megatron_oar.training.evaluate import evaluate, load_eval_examples
from tests.test_config import EXAMPLES


class FakeTokenizer:
    """One token per character."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) % 97 + 1 for c in text]}


def _cfg(*overrides: str):
    return load_config(EXAMPLES / "tiny_cpu.yaml", list(overrides))


def test_synthetic_eval_set_is_held_out():
    from megatron_oar.training.inputs import load_examples

    cfg = _cfg("data.synthetic.eval_n=300")
    train = load_examples(cfg, tokenizer=None)
    evals = load_eval_examples(cfg, None, train)
    assert evals and len(evals) < 300  # some of the 300 draws were training problems
    assert not {e.prompt for e in evals} & {t.prompt for t in train}
    assert evals == load_eval_examples(cfg, None, train)  # deterministic
    limited = load_eval_examples(_cfg("data.synthetic.eval_n=300", "train.eval_max_prompts=5"),
                                 None, train)
    assert limited == evals[:5]


def test_no_eval_set_and_an_exhausted_task():
    from megatron_oar.training.inputs import load_examples

    assert load_eval_examples(_cfg("data.synthetic.eval_n=0"), None, []) == []
    # "Compute a + b." with a, b in [0, 1]: 4 problems, all of them in the training set
    tiny = ("data.synthetic.max_value=1", "data.synthetic.operators=+", "data.synthetic.n=64")
    cfg = _cfg(*tiny)
    with pytest.raises(ConfigError, match="data.synthetic.eval_n=160: every drawn problem"):
        load_eval_examples(cfg, None, load_examples(cfg, tokenizer=None))


def test_eval_files(tmp_path):
    rows = [Example(f"What is {i} + 1?", str(i + 1), "test", i) for i in range(6)]
    rows.append(Example("x" * 40, "0", "test", 6))  # longer than data.max_prompt_tokens=32
    path = write_jsonl(rows, tmp_path / "eval.jsonl")
    cfg = _cfg(f"data.eval_files=[{path}]", "data.synthetic.eval_n=0", "data.template=raw")
    got = load_eval_examples(cfg, FakeTokenizer(), [])
    assert [(e.prompt, e.answer) for e in got] == [(r.prompt, r.answer) for r in rows[:6]]
    write_jsonl(rows[6:], path)
    with pytest.raises(ConfigError, match=r"data.eval_files: no usable examples \(0 malformed, 1 too long"):
        load_eval_examples(cfg, FakeTokenizer(), [])


# ------------------------------------------------------------------------------ metrics

class FakeEngine:
    """One rollout group; completion ``j`` of a prompt says ``answers[j]``."""

    dp_size, dp_rank = 1, 0

    def __init__(self, answers: list[str]):
        self.answers = answers
        self.calls: list[dict] = []

    def generate(self, ids, *, seeds, n, temperature):
        self.calls.append({"seeds": list(seeds), "n": n, "temperature": temperature})
        texts = [[self.answers[j] for j in range(n)] for _ in ids]
        return RolloutBatch(prompt_ids=[list(p) for p in ids],
                            response_ids=[[[1] * (j + 1) for j in range(n)] for _ in ids],
                            logprobs=[[[0.0] * (j + 1) for j in range(n)] for _ in ids],
                            finish_reasons=[["stop"] * (n - 1) + ["length"] for _ in ids],
                            stop_reasons=[[None] * n for _ in ids], texts=texts,
                            seeds=list(seeds), n=n, temperature=temperature, top_p=1.0, top_k=0,
                            logprobs_mode="raw_logprobs")

    def gather(self, batch):
        return batch


def fake_scorer(texts, refs):
    acc = torch.tensor([float(t == r) for t, r in zip(texts, refs)])
    fmt = torch.ones(len(texts))
    return SimpleNamespace(rewards=acc + 0.1 * fmt, accuracy=acc, format=fmt,
                           status=["ok"] * len(texts))


@pytest.fixture()
def group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_evaluate_metrics_and_seeds(group):
    # three prompts with answers 1, 2, 3; completion 0 says "1", completion 1 says "2"
    examples = [Example(f"p{i}", str(i), "test", i) for i in (1, 2, 3)]
    engine = FakeEngine(["1", "2"])
    m = evaluate(engine, fake_scorer, FakeTokenizer(), examples, template="raw", n=2,
                 temperature=0.7, seed=5, group=group)
    assert m["eval/accuracy"] == pytest.approx(2 / 6)       # mean over all samples (pass@1)
    assert m["eval/pass_at_n"] == pytest.approx(2 / 3)      # prompts 1 and 2 solved by a sample
    assert m["eval/reward"] == pytest.approx(2 / 6 + 0.1)
    assert m["eval/format"] == 1.0
    assert m["eval/length_mean"] == 1.5 and m["eval/truncated_fraction"] == 0.5
    assert m["eval/prompts"] == 3
    evaluate(engine, fake_scorer, FakeTokenizer(), examples, template="raw", n=2,
             temperature=0.7, seed=5, group=group)
    first, again = engine.calls
    assert first == again and first["n"] == 2 and first["temperature"] == 0.7
    assert len(set(first["seeds"])) == 3  # one per prompt, the same at every evaluation
