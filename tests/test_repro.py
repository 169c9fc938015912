"""``oar repro``: intervals, the grid, the report from run directories, resumability.

The runs themselves are ``megatron_oar.commands.train`` (tested in test_trainer.py); here synthetic run
directories stand in for them, so the report's arithmetic is checked against values written by
hand. The end-to-end harness on a tiny budget is the slow test at the end, on the credit testbed
(``--grid tiny-credit``): the SFT start (20
steps, here), its conversion, 4 training runs and 1 oracle run, 2 at a time, each a process
forked from the harness's one warm interpreter (``repro/warm_start.py``: one import of torch,
megatron-core, transformers and vLLM instead of 9). About 90 s on 2 busy cores for the chain
testbed's tiny grid (6 runs, 2 oracle runs) when it was the end-to-end test; at a load average of
about 10 (three agents on 2 cores) the chain's tiny grid took 263 s and this one 251 s. The
same test then runs the tiny lookahead (``oar analyze lookahead``: 2 arms x 2 batches x 1 step,
4 more training runs on the same SFT start): the whole test took 327 s on the shared 2 cores
with them (issue 54's session).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from megatron_oar.repro import report, runner
from megatron_oar.repro.stats import fmt, mean_ci, paired_diff_ci, t975


def test_t_interval():
    iv = mean_ci([1.0, 2.0, 3.0])
    assert iv.mean == 2.0 and iv.n == 3
    assert iv.half == pytest.approx(4.303 * 1.0 / math.sqrt(3))
    assert math.isnan(mean_ci([0.5]).half) and fmt(mean_ci([0.5])) == "50.0 (1 seed)"
    assert fmt(mean_ci([0.2, 0.4])) == f"30.0 ± {12.706 * math.sqrt(0.02) / math.sqrt(2) * 100:.1f}"
    assert t975(40) == 1.96
    with pytest.raises(ValueError, match="NaN"):
        mean_ci([0.1, float("nan")])
    d = paired_diff_ci({0: 0.5, 1: 0.7, 2: 0.9}, {0: 0.4, 1: 0.5, 2: 0.6, 3: 0.9})
    assert d.n == 3 and d.mean == pytest.approx(0.2)  # seed 3 has no pair


def test_grid_default_and_aliases():
    g = runner.Grid()
    specs = runner.grid(g)
    assert len({s.name for s in specs}) == len(specs)
    main = [s for s in specs if s.group == "main"]
    assert len(main) == len(runner.METHODS) * 3
    assert {s.label for s in specs if s.group == "tau"} == {"tau=0.0", "tau=0.7", "tau=1.0"}
    assert all(s.method == "oar_g" for s in specs if s.group not in ("main", "loss"))
    aliases = runner._baselines(specs, g)
    assert {(a.group, a.label, a.name) for a in aliases if a.group != "loss"} == {
        ("tau", "tau=0.4", "oar_g_s0"), ("probe", "answer_mean", "oar_g_s0"),
        ("floor", "floor=0", "oar_g_s0")}
    # the loss axis: GRPO and OAR-G x (gspo_token, cispo, ppo_clip + tis) x 3 seeds, and the main
    # runs as its ppo_clip rows
    loss = [s for s in specs if s.group == "loss"]
    assert len(loss) == 2 * 3 * 3
    assert {s.label for s in loss} == {f"{m} / {x}" for m in ("grpo", "oar_g")
                                       for x in ("gspo_token", "cispo", "ppo_clip + tis")}
    assert {s.overrides for s in loss} == {("loss.policy_loss=gspo_token",), ("loss.policy_loss=cispo",),
                                           ("loss.rollout_correction=tis",)}
    assert {(a.label, a.name) for a in aliases if a.group == "loss"} == {
        (f"{m} / ppo_clip", f"{m}_s{s}") for m in ("grpo", "oar_g") for s in range(3)}


def test_loss_axis_runs_validate():
    """Every loss-axis run of the default and full grids is a config the trainer accepts (one
    of each method and overrides; no run started)."""
    from megatron_oar.config import load_config, validate

    seen = set()
    for g in (runner.GRIDS["default"], runner.GRIDS["full"], runner.GRIDS["losses"]):
        for spec in runner.grid(g):
            if spec.group == "loss" and (spec.method, spec.overrides) not in seen:
                seen.add((spec.method, spec.overrides))
                cfg = load_config(runner.CONFIG, runner.run_overrides(spec, Path("sft"), Path("run"), g))
                validate(cfg, world_size=1)
                assert cfg.credit == spec.method


def test_losses_grid_is_the_default_grids_loss_axis():
    """`--grid losses` runs the default grid's loss axis and the main runs it is paired with,
    under the same names (so its runs are the default grid's), and nothing else."""
    default = {r.name: r for r in runner.grid(runner.GRIDS["default"])}
    losses = runner.grid(runner.GRIDS["losses"])
    assert all(default[r.name] == r for r in losses)
    assert {r.name for r in losses} == {r.name for r in default.values() if r.group == "loss"} | {
        r.name for r in default.values() if r.group == "main" and r.method in ("grpo", "oar_g")}


def _write_run(out: Path, spec: runner.RunSpec, evals: dict[int, float], pass_k: float,
               step_seconds: float) -> None:
    from dataclasses import asdict

    d = out / "runs" / spec.name
    (d / "logs").mkdir(parents=True)
    (d / "spec.json").write_text(json.dumps(asdict(spec)))
    (d / "result.json").write_text(json.dumps({"pass_at_k": pass_k, "seconds": 1.0}))
    lines = []
    for step in range(0, 5):
        rec = {"step": step, "wall_time": 0.0}
        if step in evals:
            rec["eval/accuracy"] = evals[step]
        if step > 0:
            rec.update({"reward/mean": 0.1 * step, "policy/entropy": 1.0, "credit/ess_ratio": 0.9,
                        "credit/top10_mass": 0.2, "tokens/action": 100.0,
                        "time/logprob": step_seconds, "time/update": step_seconds,
                        "time/step": 4 * step_seconds})
        lines.append(json.dumps(rec))
    (d / "logs" / "metrics.jsonl").write_text("\n".join(lines) + "\n")


def test_report_from_runs(tmp_path):
    g = runner.Grid(methods=("grpo", "oar_g"), seeds=2, taus=(1.0,), probes=(), floors=(),
                    loss_methods=("oar_g",), losses=("cispo",), corrections=(), loss_seeds=2)
    acc = {("grpo", 0): 0.40, ("grpo", 1): 0.50, ("oar_g", 0): 0.55, ("oar_g", 1): 0.60}
    for s in runner.grid(g):
        if s.group == "main":
            _write_run(tmp_path, s, {0: 0.3, 4: acc[s.method, s.seed]}, 0.8 if s.method == "grpo" else 0.9,
                       1.0 if s.method == "grpo" else 2.0)
        elif s.group == "loss":  # oar_g / cispo: 0.65 and 0.60, vs ppo_clip's 0.55 and 0.60
            _write_run(tmp_path, s, {0: 0.3, 4: (0.65, 0.60)[s.seed]}, 0.95, 2.0)
        else:
            _write_run(tmp_path, s, {0: 0.3, 4: 0.45}, 0.7, 2.0)
    (tmp_path / "oracle" / "answer_mean").mkdir(parents=True)
    (tmp_path / "oracle" / "answer_mean" / "recall.json").write_text(json.dumps({
        "k_percents": [10, 20], "trajectories": 5, "with_pivots": 4, "pivots": 12,
        "scored_tokens": 100, "recall": {"oar_p": {"micro": [0.3, 0.5], "macro": [0.3, 0.5]},
                                          "random": {"micro": [0.1, 0.2], "macro": [0.1, 0.2]}}}))
    from megatron_oar.eval.records import TokenRecord, write_records

    # the oracle's records, with its control decode: " Take 14. Then plus 5 is 19." (the answer
    # span unscored); pivots 1, 4, plus, 5, 1, 9 (6 of 14); labels on 1, 4 and "Then"; the control
    # fails after "4", so 2 of the 3 labels are caused
    tokens = [" Take", " ", "1", "4", ".", " Then", " plus", " ", "5", " is", " ", "1", "9", ".",
              " <answer>", "19", "</answer>"]
    write_records([TokenRecord(
        id="a", prompt="Compute 14 plus 5.", reference="19", correct=True, token_ids=list(range(17)),
        tokens=tokens, scored=[True] * 14 + [False] * 3, oracle=[0, 0, 1, 1, 0, 1] + [0] * 11,
        kept_correct=[1, 1, 1, 0] + [1] * 10 + [0] * 3)], tmp_path / "oracle" / "answer_mean" / "records.jsonl")
    aliases = [dict(a.__dict__) for a in runner._baselines(runner.grid(g), g)]
    rep = report.build(tmp_path, {"pass_k": 8}, aliases=aliases)
    t1 = rep["table1"]
    assert t1["grpo"]["accuracy"]["mean"] == pytest.approx(0.45)
    assert t1["oar_g"]["accuracy_vs_grpo"]["mean"] == pytest.approx(0.125)  # (0.15 + 0.10) / 2
    assert t1["oar_g"]["accuracy_vs_grpo"]["half95"] == pytest.approx(12.706 * 0.025)
    assert t1["oar_g"]["pass_at_k_vs_grpo"]["mean"] == pytest.approx(0.1)
    assert t1["grpo"]["start_accuracy"]["mean"] == pytest.approx(0.3)
    assert set(rep["ablations"]["tau"]) == {"tau=1.0", "tau=0.4"}
    assert rep["ablations"]["tau"]["tau=0.4"]["accuracy"]["mean"] == pytest.approx(0.55)
    assert rep["cost"]["oar_g"]["sweep_ratio"] == pytest.approx(2.0)
    assert rep["cost"]["oar_g"]["step_ratio"] == pytest.approx(2.0)
    curve = rep["curves"]["reward/mean"]["grpo"]
    assert curve["steps"] == [1, 2, 3, 4] and curve["mean"][0] == pytest.approx(0.1)
    assert Path(rep["figures"]["curves"]).is_file() and Path(rep["figures"]["recall"]).is_file()
    losses = rep["losses"]
    assert set(losses) == {"oar_g / ppo_clip", "oar_g / cispo"}
    assert losses["oar_g / ppo_clip"]["accuracy"]["mean"] == pytest.approx(0.575)  # the main runs
    assert losses["oar_g / cispo"]["accuracy_vs_ppo_clip"]["mean"] == pytest.approx(0.05)  # (0.10 + 0) / 2
    assert losses["oar_g / cispo"]["pass_at_k_vs_ppo_clip"]["mean"] == pytest.approx(0.05)
    assert "accuracy_vs_ppo_clip" not in losses["oar_g / ppo_clip"]
    # the learning curve, threshold 0.5: grpo's seeds end at 0.40 (never: its last step, 4) and
    # 0.50 (step 4); areas (0.3 + final) / 2
    learn = report.learning(report.load_runs(tmp_path), 0.5)["rows"]
    assert learn["grpo"]["auc"]["mean"] == pytest.approx((0.35 + 0.40) / 2)
    assert learn["oar_g"]["auc_vs_grpo"]["mean"] == pytest.approx(0.125 / 2)
    assert learn["grpo"]["reached"] == 1 and learn["oar_g"]["reached"] == 2
    assert learn["grpo"]["steps_to_threshold"]["mean"] == 4.0 and learn["oar_g"]["steps_vs_grpo"]["mean"] == 0.0
    assert rep["learning"]["threshold"] == 0.6  # settings without one: the Grid's default
    text = report.render(rep)
    assert "| oar_g / cispo | 2 | 62.5 ± 31.8 | 5.0 ± 63.5 | 95.0 ± 0.0 | 5.0 ± 0.0 |" in text
    assert "| grpo | 2 | 37.5 ± 31.8 | - | 4.0 ± 0.0 | 0 | - |" in text  # neither seed reached 60%
    assert "| oar_g | 2 | 30.0 ± 0.0 | 57.5 ± 31.8 | 12.5 ± 31.8 |" in text
    assert "pivot share 12.0%" in text and "| oar_p | 30.0 | 50.0 |" in text
    # built-in pivots 6/14 = 42.9%, oracle 3/14; flips on pivots 2/6, on others 1/8; 2/3 built-in
    assert "| answer_mean | 1 | 14 | 42.9% | 21.4% | 33.3% | 12.5% | 66.7% |" in text
    # control verifies 13/14; caused 2/14; on pivots 1/5 (the "4" is not kept), others 1/8
    assert "| answer_mean | 92.9% | 14.3% | 20.0% | 12.5% | 50.0% |" in text


def test_learning_curve_measures_by_hand():
    pts = [(0, 0.3), (5, 0.5), (10, 0.5)]
    assert report.area_under_curve(pts) == pytest.approx((5 * 0.4 + 5 * 0.5) / 10)
    assert report.area_under_curve([(0, 0.7)]) == 0.7
    assert report.steps_to(pts, 0.5) == (5, True) and report.steps_to(pts, 0.9) == (10, False)
    with pytest.raises(ValueError, match="eval/accuracy"):
        report.area_under_curve([])


def test_credit_grid_runs_validate():
    """The credit grids run the credit testbed's config (asides on), every method with the same
    settings, no ablation or loss axis; each run is a config the trainer accepts."""
    from megatron_oar.config import load_config, validate

    assert runner.GRIDS["tiny-credit"].config().name == "tiny_credit_cpu.yaml"  # run end to end below
    for name in ("credit",):
        g = runner.GRIDS[name]
        assert g.config().name == "tiny_credit_cpu.yaml"
        specs = runner.grid(g)
        assert {s.group for s in specs} == {"main"} and len(specs) == 5 * 12
        for spec in {s.method: s for s in specs}.values():  # one run per method (seeds alike)
            cfg = load_config(g.config(), runner.run_overrides(spec, Path("sft"), Path("run"), g))
            validate(cfg, world_size=1)
            assert cfg.credit == spec.method and cfg.data.synthetic.chain.asides_max > 0
    assert {s.overrides for s in runner.grid(runner.GRIDS["credit"])} == {()}
    assert runner.GRIDS["default"].config() == runner.CONFIG
    with pytest.raises(ValueError, match="testbed must be one of"):
        runner.Grid(testbed="nope").config()


def test_publish_keeps_the_hand_written_part(tmp_path):
    out, docs = tmp_path / "out", tmp_path / "docs"
    out.mkdir()
    docs.mkdir()
    (out / "repro.md").write_text("## Table 1\n")
    (out / "report.json").write_text(json.dumps({
        "runs": 2, "figures": {}, "settings": {"config": "/x/tiny_credit_cpu.yaml", "wall_seconds": 60.0,
                                               "jobs": 2, "methods": ["grpo"], "seeds": 2, "steps": 3,
                                               "testbed": "credit"}}))
    (docs / "repro-credit.md").write_text(f"# by hand\n\nthe pilot\n{runner.KEEP}\nold tables\n")
    runner.publish(out, docs, "oar repro --grid credit --publish docs", name="repro-credit")
    text = (docs / "repro-credit.md").read_text()
    assert text.startswith("# by hand\n\nthe pilot\n" + runner.KEEP) and "old tables" not in text
    assert "Made by `oar repro --grid credit --publish docs` in 1 min" in text and text.endswith("## Table 1\n")
    assert (docs / "repro-credit" / "report.json").is_file()


def test_sft_seed_makes_another_start_and_an_out_dir_keeps_its_own(tmp_path, monkeypatch, capsys):
    from megatron_oar.repro import demo_model

    seeds = []
    monkeypatch.setattr(demo_model, "make_demo_model", lambda hf, seed, **kw: (seeds.append(("init", seed)),
                                                                              hf.mkdir(parents=True)))
    monkeypatch.setattr(demo_model, "sft_warmup", lambda hf, seed, **kw: (seeds.append(("data", seed)),
                                                                          {"steps": kw["steps"]})[1])
    config = runner.GRIDS["tiny-credit"].config()
    hf = runner.sft_start(tmp_path, config, 5, seed=3)
    assert seeds == [("init", 3), ("data", 3)] and json.loads((hf / "sft.json").read_text()) == {"steps": 5, "seed": 3}
    assert runner.sft_start(tmp_path, config, 5, seed=3) == hf and len(seeds) == 2  # made once
    with pytest.raises(ValueError, match="made with --sft-seed 3, not 0"):
        runner.sft_start(tmp_path, config, 5)
    (hf / "sft.json").write_text(json.dumps({"steps": 5}))  # a start made before the seed was recorded
    assert runner.sft_start(tmp_path, config, 5, seed=0) == hf
    with pytest.raises(ValueError, match="made with --sft-seed 0, not 1"):
        runner.sft_start(tmp_path, config, 5, seed=1)
    with pytest.raises(ValueError, match="made with --sft-seed 0, not 1"):  # a report too
        runner.run(tmp_path, runner.Grid(sft_seed=1), report_only=True)
    with pytest.raises(SystemExit) as e:  # on the command line: the flag named, no traceback
        runner.main(["--out", str(tmp_path), "--sft-seed", "1", "--report-only"])
    assert e.value.code == 2 and "--sft-seed: " in capsys.readouterr().err
    assert not (tmp_path / "settings.json").exists()


def test_publish_names_files_relative_to_docs(tmp_path):
    out, docs = tmp_path / "out", tmp_path / "docs"
    out.mkdir()
    (out / "curves.png").write_bytes(b"png")
    (out / "repro.md").write_text("## Table 1\n")
    (out / "report.json").write_text(json.dumps({
        "runs": 2, "figures": {"curves": str(out / "curves.png")},
        "settings": {"config": "/somewhere/tiny_chain_cpu.yaml", "wall_seconds": 600.0, "jobs": 2,
                     "methods": ["grpo"], "seeds": 2, "steps": 3, "ablation_method": "oar_g",
                     "ablation_seeds": 1}}))
    runner.publish(out, docs, f"oar repro --out {out} --report-only --publish docs")  # names the runs' command
    text = (docs / "repro.md").read_text()
    assert text.startswith("# `oar repro`") and "Made by `oar repro --out out --publish docs` in 10 min" in text
    assert text.endswith("## Table 1\n") and (docs / "repro" / "curves.png").read_bytes() == b"png"
    published = json.loads((docs / "repro" / "report.json").read_text())
    assert published["figures"] == {"curves": "repro/curves.png"}
    assert published["settings"]["config"] == "tiny_chain_cpu.yaml" and str(tmp_path) not in json.dumps(published)
    assert str(tmp_path) not in text


def test_finished_runs_are_not_redone(tmp_path, monkeypatch):
    spec = runner.grid(runner.GRIDS["tiny"])[0]
    _write_run(tmp_path, spec, {0: 0.1, 4: 0.2}, 0.5, 1.0)
    monkeypatch.setattr(runner.subprocess, "call", lambda *a, **k: pytest.fail("re-ran a finished run"))
    res = runner.train_run(spec, tmp_path, tmp_path / "sft", runner.CONFIG, runner.GRIDS["tiny"])
    assert res["pass_at_k"] == 0.5


def test_pass_at_k_scored_in_threads_matches_one_at_a_time(tmp_path):
    """``oar repro`` scores its runs in threads. transformers' ``from_pretrained`` swaps
    ``PreTrainedModel.init_weights`` / ``tie_weights`` process-wide while it loads, and HF
    ``generate`` samples from torch's global RNG: two threads at once left the swap in place for
    the rest of the process (a tied model built later was saved untied) and gave samples that
    depended on timing. Two threads give what one at a time gives, and transformers is intact."""
    from concurrent.futures import ThreadPoolExecutor

    from transformers.modeling_utils import PreTrainedModel

    from megatron_oar.models.tiny import make_tiny_qwen2
    from megatron_oar.repro import demo_model

    hf = make_tiny_qwen2(tmp_path / "hf", tied=True, seed=3)
    intact = (PreTrainedModel.init_weights, PreTrainedModel.tie_weights)
    prompts = ["1 + 2 =", "3 + 4 = 7. <answer>"]

    def sample(seed: int) -> list[list[str]]:
        return demo_model.generate_responses(hf, prompts, samples=3, temperature=1.0,
                                             max_new_tokens=6, seed=seed)

    alone = [sample(seed) for seed in range(4)]
    with ThreadPoolExecutor(max_workers=2) as pool:
        threaded = list(pool.map(sample, range(4)))
    assert (PreTrainedModel.init_weights, PreTrainedModel.tie_weights) == intact
    assert threaded == alone


@pytest.mark.slow
@pytest.mark.e2e
def test_tiny_grid_end_to_end(tmp_path):
    """The whole harness on a tiny budget, on the credit testbed (``--grid tiny-credit``: the
    chain testbed's config differs only in its data knobs and lengths): SFT start, 2 methods x 2
    seeds x 2 steps, the oracle, the report; then a second call redoes nothing. (The ablations'
    aliases and tables are checked on hand-written runs above.)"""
    from transformers.modeling_utils import PreTrainedModel

    g = runner.GRIDS["tiny-credit"]
    intact = (PreTrainedModel.init_weights, PreTrainedModel.tie_weights)
    rep = runner.run(tmp_path, g, jobs=2)
    assert (PreTrainedModel.init_weights, PreTrainedModel.tie_weights) == intact  # see above
    assert set(rep["table1"]) == {"grpo", "oar_g"} and rep["runs"] == 4
    assert rep["settings"]["config"].endswith("tiny_credit_cpu.yaml")
    assert set(rep["oracle"]) == {"answer_mean"} == set(rep["oracle_confirmation"])
    assert set(rep["learning"]["rows"]) == {"grpo", "oar_g"}
    assert (tmp_path / "repro.md").read_text().startswith("## Table 1")
    stamps = {p: p.stat().st_mtime for p in (tmp_path / "runs").glob("*/result.json")}
    runner.run(tmp_path, g, jobs=2)
    assert stamps == {p: p.stat().st_mtime for p in (tmp_path / "runs").glob("*/result.json")}
    # the tiny lookahead (issue 54) on the same SFT start: 2 arms x 2 batches x 1 step, with the
    # credit records on; every arm updates on the same rollouts, and oar analyze credit reads them
    from megatron_oar.eval import credit_profile
    from megatron_oar.repro import lookahead

    s = lookahead.run(tmp_path, ["grpo", "oar_g"], 2, 1, config=g.config(), jobs=2,
                      extra=[*g.overrides, "log.credit_records=1"], sft_steps=g.sft_steps)
    assert s["rows"]["oar_g"]["batches"] == [0, 1] and s["rows"]["oar_g"]["same_rollouts"] == 2
    assert set(s["rows"]["oar_g"]["vs_baseline"]) == {"mean", "half95", "n"}
    records = credit_profile.read_credit_records(tmp_path / "lookahead" / "oar_g_b0")
    assert len(records) == 16 * 8 and all(r["credit"] == "oar_g" for r in records)
    for r in records:
        assert len(r["weights"]) == len(r["tokens"]) == len(r["advantages"])
        if r["seq_adv"] != 0:
            assert r["importance"] is not None and any(r["scored"])
    assert credit_profile.profile(records)["rollouts"] == 16 * 8


def test_warm_started_runs_report_status_output_and_environment(tmp_path, capfd):
    """A run forked from the warm interpreter (``repro/warm_start.py``) gets the environment and
    working directory it is given, appends its stdout and stderr to its log and returns its exit
    status; two threads may start runs at once; a failed run raises naming what and the log.
    (The converter's CLI stands in for a run: what its ``main`` imports is preloaded, not vLLM.)
    The server's preload prints none of megatron's import-time backend notices on the console."""
    import os
    import sys
    from concurrent.futures import ThreadPoolExecutor

    from megatron_oar.repro.warm_start import WarmStarter

    log = tmp_path / "run.log"
    preload = ("checkpoints_convert.cli", "checkpoints_convert.convert", "checkpoints_convert.hf_io",
               "megatron_oar.models.model_checkpoint", "torch.distributed.checkpoint.api",
               "megatron.core.optimizer")  # warns at import without TE / Apex
    with WarmStarter(preload=preload) as starter:
        env = {**os.environ, "COLUMNS": "40"}  # argparse wraps its usage at COLUMNS
        assert starter.run("checkpoints_convert.cli", ["--help"], env=env, log=log) == 0
        assert "usage: oar-convert" in log.read_text()
        with ThreadPoolExecutor(max_workers=2) as pool:
            rcs = list(pool.map(lambda argv: starter.run("checkpoints_convert.cli", argv, env=env, log=log),
                                [["nope"], ["verify"]]))
        assert rcs == [2, 2]
        text = log.read_text()
        assert text.count("usage: oar-convert") == 3 and "invalid choice: 'nope'" in text
        assert "usage: oar-convert [-h]\n" in text  # wrapped at the child's COLUMNS=40
        with pytest.raises(RuntimeError, match=r"converting x failed \(exit 2\); see .*run.log"):
            runner._run_one_process([sys.executable, "-m", "checkpoints_convert.cli", "nope"], log,
                                    "converting x", starter)
        with pytest.raises(ValueError, match="not a `python -m MODULE` command"):
            runner._run_one_process(["oar-convert", "nope"], log, "converting x", starter)
    assert "are not installed. Falling back to" not in capfd.readouterr().err


def test_credit_ablations_grid_arms_validate_and_report(tmp_path):
    """``--grid credit-ablations`` (issue 54): GRPO and OAR-G x 12 seeds, OAR-G's arms x 12 seeds
    (tau 0, tau 1, beta 0, floor 0.1, the LT-Logits warm-up, sign-aware), each a config the
    trainer accepts with the arm's setting in it; the arm table pairs each arm with OAR-G's main
    run (the arm ``paper``) and with GRPO by seed."""
    from megatron_oar.config import load_config, validate

    g = runner.GRIDS["credit-ablations"]
    specs = runner.grid(g)
    arms = {s.label: s.overrides for s in specs if s.group == "arm"}
    assert set(arms) == {"tau=0 (boost-only)", "tau=1 (suppress-only)", "beta=0 (no boost)",
                         "floor=0.1 (authors' code)", "LT-Logits warm-up", "sign_aware (ours)"}
    assert len(specs) == 2 * 12 + 6 * 12 and len({s.name for s in specs}) == len(specs)
    checks = {"tau=0 (boost-only)": ("shaping", "tau", 0.0), "beta=0 (no boost)": ("shaping", "beta", 0.0),
              "floor=0.1 (authors' code)": ("shaping", "floor", 0.1),
              "sign_aware (ours)": ("shaping", "variant", "sign_aware")}
    for spec in {s.label: s for s in specs if s.seed == 0}.values():
        cfg = load_config(g.config(), runner.run_overrides(spec, Path("sft"), Path("run"), g))
        validate(cfg, world_size=1)
        if spec.label in checks:
            section, key, value = checks[spec.label]
            assert getattr(getattr(cfg, section), key) == value
        if spec.label == "LT-Logits warm-up":
            assert cfg.attribution.probe.warmup_steps == 3 and cfg.attribution.probe.kind == "answer_mean"
    aliases = runner._baselines(specs, g)
    assert {(a.group, a.label, a.name) for a in aliases} == {("arm", "paper", f"oar_g_s{s}") for s in range(12)}
    # the report on hand-written runs: two seeds of grpo, oar_g and one arm
    small = runner.Grid(methods=("grpo", "oar_g"), seeds=2, taus=(), probes=(), floors=(), losses=(),
                        corrections=(), loss_seeds=0, ablation_seeds=2,
                        arms=(("beta=0", ("shaping.beta=0.0",)),))
    acc = {"grpo": (0.40, 0.50), "oar_g": (0.30, 0.40), "beta=0": (0.45, 0.50)}
    for s in runner.grid(small):
        _write_run(tmp_path, s, {0: 0.3, 4: acc[s.label][s.seed]}, 0.8, 1.0)
    rep = report.build(tmp_path, {"pass_k": 4},
                       aliases=[dict(a.__dict__) for a in runner._baselines(runner.grid(small), small)])
    arm = rep["arms"]["beta=0"]
    assert arm["accuracy"]["mean"] == pytest.approx(0.475)
    assert arm["accuracy_vs_paper"]["mean"] == pytest.approx(0.125)  # (0.15 + 0.10) / 2
    assert arm["accuracy_vs_grpo"]["mean"] == pytest.approx(0.025)   # (0.05 + 0.00) / 2
    assert arm["auc_vs_paper"]["mean"] == pytest.approx(0.125 / 2)
    assert "accuracy_vs_paper" not in rep["arms"]["paper"] and rep["arms"]["paper"]["accuracy_vs_grpo"]
    assert "| beta=0 | 2 | 47.5 ± 31.8 | 12.5 ± 31.8 |" in report.render(rep)
    from dataclasses import asdict

    assert "oar_g's arms beta=0 x 2 seed(s)" in runner._axes(asdict(small))


def test_lookahead_summary_pairs_batches(tmp_path):
    """``oar analyze lookahead``'s table: per arm the held-out accuracy over batches, the paired
    difference to the baseline, and the batches whose step-1 rollouts (training reward) equal the
    baseline's; a run's overrides make a config the trainer accepts."""
    from megatron_oar.config import load_config, validate
    from megatron_oar.repro import lookahead as L

    res = [{"arm": a, "batch": b, "start": 0.36, "accuracy": acc, "reward_step1": rw, "seconds": 10.0}
           for a, b, acc, rw in (("grpo", 0, 0.50, 0.25), ("grpo", 1, 0.60, 0.5), ("grpo", 2, 0.55, 0.75),
                                 ("oar_g", 0, 0.45, 0.25), ("oar_g", 1, 0.50, 0.5), ("oar_g", 2, 0.55, 0.70))]
    s = L.summarize(res, "grpo", 1)
    vs = s["rows"]["oar_g"]["vs_baseline"]
    assert vs["mean"] == pytest.approx(-0.05) and vs["n"] == 3
    assert vs["half95"] == pytest.approx(t975(2) * 0.05 / math.sqrt(3))  # diffs -0.05, -0.10, 0.00
    assert s["rows"]["oar_g"]["same_rollouts"] == 2  # batch 2's step-1 reward differs
    assert s["start_accuracy"] == pytest.approx(0.36)
    assert "| oar_g | 3 | 50.0 ± 12.4 | -5.0 ± 12.4 | 2 | 10 |" in L.render(s)
    # the oar_g arms' settings are validated in the grid test above; here the run overrides
    for arm in ("grpo", "oar_p_screened", "oar_g sign_aware (ours)"):
        cfg = load_config(runner.CONFIG.parent / "tiny_credit_cpu.yaml",
                          L.run_overrides(arm, 1, Path("sft"), tmp_path / L.slug(arm), 1, []))
        validate(cfg, world_size=1)
        assert cfg.train.steps == cfg.train.eval_interval == 1 and cfg.rollout.seed == 1
    assert len({L.slug(a) for a in L.ARMS}) == len(L.ARMS)


def test_credit_ablations_arms_and_seeds_select_a_resumable_subset(tmp_path, monkeypatch, capsys):
    """``oar repro --grid credit-ablations --arms A,B --seeds N``: only those arms (GRPO and OAR-G
    beside them), N seeds for the arms too; an unknown arm is an error naming the flag and the
    choices. The runs go seed by seed (a stopped grid has whole seeds), with no oracle run in this
    grid, and the report counts only the grid's own runs (an out dir holding more seeds or arms
    gives the same tables)."""
    import io

    from rich.console import Console

    seen = {}
    monkeypatch.setattr(runner, "run", lambda out, g, **k: seen.setdefault("g", g))
    runner.main(["--grid", "credit-ablations", "--out", str(tmp_path), "--seeds", "3",
                 "--arms", "sign_aware (ours), tau=1 (suppress-only)"])
    g = seen.pop("g")
    assert [a[0] for a in g.arms] == ["tau=1 (suppress-only)", "sign_aware (ours)"]  # the grid's order
    assert g.seeds == g.ablation_seeds == 3 and g.methods == ("grpo", "oar_g")
    assert {s.label for s in runner.grid(g)} == {"grpo", "oar_g", "tau=1 (suppress-only)", "sign_aware (ours)"}
    runner.main(["--grid", "default", "--out", str(tmp_path), "--seeds", "5"])
    assert seen.pop("g").ablation_seeds == 1  # at most --seeds: the default grid's 1 stays
    for bad, msg in ((["--grid", "credit-ablations", "--arms", "tau=2"], "unknown arm"),
                     (["--grid", "credit", "--arms", "tau=0 (boost-only)"], "no named arms")):
        with pytest.raises(SystemExit) as e:
            runner.main([*bad, "--out", str(tmp_path)])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert "--arms" in err and msg in err
    # seed-major order, with the finished runs skipped
    (tmp_path / "sft").mkdir()
    (tmp_path / "sft" / "sft.json").write_text("{}")
    monkeypatch.setattr(runner, "sft_start", lambda *a: tmp_path / "sft")
    monkeypatch.setattr(runner, "sft_checkpoint", lambda *a: tmp_path / "sft")
    monkeypatch.setattr(runner, "oracle_run", lambda *a: pytest.fail("an oracle in the ablation grid"))
    order = []
    monkeypatch.setattr(runner, "train_run", lambda spec, *a: order.append(spec) or {"pass_at_k": 0.0})
    done = runner.grid(g)[0]
    (tmp_path / "runs" / done.name).mkdir(parents=True)
    (tmp_path / "runs" / done.name / "result.json").write_text("{}")
    runner._run_grid(tmp_path, g, runner.CONFIG, 1, None, Console(file=io.StringIO()), 0.0)
    assert len(order) == len(runner.grid(g)) - 1 and done.name not in {s.name for s in order}
    assert [s.seed for s in order] == sorted(s.seed for s in order)
    # the report: only the grid's runs (seed 2 of an arm finished in the dir, the grid has 2 seeds)
    out = tmp_path / "rep"
    small = runner.Grid(methods=("grpo", "oar_g"), seeds=2, taus=(), probes=(), floors=(), losses=(),
                        corrections=(), loss_seeds=0, ablation_seeds=2,
                        arms=(("beta=0", ("shaping.beta=0.0",)),))
    bigger = runner.Grid(**{**small.__dict__, "seeds": 3, "ablation_seeds": 3})
    for s in runner.grid(bigger):
        _write_run(out, s, {0: 0.3, 4: 0.4 + 0.1 * s.seed}, 0.8, 1.0)
    aliases = [dict(a.__dict__) for a in runner._baselines(runner.grid(small), small)]
    rep = report.build(out, {"pass_k": 4}, aliases=aliases, names={s.name for s in runner.grid(small)})
    assert rep["arms"]["beta=0"]["seeds"] == [0, 1] and rep["table1"]["grpo"]["seeds"] == [0, 1]


def test_grid_without_pass_at_k(tmp_path, monkeypatch):
    """``oar repro --pass-k 0``: a run's result has no pass@k (its HF sampling, the slow part of a
    10-step run on a busy machine, is skipped) and the tables give held-out greedy accuracy with
    "-" for pass@k; a run that measured it beside ones that did not is left out of pass@k only."""
    seen = {}
    monkeypatch.setattr(runner, "run", lambda out, g, **k: seen.setdefault("g", g))
    runner.main(["--grid", "credit-ablations", "--out", str(tmp_path), "--pass-k", "0"])
    g = seen["g"]
    assert g.pass_k == 0
    with pytest.raises(SystemExit):
        runner.main(["--grid", "credit", "--out", str(tmp_path), "--pass-k", "-1"])
    spec = runner.grid(g)[0]

    def fake_train(cmd, log, what, starter=None):
        (tmp_path / "runs" / spec.name / "hf" / "step_00000010").mkdir(parents=True)

    monkeypatch.setattr(runner, "_run_one_process", fake_train)
    monkeypatch.setattr(runner, "pass_at_k", lambda *a, **k: pytest.fail("pass@k with --pass-k 0"))
    res = runner.train_run(spec, tmp_path, tmp_path / "sft", g.config(), g)
    assert res["pass_at_k"] is None
    assert json.loads((tmp_path / "runs" / spec.name / "result.json").read_text())["pass_at_k"] is None
    out = tmp_path / "rep"
    small = runner.Grid(methods=("grpo", "oar_g"), seeds=2, taus=(), probes=(), floors=(), losses=(),
                        corrections=(), loss_seeds=0, ablation_seeds=2, arms=(("beta=0", ("shaping.beta=0.0",)),))
    for s in runner.grid(small):
        _write_run(out, s, {0: 0.3, 4: 0.4 + 0.1 * s.seed}, 0.5, 1.0)
        if s.name != "grpo_s0":
            res = json.loads((out / "runs" / s.name / "result.json").read_text())
            (out / "runs" / s.name / "result.json").write_text(json.dumps({**res, "pass_at_k": None}))
    aliases = [dict(a.__dict__) for a in runner._baselines(runner.grid(small), small)]
    rep = report.build(out, {"pass_k": 0}, aliases=aliases)
    assert rep["table1"]["oar_g"]["pass_at_k"] is None and "pass_at_k_vs_grpo" not in rep["table1"]["oar_g"]
    assert rep["table1"]["grpo"]["pass_at_k"]["n"] == 1
    assert rep["table1"]["oar_g"]["accuracy_vs_grpo"]["mean"] == pytest.approx(0.0)
    text = report.render(rep)
    assert "pass@k (not measured)" in text and "| oar_g | 2 |" in text
