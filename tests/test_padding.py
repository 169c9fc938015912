"""Padding to the sequence multiple (sequence parallelism, FP8) changes nothing but rounding.

The multiple follows the model's ``TransformerConfig`` (TP with SP, 16 with FP8, 16 x TP with
both: each rank's FP8 GEMMs see its s / TP share).
On CPU neither SP nor FP8 runs, so the TP2 and PP2 tests force the multiple to 16 with
``force_multiple`` on the tiny batch of tests/test_attribution.py (width 29) and check that
every Megatron pass ran padded lengths, and that log-probs, entropies, the probe teacher, OAR-G,
OAR-P, screened OAR-P, the loss, the gradients and the updated weights equal the unpadded run.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_oar.models.padding import force_multiple, pad_to, padded_length, sequence_multiple, trim
from tests.distributed import launch_and_load, save_gathered
from tests.test_attribution import SEQ_ADV, make_batch, rel_error
from tests.tolerances import assert_close_to_rounding, tiny_grad_tol, tiny_logprob_tol

FORCED = 16
SIGMA = 1e-2  # as in test_attribution: OAR-G's fp32 rounding floor stays ~1e-5
# OAR-G's scores are gradients of a divergence near 0, divided by sigma: their rounding is the
# gradients' (tests/tolerances.py) over sigma's share of the scale, i.e. a backward chain's
# tolerance; OAR-P's are differences of log-probs, within the same bound. One bound for the three.
IMPORTANCE_TOL = tiny_grad_tol()
LOGPROB_TOL = tiny_logprob_tol()


def _config(tp: int = 1, sp: bool = False, fp8: str | None = None):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(num_layers=1, hidden_size=96, num_attention_heads=96,
                             use_cpu_initialization=True, tensor_model_parallel_size=tp,
                             sequence_parallel=sp, fp8=fp8)


@pytest.mark.parametrize("tp,sp,fp8,want", [
    (1, False, None, 1), (2, False, None, 1), (2, True, None, 2), (4, True, None, 4),
    (1, False, "hybrid", 16), (2, False, "e4m3", 16), (2, True, "hybrid", 32), (8, True, "e4m3", 128),
    (3, True, "hybrid", 48), (32, True, "hybrid", 512)])
def test_sequence_multiple_rule(tp, sp, fp8, want):
    assert sequence_multiple(_config(tp, sp, fp8)) == want


@pytest.mark.parametrize("tp", [2, 4, 6, 8])
def test_fp8_with_sequence_parallelism_pads_each_rank_share_to_16(tp):
    """Under SP each rank's FP8 GEMMs run on s / TP tokens: that share must divide by 16. With
    lcm(TP, 16) as the multiple, TP 8 let s = 16 k through (s / TP = 2 k, odd for odd k)."""
    from megatron_oar.models.forward import MicroInput

    config = _config(tp, sp=True, fp8="hybrid")
    multiple = sequence_multiple(config)
    assert multiple == 16 * tp
    for length in range(1, 3 * multiple):
        share, rest = divmod(padded_length(length, multiple), tp)
        assert rest == 0 and share % 16 == 0, (length, multiple)
    # packed sequences: every row padded to the multiple, so T and each row's span are too
    lengths = [1, 17, 40, 129, 5]
    inp = MicroInput(torch.ones(len(lengths), max(lengths), dtype=torch.long), multiple, lengths)
    total = inp.tokens.shape[1]
    assert total % tp == 0 and (total // tp) % 16 == 0
    offsets = inp.packed.cu_seqlens_padded.tolist()
    assert all((b - a) % multiple == 0 for a, b in zip(offsets, offsets[1:]))
    # the rule's other cases: SP alone needs TP, FP8 alone 16
    assert sequence_multiple(_config(2, sp=True)) == 2
    assert sequence_multiple(_config(8, fp8="e4m3")) == 16


def test_force_multiple_is_scoped_and_combines_by_lcm():
    plain, sp4 = _config(2), _config(4, sp=True)
    with force_multiple(16):
        assert sequence_multiple(plain) == 16 and sequence_multiple(sp4) == 16
        with force_multiple(6):
            assert sequence_multiple(sp4) == 12
        assert sequence_multiple(plain) == 16
    assert sequence_multiple(plain) == 1
    with pytest.raises(ValueError), force_multiple(0):
        pass


def test_pad_and_trim():
    assert [padded_length(n, 16) for n in (1, 15, 16, 17, 29)] == [16, 16, 16, 32, 32]
    assert padded_length(29, 1) == 29
    t = torch.arange(6).view(2, 3)
    p = pad_to(t, 5)
    assert p.shape == (2, 5) and (p[:, 3:] == 0).all() and torch.equal(trim(p, 3), t)
    assert pad_to(t, 3) is t
    mask = pad_to(torch.ones(2, 3, dtype=torch.bool), 4)
    assert mask.dtype == torch.bool and not mask[:, 3].any()
    h = torch.randn(3, 2, 4)  # [s, b, h]
    ph = pad_to(h, 8, dim=0)
    assert ph.shape == (8, 2, 4) and (ph[3:] == 0).all() and torch.equal(trim(ph, 3, dim=0), h)


def _record_lengths(gpt, log: dict, key: list):
    """Every sequence length the model is run on, per pass (``key[0]``); a forward pre-hook."""

    def hook(_module, args, kwargs):
        tokens = args[0] if args else kwargs["input_ids"]
        lengths = {tokens.shape[1]}
        if kwargs.get("decoder_input") is not None:  # [s, b, h] (no sequence parallelism on CPU)
            lengths.add(kwargs["decoder_input"].shape[0])
        log.setdefault(key[0], set()).update(lengths)

    return gpt.register_forward_pre_hook(hook, with_kwargs=True)


def _probe(out, rows=None) -> tuple:
    """``(logp, score)`` of a ``ProbeOutput`` (its ``rows``); ``()`` off the last pipeline stage."""
    if out is None:
        return ()
    rows = slice(None) if rows is None else rows
    return out.logp[rows], out.score[rows]


def _passes(ckpt: str, update: bool, micro_batch_size: int = 1, attention: str = "auto") -> dict:
    """Every Megatron pass of one training step on a fresh policy; this rank's outputs."""
    from transformers import AutoTokenizer

    from megatron_oar.algorithms import PolicyLossConfig, ShapingConfig, assign_credit
    from megatron_oar.attribution import (
        AttributionConfig,
        ProbeConfig,
        compute_importance,
        locate_probes,
        probe_teacher,
    )
    from megatron_oar.attribution.spans import SpanFinder
    from megatron_oar.config import ModelConfig, OptimConfig
    from megatron_oar.models import read_hf_config
    from megatron_oar.training.inputs import TrainBatch
    from megatron_oar.training.policy import build_policy
    from megatron_oar.training.policy_passes import old_logprob_pass, reference_logprobs, update_step

    ckpt = Path(ckpt)
    policy = build_policy(read_hf_config(ckpt / "hf"), ModelConfig(path=str(ckpt), spec="local", attention=attention),
                          OptimConfig(lr=1e-3), checkpoint=ckpt, total_optimizer_steps=4)
    vocab = read_hf_config(ckpt / "hf")["vocab_size"]
    tok = AutoTokenizer.from_pretrained(str(ckpt / "hf"))
    seqs = make_batch(tok)
    batch = TrainBatch(seqs.tokens, seqs.prompt_lens, seqs.lengths, seqs.sample_ids,
                       loss_mask=seqs.response_mask(), rollout_logprobs=torch.zeros(seqs.tokens.shape),
                       seq_adv=SEQ_ADV)
    lengths, key = {}, [""]
    _record_lengths(policy.gpt, lengths, key)
    probe = ProbeConfig(kind="answer_mean")
    sites = locate_probes(seqs, probe, 3, SpanFinder(tok, probe.answer_pattern))
    out = {"lengths": lengths}

    key[0] = "old_logprob"
    batch.old_logprobs, batch.entropy, teacher = old_logprob_pass(policy.model, batch, vocab, 1, sites=sites)
    out.update(logprobs=batch.old_logprobs, entropy=batch.entropy, teacher=_probe(teacher))
    key[0] = "reference"
    batch.ref_logprobs = reference_logprobs(policy.model, batch, vocab, 5)
    out["ref_logprobs"] = batch.ref_logprobs
    key[0] = "probe_teacher"
    rows = [i for i in range(seqs.size) if SEQ_ADV[i] != 0]
    clean = probe_teacher(policy.model, seqs, sites, rows, vocab, 2)
    out["probe_teacher"] = _probe(clean, rows)
    for name, cfg in {
        "oar_g": AttributionConfig(method="oar_g", sigma=SIGMA, micro_batch_size=2),
        "oar_p": AttributionConfig(method="oar_p", perturb_micro_batch_size=4, length_bucket=8),
        "oar_p_screened": AttributionConfig(method="oar_p_screened", sigma=SIGMA, screen_fraction=0.5,
                                            perturb_micro_batch_size=4, length_bucket=8),
    }.items():
        key[0] = name
        out[name] = compute_importance(policy.model, seqs, cfg, vocab_size=vocab, seq_adv=SEQ_ADV,
                                       step=3, tokenizer=tok, sites=sites, teacher=teacher,
                                       external_teacher=True).importance
    credit = assign_credit(ShapingConfig(scheme="oar"), batch.seq_adv, batch.loss_mask,
                           importance=out["oar_g"], score_mask=sites.score_mask)
    batch.advantages = credit.advantages
    if not update:
        return out
    key[0] = "update"
    result = update_step(policy, batch, PolicyLossConfig(kl_coef=0.1, entropy_coef=0.01), vocab,
                         micro_batch_size)
    out.update(loss=result.stats["loss"], grad_norm=result.grad_norm, applied=result.applied,
               grads=[p.main_grad.clone() for p in policy.gpt.parameters()],
               weights=[p.detach().clone() for p in policy.gpt.parameters()])
    return out


def _worker(ckpt: str, tp: int, pp: int, out: str) -> None:
    from megatron_oar.runtime import ParallelConfig, init_runtime

    init_runtime(ParallelConfig(tp=tp, pp=pp))
    results = {}
    for multiple in (1, FORCED):
        with force_multiple(multiple):  # 1: no padding on this CPU model (no SP, no FP8)
            results[multiple] = _passes(ckpt, update=True)
    save_gathered(results, out)


@pytest.fixture(scope="module", params=[(2, 1), (1, 2)], ids=["tp2", "pp2"])
def runs(request, scaled_checkpoint, tmp_path_factory):
    """Per rank: ``{1: unpadded run, 16: forced run}``."""
    tp, pp = request.param
    out = tmp_path_factory.mktemp("padding") / f"tp{tp}pp{pp}.pt"
    return launch_and_load(_worker, tp * pp, out, str(scaled_checkpoint), tp, pp)


PASSES = ("old_logprob", "reference", "probe_teacher", "oar_g", "oar_p", "oar_p_screened", "update")


@pytest.mark.slow
def test_every_pass_runs_padded_lengths(runs):
    for ranks in runs:
        plain, padded = ranks[1]["lengths"], ranks[FORCED]["lengths"]
        assert plain.keys() == padded.keys() and set(PASSES) <= plain.keys()
        for name in plain:
            assert any(n % FORCED for n in plain[name]), f"{name}: the test needs unpadded lengths"
            assert all(n % FORCED == 0 for n in padded[name]), (name, padded[name])


@pytest.mark.slow
def test_padding_changes_nothing(runs):
    for rank, ranks in enumerate(runs):
        plain, padded = ranks[1], ranks[FORCED]
        for name in ("logprobs", "entropy", "ref_logprobs"):
            assert_close_to_rounding(padded[name], plain[name], LOGPROB_TOL, f"rank {rank}: {name}")
        for name in ("teacher", "probe_teacher"):
            for got, want in zip(padded[name], plain[name]):
                assert_close_to_rounding(got, want, LOGPROB_TOL, f"rank {rank}: {name}")
        for name in ("oar_g", "oar_p", "oar_p_screened"):
            assert plain[name].abs().max() > 0
            err = rel_error(padded[name], plain[name])
            assert err <= IMPORTANCE_TOL, f"rank {rank}: {name} rel err {err:.2e}"
        # applied, loss, grad norm, gradients; the updated weights where a gradient is above
        # rounding (Adam's first step is lr * sign(g) where g is at rounding level)
        from tests.test_micro_batches import assert_same_update

        assert_same_update(padded, plain, f"rank {rank}", lr=1e-3)
