"""Qwen2 config -> megatron TransformerConfig, validation errors, padded vocab, spec choice."""

from __future__ import annotations

import json

import pytest
import torch

from megatron_oar.models import ModelConfigError, ModelOptions, check_layout, parse_arch, read_hf_config
from megatron_oar.models.builder import mask_padded_vocab, transformer_config

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


def test_family_registry():
    """Each registered family parses its own config (by ``architectures``, else ``model_type``)
    into an arch that names it, and the 'unsupported' message lists the registry."""
    from megatron_oar.models import FAMILIES, SUPPORTED_ARCHITECTURES
    from megatron_oar.models.families import family_for_config, family_of

    assert SUPPORTED_ARCHITECTURES == tuple(f.architecture for f in FAMILIES)
    # the fields a family requires beyond the dense ones
    extra = {"qwen3_moe": {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64}}
    for family in FAMILIES:
        hf = {**QWEN25_7B, **extra.get(family.model_type, {}), "architectures": [family.architecture],
              "model_type": family.model_type}
        assert family_for_config(hf) is family
        assert family_for_config({**hf, "architectures": None}) is family
        assert family_of(parse_arch(hf)) is family
    with pytest.raises(ModelConfigError) as e:
        parse_arch({**QWEN25_7B, "architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    assert all(f"{f.architecture} (model_type {f.model_type!r})" in str(e.value) for f in FAMILIES)


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
    from megatron_oar.models import builder

    monkeypatch.setattr(builder, "resolve_spec", lambda opts: "te")
    cfg = transformer_config(parse_arch(QWEN25_7B),
                             ModelOptions(spec="te", fp8="hybrid", fp8_recipe="tensorwise",
                                          fp8_amax_history_len=16, dtype="bf16"), tp=1, pp=1)
    assert cfg.fp8 == "hybrid" and cfg.fp8_amax_history_len == 16
    assert str(cfg.fp8_recipe).endswith("tensorwise")


def test_mask_padded_vocab_on_a_shard():
    logits = torch.zeros(2, 3, 8)
    masked = mask_padded_vocab(logits, vocab_size=13, vocab_start=8)  # second TP shard of 16
    assert torch.isinf(masked[..., 5:]).all() and (masked[..., :5] == 0).all()


# ------------------------------------------- what megatron cannot build, refused first (issue 15)

def test_sequence_parallel_under_the_local_spec():
    """The local spec's norm (TorchRMSNorm, not megatron's WrappedTorchNorm, which asserts no SP)
    builds under sequence parallelism and marks its weight for megatron's gradient sum over TP;
    FP8 still needs the TE spec."""
    from types import SimpleNamespace

    from megatron_oar.models.local_norm import TorchRMSNorm

    arch = parse_arch(QWEN25_7B)
    cfg = transformer_config(arch, ModelOptions(spec="local", sequence_parallel=True), tp=2, pp=1,
                             perform_initialization=False)
    assert cfg.sequence_parallel
    assert TorchRMSNorm(cfg, 16).weight.sequence_parallel is True
    plain = SimpleNamespace(normalization="RMSNorm", sequence_parallel=False,
                            layernorm_zero_centered_gamma=False, memory_efficient_layer_norm=False)
    assert TorchRMSNorm(plain, 16).weight.sequence_parallel is False
    with pytest.raises(ValueError, match=r"config.normalization='LayerNorm'"):
        TorchRMSNorm(SimpleNamespace(**{**plain.__dict__, "normalization": "LayerNorm"}), 16)
    with pytest.raises(ModelConfigError, match=r"model.fp8='hybrid' needs model.spec=te"):
        transformer_config(arch, ModelOptions(spec="local", fp8="hybrid"), tp=2, pp=1)


def test_mxfp8_is_refused_before_blackwell(monkeypatch):
    from megatron_oar.models import builder

    monkeypatch.setattr(builder, "resolve_spec", lambda opts: "te")  # TE faked: config only
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    opts = ModelOptions(spec="te", fp8="hybrid", fp8_recipe="mxfp8", dtype="bf16")
    with pytest.raises(ModelConfigError, match=r"model.fp8_recipe='mxfp8' needs a Blackwell GPU.*sm_90"):
        transformer_config(parse_arch(QWEN25_7B), opts, tp=1, pp=1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    assert builder.check_fp8_recipe_device(opts)


def _build_tiny(opts: ModelOptions):
    from megatron_oar.models import build_gpt_model
    from megatron_oar.runtime import destroy_runtime, init_runtime

    hf = {**QWEN25_7B, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256}
    init_runtime()
    try:
        return build_gpt_model(hf, opts)
    finally:
        destroy_runtime()


def test_local_spec_never_uses_apex_fused_norm(monkeypatch, caplog):
    """Where apex imports (and TE does not), megatron's TransformerBlock takes apex's
    FusedLayerNorm for the final norm of a plain layer spec, and it asserts LayerNorm: Qwen's
    RMSNorm crashed there. The local spec names torch's RMSNorm for every norm."""
    from megatron.core.fusions.fused_layer_norm import FusedLayerNorm
    from megatron.core.transformer import transformer_block

    from megatron_oar.runtime import kernels

    monkeypatch.setattr(transformer_block, "LayerNormImpl", FusedLayerNorm)  # what `import apex` picks
    monkeypatch.setattr(kernels, "_logged_model_lines", set(), raising=False)
    with caplog.at_level("INFO", logger=kernels.__name__):
        model = _build_tiny(ModelOptions(spec="local"))
    norms = [name for name, m in model.named_modules() if isinstance(m, torch.nn.RMSNorm)]
    assert len(norms) == 2 * 2 + 1 and "decoder.final_layernorm" in norms
    assert not any(isinstance(m, FusedLayerNorm) for m in model.modules())
    # the kernel line says what this model uses (from its TransformerConfig), not what imports
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("model kernels:"))
    assert "spec=local norm=torch RMSNorm (TorchRMSNorm, sequence-parallel capable)" in line
    assert "grad_accum_fusion=off" in line and "fp8=off" in line and "apex" not in line
    cfg = model.config
    assert "attention=torch scaled_dot_product_attention" in line  # model.attention=auto: SDPA
    assert f"bias_activation_fusion={'on' if cfg.bias_activation_fusion else 'off'}" in line
    caplog.clear()
    monkeypatch.setattr(kernels, "_logged_model_lines", set(), raising=False)
    with caplog.at_level("INFO", logger=kernels.__name__):
        model = _build_tiny(ModelOptions(spec="local", attention="unfused"))
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("model kernels:"))
    assert f"masked_softmax_fusion={'on' if model.config.masked_softmax_fusion else 'off'}" in line


@pytest.mark.parametrize("cpu_init", [False, True])
def test_local_norm_is_built_where_megatron_builds_its_layers(monkeypatch, cpu_init):
    """On CUDA, megatron builds its layers on the current device unless ``use_cpu_initialization``
    (the trainer and ``oar-convert verify`` never call ``.cuda()``); the local spec's norm must
    follow, or the first forward mixes devices (seen on an H100: ``weight is on cpu``). CUDA is
    faked here with the meta device."""
    from types import SimpleNamespace

    from megatron_oar.models.local_norm import TorchRMSNorm

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: torch.device("meta"))
    config = SimpleNamespace(normalization="RMSNorm", layernorm_zero_centered_gamma=False,
                             memory_efficient_layer_norm=False, sequence_parallel=False,
                             use_cpu_initialization=cpu_init)
    norm = TorchRMSNorm(config, 16)
    assert norm.weight.device.type == ("cpu" if cpu_init else "meta")


def test_a_model_built_for_cuda_is_on_the_device_as_a_whole(monkeypatch, tmp_path):
    """megatron-core 0.16 creates the MoE router's weight on the CPU and leaves the move to its
    caller (Megatron-LM's ``get_model`` calls ``model.cuda()``); the trainer wraps the model as it
    is built, and megatron's Float16Module refused the CPU router (seen on an H200 under R3).
    Built for CUDA, every parameter must be on the device. CUDA is faked: megatron's layers go to
    the CPU (``current_device``) and ``Module.cuda`` moves to the meta device, which stands for it."""
    from megatron_oar.models import build_gpt_model, read_hf_config
    from megatron_oar.models.tiny import make_tiny_qwen3_moe
    from megatron_oar.runtime import destroy_runtime, init_runtime

    hf = read_hf_config(make_tiny_qwen3_moe(tmp_path / "hf", tokenizer=False))
    init_runtime()
    try:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: torch.device("cpu"))
        monkeypatch.setattr(torch.nn.Module, "cuda", lambda self, device=None: self.to("meta"))
        model = build_gpt_model(hf, ModelOptions(spec="local", moe_dispatcher="allgather"))
    finally:
        monkeypatch.undo()
        destroy_runtime()
    left = [n for n, p in model.named_parameters() if p.device.type != "meta"]
    # before the fix every parameter here (the fake builds megatron's layers on the CPU); on CUDA,
    # decoder.layers.{0,1}.mlp.router.weight
    assert not left, left
