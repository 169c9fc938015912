"""Rewards: extraction, format, math-verify equivalence, and the sandboxed verifier pool.

The pool tests use short time limits (1-2 s) so the suite stays fast; the verifier hooks at the
top of this file are imported by the worker processes (``rewards.verifier="tests.test_rewards:..."``).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from megatron_oar.rewards import (
    RewardConfig,
    RewardScorer,
    VerifierPool,
    extract_answer,
    extract_answer_tag,
    extract_boxed,
    extract_gsm8k,
    format_score,
    normalize_reference,
    sanitize,
    score_batch,
)

# ------------------------------------------------------------------ verifier hooks (run in workers)


def sleepy_verify(pred: str, gold: str) -> bool:
    """Test-only verifier: ``hang`` never returns, ``crash`` kills its process, ``hog`` asks for
    8 GiB (past the pool's address-space limit), ``raise`` raises; else string equality."""
    if pred == "hog":
        return len(bytearray(8 << 30)) > 0
    if pred == "hang":
        time.sleep(600)
    if pred == "crash":
        os._exit(3)
    if pred == "raise":
        raise RuntimeError("verifier bug")
    return pred == gold


def _gone(pid: int, within: float = 5.0) -> bool:
    """True once ``pid`` no longer exists at all (neither running nor a zombie)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if not Path(f"/proc/{pid}").exists():
            return True
        time.sleep(0.05)
    return False


@pytest.fixture(scope="module")
def scorer():
    with RewardScorer(RewardConfig(timeout_s=2.0, num_workers=2)) as s:
        yield s


# ------------------------------------------------------------------ extraction (no pool)


def test_answer_tag_last_complete_block_wins():
    text = "<answer>1</answer> then <answer>2</answer> and <answer>3"
    found = extract_answer_tag(text)
    assert found.text == "2" and text[found.start:found.end] == "2"
    assert extract_answer_tag("no tags here") is None
    assert extract_answer_tag("<answer>5") is None
    assert extract_answer_tag("<answer>a</answer></answer>").text == "a"
    assert extract_answer_tag("<answer><answer>b</answer>").text == "b"


def test_boxed_nested_braces_fbox_and_last_wins():
    assert extract_boxed(r"x \boxed{\frac{\sqrt{3}}{2}} y").text == r"\frac{\sqrt{3}}{2}"
    assert extract_boxed(r"\boxed{1} then \fbox{2}").text == "2"
    assert extract_boxed(r"\fbox{1} then \boxed{ {a}{b} }").text == " {a}{b} "
    assert extract_boxed(r"\boxed{7} and a broken \boxed{8").text == "7"  # unclosed last box skipped
    assert extract_boxed(r"so \boxed 5 done").text == "5"
    assert extract_boxed(r"\boxed{\{1,2\}}").text == r"\{1,2\}"  # escaped braces do not count
    assert extract_boxed("nothing") is None


def test_gsm8k_number_with_commas():
    assert extract_gsm8k("so she pays 1,234 in all.\n#### 1,234").text == "1234"
    assert extract_gsm8k("#### -3.5").text == "-3.5"
    assert extract_gsm8k("#### 1\n#### $72").text == "72"
    assert extract_gsm8k("#### none") is None
    assert normalize_reference("Natalia sold 48/2 = 24 clips.\n#### 72") == "72"


def test_answer_line_takes_the_last_answer_line():
    assert extract_answer("Answer: 1\nmore work\nAnswer: 34", ["answer_line"]).text == "34"
    assert extract_answer("work\n**Final Answer:** $\\frac12$", ["answer_line"]).text == "$\\frac12$"
    assert extract_answer("The answer: 3\nanswer:", ["answer_line"]) is None


def test_extractor_order_is_configurable():
    text = r"\boxed{1} and finally <answer>2</answer>"
    assert extract_answer(text, ["answer_tag", "boxed"]).text == "2"
    assert extract_answer(text, ["boxed", "answer_tag"]).text == "1"
    assert extract_answer(text, ["gsm8k"]) is None
    with pytest.raises(ValueError, match="rewards.extractors"):
        extract_answer(text, ["nope"])


def test_tail_limit_and_spans_refer_to_the_full_text():
    text = "x" * 100_000 + "<answer>42</answer>"
    found = extract_answer(text, ["answer_tag"], tail_chars=64)
    assert found.text == "42" and text[found.start:found.end] == "42"
    assert extract_answer("<answer>1</answer>" + "x" * 100, ["answer_tag"], tail_chars=50) is None


def test_references_in_every_accepted_form_normalize():
    for ref in ("0.5", "$0.5$", r"\boxed{0.5}", r"$\boxed{0.5}$", r"\(0.5\)", " 0.5. "):
        assert normalize_reference(ref) == "0.5", ref


def test_sanitize_is_length_preserving():
    s = "a\ud800b\x00c"
    out = sanitize(s)
    assert len(out) == len(s) and out.encode("utf-8") and "\x00" not in out
    with pytest.raises(TypeError):
        sanitize(None)


# ------------------------------------------------------------------ format reward


@pytest.mark.parametrize("text,style,expected", [
    ("Reasoning here.\n<answer>5</answer>", "answer_tag", 1.0),
    ("Reasoning.<answer>5</answer>\n<|im_end|>", "answer_tag", 1.0),
    ("<answer>5</answer>", "answer_tag", 0.0),                                  # no reasoning
    ("Reasoning. <answer>5</answer> more text", "answer_tag", 0.0),             # not at the end
    ("R. <answer>4</answer> R. <answer>5</answer>", "answer_tag", 0.0),          # two blocks
    ("Reasoning. <answer>  </answer>", "answer_tag", 0.0),                      # empty answer
    ("Reasoning. <answer>5", "answer_tag", 0.0),                                # unclosed
    ("<think>steps</think> <answer>5</answer>", "think_answer", 1.0),
    ("steps</think><answer>5</answer>", "think_answer", 1.0),                   # <think> in the prompt
    ("<think></think><answer>5</answer>", "think_answer", 0.0),
    ("<think>a</think> b <answer>5</answer>", "think_answer", 0.0),
    (r"So the total is $\boxed{12}$.", "boxed", 1.0),
    (r"\boxed{12}", "boxed", 0.0),
    (r"Two: \boxed{1} \boxed{2}", "boxed", 0.0),
], ids=lambda v: v if isinstance(v, str) and len(v) < 12 else None)
def test_format_styles(text, style, expected):
    assert format_score(text, style) == expected


def test_format_custom_pattern_and_errors():
    assert format_score("Answer: 5", pattern=r"Answer: \d+") == 1.0
    assert format_score("Answer: five", pattern=r"Answer: \d+") == 0.0
    with pytest.raises(ValueError, match="rewards.format_pattern"):
        format_score("x", pattern="(")
    with pytest.raises(ValueError, match="rewards.format_style"):
        format_score("x", style="nope")
    big = "x" * 2_000_000 + "<answer>1</answer>"
    t = time.monotonic()
    assert format_score(big) == 1.0
    assert time.monotonic() - t < 1.0


# ------------------------------------------------------------------ accuracy via math-verify

EQUIVALENT = [
    ("<answer>1/2</answer>", "0.5"),
    ("<answer>0.5</answer>", r"\frac{1}{2}"),
    (r"<answer>\frac{1}{2}</answer>", "1/2"),
    (r"<answer>\dfrac12</answer>", r"$\frac{1}{2}$"),
    ("<answer>.5</answer>", r"\boxed{\frac12}"),
    (r"so the answer is \boxed{\frac{\sqrt{3}}{2}}", r"\frac{\sqrt{3}}{2}"),
    (r"\boxed{\dfrac{\sqrt{3}}{2}}", r"\boxed{\frac{\sqrt3}{2}}"),
    ("Total: 1,234 apples.\n#### 1,234", "1234"),
    ("<answer>1,234</answer>", "She has 1234 in all.\n#### 1,234"),
    ("<answer>x = 3</answer>", "3"),
    (r"<answer>2\sqrt{2}</answer>", r"\sqrt{8}"),
    (r"<answer>\{1,2\}</answer>", r"\{2,1\}"),
    (r"<answer>The answer is \boxed{7}.</answer>", "7"),
    (r"<answer>10\%</answer>", "0.1"),
    (r"<answer>18 \text{ dollars}</answer>", "18"),
]
WRONG = [
    ("<answer>0.51</answer>", "0.5"),
    ("<answer>2</answer>", "1/2"),
    ("<answer>-1/2</answer>", "1/2"),
    (r"<answer>\sqrt{2}</answer>", "2"),
    (r"\boxed{\frac{\sqrt{3}}{3}}", r"\frac{\sqrt{3}}{2}"),
    ("#### 1,235", "1234"),
]


def test_equivalent_forms_score_one_and_wrong_answers_zero(scorer):
    pairs = EQUIVALENT + WRONG
    batch = scorer([p for p, _ in pairs], [g for _, g in pairs])
    got = {p: (s, a) for (p, _), s, a in zip(pairs, batch.status, batch.accuracy.tolist())}
    assert {p: got[p] for p, _ in EQUIVALENT} == {p: ("ok", 1.0) for p, _ in EQUIVALENT}
    assert {p: got[p] for p, _ in WRONG} == {p: ("ok", 0.0) for p, _ in WRONG}
    assert batch.rewards.tolist() == batch.accuracy.tolist()  # default: accuracy only


def test_missing_answers_are_counted_and_rewards_combine(scorer):
    cfg = RewardConfig(timeout_s=2.0, accuracy_weight=1.0, format_weight=0.5, unparseable_penalty=-1.0)
    responses = ["Reasoning. <answer>4</answer>",   # right, well-formed      -> 1.5
                 "<answer>4</answer>",              # right, no reasoning     -> 1.0
                 "Reasoning. <answer>5</answer>",   # wrong, well-formed      -> 0.5
                 "I give up.",                      # no answer               -> -1.0
                 "Reasoning. <answer>{{</answer>"]  # unparseable, formatted  -> -0.5
    batch = score_batch(responses, ["4"] * 5, cfg, pool=scorer.pool)
    assert batch.status == ["ok", "ok", "ok", "no_answer", "parse_error"]
    assert batch.rewards.tolist() == [1.5, 1.0, 0.5, -1.0, -0.5]
    assert batch.format.tolist() == [1.0, 0.0, 1.0, 0.0, 1.0]
    assert batch.counts == {"ok": 3, "no_answer": 1, "parse_error": 1, "timeout": 0, "error": 0}
    m = batch.metrics()
    assert m["reward/no_answer"] == 1 and m["reward/accuracy"] == pytest.approx(0.4)
    assert batch.answers[3] is None and batch.answer_spans[3] is None
    s, e = batch.answer_spans[0]
    assert responses[0][s:e] == "4"


def test_answer_line_extractor_for_dapo_prompts(scorer):
    cfg = RewardConfig(extractors=["answer_tag", "answer_line"])
    batch = score_batch(["Work...\nAnswer: 34", "Work...\nAnswer: 35"], ["34", "34"], cfg,
                        pool=scorer.pool)
    assert batch.accuracy.tolist() == [1.0, 0.0]


def test_bad_inputs_raise_clear_errors(scorer):
    with pytest.raises(ValueError, match="2 responses but 1 references"):
        score_batch(["a", "b"], ["1"], pool=scorer.pool)
    with pytest.raises(TypeError, match=r"responses\[1\]"):
        score_batch(["a", None], ["1", "1"], pool=scorer.pool)
    for kwargs, needle in [({"timeout_s": 0}, "rewards.timeout_s"),
                           ({"batch_timeout_s": -1.0}, "rewards.batch_timeout_s"),
                           ({"num_workers": 0}, "rewards.num_workers"),
                           ({"extractors": ["boxed", "nope"]}, "rewards.extractors"),
                           ({"format_style": "nope"}, "rewards.format_style"),
                           ({"format_pattern": "("}, "rewards.format_pattern"),
                           ({"max_answer_chars": 0}, "rewards.max_answer_chars")]:
        with pytest.raises(ValueError, match=needle):
            RewardConfig(**kwargs).validate()
    with pytest.raises(ValueError, match="rewards.start_method"):
        VerifierPool(1, 1.0, start_method="fork")


def test_reward_config_is_an_omegaconf_schema():
    from omegaconf import OmegaConf

    merged = OmegaConf.merge(OmegaConf.structured(RewardConfig),
                             OmegaConf.from_dotlist(["extractors=[boxed]", "batch_timeout_s=30"]))
    cfg = OmegaConf.to_object(merged)
    assert isinstance(cfg, RewardConfig) and cfg.extractors == ["boxed"] and cfg.batch_timeout_s == 30.0
    cfg.validate()


# ------------------------------------------------------------------ hostile model output


def test_hostile_outputs_are_bounded_and_never_break_the_pool(scorer, tmp_path):
    marker = tmp_path / "pwned"
    payload = f"__import__('os').system('touch {marker}')"
    hostile = [
        ("Reasoning. <answer>9**9**9**9</answer>", "5"),
        (r"Reasoning. \boxed{9^{9^{9^{9}}}}", "5"),                  # sympy hangs: killed at 2 s
        ("<answer>" + "(" * 10_000 + "</answer>", "5"),              # deeper than any sane answer
        (r"\boxed{" + "(" * 5_000 + "}", "5"),
        (f"<answer>{payload}</answer>", "0"),
        (rf"\boxed{{{payload}}}", "0"),
        (f"#### 1\n<answer>eval(\"{payload}\")</answer>", "0"),
        ("x" * 1_000_000 + "<answer>5</answer>", "5"),               # a megabyte, right answer
        ("{" * 1_000_000, "5"),                                      # a megabyte of junk
        (r"\boxed{" * 200_000, "5"),
        ("<answer>" * 100_000 + "</answer>" * 3, "5"),
        ("\ud800 reasoning \x00 <answer>5</answer>", "5"),           # lone surrogate, NUL: still right
        ("<answer>\ud800\x00</answer>", "5"),
        ("<answer>\x00</answer>", "5"),
    ]
    restarts = scorer.pool.restarts
    t = time.monotonic()
    batch = scorer([r for r, _ in hostile], [g for _, g in hostile])
    elapsed = time.monotonic() - t
    assert elapsed < 12, f"hostile batch took {elapsed:.1f} s"
    assert not marker.exists(), "model output was executed"
    by_index = list(zip(batch.status, batch.rewards.tolist()))
    assert by_index[1] == ("timeout", 0.0)
    assert by_index[7] == ("ok", 1.0) and by_index[11] == ("ok", 1.0)
    for i, (status, reward) in enumerate(by_index):
        if i not in (7, 11):
            assert reward == 0.0 and status in ("no_answer", "parse_error", "timeout", "ok"), (i, status)
    assert batch.counts["timeout"] >= 1 and batch.worker_restarts >= 1
    assert scorer.pool.restarts > restarts
    after = scorer(["Reasoning. <answer>1/2</answer>"], ["0.5"])  # the pool still works
    assert after.status == ["ok"] and after.accuracy.tolist() == [1.0]


@pytest.mark.parametrize("text", [
    "####" + " " * 8000 + "x",                       # regex backtracking bait
    "Final answer" + " " * 8000 + "x",
    "\n".join(["*" * 80 + " answer"] * 100),
    "\\boxed{" * 2000, "{" * 8000, "<answer>" * 1000, "</answer>" * 1000,
    "\\fbox " * 1500,
], ids=["gsm8k_spaces", "answer_line_spaces", "answer_line_stars", "boxes", "braces", "opens",
        "closes", "fbox_spaces"])
def test_extraction_is_fast_on_pathological_text(text):
    t = time.monotonic()
    for _ in range(5):
        extract_answer(text, ["answer_tag", "boxed", "gsm8k", "answer_line"], tail_chars=8192)
        format_score(text)
    assert time.monotonic() - t < 1.0


def test_deep_nesting_that_reaches_the_worker_times_out_cleanly(scorer):
    cfg = RewardConfig(max_tail_chars=50_000, max_answer_chars=50_000, max_nesting=100_000)
    t = time.monotonic()
    batch = score_batch(["<answer>" + "(" * 10_000 + "</answer>", r"\boxed{" + "{" * 3000 + "1" + "}" * 3000 + "}"],
                        ["5", "1"], cfg, pool=scorer.pool)
    assert time.monotonic() - t < 8
    assert all(s in ("timeout", "parse_error", "error") for s in batch.status), batch.status
    assert batch.rewards.tolist() == [0.0, 0.0]
    assert scorer(["R. <answer>3</answer>"], ["3"]).accuracy.tolist() == [1.0]


# ------------------------------------------------------------------ pool: kill, replace, close


def test_timeout_kills_and_replaces_a_hung_worker():
    with VerifierPool(1, timeout_s=1.0, verifier="tests.test_rewards:sleepy_verify") as pool:
        (old,) = pool.pids
        t = time.monotonic()
        results = pool.map([("hang", "x"), ("3", "3"), ("raise", "x"), ("crash", "x"), ("4", "5"),
                            ("hog", "x")])
        assert time.monotonic() - t < 6
        assert [r.status for r in results] == ["timeout", "ok", "error", "error", "ok", "error"]
        assert [r.correct for r in results] == [False, True, False, False, False, False]
        assert "RuntimeError: verifier bug" in results[2].detail
        assert "died" in results[3].detail
        assert "MemoryError" in results[5].detail
        assert pool.restarts == 2  # one for the hang, one for the crash
        (new,) = pool.pids
        assert new != old and _gone(old), "the hung worker is still alive (or a zombie)"
        pids = pool.pids
    assert all(_gone(p) for p in pids), "workers left after close()"
    with pytest.raises(RuntimeError, match="closed"):
        pool.map([("1", "1")])


def test_batch_budget_bounds_a_whole_call():
    with VerifierPool(1, timeout_s=1.0, verifier="tests.test_rewards:sleepy_verify") as pool:
        t = time.monotonic()
        results = pool.map([("hang", "x"), ("hang", "x"), ("a", "a")], budget_s=1.5)
        assert time.monotonic() - t < 4
        assert [r.status for r in results] == ["timeout"] * 3
        assert "budget" in results[1].detail and "not started" in results[2].detail
        assert pool.map([("a", "a")])[0].correct  # fresh workers after the kills


@pytest.mark.slow
def test_spawn_start_method_and_close_reaps_children():
    pool = VerifierPool(2, timeout_s=1.0, verifier="tests.test_rewards:sleepy_verify",
                        start_method="spawn")
    first = pool.pids
    results = pool.map([("hang", "x"), ("a", "a")])
    assert [r.status for r in results] == ["timeout", "ok"]
    pids = pool.pids
    pool.close()
    pool.close()  # idempotent
    assert all(_gone(p) for p in set(first) | set(pids))
    import multiprocessing
    assert not [c for c in multiprocessing.active_children() if c.pid in set(first) | set(pids)]


def test_bad_verifier_fails_at_start_naming_the_field():
    with pytest.raises(RuntimeError, match="rewards.verifier"):
        VerifierPool(1, 1.0, verifier="tests.test_rewards:no_such_function")
    with pytest.raises(ValueError, match="rewards.verifier"):
        RewardConfig(verifier="not a spec").make_pool()
