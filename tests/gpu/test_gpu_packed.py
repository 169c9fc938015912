"""CUDA: packed (THD) micro-batches against token budgets, in bf16, through Transformer Engine's
THD attention (the TE spec) and through SDPA's (the local spec: variable-length FlashAttention).

The GPTModel runs the old-logprob pass, the reference pass and one ``update_step`` with
``batching=packed`` and with ``batching=token_budget`` on the same rows, at sequence multiples 1
and 16 (the FP8 multiple: every row padded inside the packed sequence): the log-probs, the
entropies and the loss agree at bf16 tolerance; and under the local spec SDPA's token-budget
passes agree with megatron's unfused attention. The CPU tests (tests/test_packing.py) check the
same in fp32 through SDPA's per-row path; this checks the CUDA kernels. Skipped without CUDA
(the TE cases without TE); record runs in docs/gpu-validation.md.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (no GPU on this machine)"),
]
NO_TE = pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is None,
                           reason="needs Transformer Engine (pip install 'megatron-oar[gpu]')")
# (model.spec, model.attention)
MODELS = [pytest.param(("te", "auto"), marks=NO_TE, id="te"), pytest.param(("local", "sdpa"), id="sdpa")]

LENGTHS = (97, 33, 64, 15, 80, 41)  # prompt + response tokens per row
PROMPT = 8
BUDGET = 200  # tokens per micro-batch: 3 micro-batches of 1 to 3 rows at both multiples
MULTIPLES = (1, 16)
LOGPROB_TOL = 0.1  # bf16 logits, different attention kernels and GEMM shapes
SEQ_ADV = torch.tensor([1.0, -1.0, 0.5, 2.0, -0.5, 1.0])


def _rows(vocab: int):
    g = torch.Generator().manual_seed(0)
    tokens = torch.zeros(len(LENGTHS), max(LENGTHS), dtype=torch.long)
    for i, n in enumerate(LENGTHS):
        tokens[i, :n] = torch.randint(3, vocab, (n,), generator=g)
    lengths = torch.tensor(LENGTHS)
    pos = torch.arange(tokens.shape[1])
    mask = (pos >= PROMPT) & (pos < lengths[:, None])
    return tokens, lengths, mask


def _passes(ckpt, batching: str, old_logprobs: torch.Tensor | None, model: tuple[str, str]) -> dict:
    """A fresh bf16 policy of ``model`` (spec, attention): old-logprob and reference passes, one
    update_step (with the given old log-probs, so both batchings take the same step), on CPU
    tensors."""
    from megatron_oar.algorithms import PolicyLossConfig
    from megatron_oar.config import ModelConfig, OptimConfig
    from megatron_oar.models import read_hf_config
    from megatron_oar.training.inputs import TrainBatch
    from megatron_oar.training.policy import build_policy
    from megatron_oar.training.policy_passes import old_logprob_pass, reference_logprobs, update_step

    hf_config = read_hf_config(ckpt / "hf")
    vocab = hf_config["vocab_size"]
    spec, attention = model
    policy = build_policy(hf_config, ModelConfig(path=str(ckpt), spec=spec, attention=attention, dtype="bf16"),
                          OptimConfig(lr=1e-4),
                          checkpoint=ckpt, total_optimizer_steps=4)
    dev = torch.device("cuda", torch.cuda.current_device())
    tokens, lengths, mask = _rows(vocab)
    batch = TrainBatch(tokens.to(dev), torch.full((len(LENGTHS),), PROMPT, device=dev), lengths.to(dev),
                       torch.arange(len(LENGTHS), device=dev), loss_mask=mask.to(dev),
                       rollout_logprobs=torch.zeros(tokens.shape, device=dev), seq_adv=SEQ_ADV.to(dev))
    grouping = {"batching": batching, "max_tokens": BUDGET}
    lp, ent, _ = old_logprob_pass(policy.model, batch, vocab, 1, **grouping)
    ref = reference_logprobs(policy.model, batch, vocab, 1, **grouping)
    batch.old_logprobs = lp if old_logprobs is None else old_logprobs.to(dev)
    batch.ref_logprobs = ref
    batch.entropy = ent
    batch.advantages = batch.seq_adv[:, None] * batch.loss_mask
    result = update_step(policy, batch, PolicyLossConfig(kl_coef=0.1, entropy_coef=0.01), vocab, 1, **grouping)
    return {"logprobs": lp.float().cpu(), "entropy": ent.float().cpu(), "ref_logprobs": ref.float().cpu(),
            "loss": result.stats["loss"], "grad_norm": result.grad_norm, "applied": result.applied,
            "valid": torch.arange(tokens.shape[1])[None] < lengths[:, None]}


@pytest.fixture(scope="module", params=MODELS)
def results(request, tmp_path_factory):
    from checkpoints_convert.convert import hf_to_megatron
    from megatron_oar.models.padding import force_multiple
    from megatron_oar.models.tiny import make_tiny_qwen2
    from megatron_oar.runtime import ParallelConfig, destroy_runtime, init_runtime

    root = tmp_path_factory.mktemp("gpu_packed")
    hf = make_tiny_qwen2(root / "hf", seed=5, dtype=torch.bfloat16, hidden_size=256, intermediate_size=512,
                         num_attention_heads=4, num_key_value_heads=2)
    hf_to_megatron(hf, root / "ckpt", progress=False)
    out = {}
    init_runtime(ParallelConfig())
    try:
        for multiple in MULTIPLES:
            with force_multiple(multiple):
                budget = _passes(root / "ckpt", "token_budget", None, request.param)
                out["token_budget", multiple] = budget
                out["packed", multiple] = _passes(root / "ckpt", "packed", budget["logprobs"], request.param)
        if request.param[0] == "local":
            out["unfused"] = _passes(root / "ckpt", "token_budget", None, ("local", "unfused"))
    finally:
        destroy_runtime()
    return out


@pytest.mark.parametrize("multiple", MULTIPLES)
def test_packed_logprobs_match_token_budget(results, multiple):
    budget, packed = results["token_budget", multiple], results["packed", multiple]
    valid = budget["valid"]
    for name in ("logprobs", "entropy", "ref_logprobs"):
        diff = (packed[name] - budget[name]).abs()[valid]
        print(f"multiple {multiple} {name}: max|diff|={diff.max():.3e} mean={diff.mean():.3e}")
        assert torch.isfinite(packed[name][valid]).all(), name
        assert diff.max() <= LOGPROB_TOL and diff.mean() <= LOGPROB_TOL / 10, name


@pytest.mark.parametrize("multiple", MULTIPLES)
def test_packed_update_matches_token_budget(results, multiple):
    budget, packed = results["token_budget", multiple], results["packed", multiple]
    print(f"multiple {multiple}: loss {packed['loss']:.5f} vs {budget['loss']:.5f}, "
          f"grad norm {packed['grad_norm']:.4f} vs {budget['grad_norm']:.4f}")
    assert budget["applied"] and packed["applied"]
    assert packed["loss"] == pytest.approx(budget["loss"], rel=2e-2, abs=1e-2)
    assert packed["grad_norm"] == pytest.approx(budget["grad_norm"], rel=5e-2)


def test_sdpa_matches_unfused_attention(results):
    if "unfused" not in results:
        pytest.skip("the TE spec: no unfused reference run")
    sdpa, unfused = results["token_budget", 1], results["unfused"]
    valid = unfused["valid"]
    for name in ("logprobs", "entropy", "ref_logprobs"):
        diff = (sdpa[name] - unfused[name]).abs()[valid]
        print(f"sdpa vs unfused {name}: max|diff|={diff.max():.3e} mean={diff.mean():.3e}")
        assert diff.max() <= LOGPROB_TOL and diff.mean() <= LOGPROB_TOL / 10, name
    assert sdpa["loss"] == pytest.approx(unfused["loss"], rel=2e-2, abs=1e-2)
