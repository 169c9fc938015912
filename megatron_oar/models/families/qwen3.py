"""Qwen3 dense (``Qwen3ForCausalLM``): Qwen2's network without the q/k/v bias, with a per-head
RMSNorm on queries and keys (HF ``q_norm`` / ``k_norm``, megatron's ``qk_layernorm``) applied
before RoPE, and an explicit ``head_dim`` that need not be ``hidden_size / num_attention_heads``;
0.6B-4B tie the embeddings.

The q/k norm weights (``[head_dim]``, the same megatron name under both specs) are not
TP-sharded: every TP rank holds the whole vector, and megatron checkpoints them as replicated.
"""

from __future__ import annotations

from typing import Any

from megatron_oar.models.arch import ModelConfigError, QwenArch
from megatron_oar.models.families.qwen2 import Qwen2
from megatron_oar.models.gpt_layout import K_NORM, Q_NORM

HF_Q_NORM = "self_attn.q_norm.weight"
HF_K_NORM = "self_attn.k_norm.weight"


class Qwen3(Qwen2):
    name = "Qwen3"
    architecture = "Qwen3ForCausalLM"
    model_type = "qwen3"

    def attention(self, hf: dict[str, Any], source: str) -> dict[str, Any]:
        # attention_bias puts a bias on o_proj too, which megatron's add_qkv_bias does not cover
        # (its add_bias_linear would add one to the MLP as well); no released Qwen3 sets it.
        if hf.get("attention_bias", False):
            raise ModelConfigError(f"{source}: attention_bias=true (bias on q/k/v and o_proj) is "
                                   "not supported for Qwen3")
        return {"head_dim": hf.get("head_dim") or 128,  # Qwen3Config's default
                "qkv_bias": False, "qk_norm": True}

    def attention_names(self, spec: str, arch: QwenArch | None) -> list[str]:
        return super().attention_names(spec, arch) + [Q_NORM, K_NORM]

    def one_to_one(self, spec: str, arch: QwenArch) -> dict[str, str]:
        return {**super().one_to_one(spec, arch), Q_NORM: HF_Q_NORM, K_NORM: HF_K_NORM}

    def extra_shapes(self, arch: QwenArch) -> dict[str, tuple[int, ...]]:
        return {Q_NORM: (arch.head_dim,), K_NORM: (arch.head_dim,)}
