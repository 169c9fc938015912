"""The published Qwen2.5, Qwen3 (dense) and Qwen3-MoE architectures, for planning and validating a
layout without the weights.

Each entry holds the ``config.json`` fields :func:`~megatron_oar.models.families.parse_arch` reads,
copied from the Hugging Face model cards' ``config.json`` (Qwen/Qwen2.5-{0.5B..72B},
Qwen/Qwen2.5-Math-{1.5B,7B}, Qwen/Qwen3-{0.6B..32B}, Qwen/Qwen3-30B-A3B, Qwen/Qwen3-235B-A22B).
A real ``config.json`` always wins: :func:`resolve_hf_config`
falls back to a preset only when the model directory is not on this machine (e.g. planning a 72B
run from a laptop).
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

from megatron_oar.models.arch import ModelConfigError, read_hf_config
from megatron_oar.models.model_checkpoint import HF_DIR

log = logging.getLogger(__name__)

_COMMON = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
           "rms_norm_eps": 1e-6, "use_sliding_window": False}


def _qwen(hidden: int, inter: int, layers: int, heads: int, kv: int, vocab: int, tie: bool,
          max_pos: int = 131072, rope_theta: float = 1e6) -> dict[str, Any]:
    return {**_COMMON, "hidden_size": hidden, "intermediate_size": inter,
            "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv,
            "vocab_size": vocab, "tie_word_embeddings": tie, "max_position_embeddings": max_pos,
            "rope_theta": rope_theta}


def _qwen3(hidden: int, inter: int, layers: int, heads: int, tie: bool) -> dict[str, Any]:
    """Qwen3 dense: 8 KV heads, head_dim 128 whatever the width, q/k RMSNorm, no q/k/v bias."""
    return {**_COMMON, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": hidden,
            "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": 8, "head_dim": 128, "attention_bias": False, "vocab_size": 151936,
            "tie_word_embeddings": tie, "max_position_embeddings": 40960, "rope_theta": 1e6}


def _qwen3_moe(hidden: int, inter: int, moe_inter: int, layers: int, heads: int) -> dict[str, Any]:
    """Qwen3-MoE as released (Qwen/Qwen3-30B-A3B and Qwen/Qwen3-235B-A22B ``config.json``, the
    April 2025 releases; the "-2507" updates differ in max_position_embeddings and rope_theta):
    Qwen3's attention with 4 KV heads of head_dim 128, 128 routed experts of which 8 per token
    with renormalised top-k weights (norm_topk_prob), every layer a MoE layer
    (decoder_sparse_step 1, no mlp_only_layers), no shared expert, untied embeddings.
    ``intermediate_size`` is the dense-MLP width the config states (no layer uses it)."""
    return {**_COMMON, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
            "hidden_size": hidden, "intermediate_size": inter, "moe_intermediate_size": moe_inter,
            "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": 4,
            "head_dim": 128, "attention_bias": False, "num_experts": 128, "num_experts_per_tok": 8,
            "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
            "vocab_size": 151936, "tie_word_embeddings": False, "max_position_embeddings": 40960,
            "rope_theta": 1e6}


PRESETS: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": _qwen(896, 4864, 24, 14, 2, 151936, True, max_pos=32768),
    "qwen2.5-1.5b": _qwen(1536, 8960, 28, 12, 2, 151936, True),
    "qwen2.5-3b": _qwen(2048, 11008, 36, 16, 2, 151936, True, max_pos=32768),
    "qwen2.5-7b": _qwen(3584, 18944, 28, 28, 4, 152064, False),
    "qwen2.5-14b": _qwen(5120, 13824, 48, 40, 8, 152064, False),
    "qwen2.5-32b": _qwen(5120, 27648, 64, 40, 8, 152064, False),
    "qwen2.5-72b": _qwen(8192, 29568, 80, 64, 8, 152064, False),
    "qwen2.5-math-1.5b": _qwen(1536, 8960, 28, 12, 2, 151936, True, max_pos=4096, rope_theta=1e4),
    "qwen2.5-math-7b": _qwen(3584, 18944, 28, 28, 4, 152064, False, max_pos=4096, rope_theta=1e4),
    "qwen3-0.6b": _qwen3(1024, 3072, 28, 16, True),
    "qwen3-1.7b": _qwen3(2048, 6144, 28, 16, True),
    "qwen3-4b": _qwen3(2560, 9728, 36, 32, True),
    "qwen3-8b": _qwen3(4096, 12288, 36, 32, False),
    "qwen3-14b": _qwen3(5120, 17408, 40, 40, False),
    "qwen3-32b": _qwen3(5120, 25600, 64, 64, False),
    "qwen3-30b-a3b": _qwen3_moe(2048, 6144, 768, 48, 32),
    "qwen3-235b-a22b": _qwen3_moe(4096, 12288, 1536, 94, 64),
}


def preset_name(model_path: str | Path) -> str | None:
    """The preset a model directory's name refers to: ``.../Qwen2.5-Math-7B-Instruct`` ->
    ``qwen2.5-math-7b`` (instruct / chat variants share the base architecture); None if none."""
    name = Path(str(model_path)).name.lower()
    name = re.sub(r"-(instruct|chat|base)$", "", name)
    return name if name in PRESETS else None


def resolve_hf_config(model_path: str | Path, arch: str | None = None) -> tuple[dict[str, Any], str]:
    """``(config.json as a dict, where it came from)``: ``arch`` (a preset name) when given, else
    the model directory's ``config.json`` when it exists, else the preset its name refers to."""
    if arch is not None:
        key = arch.lower()
        if key not in PRESETS:
            raise ModelConfigError(f"--arch {arch!r}: unknown; known: {', '.join(PRESETS)}")
        return dict(PRESETS[key]), f"preset {key}"
    path = Path(str(model_path))
    config_json = path / "config.json"
    if config_json.is_file():
        return read_hf_config(config_json), str(config_json)
    checkpoint_json = path / HF_DIR / "config.json"  # an oar-convert Megatron checkpoint
    if checkpoint_json.is_file():
        return read_hf_config(checkpoint_json), str(checkpoint_json)
    key = preset_name(path)
    if key is None:
        raise ModelConfigError(
            f"model.path={str(model_path)!r}: no config.json there and its name matches no preset; "
            f"pass --arch (one of {', '.join(PRESETS)})")
    log.info("model.path=%s has no config.json here; using the published %s architecture",
             model_path, key)
    return dict(PRESETS[key]), f"preset {key} (from the name of model.path)"
