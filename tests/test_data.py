"""Data: readers for each dataset format (good and malformed rows, skip and strict), templates,
the synthetic arithmetic task (its answers verify with the reward function), the prompt sampler."""

from __future__ import annotations

import copy
import json
import logging
import random
import re
from fractions import Fraction
from pathlib import Path

import pytest

from megatron_oar.data import (
    PRESETS,
    TEMPLATES,
    ArithmeticConfig,
    DataError,
    Example,
    FieldMap,
    PromptSampler,
    build_messages,
    detect_preset,
    make_arithmetic,
    read_examples,
    readers,
    render_prompt,
    write_jsonl,
)

QWEN_LIKE_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def write_jsonl_rows(path: Path, rows: list) -> Path:
    """Rows are dicts (dumped as JSON) or raw strings (written as is, e.g. broken JSON)."""
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from megatron_oar.models.tiny import make_tokenizer

    out = tmp_path_factory.mktemp("tok")
    make_tokenizer(out)
    return AutoTokenizer.from_pretrained(str(out))


@pytest.fixture(scope="module")
def chat_tokenizer(tokenizer):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = QWEN_LIKE_CHAT_TEMPLATE
    return tok


# ------------------------------------------------------------------ record formats

DAPO = {"data_source": "math_dapo", "ability": "MATH",
        "prompt": [{"role": "user", "content": "Solve: what is 6 * 7?"}],
        "reward_model": {"ground_truth": "42", "style": "rule-lighteval/MATH_v2"},
        "extra_info": {"index": "a1b2"}}
MATH500 = {"problem": r"What is $\frac{1}{2} + \frac{1}{4}$?", "answer": r"\frac{3}{4}",
           "solution": r"... so $\boxed{\frac{3}{4}}$.", "subject": "Algebra", "level": 1,
           "unique_id": "test/algebra/1.json"}
GSM8K = {"question": "Tom has 1,000 apples and buys 234 more. How many?",
         "answer": "Tom has 1000 + 234 = <<1000+234=1234>>1234 apples.\n#### 1,234"}
AIME24 = {"id": 60, "problem": "Find the remainder when 2024 is divided by 1000.", "solution": "24",
          "answer": 24, "url": "https://example.invalid", "year": "2024"}
AIME25 = {"Problem": "Find the sum of all integer bases $b>9$ ...", "Answer": "70", "ID": "2025-I-1"}
AMC23 = {"id": 0, "question": "What is 3^3?", "answer": 27.0, "url": "https://example.invalid"}


@pytest.mark.parametrize("record,preset,detected,prompt,answer", [
    (DAPO, "dapo", "dapo", "Solve: what is 6 * 7?", "42"),
    (MATH500, "math500", "math500", MATH500["problem"], r"\frac{3}{4}"),
    (GSM8K, "gsm8k", "gsm8k", GSM8K["question"], "1234"),
    # AIME 2024 has MATH500's keys (problem/answer/solution); both presets map them the same way.
    (AIME24, "aime2024", "math500", AIME24["problem"], "24"),
    (AIME25, "aime2025", "aime", AIME25["Problem"], "70"),
    (AMC23, "amc23", "amc23", "What is 3^3?", "27"),
], ids=["dapo", "math500", "gsm8k", "aime2024", "aime2025", "amc23"])
def test_each_format_reads_with_auto_detection_and_its_preset(tmp_path, caplog, record, preset,
                                                               detected, prompt, answer):
    path = write_jsonl_rows(tmp_path / f"{preset}.jsonl", [record, record])
    assert detect_preset(record) == detected
    with caplog.at_level(logging.INFO, logger="megatron_oar.data.readers"):
        examples, stats = read_examples(path)
    assert f"detected dataset format {detected!r}" in caplog.text
    assert stats.presets == {str(path): f"{detected} (auto)"}
    source = "math_dapo" if preset == "dapo" else path.name
    assert examples == [Example(prompt, answer, source, 0), Example(prompt, answer, source, 1)]
    assert (stats.rows, stats.kept, stats.malformed, stats.too_long) == (2, 2, 0, 0)
    explicit, stats = read_examples(path, fields=preset)
    assert explicit == examples and stats.presets == {str(path): preset}


def test_hendrycks_math_solution_boxed_and_custom_field_maps(tmp_path):
    path = write_jsonl_rows(tmp_path / "math.jsonl", [{"problem": "p", "solution": r"so \boxed{\frac{1}{2}}."}])
    (ex,), _ = read_examples(path, fields="math")
    assert ex.answer == r"\frac{1}{2}"
    nested = {"data": {"messages": [{"role": "system", "content": "sys"},
                                    {"role": "user", "content": "q1"}]},
              "meta": {"gold": None, "alt_gold": "7"}, "origin": "mine"}
    path = write_jsonl_rows(tmp_path / "custom.jsonl", [nested])
    fmap = FieldMap(prompt="data.messages", answer="meta.gold|meta.alt_gold", source="origin")
    (ex,), stats = read_examples(path, fields=fmap)
    assert ex == Example("q1", "7", "mine", 0) and stats.presets[str(path)] == "custom"
    fmap = FieldMap(prompt="data.messages.1.content", answer="meta.alt_gold")
    (ex,), _ = read_examples(path, fields=fmap, source="override")
    assert (ex.prompt, ex.source) == ("q1", "override")


def test_json_array_files_and_multiple_files(tmp_path):
    arr = tmp_path / "aime.json"
    arr.write_text(json.dumps([AIME25, {"Problem": "p"}]))
    lines = write_jsonl_rows(tmp_path / "amc.jsonl", [AMC23])
    examples, stats = read_examples([arr, lines])
    assert [e.answer for e in examples] == ["70", "27"]
    assert stats.malformed == 1 and stats.messages == [f"{arr} item 1: missing field 'answer|Answer'"]
    assert set(stats.presets.values()) == {"aime (auto)", "amc23 (auto)"}


# ------------------------------------------------------------------ malformed rows

BAD_ROWS = [
    MATH500,                                            # line 1: fine
    '{"problem": "broken", "answer": ',                 # line 2: bad JSON
    {"problem": "no answer here"},                      # line 3: missing field
    "",                                                 # line 4: blank, ignored
    {"problem": "empty", "answer": "   "},              # line 5: empty answer
    {"problem": "wrong type", "answer": [1, 2]},        # line 6: wrong type
    {"problem": 12, "answer": "1"},                     # line 7: prompt not a string
    {"problem": "bool", "answer": True},                # line 8: bool is not an answer
    [1, 2, 3],                                          # line 9: not an object
    {"problem": "fine too", "answer": 3},               # line 10: fine
]


def test_malformed_rows_are_skipped_with_counted_warnings(tmp_path, caplog):
    path = write_jsonl_rows(tmp_path / "bad.jsonl", BAD_ROWS)
    with caplog.at_level(logging.WARNING, logger="megatron_oar.data.readers"):
        examples, stats = read_examples(path, fields="math500")
    assert [e.prompt for e in examples] == [MATH500["problem"], "fine too"]
    assert [e.index for e in examples] == [0, 8]  # position among the file's records
    assert (stats.rows, stats.kept, stats.malformed) == (9, 2, 7)
    expected = [f"{path}:2: invalid JSON", f"{path}:3: missing field 'answer'",
                f"{path}:5: field 'answer' is empty", f"{path}:6: field 'answer' must be a string",
                f"{path}:7: field 'problem' must be a string", f"{path}:8: field 'answer' must be",
                f"{path}:9: record is a list"]
    assert len(stats.messages) == len(expected)
    for message, start in zip(stats.messages, expected):
        assert message.startswith(start), (message, start)
        assert message in caplog.text


def test_many_malformed_rows_log_a_total_and_limit_stops_early(tmp_path, caplog):
    path = write_jsonl_rows(tmp_path / "many.jsonl", [{"problem": f"p{i}"} for i in range(25)] + [MATH500])
    with caplog.at_level(logging.WARNING, logger="megatron_oar.data.readers"):
        examples, stats = read_examples(path, fields="math500")
    assert len(examples) == 1 and stats.malformed == 25 and len(stats.messages) == 20
    assert "25 malformed records skipped in all (20 shown)" in caplog.text
    good = write_jsonl_rows(tmp_path / "good.jsonl", [MATH500] * 5)
    examples, stats = read_examples(good, limit=2)
    assert len(examples) == 2 and stats.kept == 2


@pytest.mark.parametrize("rows,needle", [
    (BAD_ROWS, ":2: invalid JSON"),
    ([MATH500, {"problem": "x"}], ":2: missing field 'answer'"),
    ([MATH500, {"problem": "x", "answer": ""}], ":2: field 'answer' is empty"),
    ([{"question": "q", "answer": "no final number"}], ":1: field 'answer' has no '#### <number>'"),
])
def test_strict_mode_raises_naming_file_line_and_field(tmp_path, rows, needle):
    path = write_jsonl_rows(tmp_path / "bad.jsonl", rows)
    fields = "gsm8k" if "####" in needle else "math500"
    with pytest.raises(DataError) as exc:
        read_examples(path, fields=fields, strict=True)
    assert str(path) + needle in str(exc.value) and "strict" in str(exc.value)


def test_reader_errors_name_the_problem(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        read_examples(tmp_path / "missing.jsonl")
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(DataError, match="unsupported file type"):
        read_examples(tmp_path / "x.csv")
    path = write_jsonl_rows(tmp_path / "odd.jsonl", [{"foo": 1}])
    with pytest.raises(DataError, match=r"odd.jsonl:1 \(first record, fields='auto'\): cannot detect"):
        read_examples(path)
    with pytest.raises(DataError, match="unknown dataset preset 'nope'"):
        read_examples(path, fields="nope")
    with pytest.raises(ValueError, match="needs a tokenizer"):
        read_examples(path, fields="math500", max_prompt_tokens=10)


# ------------------------------------------------------------------ Parquet


def _parquet_rows(path, rows):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.mark.parametrize("record,answer", [(DAPO, "42"), (MATH500, r"\frac{3}{4}"), (GSM8K, "1234"),
                                           (AIME25, "70"), (AMC23, "27")],
                         ids=["dapo", "math500", "gsm8k", "aime2025", "amc23"])
def test_parquet_each_format(tmp_path, record, answer):
    path = _parquet_rows(tmp_path / "d.parquet", [record, record])
    examples, stats = read_examples(path)
    assert [e.answer for e in examples] == [answer, answer] and stats.kept == 2


def test_parquet_malformed_rows_skip_and_strict(tmp_path):
    rows = [{"problem": "a", "answer": "1"}, {"problem": "b", "answer": None},
            {"problem": "c", "answer": ""}, {"problem": "d", "answer": "4"}]
    path = _parquet_rows(tmp_path / "bad.parquet", rows)
    examples, stats = read_examples(path, fields="math500")
    assert [e.answer for e in examples] == ["1", "4"] and [e.index for e in examples] == [0, 3]
    assert stats.messages == [f"{path} row 1: missing field 'answer'", f"{path} row 2: field 'answer' is empty"]
    with pytest.raises(DataError, match=re.escape(f"{path} row 1: missing field 'answer'")):
        read_examples(path, fields="math500", strict=True)


def test_parquet_without_pyarrow_says_so(tmp_path):
    try:
        import pyarrow  # noqa: F401
        pytest.skip("pyarrow is installed")
    except ImportError:
        pass
    (tmp_path / "d.parquet").write_bytes(b"PAR1")
    with pytest.raises(ImportError, match="needs pyarrow"):
        read_examples(tmp_path / "d.parquet")


def test_parquet_rows_are_named_by_row_index(tmp_path, monkeypatch):
    """The Parquet path's row naming and skipping, independent of pyarrow being installed."""
    path = tmp_path / "fake.parquet"
    path.write_bytes(b"PAR1")
    rows = [{"question": "q0", "answer": "5"}, {"question": "q1"}, {"question": "q2", "answer": "7"}]
    monkeypatch.setattr(readers, "_rows_parquet",
                        lambda p: ((f"{p} row {i}", r, None) for i, r in enumerate(rows)))
    examples, stats = read_examples(path, fields="amc23")
    assert [e.index for e in examples] == [0, 2]
    assert stats.messages == [f"{path} row 1: missing field 'answer|Answer'"]


# ------------------------------------------------------------------ length filter and templates


def test_over_long_prompts_are_filtered_and_counted(tmp_path, tokenizer, caplog):
    rows = [{"prompt": "Compute 1 + 2.", "answer": "3"},
            {"prompt": "Compute " + " + ".join(["1"] * 200) + ".", "answer": "200"}]
    path = write_jsonl_rows(tmp_path / "p.jsonl", rows)
    n_short = len(tokenizer(render_prompt(rows[0]["prompt"], "raw", tokenizer))["input_ids"])
    with caplog.at_level(logging.WARNING, logger="megatron_oar.data.readers"):
        examples, stats = read_examples(path, tokenizer=tokenizer, max_prompt_tokens=n_short, template="raw")
    assert [e.answer for e in examples] == ["3"]
    assert (stats.kept, stats.too_long, stats.malformed) == (1, 1, 0)
    assert "dropped 1 prompts longer than max_prompt_tokens" in caplog.text
    # The template counts: with the long answer_tag instruction the short prompt no longer fits.
    _, stats = read_examples(path, tokenizer=tokenizer, max_prompt_tokens=n_short, template="answer_tag")
    assert stats.too_long == 2


def test_templates_plain_and_chat(tokenizer, chat_tokenizer):
    assert set(TEMPLATES) >= {"answer_tag", "think_answer", "boxed", "raw"}
    plain = render_prompt("Compute 2 + 3.", "answer_tag", tokenizer)  # no chat template
    assert plain.endswith("User: Compute 2 + 3.\nAssistant:") and "<answer>" in plain
    assert render_prompt("Compute 2 + 3.", "raw") == "Compute 2 + 3."
    assert "\\boxed{}" in render_prompt("q", "boxed")
    chat = render_prompt("Compute 2 + 3.", "answer_tag", chat_tokenizer)
    assert chat.startswith("<|im_start|>system\nYou are a helpful assistant.")
    assert "<|im_start|>user\nCompute 2 + 3.<|im_end|>\n" in chat
    assert chat.endswith("<|im_start|>assistant\n")  # add_generation_prompt=True
    assert render_prompt("q", "raw", chat_tokenizer) == "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n"
    assert build_messages("q {x}", "boxed")[1] == {"role": "user", "content": "q {x}"}
    with pytest.raises(ValueError, match="data.template"):
        render_prompt("q", "nope")


# ------------------------------------------------------------------ synthetic arithmetic


def _reference_value(prompt: str) -> Fraction:
    """Independent check: Python's own precedence on Fractions (the text is ours, not a model's)."""
    expr = prompt.removeprefix("Compute ").removesuffix(".")
    assert re.fullmatch(r"[0-9+\-*/() ]+", expr)
    return eval(re.sub(r"\d+", lambda m: f"Fraction({m.group()})", expr), {"Fraction": Fraction})


def test_synthetic_is_deterministic_and_respects_its_knobs():
    a, b = make_arithmetic(50, seed=3), make_arithmetic(50, seed=3)
    assert a == b and a != make_arithmetic(50, seed=4)
    assert a[0].prompt.startswith("Compute ") and a[0].source == "synthetic/arithmetic"
    cfg = ArithmeticConfig(min_operands=3, max_operands=4, max_value=9, operators="+*")
    for ex in make_arithmetic(100, seed=0, cfg=cfg):
        nums = re.findall(r"\d+", ex.prompt)
        assert 3 <= len(nums) <= 4 and all(int(n) <= 9 for n in nums)
        assert set(re.findall(r"[-+*/]", ex.prompt)) <= {"+", "*"}
    with pytest.raises(ValueError, match="data.synthetic.operators"):
        make_arithmetic(1, cfg=ArithmeticConfig(operators="+^"))


def test_synthetic_answers_are_exact():
    cfg = ArithmeticConfig(max_operands=5, operators="+-*/", parentheses=True)
    examples = make_arithmetic(300, seed=1, cfg=cfg)
    assert any("(" in e.prompt for e in examples) and any("/" in e.answer for e in examples)
    for ex in examples:
        assert Fraction(ex.answer) == _reference_value(ex.prompt), ex


def test_synthetic_text_suits_the_tiny_tokenizer(tokenizer):
    for ex in make_arithmetic(20, seed=0):
        ids = tokenizer(ex.prompt, add_special_tokens=False)["input_ids"]
        assert tokenizer.decode(ids) == ex.prompt
        # Numbers up to max_value (20) are single tokens, as in the tokenizer's training corpus.
        for number in re.findall(r"\d+", ex.prompt):
            assert len(tokenizer.tokenize(" " + number)) == 1, number


@pytest.mark.slow
def test_synthetic_answers_verify_with_the_reward_function(tmp_path):
    from megatron_oar.rewards import RewardConfig, score_batch

    examples = make_arithmetic(40, seed=2, cfg=ArithmeticConfig(operators="+-*/", parentheses=True,
                                                                max_operands=4))
    # Through a file, as a run would read them.
    examples, _ = read_examples(write_jsonl(examples, tmp_path / "arith.jsonl"), fields="prompt_answer")
    right = [f"{e.prompt} Let me work it out. <answer>{e.answer}</answer>" for e in examples]
    wrong = [f"Work. <answer>{Fraction(e.answer) + 1}</answer>" for e in examples]
    batch = score_batch(right + wrong, [e.answer for e in examples] * 2,
                        RewardConfig(timeout_s=5.0, num_workers=2))
    assert batch.status == ["ok"] * 80
    assert batch.accuracy.tolist() == [1.0] * 40 + [0.0] * 40


# ------------------------------------------------------------------ sampler


def _prompts(batches):
    return [[e.prompt for e in b] for b in batches]


def test_sampler_epochs_cover_the_data_and_reshuffle():
    data = make_arithmetic(10, seed=0)
    s = PromptSampler(data, batch_size=4, seed=7, drop_last=False, max_epochs=2)
    batches = list(s)
    assert [len(b) for b in batches] == [4, 4, 2, 4, 4, 2] and len(s) == 3
    epoch0 = [e.index for b in batches[:3] for e in b]
    epoch1 = [e.index for b in batches[3:] for e in b]
    assert sorted(epoch0) == sorted(epoch1) == list(range(10)) and epoch0 != epoch1
    assert s.epoch == 2 and s.step == 6
    again = PromptSampler(data, batch_size=4, seed=7, drop_last=False, max_epochs=2)
    assert _prompts(again) == _prompts(batches)
    other = PromptSampler(data, batch_size=4, seed=8, drop_last=False, max_epochs=2)
    assert _prompts(other) != _prompts(batches)
    dropped = PromptSampler(data, batch_size=4, seed=7, max_epochs=1)
    assert [len(b) for b in dropped] == [4, 4] and len(dropped) == 2


def test_sampler_state_dict_resumes_exactly():
    data = make_arithmetic(23, seed=0)
    run = PromptSampler(data, batch_size=5, seed=1)
    for _ in range(6):  # into the second epoch (4 full batches per epoch)
        next(run)
    state = json.loads(json.dumps(run.state_dict()))  # survives a checkpoint round trip
    assert (state["epoch"], state["position"], state["step"]) == (1, 10, 6)
    expected = _prompts(next(run) for _ in range(10))
    resumed = PromptSampler(data, batch_size=5, seed=999)  # the seed comes from the state
    resumed.load_state_dict(state)
    assert _prompts(next(resumed) for _ in range(10)) == expected
    assert resumed.step == run.step == 16
    with pytest.raises(ValueError, match="num_examples=23"):
        PromptSampler(data[:20], batch_size=5).load_state_dict(state)
    with pytest.raises(ValueError, match="batch_size=5"):
        PromptSampler(data, batch_size=4).load_state_dict(state)
    with pytest.raises(ValueError, match="larger than the dataset"):
        PromptSampler(data[:3], batch_size=5)


def test_presets_cover_the_paper_datasets():
    assert {"dapo", "math500", "gsm8k", "aime2024", "aime2025", "amc23"} <= set(PRESETS)
    random.seed(0)  # the sampler must not depend on the global RNG
    a = _prompts(PromptSampler(make_arithmetic(8), 4, seed=1, max_epochs=1))
    random.seed(1)
    assert _prompts(PromptSampler(make_arithmetic(8), 4, seed=1, max_epochs=1)) == a


# ------------------------------------------------------------------ the chain task (OAR testbed)


def test_chain_stream_is_deterministic_lazy_and_random_access():
    from megatron_oar.data.chain import ChainConfig, ChainStream, chain_examples

    big = chain_examples(10**12, seed=3)  # nothing is generated until indexed
    assert len(big) == 10**12 and isinstance(big, ChainStream)
    first = [big[i] for i in range(30)]
    assert first == [chain_examples(10**12, seed=3)[i] for i in range(30)]  # same in any process
    assert first[7] == big[7] and big[-1] == big[10**12 - 1] and big[2:5] == first[2:5]
    assert [e.index for e in first] == list(range(30))
    assert first != [chain_examples(10**12, seed=4)[i] for i in range(30)]
    assert len({e.prompt for e in first}) == 30 and first[0].source == "synthetic/chain"
    with pytest.raises(IndexError):
        chain_examples(5)[5]
    with pytest.raises(ValueError, match="operators"):
        chain_examples(5, cfg=ChainConfig(operators="+*"))
    with pytest.raises(ValueError, match="split"):
        ChainStream(5, 0, ChainConfig(), split="test")


def test_chain_split_is_a_disjoint_hash_split():
    from megatron_oar.data.chain import chain_examples, is_heldout

    train = {e.prompt for s in (0, 1) for e in chain_examples(1500, seed=s, split="train")}
    held = {e.prompt for s in (0, 1) for e in chain_examples(500, seed=s, split="heldout")}
    assert not train & held and len(train) > 2900 and len(held) > 950
    assert not any(is_heldout(p) for p in train) and all(is_heldout(p) for p in held)
    everything = chain_examples(2000, seed=5, split="all")
    share = sum(is_heldout(e.prompt) for e in everything) / len(everything)
    assert 0.2 < share < 0.3  # one in heldout_every = 4


def test_chain_answers_are_exact_and_respect_the_knobs():
    from megatron_oar.data.chain import ChainConfig, chain_examples, expression_of, parse_prompt

    cfg = ChainConfig(min_steps=2, max_steps=5, max_start=30, max_operand=12, max_total=40)
    for ex in chain_examples(400, seed=1, cfg=cfg, split="all"):
        assert re.fullmatch(r"Compute \d+( (plus|minus) \d+)+\.", ex.prompt)
        assert Fraction(ex.answer) == _reference_value(f"Compute {expression_of(ex.prompt, cfg)}."), ex
        start, steps = parse_prompt(ex.prompt, cfg)
        assert 0 <= start <= 30 and 2 <= len(steps) <= 5
        total = start
        for op, b in steps:
            assert op in "+-" and 1 <= b <= 12
            total += b if op == "+" else -b
            assert 0 <= total <= 40  # running totals stay in range
    only_plus = ChainConfig(operators="+", min_steps=3, max_steps=3, max_total=99)
    assert all("minus" not in e.prompt for e in chain_examples(50, cfg=only_plus))


def test_chain_solution_labels_pivots_and_filler():
    from megatron_oar.data import chain as C

    cfg = C.ChainConfig()
    fillers = set(C.STARTS) | set(C.CONNECTIVES) | set(C.CONNECTIVE_EXTRAS) | set(C.VERBS) \
        | set(C.VERB_EXTRAS) | set(C.CLOSINGS)
    fillers |= {" " + p for p in C.STARTS + C.OPENERS}
    rng = random.Random(0)
    for ex in _chain_list(C, 200, cfg):
        seg = C.chain_segments(ex.prompt, rng, cfg)
        text = "".join(t for t, _ in seg)
        assert text.endswith(f" <answer>{ex.answer}</answer>")
        assert C.answer_from_solution(text) == int(ex.answer)
        start, steps = C.parse_prompt(ex.prompt, cfg)
        pivots = [t for t, k in seg if k == "pivot"]
        # start, then (operator word, operand, running total) per step
        assert len(pivots) == 1 + 3 * len(steps) and pivots[0] == str(start)
        assert pivots[-1] == ex.answer
        assert pivots[1::3] == [" " + C.OP_WORDS[op] for op, _ in steps]
        assert all(t in fillers for t, k in seg if k == "filler")
        assert {k for _, k in seg} == {"pivot", "filler", "format"}
        assert all(t.strip() in {"", ".", f"<answer>{ex.answer}</answer>"} for t, k in seg if k == "format")
    bare = C.ChainConfig(filler_rate=0.0)
    seg = C.chain_segments("Compute 5 plus 3 minus 2.", random.Random(1), bare)
    assert sum(k == "filler" for _, k in seg) == 1 + 2 * 2  # start phrase, connective + verb per step


def _chain_list(C, n, cfg):
    return list(C.chain_examples(n, seed=2, cfg=cfg, split="all"))


def test_chain_filler_substitution_leaves_the_answer_unchanged():
    """Swap any filler phrase for another of its synonyms: the solution still implies the same
    answer; change a pivot (an operand or an operator word) and it does not."""
    from megatron_oar.data import chain as C

    cfg = C.ChainConfig(filler_rate=1.0)
    sets = [C.STARTS, C.CONNECTIVES, C.CONNECTIVE_EXTRAS, C.VERBS, C.VERB_EXTRAS, C.CLOSINGS, C.OPENERS]
    checked = 0
    for ex in _chain_list(C, 30, cfg):
        seg = C.chain_segments(ex.prompt, random.Random(ex.index), cfg)
        for i, (text, kind) in enumerate(seg):
            if kind == "filler":
                options = next(s for s in sets if text in s or text.removeprefix(" ") in s)
                for other in options:
                    other = " " + other if text.startswith(" ") and not other.startswith(" ") else other
                    swapped = [t for t, _ in seg[:i]] + [other] + [t for t, _ in seg[i + 1:]]
                    assert C.answer_from_solution("".join(swapped)) == int(ex.answer)
                    checked += 1
            elif kind == "pivot" and i > 2 and seg[i - 2][0] in (" plus", " minus"):  # an operand
                bumped = [t for t, _ in seg[:i]] + [str(int(text) + 1)] + [t for t, _ in seg[i + 1:]]
                assert C.answer_from_solution("".join(bumped)) != int(ex.answer)
            elif text in (" plus", " minus"):
                flipped = " minus" if text == " plus" else " plus"
                swapped = [t for t, _ in seg[:i]] + [flipped] + [t for t, _ in seg[i + 1:]]
                assert C.answer_from_solution("".join(swapped)) != int(ex.answer)
    assert checked > 1000


def test_chain_task_through_make_arithmetic_and_the_sampler():
    """data.synthetic.task=chain: the trainer's calls (training draw with seed, eval draw with
    seed + 1) get the two sides of the split, lazily; the sampler indexes the stream in place."""
    from dataclasses import dataclass

    from megatron_oar.data.chain import ChainStream, is_heldout

    @dataclass
    class Synthetic(ArithmeticConfig):  # the shape of config.SyntheticConfig
        n: int = 10**9
        seed: int = 4
        eval_n: int = 50

    cfg = Synthetic(task="chain")
    train = make_arithmetic(cfg.n, cfg.seed, cfg)
    held = make_arithmetic(cfg.eval_n, cfg.seed + 1, cfg)
    assert isinstance(train, ChainStream) and (train.split, held.split) == ("train", "heldout")
    assert len(train) == 10**9 and all(is_heldout(e.prompt) for e in held)
    assert make_arithmetic(5, 0, cfg, split="all").split == "all"
    with pytest.raises(ValueError, match="split"):
        make_arithmetic(5, 0, ArithmeticConfig(), split="train")
    with pytest.raises(ValueError, match="data.synthetic.task"):
        make_arithmetic(5, 0, ArithmeticConfig(task="nope"))
    small = make_arithmetic(40, 0, Synthetic(task="chain"))
    s = PromptSampler(small, batch_size=8, seed=1)
    assert s.examples is small  # not copied into a list
    run = [next(s) for _ in range(7)]
    assert sorted(e.index for b in run[:5] for e in b) == list(range(40))
    resumed = PromptSampler(small, batch_size=8, seed=1)
    resumed.load_state_dict(json.loads(json.dumps(PromptSampler(small, 8, seed=1).state_dict())))
    assert _prompts([next(resumed) for _ in range(7)]) == _prompts(run)
    huge = PromptSampler(train, batch_size=16, seed=1, shuffle=False)
    assert [e.index for e in next(huge)] == list(range(16))


def test_chain_answers_verify_with_the_reward_function():
    from megatron_oar.data.chain import ChainConfig, chain_examples, chain_solution
    from megatron_oar.rewards import RewardConfig, score_batch

    examples = list(chain_examples(12, seed=6))
    right = [chain_solution(e.prompt, random.Random(e.index), ChainConfig()) for e in examples]
    wrong = [r.replace(f"<answer>{e.answer}</answer>", f"<answer>{int(e.answer) + 1}</answer>")
             for r, e in zip(right, examples)]
    batch = score_batch(right + wrong, [e.answer for e in examples] * 2,
                        RewardConfig(extractors=["answer_tag"], timeout_s=5.0, num_workers=1))
    assert batch.accuracy.tolist() == [1.0] * 12 + [0.0] * 12



def test_chain_carry_slip_is_a_sloppy_teacher():
    """carry_slip=1: every addition that carries is written without the carry, and the solution
    goes on from the written total; 0: the solution is right."""
    from megatron_oar.data import chain as C

    cfg = C.ChainConfig()
    seg = C.chain_segments("Compute 17 plus 5 minus 3.", random.Random(0), cfg, carry_slip=1.0)
    totals = [t for t, k in seg if k == "pivot" and t.isdigit()][2::2]  # after start, operand
    assert totals == ["12", "9"] and seg[-1][0] == " <answer>9</answer>"
    assert C.chain_solution("Compute 17 plus 5 minus 3.", random.Random(0), cfg).endswith(
        "<answer>19</answer>")
    wrong = 0
    for ex in _chain_list(C, 100, cfg):
        text = C.chain_solution(ex.prompt, random.Random(1), cfg, carry_slip=1.0)
        start, steps = C.parse_prompt(ex.prompt, cfg)
        total, carried = start, False
        for op, b in steps:
            carried |= op == "+" and total % 10 + b >= 10
            total = total + b if op == "+" else total - b
        assert text.endswith(f"<answer>{ex.answer}</answer>") != carried
        wrong += carried
    assert 0 < wrong < 100
