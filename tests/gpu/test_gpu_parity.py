"""CUDA parity: the converted checkpoint on GPU against transformers on GPU.

Skipped with a reason where CUDA (or Transformer Engine, for the TE tests) is absent. Run on a
GPU machine with `make test-gpu` (or `pytest tests/gpu`) and record the result in
docs/gpu-validation.md.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from checkpoints_convert.convert import hf_to_megatron
from megatron_oar.models.tiny import make_tiny_qwen2

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (no GPU on this machine)"),
]
HAVE_TE = importlib.util.find_spec("transformer_engine") is not None


def _run(ckpt: Path, hf: Path, spec: str, dtype: str, tokens: torch.Tensor):
    from transformers import AutoModelForCausalLM

    from megatron_oar.models import ModelOptions, build_gpt_model, read_hf_config
    from megatron_oar.models.forward import forward_logits
    from megatron_oar.models.model_checkpoint import load_model
    from megatron_oar.runtime import ParallelConfig, destroy_runtime, init_runtime

    init_runtime(ParallelConfig())
    try:
        model = build_gpt_model(read_hf_config(ckpt / "hf"), ModelOptions(spec=spec, dtype=dtype))
        model.cuda()
        meta = load_model(model, ckpt)
        got = forward_logits(model, tokens.cuda(), vocab_size=meta.vocab_size).float()
    finally:
        destroy_runtime()
    torch_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    ref_model = AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch_dtype).cuda().eval()
    with torch.no_grad():
        ref = ref_model(tokens.cuda()).logits.float()
    return got, ref


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu")
    hf = make_tiny_qwen2(root / "hf", seed=5, dtype=torch.bfloat16, hidden_size=256,
                         intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
    hf_to_megatron(hf, root / "ckpt", progress=False)
    tokens = torch.randint(0, 1000, (2, 64), generator=torch.Generator().manual_seed(0))
    return hf, root / "ckpt", tokens


def _check(got, ref, tol):
    diff = (got - ref).abs().max().item()
    top1 = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    print(f"max|dlogit|={diff:.3e} top1={top1:.4f}")
    assert diff <= tol and top1 >= 0.97


def test_local_spec_bf16_parity(converted):
    hf, ckpt, tokens = converted
    got, ref = _run(ckpt, hf, "local", "bf16", tokens)
    _check(got, ref, tol=0.15)  # bf16: ~3 significant digits on O(1) logits


def test_local_spec_fp32_parity(converted):
    hf, ckpt, tokens = converted
    got, ref = _run(ckpt, hf, "local", "fp32", tokens)
    _check(got, ref, tol=1e-3)  # TF32 matmuls may be enabled by default on Hopper


def test_cli_verify_on_gpu(converted, capsys):
    """`oar-convert verify` as users run it: megatron builds its shard on the GPU, the prompt
    must follow it there, and the comparison with the CPU reference happens on CPU."""
    from checkpoints_convert.cli import main

    hf, ckpt, _ = converted
    rc = main(["verify", "--hf", str(hf), "--ckpt", str(ckpt), "--dtype", "fp32", "--tol", "1e-3"])
    out = capsys.readouterr().out
    print(out)
    assert rc == 0 and "verify tp=1 pp=1 ep=1 dtype=fp32" in out and " OK" in out


@pytest.mark.skipif(not HAVE_TE, reason="transformer-engine not installed")
def test_te_spec_bf16_parity(converted):
    hf, ckpt, tokens = converted
    got, ref = _run(ckpt, hf, "te", "bf16", tokens)
    _check(got, ref, tol=0.15)
