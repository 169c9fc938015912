"""Outcome-probe planning: answer spans to token positions, warm-up, fallback, scored tokens."""

from pathlib import Path

import pytest
import torch

from megatron_oar.attribution import AttributionConfig, ProbeConfig, SequenceBatch, plan_probes
from megatron_oar.attribution.spans import SpanFinder, find_answer_chars
from megatron_oar.models.tiny import make_tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("tok")
    make_tokenizer(Path(path))
    return AutoTokenizer.from_pretrained(str(path))


@pytest.mark.parametrize("text,pattern,answer", [
    ("so <answer>15</answer>", None, "15"),
    ("<answer>1</answer> then <answer> 2 </answer>", None, "2"),  # last one wins, spaces stripped
    ("a \\boxed{\\frac{1}{2}} b", "boxed", "\\frac{1}{2}"),
    ("\\boxed{1} and \\fbox{x^{2}}", "boxed", "x^{2}"),
    ("Answer: 42\n", r"Answer:\s*(\S+)", "42"),
    ("no answer here", None, None),
    ("<answer>   </answer>", None, None),
    ("\\boxed{unclosed", "boxed", None),
])
def test_find_answer_chars(text, pattern, answer):
    span = find_answer_chars(text, pattern) if pattern else find_answer_chars(text)
    assert (text[span[0]:span[1]] if span else None) == answer


def test_bad_pattern_is_named():
    with pytest.raises(ValueError, match="answer_pattern"):
        find_answer_chars("x", "(unclosed")
    with pytest.raises(ValueError, match="needs a group"):
        find_answer_chars("x", "<answer>")


@pytest.mark.parametrize("text,pattern,answer", [
    ("12 + 3 is 15. <answer>15</answer>", None, "15"),
    ("x <answer> 7 </answer>", None, " 7"),
    ("so \\boxed{\\frac{1}{2}} done", "boxed", "\\frac{1}{2}"),
])
def test_span_finder_maps_to_tokens(tok, text, pattern, answer):
    ids = tok.encode(text)
    k0, k1 = SpanFinder(tok, pattern or "<answer>(.*?)</answer>")(ids)
    assert tok.decode(ids[k0:k1]) == answer  # the tokens holding the answer, nothing more


def batch_of(tok, pairs):
    rows = [(tok.encode(p), tok.encode(r)) for p, r in pairs]
    length = max(len(p) + len(r) for p, r in rows) + 2  # right padding
    tokens = torch.full((len(rows), length), tok.pad_token_id)
    for i, (p, r) in enumerate(rows):
        tokens[i, :len(p) + len(r)] = torch.tensor(p + r)
    return SequenceBatch(tokens, torch.tensor([len(p) for p, _ in rows]),
                         torch.tensor([len(p) + len(r) for p, r in rows]))


PAIRS = [("1 + 2 = ", "1 + 2 is 3. <answer>3</answer>"), ("5 + 5 = ", "5 + 5 is 10."),
         ("2 + 2 = ", "<answer>4</answer>")]


def test_answer_mean_plan(tok):
    batch = batch_of(tok, PAIRS)
    plan = plan_probes(batch, ProbeConfig(kind="answer_mean"), finder=SpanFinder(tok))
    assert plan.kinds == ["answer_mean", "last_token", "answer_mean"]
    p0, resp = int(batch.prompt_lens[0]), batch.response_ids(0)
    k0, k1 = SpanFinder(tok)(resp)
    # row 0: the positions that predict the answer tokens, and their targets
    sel = plan.row == 0
    assert plan.pos[sel].tolist() == list(range(p0 + k0 - 1, p0 + k1 - 1))
    assert tok.decode(plan.target[sel].tolist()) == "3"
    # scored: the response before the answer span; the span and after keep weight 1
    assert plan.score_mask[0].nonzero().flatten().tolist() == list(range(p0, p0 + k0))
    # row 1: no answer -> last_token at the final position, every response token scored
    assert plan.pos[plan.row == 1].tolist() == [int(batch.lengths[1]) - 1]
    assert plan.score_mask[1].sum() == int(batch.lengths[1] - batch.prompt_lens[1])
    # row 2: only the "<answer>" tag tokens come before the span
    assert tok.decode(batch.tokens[2][plan.score_mask[2]].tolist()) == "<answer>"
    # an answer that opens the response leaves nothing to score
    opening = plan_probes(batch, ProbeConfig(answer_pattern=r"^(\d+)"), finder=SpanFinder(tok, r"^(\d+)"))
    assert opening.kinds[0] == "none" and not opening.score_mask[0].any()
    assert opening.kinds == ["none", "none", "last_token"]  # rows 0, 1 start with a number
    assert opening.scored_rows().tolist() == [False, False, True]


def test_uniform_mode_warmup_and_last_token(tok):
    batch = batch_of(tok, PAIRS)
    finder = SpanFinder(tok)
    uniform = plan_probes(batch, ProbeConfig(kind="answer_joint", no_answer="uniform"), finder=finder)
    assert uniform.kinds == ["answer_joint", "none", "answer_joint"]
    assert not uniform.score_mask[1].any()
    warm = plan_probes(batch, ProbeConfig(kind="answer_mean", warmup_steps=5), step=4, finder=finder)
    assert warm.kinds == ["last_token"] * 3
    after = plan_probes(batch, ProbeConfig(kind="answer_mean", warmup_steps=5), step=5, finder=finder)
    assert after.kinds[0] == "answer_mean"
    last = plan_probes(batch, ProbeConfig(kind="last_token"))  # no tokenizer needed
    assert last.score_mask.sum() == int((batch.lengths - batch.prompt_lens).sum())
    with pytest.raises(ValueError, match="needs a tokenizer"):
        plan_probes(batch, ProbeConfig(kind="answer_mean"))


def test_take_renumbers_rows(tok):
    plan = plan_probes(batch_of(tok, PAIRS), ProbeConfig(), finder=SpanFinder(tok))
    sub = plan.take([1, 0, 0])
    assert sub.kinds == ["last_token", "answer_mean", "answer_mean"]
    assert sub.pos[sub.row == 0].tolist() == plan.pos[plan.row == 1].tolist()
    assert sub.pos[sub.row == 2].tolist() == plan.pos[plan.row == 0].tolist()
    assert torch.equal(sub.score_mask[2], plan.score_mask[0])


@pytest.mark.parametrize("kwargs", [dict(method="oar_x"), dict(sigma=0.0), dict(micro_batch_size=0),
                                    dict(probe=dict(kind="middle")), dict(probe=dict(no_answer="skip"))])
def test_config_errors(kwargs):
    with pytest.raises(ValueError):
        AttributionConfig(**kwargs)


def test_batch_validation():
    with pytest.raises(ValueError, match="prompt_len"):
        SequenceBatch(torch.zeros(1, 4, dtype=torch.long), torch.tensor([3]), torch.tensor([5]))
