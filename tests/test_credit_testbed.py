"""The credit testbed (``tiny_credit_cpu.yaml``: the chain task with filler sentences after every
step, ``oar repro --grid credit``): its pivots are few, known by construction, and the only
tokens the answer depends on; its stream is deterministic with a disjoint held-out side; the
oracle-confirmation figures are computed as defined.

Cost: about 5 s (a tokenizer trained on 4000 solutions, 300 solutions tokenized); no model.
"""

from __future__ import annotations

import random
import re

import pytest

from megatron_oar import resources
from megatron_oar.data import chain as C


@pytest.fixture(scope="module")
def task():
    from megatron_oar.config import load_config

    return load_config(resources.path("tiny_credit_cpu.yaml")).data.synthetic


@pytest.fixture(scope="module")
def tokenizer(task, tmp_path_factory):
    from transformers import AutoTokenizer

    from megatron_oar.repro.demo_model import make_task_tokenizer

    return AutoTokenizer.from_pretrained(str(make_task_tokenizer(tmp_path_factory.mktemp("tok"), task=task)))


def _scored_tokens(tok, solution: str) -> list[str]:
    """The response's tokens before the answer tag (what the probe scores), decoded one by one."""
    ids = tok(solution, add_special_tokens=False)["input_ids"]
    pieces = [tok.decode([i]) for i in ids]
    assert "".join(pieces) == solution
    body, n = solution.split("<answer>")[0], 0
    while len("".join(pieces[:n + 1])) <= len(body) and n < len(pieces):
        n += 1
    return pieces[:n]


@pytest.mark.parametrize("slip", [0.0, 0.6])  # the correct teacher and the SFT start's sloppy one
def test_pivots_are_at_most_a_fifth_of_the_scored_tokens(task, tokenizer, slip):
    """Measured with the testbed's own tokenizer on 300 teacher solutions: operator words and
    numbers are at most 20% of the tokens before the answer tag (about 16% measured; the chain
    testbed about 30% by this measure, the oracle's 47% there counts flips on other tokens too)."""
    def share(cfg, n=300):
        pivots = scored = 0
        for ex in C.chain_examples(n, seed=11, cfg=cfg):
            flags = C.token_pivots(_scored_tokens(tokenizer, C.chain_solution(
                ex.prompt, random.Random(ex.index), cfg, carry_slip=slip)))
            pivots, scored = pivots + sum(flags), scored + len(flags)
        return pivots / scored

    credit = share(task.chain)
    print(f"pivot share, carry_slip {slip}: {credit:.3f}")
    assert credit <= 0.20, credit
    if slip == 0.0:  # the chain testbed, same tokenizer and measure (30% measured): fewer here
        chain = share(C.ChainConfig(max_total=49), 100)
        print(f"pivot share, chain testbed: {chain:.3f}")
        assert credit < chain


def test_constructed_labels_match_the_token_labels(task):
    """``pivot_spans`` (which labels any text, a model's too) finds exactly the ``pivot`` pieces
    of the teacher's solution; the asides hold no digit and no operator word."""
    assert not any(re.search(r"\d|\bplus\b|\bminus\b", a) for a in C.ASIDES)
    rng = random.Random(0)
    for ex in C.chain_examples(200, seed=4, cfg=task.chain, split="all"):
        seg = C.chain_segments(ex.prompt, rng, task.chain)
        spans, pos = [], 0
        for text, kind in seg:
            if kind == "pivot":
                s = pos + len(text) - len(text.lstrip())
                spans.append((s, pos + len(text)))
            pos += len(text)
        text = "".join(t for t, _ in seg)
        assert C.pivot_spans(text) == spans
        asides = sum(t in {a.rstrip(".") for a in C.ASIDES} for t, _ in seg)
        steps = len(C.parse_prompt(ex.prompt, task.chain)[1])
        assert task.chain.asides_min * steps <= asides <= task.chain.asides_max * steps
    assert C.token_pivots([" Take", " ", "1", "4", ".", " Now", " minus", " ", "5"]) == [
        False, False, True, True, False, False, True, False, True]


def test_the_answer_depends_on_the_pivots_only(task):
    """Drop or swap any aside: the answer the solution implies is unchanged; bump an operand and
    it changes. The reward reads the answer tag only (the chain testbed's verifier)."""
    cfg = task.chain
    checked = 0
    for ex in C.chain_examples(40, seed=5, cfg=cfg):
        seg = C.chain_segments(ex.prompt, random.Random(ex.index), cfg)
        texts = [t for t, _ in seg]
        for i, (text, kind) in enumerate(seg):
            if kind == "filler" and text in {a.rstrip(".") for a in C.ASIDES}:
                for other in ("", *(a.rstrip(".") for a in C.ASIDES)):
                    assert C.answer_from_solution("".join(texts[:i] + [other] + texts[i + 1:])) \
                        == int(ex.answer)
                    checked += 1
        operand = next(i for i, (t, k) in enumerate(seg) if k == "pivot" and seg[i - 2][0] in (" plus", " minus"))
        bumped = texts[:operand] + [str(int(texts[operand]) + 1)] + texts[operand + 1:]
        assert C.answer_from_solution("".join(bumped)) != int(ex.answer)
    assert checked > 500


def test_stream_is_deterministic_and_the_heldout_side_disjoint(task):
    cfg = task.chain
    first = [C.chain_examples(10**9, seed=3, cfg=cfg)[i] for i in range(50)]
    assert first == list(C.chain_examples(50, seed=3, cfg=cfg))
    sol = [C.chain_solution(e.prompt, random.Random(e.index), cfg) for e in first]
    assert sol == [C.chain_solution(e.prompt, random.Random(e.index), cfg) for e in first]
    train = {e.prompt for s in (0, 1) for e in C.chain_examples(1000, seed=s, cfg=cfg, split="train")}
    held = {e.prompt for s in (0, 1) for e in C.chain_examples(300, seed=s, cfg=cfg, split="heldout")}
    assert not train & held and len(held) > 550
    assert all(C.is_heldout(p, cfg.heldout_every) for p in held)
    with pytest.raises(ValueError, match="asides_min <= asides_max"):
        C.ChainConfig(asides_min=2, asides_max=1).validate()


def test_without_asides_the_chain_testbed_is_unchanged():
    """asides_max = 0 draws nothing more: the chain testbed's solutions stay what they were."""
    cfg = C.ChainConfig()
    ex = C.chain_examples(1, seed=0, cfg=cfg)[0]
    assert C.chain_solution(ex.prompt, random.Random(0), cfg) == \
        C.chain_solution(ex.prompt, random.Random(0), C.ChainConfig(asides_min=0, asides_max=0))
    assert not any(a.rstrip(".") in C.chain_solution(e.prompt, random.Random(1), cfg)
                   for e in C.chain_examples(50, seed=1, cfg=cfg) for a in C.ASIDES)


def test_confirmation_by_hand():
    from megatron_oar.eval.pivots import confirmation
    from megatron_oar.eval.records import TokenRecord

    tokens = [" Take", " ", "1", "4", ".", " Fine", " plus", " ", "5", " is", " ", "1", "9", ".",
              " <answer>", "19", "</answer>"]
    scored = [True] * 14 + [False] * 3
    oracle = [0, 0, 1, 1, 0, 1, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0]  # answer span: not counted
    rec = TokenRecord(id="a", prompt="Compute 14 plus 5.", reference="19", correct=True,
                      token_ids=list(range(17)), tokens=tokens, scored=scored, oracle=oracle)
    unlabelled = TokenRecord(id="b", prompt="p", reference="1", correct=True, token_ids=[0],
                             tokens=["1"])
    c = confirmation([rec, unlabelled])
    assert (c["trajectories"], c["scored_tokens"], c["pivots"], c["oracle_pivots"]) == (1, 14, 6, 4)
    assert c["pivot_share"] == pytest.approx(6 / 14) and c["oracle_share"] == pytest.approx(4 / 14)
    assert c["flip_rate_pivots"] == pytest.approx(3 / 6) and c["flip_rate_other"] == pytest.approx(1 / 8)
    assert c["oracle_on_pivots"] == pytest.approx(3 / 4)
    assert all(c[k] != c[k] for k in ("kept_share", "caused_share", "caused_on_pivots"))  # NaN: no control
    # with the control decode: a label counts as caused only where the kept token's own greedy
    # continuation verifies; here it fails at tokens 3 (a pivot) and 5 (filler, labelled)
    rec.kept_correct = [1, 1, 1, 0, 1, 0, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0]
    c = confirmation([rec])
    assert (c["controlled_tokens"], c["kept"], c["kept_pivots"], c["caused"]) == (14, 12, 5, 2)
    assert c["kept_share"] == pytest.approx(12 / 14) and c["caused_share"] == pytest.approx(2 / 14)
    assert c["caused_flip_rate_pivots"] == pytest.approx(2 / 5) and c["caused_flip_rate_other"] == 0.0
    assert c["caused_on_pivots"] == 1.0
