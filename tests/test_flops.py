"""Model FLOPs (models/flops.py) against PyTorch's own FLOP counter on a real Qwen2 forward and a
real Qwen3-MoE forward (the FLOPs of the active parameters: router and top-k experts), and the
GPU peak table. About 5 s on 2 cores, one process."""

from __future__ import annotations

import pytest
import torch

from megatron_oar.models import parse_arch
from megatron_oar.models.flops import forward_flops, matmul_params, peak_tflops
from tests.tiny import make_tiny_qwen2


def _assert_counted(model, arch) -> None:
    """``forward_flops`` equals torch's FLOP counter on ``model``'s eager forward of 7 and 32
    tokens, less the half of the attention score matrix the causal count leaves out."""
    from torch.utils.flop_counter import FlopCounterMode

    for n in (7, 32):
        counter = FlopCounterMode(display=False)
        with counter, torch.no_grad():
            model(torch.randint(0, arch.vocab_size, (1, n)))
        # eager attention multiplies the whole n x n score matrix (QK^T and AV, 2 FLOPs per
        # multiply-add each); the causal count keeps the half that the mask does not discard
        full_attention = 4 * arch.num_layers * arch.num_heads * arch.head_dim * n * n
        assert counter.get_total_flops() - full_attention / 2 == forward_flops(arch, [n])

def test_forward_flops_equal_torch_flop_counter(tmp_path):
    from transformers import AutoModelForCausalLM

    hf = make_tiny_qwen2(tmp_path / "hf", seed=0)
    model = AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    arch = parse_arch(model.config.to_dict())
    _assert_counted(model, arch)
    assert forward_flops(arch, [7, 32]) == forward_flops(arch, [7]) + forward_flops(arch, [32])
    # logits at 2 of 39 positions: the output layer's FLOPs at the other 37 are not spent
    saved = forward_flops(arch, [7, 32]) - forward_flops(arch, [7, 32], output_positions=2)
    assert saved == 2 * arch.vocab_size * arch.hidden_size * 37
    assert matmul_params(arch) < sum(p.numel() for p in model.parameters())  # no embedding, norms


def test_moe_forward_flops_equal_torch_flop_counter():
    """A tiny Qwen3-MoE (4 experts, top-2) in transformers' eager expert loop, which runs each
    expert on the tokens routed to it: the counted matmul FLOPs are those of the attention, the
    router, 2 of the 4 experts per token and the output layer, whatever the routing."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from tests.tiny import SMALL_QWEN3_MOE

    for overrides in ({}, {"num_hidden_layers": 4, "decoder_sparse_step": 2}):  # dense layers 0, 2
        cfg = Qwen3MoeConfig(**{**SMALL_QWEN3_MOE, **overrides}, attn_implementation="eager",
                             experts_implementation="eager")
        torch.manual_seed(0)
        model = Qwen3MoeForCausalLM(cfg).eval()
        arch = parse_arch(cfg.to_dict())
        _assert_counted(model, arch)
        assert arch.moe_layers == ((True,) * 2 if not overrides else (False, True, False, True))
        # active, not all: the experts a token is not routed to are not counted
        assert matmul_params(arch) < sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name,peak", [("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H200", 989.0),
                                       ("NVIDIA A100-SXM4-80GB", 312.0), ("NVIDIA GB200", 2500.0),
                                       ("NVIDIA B200", 2250.0), ("Tesla T4", None), ("cpu", None)])
def test_peak_tflops_by_device_name(name, peak):
    assert peak_tflops(name) == peak
