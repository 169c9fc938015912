"""Qwen2 config -> megatron TransformerConfig, validation errors, padded vocab, spec choice."""

from __future__ import annotations

import json

import pytest
import torch

from megatron_oar.models.qwen2 import (
    ModelConfigError,
    ModelOptions,
    check_layout,
    mask_padded_vocab,
    parse_arch,
    read_hf_config,
    transformer_config,
)

QWEN25_7B = {  # the fields of Qwen2.5-7B's config.json that matter
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
    "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
    "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 131072,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_sliding_window": False,
}


def test_arch_fields_from_qwen25_7b():
    arch = parse_arch(QWEN25_7B)
    assert (arch.num_heads, arch.num_kv_heads, arch.head_dim) == (28, 4, 128)
    assert arch.rope_theta == 1e6 and arch.rms_norm_eps == 1e-6
    assert arch.padded_vocab_size() == 152064 and not arch.tie_word_embeddings


def test_transformer_config_matches_qwen2():
    cfg = transformer_config(parse_arch(QWEN25_7B), ModelOptions(dtype="bf16"), tp=4, pp=2,
                             perform_initialization=False)
    assert cfg.num_query_groups == 4 and cfg.kv_channels == 128
    assert cfg.add_qkv_bias and not cfg.add_bias_linear and cfg.gated_linear_unit
    assert cfg.normalization == "RMSNorm" and cfg.layernorm_epsilon == 1e-6
    assert cfg.params_dtype is torch.bfloat16 and cfg.bf16
    assert cfg.tensor_model_parallel_size == 4 and cfg.pipeline_model_parallel_size == 2
    assert not cfg.gradient_accumulation_fusion  # needs apex's CUDA kernel


def test_vocab_padding_independent_of_tp():
    arch = parse_arch({**QWEN25_7B, "vocab_size": 1000})
    assert arch.padded_vocab_size(128) == 1024
    for tp in (1, 2, 4):
        check_layout(arch, tp=tp, pp=1)  # 1024 rows split evenly at any power-of-two TP


@pytest.mark.parametrize("tp,msg", [(3, "num_attention_heads"), (7, "num_key_value_heads")])
def test_tp_not_dividing_heads_or_groups(tp, msg):
    with pytest.raises(ModelConfigError, match=msg):
        check_layout(parse_arch(QWEN25_7B), tp=tp, pp=1)


def test_pp_not_dividing_layers():
    with pytest.raises(ModelConfigError, match=r"--pp=3 does not divide num_hidden_layers=28"):
        check_layout(parse_arch(QWEN25_7B), tp=1, pp=3)


@pytest.mark.parametrize("patch,msg", [
    ({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}, "unsupported architecture"),
    ({"use_sliding_window": True}, "use_sliding_window"),
    ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, "rope_scaling"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"num_key_value_heads": 5}, "not divisible"),
])
def test_unsupported_configs(patch, msg):
    with pytest.raises(ModelConfigError, match=msg):
        parse_arch({**QWEN25_7B, **patch})


def test_missing_field_named():
    cfg = dict(QWEN25_7B)
    del cfg["hidden_size"]
    with pytest.raises(ModelConfigError, match="hidden_size"):
        parse_arch(cfg, source="x/config.json")


def test_read_hf_config_errors(tmp_path):
    with pytest.raises(ModelConfigError, match="config.json"):
        read_hf_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelConfigError, match="not valid JSON"):
        read_hf_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(QWEN25_7B))
    assert read_hf_config(tmp_path)["hidden_size"] == 3584


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only behaviour")
def test_te_spec_and_fp8_need_transformer_engine_on_cpu():
    arch = parse_arch(QWEN25_7B)
    with pytest.raises(ModelConfigError, match="transformer-engine"):
        transformer_config(arch, ModelOptions(spec="te"), tp=1, pp=1)
    with pytest.raises(ModelConfigError, match="Transformer Engine"):
        transformer_config(arch, ModelOptions(fp8="hybrid"), tp=1, pp=1)
    with pytest.raises(ModelConfigError, match="model.fp8"):
        transformer_config(arch, ModelOptions(fp8="e5m2"), tp=1, pp=1)
    # auto picks the local spec without CUDA/TE
    cfg = transformer_config(arch, ModelOptions(spec="auto"), tp=1, pp=1)
    assert cfg.fp8 is None


def test_fp8_options_reach_transformer_config(monkeypatch):
    """FP8 settings are taken from the model options (TE presence faked: config only)."""
    from megatron_oar.models import qwen2

    monkeypatch.setattr(qwen2, "resolve_spec", lambda opts: "te")
    cfg = transformer_config(parse_arch(QWEN25_7B),
                             ModelOptions(spec="te", fp8="hybrid", fp8_recipe="tensorwise",
                                          fp8_amax_history_len=16, dtype="bf16"), tp=1, pp=1)
    assert cfg.fp8 == "hybrid" and cfg.fp8_amax_history_len == 16
    assert str(cfg.fp8_recipe).endswith("tensorwise")


def test_mask_padded_vocab_on_a_shard():
    logits = torch.zeros(2, 3, 8)
    masked = mask_padded_vocab(logits, vocab_size=13, vocab_start=8)  # second TP shard of 16
    assert torch.isinf(masked[..., 5:]).all() and (masked[..., :5] == 0).all()
