"""Outcome-probe planning: answer spans to token positions, warm-up, fallback, scored tokens."""

from pathlib import Path

import pytest
import torch

from megatron_oar.attribution import AttributionConfig, ProbeConfig, SequenceBatch, locate_probes
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
    ("it is 42", r"is (\d+)", " 42"),  # " 42" is one token
])
def test_span_finder_maps_to_tokens(tok, text, pattern, answer):
    ids = tok.encode(text)
    finder = SpanFinder(tok, pattern or "<answer>(.*?)</answer>")
    k0, k1 = finder(ids)
    assert tok.decode(ids[k0:k1]) == answer  # the tokens holding the answer, nothing more
    t0, *span = finder.locate(ids)
    assert span == [k0, k1] and t0 <= k0
    # the reasoning ends where the opening tag (the whole match) starts; a token holding both
    # reasoning text and the tag's first character (" <" here) belongs to the tag
    reasoning = {"12": "12 + 3 is 15.", "x ": "x", "so": "so ", "it": "it "}[text[:2]]
    assert tok.decode(ids[:t0]) == reasoning


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
    sites = locate_probes(batch, ProbeConfig(kind="answer_mean"), finder=SpanFinder(tok))
    assert sites.kinds == ["answer_mean", "last_token", "none"]
    p0, resp = int(batch.prompt_lens[0]), batch.response_ids(0)
    t0, k0, k1 = SpanFinder(tok).locate(resp)
    # row 0: the positions that predict the answer tokens, and their targets
    sel = sites.row == 0
    assert sites.pos[sel].tolist() == list(range(p0 + k0 - 1, p0 + k1 - 1))
    assert tok.decode(sites.target[sel].tolist()) == "3"
    # scored: the reasoning before the opening tag; the tag, the span and after keep weight 1
    assert sites.score_mask[0].nonzero().flatten().tolist() == list(range(p0, p0 + t0))
    assert tok.decode(batch.tokens[0][sites.score_mask[0]].tolist()) == "1 + 2 is 3."
    # row 1: no answer (and no EOS) -> last_token at the final position; it scores the tokens
    # before it, not the probe position itself
    end = int(batch.lengths[1])
    assert sites.pos[sites.row == 1].tolist() == [end - 1]
    assert sites.score_mask[1].nonzero().flatten().tolist() == list(range(int(batch.prompt_lens[1]), end - 1))
    # row 2: only the "<answer>" tag comes before the span: nothing to score
    assert not sites.score_mask[2].any() and not (sites.row == 2).any()
    # an answer that opens the response leaves nothing to score
    opening = locate_probes(batch, ProbeConfig(answer_pattern=r"^(\d+)"), finder=SpanFinder(tok, r"^(\d+)"))
    assert opening.kinds[0] == "none" and not opening.score_mask[0].any()
    assert opening.kinds == ["none", "none", "last_token"]  # rows 0, 1 start with a number
    assert opening.scored_rows().tolist() == [False, False, True]


def test_uniform_mode_warmup_and_last_token(tok):
    batch = batch_of(tok, PAIRS)
    finder = SpanFinder(tok)
    uniform = locate_probes(batch, ProbeConfig(kind="answer_joint", no_answer="uniform"), finder=finder)
    assert uniform.kinds == ["answer_joint", "none", "none"]
    assert not uniform.score_mask[1].any()
    warm = locate_probes(batch, ProbeConfig(kind="answer_mean", warmup_steps=5), step=4, finder=finder)
    assert warm.kinds == ["last_token", "last_token", "none"]
    after = locate_probes(batch, ProbeConfig(kind="answer_mean", warmup_steps=5), step=5, finder=finder)
    assert after.kinds[0] == "answer_mean"
    last = locate_probes(batch, ProbeConfig(kind="last_token"))  # no tokenizer needed
    assert last.kinds == ["last_token"] * 3  # without a finder: the last token of each row
    assert last.pos.tolist() == (batch.lengths - 1).tolist()
    assert last.score_mask.sum() == int((batch.lengths - batch.prompt_lens - 1).sum())
    with pytest.raises(ValueError, match="needs a tokenizer"):
        locate_probes(batch, ProbeConfig(kind="answer_mean"))


EOS = "<|endoftext|>"
LT_PAIRS = [("1 + 2 = ", f"1 + 2 is 3. <answer>3</answer>{EOS}"),  # answer, then EOS
            ("5 + 5 = ", f"5 + 5 is 10.{EOS}"),                     # no answer, EOS
            ("7 + 1 = ", "7 + 1 is 8"),                              # no answer, stopped by a string
            ("2 + 2 = ", "2 + 2 is 4. <answer>4</answer> and 4 and")]  # answer, then cut at the limit


@pytest.mark.parametrize("cfg,step", [(ProbeConfig(kind="last_token"), 0),
                                      (ProbeConfig(kind="answer_mean", warmup_steps=2), 1)],
                         ids=["last_token", "warmup"])
def test_last_token_reads_where_the_answer_is_predicted(tok, cfg, step):
    """LT-Logits reads the distribution that predicts the answer (the last token of the opening
    tag), else the one at the last content token (it predicts EOS), never the one after EOS."""
    batch = batch_of(tok, LT_PAIRS)
    sites = locate_probes(batch, cfg, step, finder=SpanFinder(tok))
    assert sites.kinds == ["last_token"] * 4
    assert sites.row.tolist() == [0, 1, 2, 3]  # one position per row
    # row 1 ends with EOS: read at "." (the distribution that predicts EOS), score before it
    end = int(batch.lengths[1])
    assert sites.pos[1] == end - 2 and int(sites.target[1]) == tok.eos_token_id
    assert tok.decode(batch.tokens[1][sites.score_mask[1]].tolist()) == "5 + 5 is 10"
    for i in (0, 3):  # before the answer span: its target is the answer's first token
        assert tok.decode([int(sites.target[i])]) == {0: "3", 3: "4"}[i]
        reasoning = {0: "1 + 2 is 3.", 3: "2 + 2 is 4."}[i]
        assert tok.decode(batch.tokens[i][sites.score_mask[i]].tolist()) == reasoning
        start, (_, k0, _) = int(batch.prompt_lens[i]), SpanFinder(tok).locate(batch.response_ids(i))
        assert sites.pos[i] == start + k0 - 1
    # row 2 has no EOS (a stop string ended it): its last token is the last content token
    assert sites.pos[2] == int(batch.lengths[2]) - 1
    assert tok.decode(batch.tokens[2][sites.score_mask[2]].tolist()) == "7 + 1 is"
    # EOS ids can be given explicitly (no finder: no answer spans, every row falls back)
    bare = locate_probes(batch, ProbeConfig(kind="last_token"), eos_ids=[tok.eos_token_id])
    assert bare.pos[1] == end - 2 and bare.pos[0] == int(batch.lengths[0]) - 2


def test_truncated_rows_are_not_read_at_the_cut(tok):
    """A response cut at the length limit has no last content token: without an answer it is
    not scored; with one, the answer's probe is read as usual."""
    rows = [tok.encode(p) + tok.encode(r) for p, r in LT_PAIRS]
    base = batch_of(tok, LT_PAIRS)
    batch = SequenceBatch(base.tokens, base.prompt_lens, base.lengths,
                          truncated=torch.tensor([False, False, True, True]))
    assert len(rows) == batch.size
    for cfg in (ProbeConfig(kind="last_token"), ProbeConfig(kind="answer_mean")):
        sites = locate_probes(batch, cfg, finder=SpanFinder(tok))
        assert sites.kinds[2] == "none" and not sites.score_mask[2].any() and not (sites.row == 2).any()
        assert sites.kinds[3] == cfg.kind and sites.score_mask[3].any()
        assert sites.kinds[1] == "last_token"
    with pytest.raises(ValueError, match="truncated"):
        SequenceBatch(base.tokens, base.prompt_lens, base.lengths, truncated=torch.tensor([True]))


@pytest.mark.parametrize("kind", ["last_token", "answer_mean", "answer_joint"])
@pytest.mark.parametrize("pattern", [None, "boxed", r"is (\d+)"])
def test_scored_tokens_are_reasoning_only(tok, kind, pattern):
    """No probe position and no token of the opening tag or the answer is ever scored."""
    pairs = LT_PAIRS + PAIRS + [("3 + 3 = ", "so \\boxed{6} ok"), ("4 + 1 = ", "it is 5")]
    batch = batch_of(tok, pairs)
    finder = SpanFinder(tok, pattern) if pattern else SpanFinder(tok)
    sites = locate_probes(batch, ProbeConfig(kind=kind, answer_pattern=finder.pattern), finder=finder)
    assert not sites.score_mask[sites.row, sites.pos].any()  # never a probe position
    for i in range(batch.size):
        found = finder.locate(batch.response_ids(i))
        scored = sites.score_mask[i].nonzero().flatten()
        if found is not None and len(scored):
            assert int(scored.max()) < int(batch.prompt_lens[i]) + found[0]  # before the tag
        if sites.kinds[i] != "none":
            assert int(sites.pos[sites.row == i].min()) >= int(scored.max()) + 1


def test_take_renumbers_rows(tok):
    sites = locate_probes(batch_of(tok, PAIRS), ProbeConfig(), finder=SpanFinder(tok))
    sub = sites.take([1, 0, 0])
    assert sub.kinds == ["last_token", "answer_mean", "answer_mean"]
    assert sub.pos[sub.row == 0].tolist() == sites.pos[sites.row == 1].tolist()
    assert sub.pos[sub.row == 2].tolist() == sites.pos[sites.row == 0].tolist()
    assert torch.equal(sub.score_mask[2], sites.score_mask[0])


@pytest.mark.parametrize("kwargs", [dict(method="oar_x"), dict(sigma=0.0), dict(micro_batch_size=0),
                                    dict(probe=dict(kind="middle")), dict(probe=dict(no_answer="skip"))])
def test_config_errors(kwargs):
    with pytest.raises(ValueError):
        AttributionConfig(**kwargs)


def test_batch_validation():
    with pytest.raises(ValueError, match="prompt_len"):
        SequenceBatch(torch.zeros(1, 4, dtype=torch.long), torch.tensor([3]), torch.tensor([5]))
