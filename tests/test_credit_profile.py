"""``oar analyze credit`` (eval/credit_profile.py) on hand-built credit records with known
answers: token kinds, the answer's copy source, the Figure 6 measures, the raw score at the
gate's threshold, the decision locus of a wrong chain solution and its recall; the trainer's
record rows (training/credit_records.py) from a hand-built batch.

Cost: under 2 s (no model, no process).
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from megatron_oar.algorithms import ShapingConfig, assign_credit
from megatron_oar.eval import credit_profile as P

PROMPT = "Compute 17 plus 5 minus 3."
# the correct solution: 17 plus 5 is 22, minus 3 is 19
RIGHT = [" Take", " 17", ".", " Now", " plus", " 5", " is", " 22", ".", " Then", " minus", " 3",
         " is", " 19", ".", " <answer>", "19", "</answer>"]
# a dropped carry: 12 instead of 22, then a correct copy of the wrong total
WRONG = [" Take", " 17", ".", " Now", " plus", " 5", " is", " 12", ".", " Then", " minus", " 3",
         " is", " 9", ".", " <answer>", "9", "</answer>"]


def _record(tokens, *, seq_adv, importance, accuracy, credit="oar_g", entropy=None, tau=0.4, beta=2.0):
    """A record as the trainer writes it: weights and advantages from assign_credit itself."""
    n = len(tokens)
    scored = [int("<answer>" not in t and t not in ("19", "9", "</answer>")) for t in tokens]
    imp = torch.tensor([importance], dtype=torch.float64)
    cfg = ShapingConfig(tau=tau, beta=beta)
    c = assign_credit(cfg, torch.tensor([seq_adv], dtype=torch.float64), torch.ones(1, n, dtype=torch.bool),
                      importance=imp, score_mask=torch.tensor([[bool(s) for s in scored]]))
    return {"step": 1, "index": 0, "credit": credit, "prompt": PROMPT, "reference": "19",
            "reward": accuracy, "accuracy": accuracy, "seq_adv": seq_adv,
            "token_ids": list(range(n)), "tokens": tokens, "loss_mask": [1] * n, "scored": scored,
            "importance": importance, "weights": c.weights[0].tolist(),
            "advantages": c.advantages[0].tolist(),
            "entropy": entropy if entropy is not None else [0.5] * n,
            "shaping": {"scheme": "oar", "tau": tau, "beta": beta, "tau_mode": "quantile",
                        "floor": 0.0, "eps": 1e-6}}


def test_chain_kinds_label_operators_operands_totals_and_the_final_total():
    kinds = P.token_kinds(RIGHT, "chain")
    assert kinds == ["filler", "total", "format", "filler", "operator", "operand", "filler", "total",
                     "format", "filler", "operator", "operand", "filler", "final_total", "format",
                     "answer", "answer", "answer"]


def test_generic_kinds():
    assert P.token_kinds(["x", " =", " 3", ".", " ", "<answer>", "3"], "generic") == [
        "words", "operators", "digits", "punctuation", "space", "answer", "answer"]


def test_restated_tokens_are_the_last_copy_of_the_answer_before_the_tag():
    flags = P.restated_tokens(RIGHT)
    assert [t for t, f in zip(RIGHT, flags) if f] == [" 19"]
    # "9" must match a whole number: not the 9 inside " 19"
    toks = [" Take", " 19", " minus", " 10", " is", " 9", ".", " <answer>", "9", "</answer>"]
    assert [t for t, f in zip(toks, P.restated_tokens(toks)) if f] == [" 9"]
    assert not any(P.restated_tokens([" no", " answer", " here"]))


def test_first_wrong_char_finds_the_dropped_carry():
    text = "".join(WRONG)
    pos, why = P.first_wrong_char(PROMPT, text)
    assert why == "pivot" and text[pos] == "1" and text[pos - 1] == " "  # the " 12"'s first digit
    assert P.token_at(WRONG, pos) == 7
    assert P.first_wrong_char(PROMPT, "".join(RIGHT)) == (None, "correct")
    right_steps_wrong_copy = "".join(RIGHT[:15]) + " <answer>18</answer>"
    assert P.first_wrong_char(PROMPT, right_steps_wrong_copy) == (None, "answer")
    assert P.first_wrong_char(PROMPT, " Take 17. Now plus 5 is 22. <answer>22</answer>") == (None, "early_end")
    # a prefix of the right number: the wrong character is the one after it
    pos, _ = P.first_wrong_char(PROMPT, " Take 17. Now plus 5 is 2. <answer>2</answer>")
    assert " Take 17. Now plus 5 is 2. <answer>2</answer>"[pos] == "."


def test_profile_on_hand_built_records():
    # the final total gets by far the largest importance, filler tiny values
    n = len(RIGHT)
    imp = [1e-6] * n
    imp[13] = 6.0  # " 19": the final total
    for i in (1, 4, 5, 7, 10, 11):
        imp[i] = 0.3
    for i in (15, 16, 17):
        imp[i] = 0.0
    good = _record(RIGHT, seq_adv=1.0, importance=imp, accuracy=1.0)
    bad = _record(WRONG, seq_adv=-1.0, importance=imp, accuracy=0.0)
    zero = {**_record(RIGHT, seq_adv=0.0, importance=imp, accuracy=1.0)}
    p = P.profile([good, bad, zero])
    assert p["active_rollouts"] == 2 and p["kinds_scheme"] == "chain"
    assert p["scored_tokens"] == 2 * 15
    fk = p["by_kind"]["final_total"]
    assert fk["tokens"] == 2
    # the row's maximum: I_hat = 1 - eps / (log1p(6) - log1p(1e-6) + eps), just under 1
    span = math.log1p(6.0) - math.log1p(1e-6)
    assert fk["mean_norm_importance"] == pytest.approx(span / (span + 1e-6), rel=1e-9)
    assert fk["mean_weight"] > p["by_kind"]["filler"]["mean_weight"]
    # weights: scored tokens of each row sum to their count (Eq. 17)
    assert sum(good["weights"][i] for i in range(15)) == pytest.approx(15, rel=1e-6)
    # the restated token is 1 of 15 scored tokens; its share of |A| is its weight / 15
    w_final = good["weights"][13]
    for side in ("positive", "negative"):
        r = p["restated"][side]
        assert r["token_share"] == pytest.approx(1 / 15)
        assert r["abs_adv_share"] == pytest.approx(w_final / 15, rel=1e-6)
    # 8 of the 15 scored tokens are at the row's minimum (1e-6), so the 0.4-quantile threshold is
    # I_hat = 0 itself: the gate gives them omega = 1, and the renormalisation (the boosted 7 raise
    # the sum) takes them below 1: 8 / 15 suppressed, 7 / 15 boosted, in both rows
    f6 = p["figure6"]
    assert f6["frac_suppressed"] == pytest.approx(8 / 15)
    assert f6["frac_boosted"] == pytest.approx(7 / 15)
    w = torch.tensor(good["weights"], dtype=torch.float64)
    assert f6["ess_ratio"] == pytest.approx(float(w.sum() ** 2 / (n * (w * w).sum())), rel=1e-6)
    # the threshold's raw score: between the filler's 1e-6 and the pivots' 0.3
    ts = p["threshold_scale"]
    assert 1e-6 <= ts["raw_at_threshold"] <= 0.3 and ts["raw_max"] == 6.0
    assert ts["suppressed_below_floor"] == 1.0  # every suppressed token is at 1e-6 < 1e-5
    assert p["top_scored_kind"] == {"final_total": 2}  # imp 6.0 on " 19" / " 9" in both rows
    # deciles cover the scored tokens once
    assert sum(d["tokens"] for d in p["by_decile"].values()) == p["scored_tokens"]
    json.dumps(p)  # JSON-able
    assert "final_total" in P.render(p)


def test_threshold_raw_inverts_the_normalisation():
    """At tau = 0.5 with values 0, 1, 3 (log1p: 0, 0.69, 1.39), the median is 1 nat."""
    raw = P._threshold_raw([0.0, 1.0, 3.0], [1, 1, 1], {"tau": 0.5, "tau_mode": "quantile", "eps": 1e-12})
    assert raw == pytest.approx(1.0, rel=1e-9)


def test_locus_recall_ranks_the_first_wrong_token():
    n = len(WRONG)
    imp = [0.01] * n
    imp[13] = 5.0   # the copy of the wrong total: top-1 by importance
    imp[7] = 1.0    # the dropped carry: second
    ent = [0.1] * n
    ent[7] = 2.0    # entropy puts the carry first
    bad = _record(WRONG, seq_adv=-1.0, importance=imp, accuracy=0.0, entropy=ent)
    good = _record(RIGHT, seq_adv=1.0, importance=imp, accuracy=1.0)
    loc = P.locus_recall([bad, good])
    assert loc["wrong_rollouts"] == {"pivot": 1}
    assert loc["locus_kinds"] == {"total": 1} and loc["locus_deciles"] == {"4": 1}  # token 7 of 15
    s = loc["signals"]
    assert s["oar_g"]["top1"] == 0.0 and s["oar_g"]["top5"] == 1.0
    assert s["entropy"]["top1"] == 1.0
    # 15 scored tokens: top 10% is ceil(1.5) = 2 tokens, top 5% is 1
    assert s["oar_g"]["top10%"] == 1.0 and s["oar_g"]["top5%"] == 0.0
    assert s["random"]["rollouts"] == 1
    # ties rank against the locus: a constant signal never recalls it in its top 1
    flat = _record(WRONG, seq_adv=-1.0, importance=[0.5] * n, accuracy=0.0, entropy=[1.0] * n)
    assert P.locus_recall([flat])["signals"]["entropy"]["top5"] == 0.0
    # an all-wrong group's rollout (A = 0) was not scored: counted apart, ranked by no signal
    unscored = {**bad, "seq_adv": 0.0, "scored": [0] * n}
    assert P.locus_recall([unscored]) == {"signals": {}, "wrong_rollouts": {"not_scored": 1},
                                          "locus_kinds": {}, "locus_deciles": {},
                                          "median_scored_tokens": None}


def test_read_credit_records_rejects_bad_lines(tmp_path):
    d = tmp_path / "credit_records"
    d.mkdir()
    good = _record(RIGHT, seq_adv=1.0, importance=[0.1] * len(RIGHT), accuracy=1.0)
    (d / "step_000001.dp0.jsonl").write_text(json.dumps(good) + "\n")
    assert len(P.read_credit_records(tmp_path)) == 1
    assert P.main([str(tmp_path)]) == 0 and (d / "credit.md").is_file()
    (d / "step_000002.dp0.jsonl").write_text(json.dumps({**good, "weights": [1.0]}) + "\n")
    with pytest.raises(P.CreditRecordError, match="step_000002.dp0.jsonl:1: .*weights"):
        P.read_credit_records(tmp_path)
    with pytest.raises(P.CreditRecordError, match="no credit records"):
        P.read_credit_records(tmp_path / "nothing")


def test_trainer_record_rows_from_a_batch():
    from types import SimpleNamespace

    from megatron_oar.training.credit_records import record_rows
    from megatron_oar.training.inputs import build_train_batch

    class Tok:
        def decode(self, ids, skip_special_tokens=False):
            return "".join(chr(97 + i) for i in ids)

    samples = [SimpleNamespace(prompt_ids=[0, 1], response_ids=[2, 3, 4], reference="x", reward=1.0,
                               accuracy=1.0, finish_reason="stop", logprobs=[0.0] * 3),
               SimpleNamespace(prompt_ids=[5], response_ids=[6, 7], reference="y", reward=0.0,
                               accuracy=0.0, finish_reason="stop", logprobs=[0.0] * 2)]
    seq_adv = torch.tensor([1.0, -1.0])
    batch = build_train_batch(samples, [1, 0], seq_adv, pad_id=0, overlong_filter=False, device="cpu")
    batch.entropy = torch.arange(batch.tokens.numel(), dtype=torch.float32).view_as(batch.tokens)
    imp = torch.zeros_like(batch.entropy)
    imp[1, 2:5] = torch.tensor([0.1, 0.2, 0.3])  # row 1 is sample 0: response at positions 2..4
    imp[0, 1:3] = torch.tensor([0.4, 0.5])
    c = assign_credit(ShapingConfig(), batch.seq_adv, batch.loss_mask, importance=imp,
                      score_mask=batch.loss_mask)
    rows = record_rows(samples, batch, c, importance=imp, score_mask=batch.loss_mask, tokenizer=Tok(),
                       step=3, method="oar_g", shaping=ShapingConfig())
    assert [r["index"] for r in rows] == [1, 0]
    r0 = rows[1]
    assert r0["tokens"] == ["c", "d", "e"] and r0["prompt"] == "ab" and r0["seq_adv"] == 1.0
    assert r0["importance"] == pytest.approx([0.1, 0.2, 0.3])
    assert r0["entropy"] == batch.entropy[1, 2:5].tolist()
    assert sum(r0["weights"]) == pytest.approx(3.0)
    assert rows[0]["advantages"] == pytest.approx([-w for w in rows[0]["weights"]])
    assert rows[0]["shaping"]["tau"] == 0.4
