"""Model FLOPs (models/flops.py) against PyTorch's own FLOP counter on a real Qwen2 forward,
and the GPU peak table."""

from __future__ import annotations

import pytest
import torch

from megatron_oar.models import parse_arch
from megatron_oar.models.flops import forward_flops, matmul_params, peak_tflops
from tests.tiny import make_tiny_qwen2


def test_forward_flops_equal_torch_flop_counter(tmp_path):
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import AutoModelForCausalLM

    hf = make_tiny_qwen2(tmp_path / "hf", seed=0)
    model = AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    arch = parse_arch(model.config.to_dict())
    for n in (7, 32):
        counter = FlopCounterMode(display=False)
        with counter, torch.no_grad():
            model(torch.randint(0, arch.vocab_size, (1, n)))
        # eager attention multiplies the whole n x n score matrix (QK^T and AV, 2 FLOPs per
        # multiply-add each); the causal count keeps the half that the mask does not discard
        full_attention = 4 * arch.num_layers * arch.num_heads * arch.head_dim * n * n
        assert counter.get_total_flops() - full_attention / 2 == forward_flops(arch, [n])
    assert forward_flops(arch, [7, 32]) == forward_flops(arch, [7]) + forward_flops(arch, [32])
    # logits at 2 of 39 positions: the output layer's FLOPs at the other 37 are not spent
    saved = forward_flops(arch, [7, 32]) - forward_flops(arch, [7, 32], output_positions=2)
    assert saved == 2 * arch.vocab_size * arch.hidden_size * 37
    assert matmul_params(arch) < sum(p.numel() for p in model.parameters())  # no embedding, norms


@pytest.mark.parametrize("name,peak", [("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H200", 989.0),
                                       ("NVIDIA A100-SXM4-80GB", 312.0), ("NVIDIA GB200", 2500.0),
                                       ("NVIDIA B200", 2250.0), ("Tesla T4", None), ("cpu", None)])
def test_peak_tflops_by_device_name(name, peak):
    assert peak_tflops(name) == peak
