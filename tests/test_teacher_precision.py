"""OAR-G's teacher P0 and its noisy student run in one precision, so as sigma -> 0 the scores go to 0.

J = KL(P0 || P_sigma) has gradient ``(P_sigma - P0) . dlogits/de``: zero at sigma = 0 only when
P0 is the student's own clean output. A teacher from another precision (the trainer's FP8
old-logprob forward against a bf16 OAR-G) leaves the precision gap in the gradient, whatever
sigma. On CPU there is no FP8: the stand-in is a teacher rounded to bf16 against an fp32
student, and the FP8 decision rule of ``compute_importance`` is checked on a stub model.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_oar.attribution import AttributionConfig, ProbeConfig, SequenceBatch, locate_probes
from tests.test_attribution import SEQ_ADV, make_batch

SIGMAS = (1e-2, 1e-4, 1e-6, 1e-12)


@pytest.fixture(scope="module")
def scores(scaled_checkpoint):
    """Max |importance| per case, computed in this process (world size 1)."""
    from transformers import AutoTokenizer

    from megatron_oar.attribution import ProbeOutput, compute_importance
    from megatron_oar.attribution.spans import SpanFinder
    from megatron_oar.models import ModelOptions, build_gpt_model, read_hf_config
    from megatron_oar.models.forward import forward_logits
    from megatron_oar.models.model_checkpoint import load_model
    from megatron_oar.runtime import ParallelConfig, destroy_runtime, init_runtime

    root = scaled_checkpoint.parent  # conftest: seed 5, weights of std 0.3
    out = {}
    try:
        init_runtime(ParallelConfig(tp=1, pp=1))
        model = build_gpt_model(read_hf_config(root / "hf"), ModelOptions())
        meta = load_model(model, root / "ckpt")
        tok = AutoTokenizer.from_pretrained(str(root / "hf"))
        batch = make_batch(tok)

        def run(cfg, **kw):
            attr = compute_importance(model, batch, cfg, vocab_size=meta.vocab_size, seq_adv=SEQ_ADV,
                                      step=3, tokenizer=tok, **kw)
            assert attr.score_mask.any()
            return attr.importance, attr.stats["teacher_passes"]

        for sigma in SIGMAS:  # the teacher computed here, in the student's precision
            out["own", sigma] = run(AttributionConfig(method="oar_g", sigma=sigma))
        # the trainer's path: P0 from an old-logprob forward's logits; rounded to bf16 it stands
        # in for a teacher of another precision than the student's (FP8 against bf16 on GPU)
        sites = locate_probes(batch, ProbeConfig(), 3, SpanFinder(tok))
        logits = forward_logits(model, batch.tokens, vocab_size=meta.vocab_size)
        local = torch.nn.functional.pad(logits, (0, meta.padded_vocab_size - meta.vocab_size))
        other = ProbeOutput.from_position_logits(local[sites.row, sites.pos].bfloat16().float(), sites,
                                                 meta.vocab_size)
        for sigma in (1e-2, 1e-12):
            for flag in (False, True):  # False: declared the student's precision, so it is used
                out["other", flag, sigma] = run(AttributionConfig(method="oar_g", sigma=sigma),
                                                sites=sites, teacher=other, teacher_fp8=flag)
        oar_p = AttributionConfig(method="oar_p", pad_id=tok.pad_token_id)
        out["oar_p_own"] = run(oar_p)
        out["oar_p_other"] = run(oar_p, sites=sites, teacher=other, teacher_fp8=True)
    finally:
        destroy_runtime()
    return out


def test_scores_vanish_with_sigma_when_teacher_and_student_match(scores):
    top = {s: float(scores["own", s][0].abs().max()) for s in SIGMAS}
    assert top[1e-2] > 1e-3
    # first order in sigma: 100x less noise, about 100x smaller scores (fp32 rounding aside)
    assert top[1e-4] < 2e-2 * top[1e-2]
    assert top[1e-6] < 2e-4 * top[1e-2]
    assert top[1e-12] < 1e-12 * top[1e-2]  # the noise is below fp32 resolution: P_sigma == P0
    assert all(scores["own", s][1] == 1 for s in SIGMAS)  # one clean teacher pass each


def test_a_teacher_of_another_precision_is_not_used(scores):
    top = float(scores["own", 1e-2][0].abs().max())
    used, _ = scores["other", False, 1e-12]
    # used as is, the precision gap is the gradient: scores stay large as sigma -> 0
    assert float(used.abs().max()) > 1e-3 * top
    # declared of another precision, it is replaced by a clean teacher in the student's
    replaced, passes = scores["other", True, 1e-12]
    assert passes == 1 and float(replaced.abs().max()) < 1e-12 * top
    assert torch.equal(scores["other", True, 1e-2][0], scores["own", 1e-2][0])
    assert scores["other", False, 1e-2][1] == 0  # a matching teacher costs no pass
    # OAR-P's counterfactuals run outside FP8 too: the same rule, the same scores
    assert torch.equal(scores["oar_p_other"][0], scores["oar_p_own"][0]) and scores["oar_p_other"][1] == 1


# ------------------------------------------------------------------ the FP8 rule on a stub model

EXT = "external teacher"


def _stub_batch() -> SequenceBatch:
    tokens = torch.arange(1, 13).reshape(2, 6)
    return SequenceBatch(tokens, torch.tensor([2, 2]), torch.tensor([6, 6]))


@pytest.mark.parametrize("model_fp8,method,allow_fp8,given,teacher_fp8,want_g,want_p", [
    # the trainer: P0 from its FP8 old-logprob forward (teacher_fp8 inferred from the model)
    ("hybrid", "oar_g", False, EXT, None, "own fp8=False", None),
    ("hybrid", "oar_g", True, EXT, None, EXT, None),
    ("hybrid", "oar_p", False, EXT, None, None, "own fp8=False"),
    ("hybrid", "oar_p_screened", True, EXT, None, EXT, "own fp8=False"),
    ("hybrid", "oar_p_screened", False, EXT, None, "own fp8=False", "own fp8=False"),
    # the trainer without FP8: the old-logprob teacher is the students' precision
    (None, "oar_g", False, EXT, None, EXT, None),
    (None, "oar_p_screened", True, EXT, None, EXT, EXT),
    # a teacher declared non-FP8 (the oracle's probe_teacher) on an FP8 model
    ("hybrid", "oar_g", False, EXT, False, EXT, None),
    ("hybrid", "oar_p_screened", True, EXT, False, "own fp8=True", EXT),
    # no teacher given: computed in the student's precision (FP8 only for an FP8 OAR-G)
    ("hybrid", "oar_g", True, None, None, "own fp8=True", None),
    ("hybrid", "oar_p", True, None, None, None, "own fp8=False"),
])
def test_fp8_rule(monkeypatch, model_fp8, method, allow_fp8, given, teacher_fp8, want_g, want_p):
    import megatron_oar.attribution as attribution

    seen = {}

    def fake_teacher(model, batch, sites, rows, vocab_size, micro_batch_size, allow_fp8=False, **grouping):
        seen.setdefault("passes", []).append(allow_fp8)
        return f"own fp8={allow_fp8}"

    def fake_g(model, batch, sites, teacher, rows, vocab_size, **kw):
        seen["g"] = teacher
        return torch.zeros(batch.tokens.shape)

    def fake_p(model, batch, sites, teacher, rows, vocab_size, **kw):
        seen["p"] = teacher
        return torch.zeros(batch.tokens.shape), 0

    monkeypatch.setattr(attribution, "probe_teacher", fake_teacher)
    monkeypatch.setattr(attribution, "oar_g", fake_g)
    monkeypatch.setattr(attribution, "oar_p", fake_p)
    monkeypatch.setattr(attribution, "oar_p_screened", fake_p)
    model = SimpleNamespace(config=SimpleNamespace(fp8=model_fp8))
    cfg = AttributionConfig(method=method, allow_fp8=allow_fp8, pad_id=0,
                            probe=ProbeConfig(kind="last_token"))
    attr = attribution.compute_importance(model, _stub_batch(), cfg, vocab_size=16, teacher=given,
                                          external_teacher=given is not None, teacher_fp8=teacher_fp8)
    assert seen.get("g") == want_g and seen.get("p") == want_p
    own = {t for t in (want_g, want_p) if t not in (None, EXT)}
    assert attr.stats["teacher_passes"] == len(own) == len(seen.get("passes", []))
