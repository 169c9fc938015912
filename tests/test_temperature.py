"""The rollout temperature in the trainer's log-probs (``rollout.temperature``; issue 39, item 5).

vLLM samples from ``softmax(logits / T)``; the PPO ratio, the rollout correction and the
log-prob mismatch check compare the trainer's log-probs with that policy, so every trainer pass
computes ``log_softmax(logits / T)`` (and the entropy of that distribution). Fast: the
per-token statistics every pass uses (``policy_passes._next_token_stats``), chunked and whole,
against float64 ``log_softmax(logits / T)``: values and gradients (one in-process rank, < 1 s).
Slow (a world of 1 in the pool, about 10 s): the old-logprob, reference and update passes at
T = 0.7 on a tiny Qwen2 against transformers' logits / T, and the update's first ratio is 1
(old and new log-probs at the same temperature).
"""

from __future__ import annotations

import pickle
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from tests.distributed import launch

VOCAB, PADDED, HIDDEN = 13, 16, 8  # three padded vocabulary rows
T = 0.7


def _reference(h: torch.Tensor, w: torch.Tensor, tokens: torch.Tensor, temperature: float):
    """float64 ``(log p(next token), entropy)`` of ``softmax(logits / T)`` over the real vocabulary."""
    logp = (F.linear(h[:, :-1].double(), w.double())[..., :VOCAB] / temperature).log_softmax(-1)
    lp = logp.gather(-1, tokens[:, 1:, None])[..., 0]
    return lp, -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("chunk", [0, 3], ids=["whole", "chunked"])
@pytest.mark.parametrize("temperature", [T, 1.0, 1.6])
def test_next_token_stats_at_temperature(chunk, temperature):
    from megatron_oar.runtime import destroy_runtime, init_runtime
    from megatron_oar.training.policy_passes import _next_token_stats

    init_runtime()
    try:
        g = torch.Generator().manual_seed(0)
        h = torch.randn(2, 6, HIDDEN, generator=g, requires_grad=True)
        w = torch.randn(PADDED, HIDDEN, generator=g, requires_grad=True)
        tokens = torch.randint(0, VOCAB, (2, 6), generator=g)
        a, b = torch.randn(2, 5, generator=g), torch.randn(2, 5, generator=g)
        gpt = SimpleNamespace(share_embeddings_and_output_weights=False, pre_process=True,
                              output_layer=SimpleNamespace(weight=w))
        out = h if chunk else F.linear(h, w)  # the pass's output: hidden states, or whole logits
        lp, ent = _next_token_stats(gpt, out, tokens, VOCAB, chunk, temperature=temperature)
        ((lp * a).sum() + (ent * b).sum()).backward()

        h2, w2 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
        ref_lp, ref_ent = _reference(h2, w2, tokens, temperature)
        ((ref_lp * a).sum() + (ref_ent * b).sum()).backward()
        torch.testing.assert_close(lp.double(), ref_lp, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ent.double(), ref_ent, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(h.grad.double(), h2.grad, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(w.grad.double(), w2.grad, rtol=1e-4, atol=1e-5)
        if temperature != 1.0:  # not vacuous: temperature 1 gives other numbers
            assert (ref_lp - _reference(h2, w2, tokens, 1.0)[0]).abs().max() > 0.1
    finally:
        destroy_runtime()


# ----------------------------------------------------------------------- the passes at T

def _passes_worker(root: str) -> None:
    from checkpoints_convert.convert import hf_to_megatron
    from megatron_oar.algorithms import PolicyLossConfig
    from megatron_oar.config import ModelConfig, OptimConfig
    from megatron_oar.models import read_hf_config
    from megatron_oar.models.tiny import make_tiny_qwen2
    from megatron_oar.runtime import ParallelConfig, init_runtime
    from megatron_oar.training.inputs import TrainBatch
    from megatron_oar.training.policy import build_policy
    from megatron_oar.training.policy_passes import old_logprob_pass, reference_logprobs, update_step
    from tests.train_step_check import SEQ_ADV, make_rows

    root = Path(root)
    hf = make_tiny_qwen2(root / "hf", seed=7, vocab_size=256, initializer_range=0.3)
    hf_to_megatron(hf, root / "ckpt", progress=False)
    init_runtime(ParallelConfig())
    hf_config = read_hf_config(root / "ckpt" / "hf" / "config.json")
    vocab = hf_config["vocab_size"]
    policy = build_policy(hf_config, ModelConfig(path=str(root / "ckpt")), OptimConfig(lr=1e-3),
                          checkpoint=root / "ckpt", total_optimizer_steps=2)
    tokens, prompt_lens, lengths = make_rows(vocab)
    pos = torch.arange(tokens.shape[1])
    mask = (pos >= prompt_lens[:, None]) & (pos < lengths[:, None])
    batch = TrainBatch(tokens, prompt_lens, lengths, torch.arange(4), loss_mask=mask,
                       rollout_logprobs=torch.zeros(tokens.shape), seq_adv=SEQ_ADV)
    out = {"mask": mask, "tokens": tokens}
    for chunk in (0, 4096):
        old, ent, _ = old_logprob_pass(policy.model, batch, vocab, 2, logits_chunk=chunk, temperature=T)
        ref = reference_logprobs(policy.model, batch, vocab, 2, logits_chunk=chunk, temperature=T)
        out[chunk] = {"old": old, "entropy": ent, "ref": ref}
    batch.old_logprobs, batch.entropy = out[4096]["old"], out[4096]["entropy"]
    batch.advantages = batch.seq_adv[:, None] * mask
    step = update_step(policy, batch, PolicyLossConfig(), vocab, 2, temperature=T)
    out["ratio"] = (step.stats["ratio_mean"], step.stats["ratio_max"], step.stats["approx_kl"])
    (root / "result.pkl").write_bytes(pickle.dumps(out))


@pytest.mark.slow
def test_passes_use_the_rollout_temperature(tmp_path):
    from transformers import AutoModelForCausalLM

    launch(_passes_worker, 1, str(tmp_path))
    res = pickle.loads((tmp_path / "result.pkl").read_bytes())
    mask, tokens = res["mask"], res["tokens"]
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    with torch.no_grad():
        logp = (hf(tokens).logits.double()[:, :-1] / T).log_softmax(-1)
    want_lp = torch.cat([logp.new_zeros(4, 1), logp.gather(-1, tokens[:, 1:, None])[..., 0]], 1)
    want_ent = torch.cat([logp.new_zeros(4, 1), -(logp.exp() * logp).sum(-1)], 1)
    at_one = torch.cat([logp.new_zeros(4, 1), (logp * T).log_softmax(-1).gather(-1, tokens[:, 1:, None])[..., 0]], 1)
    assert (want_lp - at_one)[mask].abs().max() > 0.1  # temperature 1 would fail the checks below
    for chunk in (0, 4096):
        got = res[chunk]
        for name, want in (("old", want_lp), ("ref", want_lp), ("entropy", want_ent)):
            diff = (got[name].double() - want)[mask].abs().max()
            assert diff < 1e-4, (chunk, name, float(diff))
    ratio_mean, ratio_max, approx_kl = res["ratio"]  # the update's log-probs at the old ones' T
    assert ratio_mean == pytest.approx(1.0, abs=1e-5) and ratio_max == pytest.approx(1.0, abs=1e-5)
    assert abs(approx_kl) < 1e-8
