"""Qwen3-MoE (Qwen3MoeForCausalLM) as a megatron-core GPTModel with MoE layers: the family,
the router's semantics, the HF names of the expert tensors, and logits and gradients on gloo.

Tiny random models from transformers' ``Qwen3MoeConfig`` (hidden 64, 4 heads, head_dim 32,
4 experts of width 32, top-2, fp32): "A", 2 layers, all MoE, ``norm_topk_prob=true`` (as the
released 30B-A3B / 235B-A22B); "B", 4 layers with ``decoder_sparse_step=2`` (dense, MoE, dense,
MoE: the dense MLPs 96 wide) and ``norm_topk_prob=false``.

At TP=1 the slow tests load the HF weights into each rank's megatron shard directly, through the
family's mapping (:func:`_load_hf`; EP and PP pick the rank's experts and layers); at TP > 1 (with
sequence parallelism, which megatron's MoE layer requires there) they load the checkpoint
``oar-convert`` wrote (tests/test_qwen3_moe_convert.py tests the converter itself).

Fast (about 10 s with imports): config parsing and refusals naming the field, layout refusals
naming the key, the megatron settings, megatron's routing == transformers' router on the same
hidden states, the HF <-> megatron mapping under both specs, a one-process build (names equal the
mapping's, frozen router). Slow (pooled gloo ranks, about 22 s on 2 cores with the pool warm,
measured under a load average near 20; the whole file about 35 s): one world of 2 ranks runs TP1
(as DP2), EP2, PP2 and TP2 for both models, TP2 x EP2 with expert TP 1 for B, and a backward pass
at EP1, EP2 and TP2 with sequence parallelism through megatron's DDP and ``finalize_model_grads``
(gradients finite and equal; at TP2 those of the TP-replicated norms and routers, which megatron
sums over TP by their ``sequence_parallel`` mark); one world of 4 runs EP2xPP2 and EP4 for both,
TP2 x EP2 (expert TP 2) for A, and under context parallelism CP2 x EP4 and TP2 x CP2 x EP2 for
A (routing and the dispatch on each rank's chunks; two more builds, a few seconds). Measured:
max |dlogit| 2.4e-7 (A) and 2.8e-7 (B) at the TP1 layouts, at most 4.2e-7 at TP2; EP2 vs EP1
gradients within 3e-7 of each tensor's largest, TP2's (replicated parameters) within 1.1e-6.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from megatron_oar.models import ModelConfigError, ModelOptions, hf_mapping, parse_arch
from megatron_oar.models.builder import check_layout, moe_layer_pattern, transformer_config
from megatron_oar.models.families.qwen3_moe import (
    HF_ROUTER,
    PRE_MLP_NORM,
    ROUTER_W,
    expert_name,
    global_expert_name,
    parse_expert_name,
)
from megatron_oar.runtime import ParallelConfig
from megatron_oar.runtime.distributed import validate_layout
from tests.distributed import launch
from tests.tiny import hf_logits, make_tiny_qwen3_moe, read_config

TOL = 1e-4
GRAD_TOL = 1e-5  # relative to the largest gradient of the tensor: fp32 rounding, summed differently
QWEN3_30B_A3B = {  # the fields of Qwen/Qwen3-30B-A3B's config.json that matter
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_act": "silu",
    "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
    "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
    "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1,
    "mlp_only_layers": [], "attention_bias": False, "vocab_size": 151936, "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0, "rope_scaling": None, "max_position_embeddings": 40960,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_sliding_window": False,
    "sliding_window": None, "max_window_layers": 48, "output_router_logits": False,
    "router_aux_loss_coef": 0.001,
}
QWEN3_235B_A22B = {**QWEN3_30B_A3B, "hidden_size": 4096, "intermediate_size": 12288,
                   "moe_intermediate_size": 1536, "num_hidden_layers": 94,
                   "num_attention_heads": 64, "max_window_layers": 94}
MODEL_B = dict(num_hidden_layers=4, decoder_sparse_step=2, norm_topk_prob=False)


# ---------------------------------------------------------------------------------------------
# fast: config.json -> arch, refusals, megatron settings


def test_parse_released_configs():
    a = parse_arch(QWEN3_30B_A3B)
    assert (a.family, a.num_experts, a.moe_topk, a.moe_intermediate_size) == ("qwen3_moe", 128, 8, 768)
    assert a.norm_topk_prob and a.is_moe and a.moe_layers == (True,) * 48
    assert a.qk_norm and not a.qkv_bias and a.head_dim == 128 and not a.tie_word_embeddings
    b = parse_arch(QWEN3_235B_A22B)
    assert (b.num_layers, b.num_heads, b.moe_intermediate_size) == (94, 64, 1536)
    # by model_type alone; and transformers' own to_dict(), which names the experts
    # num_local_experts and nests rope_theta
    by_type = {k: v for k, v in QWEN3_30B_A3B.items() if k != "architectures"}
    assert parse_arch(by_type) == a
    from transformers import Qwen3MoeConfig

    from tests.tiny import SMALL_QWEN3_MOE

    tiny = parse_arch(Qwen3MoeConfig(**{**SMALL_QWEN3_MOE, **MODEL_B}).to_dict())
    assert (tiny.num_experts, tiny.moe_topk, tiny.moe_intermediate_size) == (4, 2, 32)
    assert tiny.moe_layers == (False, True, False, True) and not tiny.norm_topk_prob
    assert tiny.intermediate_size == 96 and tiny.rope_theta == 1e6


@pytest.mark.parametrize("step,mlp_only,want", [
    (1, [], [1, 1, 1, 1]), (2, [], [0, 1, 0, 1]), (1, [0, 2], [0, 1, 0, 1]), (1, [3], [1, 1, 1, 0]),
    (3, [], [0, 0, 1, 0]), (2, [1], [0, 0, 0, 1]),
])
def test_layer_pattern_matches_transformers(step, mlp_only, want):
    """HF's rule (layer i is MoE iff i not in mlp_only_layers and (i+1) % decoder_sparse_step
    == 0) as megatron's moe_layer_freq, read back the way megatron's block spec reads it."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeDecoderLayer

    hf = {**QWEN3_30B_A3B, "num_hidden_layers": 4, "decoder_sparse_step": step, "mlp_only_layers": mlp_only}
    arch = parse_arch(hf)
    assert [int(x) for x in arch.moe_layers] == want
    cfg = transformer_config(arch, ModelOptions(), tp=1, pp=1, perform_initialization=False)
    assert moe_layer_pattern(cfg) == want
    assert cfg.moe_layer_freq == (1 if all(want) else want)
    small = Qwen3MoeConfig(hidden_size=16, intermediate_size=8, moe_intermediate_size=8, num_attention_heads=2,
                           num_key_value_heads=1, head_dim=8, num_hidden_layers=4, num_experts=2,
                           num_experts_per_tok=1, decoder_sparse_step=step, mlp_only_layers=mlp_only)
    hf_pattern = [int(type(Qwen3MoeDecoderLayer(small, i).mlp).__name__ == "Qwen3MoeSparseMoeBlock")
                  for i in range(4)]
    assert hf_pattern == want


def test_megatron_router_settings():
    """The TransformerConfig the builder makes: transformers' router, RL-safe defaults, the
    local spec's SequentialMLP and the allgather dispatcher on CPU."""
    for norm_topk in (True, False):
        arch = parse_arch({**QWEN3_30B_A3B, "norm_topk_prob": norm_topk})
        cfg = transformer_config(arch, ModelOptions(dtype="bf16"), tp=1, pp=4, ep=8,
                                 perform_initialization=False)
        assert cfg.num_moe_experts == 128 and cfg.moe_router_topk == 8
        assert cfg.moe_ffn_hidden_size == 768 and cfg.ffn_hidden_size == 6144
        assert cfg.moe_router_score_function == "softmax"
        assert cfg.moe_router_pre_softmax is (not norm_topk)
        assert cfg.moe_router_topk_scaling_factor is None and not cfg.moe_router_enable_expert_bias
        assert cfg.moe_router_load_balancing_type == "none" and cfg.moe_aux_loss_coeff == 0.0
        assert cfg.moe_z_loss_coeff is None and cfg.moe_expert_capacity_factor is None
        assert cfg.moe_router_dtype == "fp32"
        assert cfg.moe_shared_expert_intermediate_size is None
        assert (cfg.expert_model_parallel_size, cfg.expert_tensor_parallel_size) == (8, 1)
        assert cfg.moe_token_dispatcher_type == "allgather" and not cfg.moe_grouped_gemm
        assert cfg.qk_layernorm and cfg.kv_channels == 128


REFUSALS = [
    ({"num_experts": None}, "missing field 'num_experts'"),
    ({"num_experts": 0}, "num_experts=0"),
    ({"num_experts_per_tok": None}, "missing field 'num_experts_per_tok'"),
    ({"num_experts_per_tok": 129}, "num_experts_per_tok=129 exceeds num_experts=128"),
    ({"moe_intermediate_size": None}, "missing field 'moe_intermediate_size'"),
    ({"decoder_sparse_step": 0}, "decoder_sparse_step=0"),
    ({"mlp_only_layers": [48]}, "mlp_only_layers=[48]"),
    ({"mlp_only_layers": list(range(48))}, "leave no MoE layer"),
    ({"decoder_sparse_step": 49}, "decoder_sparse_step=49"),
    ({"shared_expert_intermediate_size": 5632}, "shared_expert_intermediate_size=5632"),
    ({"norm_topk_prob": "yes"}, "norm_topk_prob='yes'"),
    ({"num_experts_per_tok": 1}, "num_experts_per_tok=1 with norm_topk_prob=true"),
    ({"attention_bias": True}, "attention_bias=true"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, "rope_scaling="),
]


@pytest.mark.parametrize("change,message", REFUSALS, ids=[f"{i}-{next(iter(c))}" for i, (c, _) in enumerate(REFUSALS)])
def test_unrepresentable_config_refused_naming_the_field(change, message):
    hf = {k: v for k, v in {**QWEN3_30B_A3B, **change}.items() if v is not None}
    with pytest.raises(ModelConfigError, match=re.escape(message)) as e:
        parse_arch(hf, source="m/config.json")
    assert str(e.value).startswith("m/config.json: ")


def test_intermediate_size_needed_only_with_dense_layers():
    hf = {k: v for k, v in QWEN3_30B_A3B.items() if k != "intermediate_size"}
    assert parse_arch(hf).intermediate_size == 768  # unused: every layer is a MoE layer
    with pytest.raises(ModelConfigError, match="missing field 'intermediate_size'"):
        parse_arch({**hf, "mlp_only_layers": [0]})


def test_layout_refusals_name_the_key():
    arch = parse_arch(QWEN3_30B_A3B)
    check_layout(arch, 4, 2, flag="parallel.tp", ep=8, etp=1)
    with pytest.raises(ModelConfigError, match=r"parallel\.ep=3 does not divide num_experts=128"):
        check_layout(arch, 1, 1, flag="parallel.tp", ep=3)
    with pytest.raises(ModelConfigError, match=r"parallel\.etp=5 does not divide moe_intermediate_size=768"):
        check_layout(arch, 1, 1, flag="parallel.tp", ep=1, etp=5)
    with pytest.raises(ModelConfigError, match=r"parallel\.tp=4 \(the expert TP by default\) does not "
                                               r"divide moe_intermediate_size=98"):
        check_layout(parse_arch({**QWEN3_30B_A3B, "moe_intermediate_size": 98}), 4, 1, flag="parallel.tp")
    with pytest.raises(ModelConfigError, match=r"parallel\.ep=0 must be a positive integer"):
        check_layout(arch, 1, 1, flag="parallel.tp", ep=0)
    dense = parse_arch({**QWEN3_30B_A3B, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"})
    with pytest.raises(ModelConfigError, match=r"parallel\.ep=2: expert parallelism needs a mixture-of-experts"):
        check_layout(dense, 1, 1, flag="parallel.tp", ep=2)
    with pytest.raises(ModelConfigError, match=r"parallel\.tp=2 with a mixture-of-experts model needs "
                                               r"parallel\.sequence_parallel=true"):
        transformer_config(arch, ModelOptions(), tp=2, pp=1, perform_initialization=False)
    with pytest.raises(ModelConfigError, match=r"model\.moe_dispatcher='alltoall' needs CUDA"):
        transformer_config(arch, ModelOptions(moe_dispatcher="alltoall"), tp=1, pp=1,
                           perform_initialization=False)
    with pytest.raises(ModelConfigError, match=r"model\.moe_dispatcher='flex'"):
        transformer_config(arch, ModelOptions(moe_dispatcher="flex"), tp=1, pp=1, perform_initialization=False)
    # the world: megatron's tp*pp and etp*ep*pp both divide it
    assert validate_layout(8, ParallelConfig(tp=2, pp=2, ep=4, etp=1)) == 2
    with pytest.raises(ValueError, match=r"world size 8 is not divisible by "
                                         r"parallel\.etp\*parallel\.ep\*parallel\.pp = 2\*4\*2"):
        validate_layout(8, ParallelConfig(tp=2, pp=2, ep=4))
    with pytest.raises(ValueError, match=r"parallel\.ep must be >= 1"):
        validate_layout(8, ParallelConfig(ep=0))


def test_config_validation_names_the_keys():
    """oar train's validation (before launch): EP against the experts and the world, and the
    dispatcher, each naming its key."""
    from megatron_oar.config import ConfigError, validate
    from tests.test_config import example

    def cfg(*overrides):
        return example("tiny_cpu.yaml", "parallel.tp=1", *overrides)

    validate(cfg("parallel.ep=2"), world_size=2, hf_config=QWEN3_30B_A3B)
    with pytest.raises(ConfigError, match=r"parallel\.ep=2 does not divide num_experts=3"):
        validate(cfg("parallel.ep=2"), world_size=2,
                 hf_config={**QWEN3_30B_A3B, "num_experts": 3, "num_experts_per_tok": 2})
    with pytest.raises(ConfigError, match=r"parallel\.etp\*parallel\.ep\*parallel\.pp = 1\*4\*1 does not "
                                          r"divide the world size 2"):
        validate(cfg("parallel.ep=4"), world_size=2)
    with pytest.raises(ConfigError, match=r"parallel\.ep=2: expert parallelism needs a mixture-of-experts"):
        validate(cfg("parallel.ep=2"), world_size=2,
                 hf_config={**QWEN3_30B_A3B, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"})
    with pytest.raises(ConfigError, match=r"model\.moe_dispatcher='deepep'"):
        validate(cfg("model.moe_dispatcher=deepep"), world_size=2)
    with pytest.raises(ConfigError, match=r"parallel\.etp=0"):
        validate(cfg("parallel.etp=0"), world_size=2)


# ---------------------------------------------------------------------------------------------
# fast: megatron's routing == transformers' router


@pytest.mark.parametrize("norm_topk,topk", [(True, 2), (True, 3), (False, 1), (False, 2), (False, 3)])
def test_router_matches_transformers(norm_topk, topk):
    """On the same hidden states and router weight: the same experts per token and the same
    weights (transformers' Qwen3MoeTopKRouter vs megatron's gating linear + routing function
    under the settings the builder chose)."""
    from megatron.core.transformer.moe.moe_utils import router_gating_linear, topk_routing_with_score_function
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    from megatron_oar.runtime.cpu_backend import patch_megatron_moe_without_te

    patch_megatron_moe_without_te()
    g = torch.Generator().manual_seed(topk)
    hf_cfg = Qwen3MoeConfig(hidden_size=64, num_experts=8, num_experts_per_tok=topk, norm_topk_prob=norm_topk)
    router = Qwen3MoeTopKRouter(hf_cfg)
    with torch.no_grad():
        router.weight.copy_(torch.randn(8, 64, generator=g) * 0.2)
    hidden = torch.randn(256, 64, generator=g)
    _, weights, indices = router(hidden)

    arch = parse_arch({**QWEN3_30B_A3B, "num_experts": 8, "num_experts_per_tok": topk,
                       "norm_topk_prob": norm_topk})
    cfg = transformer_config(arch, ModelOptions(), tp=1, pp=1, perform_initialization=False)
    logits = router_gating_linear(hidden, router.weight, None, torch.float32)
    probs, routing_map = topk_routing_with_score_function(
        logits, cfg.moe_router_topk, use_pre_softmax=cfg.moe_router_pre_softmax,
        num_groups=cfg.moe_router_num_groups, group_topk=cfg.moe_router_group_topk,
        scaling_factor=cfg.moe_router_topk_scaling_factor, score_function=cfg.moe_router_score_function)
    want_map = torch.zeros(256, 8, dtype=torch.bool).scatter(1, indices, True)
    assert torch.equal(routing_map, want_map)
    want = torch.zeros(256, 8).scatter(1, indices, weights)
    diff = (probs - want).abs().max().item()
    print(f"topk={topk} norm_topk_prob={norm_topk}: max|dweight|={diff:.2e}")
    assert diff <= 1e-6
    if norm_topk:
        torch.testing.assert_close(probs.sum(-1), torch.ones(256))


# ---------------------------------------------------------------------------------------------
# fast: HF <-> megatron names


@pytest.mark.parametrize("spec", ["local", "te"])
def test_mapping_roundtrip(spec):
    """Per layer (dense and MoE): names, HF shapes, HF -> megatron -> HF identity; a dense layer
    refuses the router, and expert indices stop at num_experts. (The vLLM sync's per-tensor
    conversion is not checked: EP gathers and its spec renaming are the sync's slice.)"""
    arch = parse_arch({**QWEN3_30B_A3B, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
                       "head_dim": 32, "intermediate_size": 96, "moe_intermediate_size": 32, "num_experts": 4,
                       "num_experts_per_tok": 2, "num_hidden_layers": 2, "mlp_only_layers": [0],
                       "vocab_size": 100})
    shapes = hf_mapping.hf_shapes(arch)
    assert shapes["model.layers.0.mlp.gate_proj.weight"] == (96, 64)
    assert shapes["model.layers.1.mlp.gate.weight"] == (4, 64)
    assert shapes["model.layers.1.mlp.experts.3.gate_proj.weight"] == (32, 64)
    assert shapes["model.layers.1.mlp.experts.3.down_proj.weight"] == (64, 32)
    assert "model.layers.1.mlp.gate_proj.weight" not in shapes and "model.layers.0.mlp.gate.weight" not in shapes
    assert len(shapes) == 3 + 11 + (8 + 1 + 3 * 4)
    moe_names = hf_mapping.layer_names(spec, arch, 1)
    assert hf_mapping.layer_names(spec, arch) == moe_names
    assert {ROUTER_W, PRE_MLP_NORM, expert_name(spec, 3, "linear_fc1")} <= set(moe_names)
    assert hf_mapping.layer_names(spec, arch, 0) == hf_mapping.layer_names(
        spec, parse_arch({**QWEN3_30B_A3B, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}))

    g = torch.Generator().manual_seed(0)
    hf = {k: torch.randn(s, generator=g) for k, s in shapes.items()}
    for i in range(arch.num_layers):
        mc = hf_mapping.hf_to_mcore_layer(hf.__getitem__, arch, i, spec)
        assert list(mc) == hf_mapping.layer_names(spec, arch, i)
        back = hf_mapping.mcore_to_hf_layer(mc.__getitem__, arch, i, spec)
        assert back.keys() == set(hf_mapping.hf_layer_names(arch, i))
        assert all(torch.equal(back[k], hf[k]) for k in back)
    mc = hf_mapping.hf_to_mcore_layer(hf.__getitem__, arch, 1, spec)
    p = "model.layers.1."
    assert torch.equal(mc[ROUTER_W], hf[p + HF_ROUTER])
    assert torch.equal(mc[PRE_MLP_NORM], hf[p + "post_attention_layernorm.weight"])
    assert torch.equal(mc[expert_name(spec, 2, "linear_fc1")],
                       torch.cat([hf[p + "mlp.experts.2.gate_proj.weight"], hf[p + "mlp.experts.2.up_proj.weight"]]))
    assert torch.equal(mc[expert_name(spec, 2, "linear_fc2")], hf[p + "mlp.experts.2.down_proj.weight"])
    with pytest.raises(KeyError, match="no HF source"):
        hf_mapping.hf_to_mcore_layer_tensor(hf.__getitem__, arch, 0, ROUTER_W, spec)
    with pytest.raises(KeyError, match="no HF source"):
        hf_mapping.hf_to_mcore_layer_tensor(hf.__getitem__, arch, 1, expert_name(spec, 4, "linear_fc1"), spec)


def test_expert_names():
    assert expert_name("local", 3, "linear_fc1") == "mlp.experts.local_experts.3.linear_fc1.weight"
    assert expert_name("te", 3, "linear_fc2") == "mlp.experts.linear_fc2.weight3"
    assert parse_expert_name("mlp.experts.linear_fc1.weight12") == ("te", 12, "linear_fc1")
    assert parse_expert_name("mlp.experts.local_experts.0.linear_fc2.weight") == ("local", 0, "linear_fc2")
    assert parse_expert_name("mlp.linear_fc1.weight") is None
    assert global_expert_name("mlp.experts.local_experts.1.linear_fc1.weight", 64) == \
        "mlp.experts.local_experts.65.linear_fc1.weight"
    assert global_expert_name("mlp.experts.linear_fc2.weight0", 2) == "mlp.experts.linear_fc2.weight2"
    assert global_expert_name(ROUTER_W, 2) == ROUTER_W


def test_built_model_matches_the_mapping():
    """One process, local spec: dense and MoE layers where HF has them, each layer's parameters
    exactly the mapping's names, SequentialMLP experts, an fp32-computing router; a MoE layer's
    MLP-input norm keeps its own checkpoint key; with model.freeze_router a forward/backward
    leaves the routers without gradients and trains the experts."""
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from checkpoints_convert.convert import _single_process_runtime
    from megatron_oar.models import build_gpt_model
    from megatron_oar.models.forward import position_ids_for

    arch = parse_arch({**QWEN3_30B_A3B, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
                       "head_dim": 32, "intermediate_size": 96, "moe_intermediate_size": 32, "num_experts": 4,
                       "num_experts_per_tok": 2, "num_hidden_layers": 4, "decoder_sparse_step": 2,
                       "vocab_size": 100})
    tokens = torch.randint(0, 100, (2, 9), generator=torch.Generator().manual_seed(0))
    with _single_process_runtime():
        model = build_gpt_model(arch, ModelOptions(spec="local", freeze_router=True))
        keys = {v.key for v in model.sharded_state_dict().values() if hasattr(v, "key")}
        loss = model(tokens[:, :-1], position_ids_for(tokens[:, :-1]), attention_mask=None, labels=tokens[:, 1:])
        loss.sum().backward()
    assert [type(layer.mlp) for layer in model.decoder.layers] == [MLP, MoELayer, MLP, MoELayer]
    params = dict(model.named_parameters())
    for i, layer in enumerate(model.decoder.layers):
        mine = {n[len(f"decoder.layers.{i}."):] for n in params if n.startswith(f"decoder.layers.{i}.")}
        assert mine == set(hf_mapping.layer_names("local", arch, i)), i
    moe = model.decoder.layers[1]
    assert isinstance(moe.mlp.experts, SequentialMLP) and len(moe.mlp.experts.local_experts) == 4
    assert isinstance(moe.pre_mlp_layernorm, torch.nn.RMSNorm)
    assert moe.mlp.router.config.moe_router_dtype == "fp32"
    assert "decoder.layers.1.pre_mlp_layernorm.weight" in keys  # a MoE layer's: not the dense fc1's
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in keys  # a dense layer's
    for i in (1, 3):
        router = params[f"decoder.layers.{i}.{ROUTER_W}"]
        assert not router.requires_grad and router.grad is None
        fc1 = params[f"decoder.layers.{i}.{expert_name('local', 0, 'linear_fc1')}"]
        assert fc1.grad is not None and torch.isfinite(fc1.grad).all()


# ---------------------------------------------------------------------------------------------
# slow: logits and gradients on gloo ranks (weights loaded through the mapping)


def hf_tensors(hf_dir: Path) -> dict[str, torch.Tensor]:
    """An HF checkpoint's tensors. transformers fuses the experts in memory
    (``mlp.experts.gate_up_proj``) but saves them per expert, as the released checkpoints are."""
    from safetensors.torch import load_file

    return load_file(str(Path(hf_dir) / "model.safetensors"))


def _global_names(model):
    """(global megatron name, parameter) of this rank's shard: decoder layers by their global
    number, experts by their global index (TP=1 only)."""
    from megatron.core import parallel_state as ps

    first_expert = ps.get_expert_model_parallel_rank() * (
        model.config.num_moe_experts // ps.get_expert_model_parallel_world_size())
    for name, p in model.named_parameters():
        if name.startswith(hf_mapping.MC_LAYER_PREFIX):
            local, rel = name[len(hf_mapping.MC_LAYER_PREFIX):].split(".", 1)
            i = model.decoder.layers[int(local)].layer_number - 1
            yield i, global_expert_name(rel, first_expert), p
        else:
            yield None, name, p


def _load_hf(model, arch, hf_dir: str, spec: str) -> None:
    """HF weights into this rank's shard through the family's mapping (TP=1; the converter's
    MoE support is the next slice)."""
    tensors = hf_tensors(Path(hf_dir))
    padded = arch.padded_vocab_size()
    with torch.no_grad():
        for i, name, p in _global_names(model):
            if i is None:
                t = hf_mapping.hf_to_mcore_global(tensors.__getitem__, arch, name, padded)
            else:
                t = hf_mapping.hf_to_mcore_layer_tensor(tensors.__getitem__, arch, i, name, spec)
            assert t.shape == p.shape, (i, name, t.shape, p.shape)
            p.copy_(t)


def _build(hf_dir: str, tp: int, pp: int, ep: int, etp: int | None = None, ckpt: str | None = None,
           cp: int = 1):
    """This rank's shard at the layout: HF weights through the mapping (TP=1), or at TP > 1 (with
    sequence parallelism) the converter's checkpoint ``ckpt``."""
    from megatron_oar.models import ModelOptions, build_gpt_model
    from megatron_oar.models.model_checkpoint import load_model
    from megatron_oar.runtime import ParallelConfig, init_runtime

    init_runtime(ParallelConfig(tp=tp, pp=pp, ep=ep, etp=etp, cp=cp))
    arch = parse_arch(read_config(Path(hf_dir)))
    model = build_gpt_model(arch, ModelOptions(spec="local", sequence_parallel=tp > 1))
    if tp == 1:
        _load_hf(model, arch, hf_dir, "local")
    else:
        load_model(model, ckpt)
    return model, arch


def _logits_worker(jobs: list, tokens: torch.Tensor) -> None:
    """Each (hf_dir, ckpt, (tp, pp, ep, etp[, cp]), out) in this one world: the logits on data-,
    tensor- and context-parallel rank 0 of the last stage (under CP gathered over it)."""
    from megatron.core import parallel_state as ps

    from megatron_oar.models.forward import forward_logits

    for hf_dir, ckpt, (tp, pp, ep, etp, *cp), out in jobs:
        model, arch = _build(hf_dir, tp, pp, ep, etp, ckpt, *cp)
        logits = forward_logits(model, tokens, micro_batch_size=1, vocab_size=arch.vocab_size)
        if (logits is not None and ps.get_data_parallel_rank() == 0 and ps.get_tensor_model_parallel_rank() == 0
                and ps.get_context_parallel_rank() == 0):
            torch.save(logits, out)


def _grads_worker(hf_dir: str, ep: int, tokens: torch.Tensor, out: str) -> None:
    """One backward pass of the summed cross entropy, data-parallel rank r on row r: gradients
    summed over data parallelism (the experts' over expert data parallelism), by global name."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_oar.models.forward import position_ids_for

    model, _ = _build(hf_dir, 1, 1, ep)
    model.train()
    r = ps.get_data_parallel_rank()
    row = tokens[r:r + 1]
    loss = model(row[:, :-1], position_ids_for(row[:, :-1]), attention_mask=None, labels=row[:, 1:])
    loss.sum().backward()
    grads = {}
    for i, name, p in _global_names(model):
        expert = parse_expert_name(name) is not None
        group = ps.get_expert_data_parallel_group() if expert else ps.get_data_parallel_group()
        g = p.grad.clone()
        dist.all_reduce(g, group=group)
        grads[name if i is None else f"{i}.{name}"] = g
    torch.save(grads, f"{out}.rank{dist.get_rank()}")


def _sp_grads_worker(hf_dir: str, ckpt: str, tokens: torch.Tensor, out: str) -> None:
    """TP2 with sequence parallelism (DP1): the backward pass of both rows through megatron's DDP
    and ``finalize_model_grads``, which sums the gradients of the parameters marked
    ``sequence_parallel`` (norms, routers) over TP. Those replicated parameters' gradients, by
    global name, from TP rank 0."""
    import torch.distributed as dist
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    from megatron_oar.models.forward import position_ids_for

    gpt, _ = _build(hf_dir, 2, 1, 1, None, ckpt)
    model = DistributedDataParallel(gpt.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), gpt)
    model.train()
    model.zero_grad_buffer()
    loss = model(tokens[:, :-1], position_ids_for(tokens[:, :-1]), attention_mask=None, labels=tokens[:, 1:])
    loss.sum().backward()
    finalize_model_grads([model])
    grads = {}
    for i, name, p in _global_names(gpt):
        if not getattr(p, "tensor_model_parallel", False):
            assert p.sequence_parallel, name  # what megatron sums over TP
            grads[name if i is None else f"{i}.{name}"] = p.main_grad.clone()
    if dist.get_rank() == 0:
        torch.save(grads, out)


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory):
    from checkpoints_convert.convert import hf_to_megatron

    root = tmp_path_factory.mktemp("qwen3_moe")
    tokens = torch.randint(0, 1000, (2, 24), generator=torch.Generator().manual_seed(0))
    out = {}
    for name, overrides in (("A", {}), ("B", MODEL_B)):
        hf = make_tiny_qwen3_moe(root / name, seed=7, **overrides)
        hf_to_megatron(hf, root / f"{name}_ckpt", progress=False)  # for the TP > 1 layouts
        out[name] = dict(hf=hf, ckpt=root / f"{name}_ckpt", ref=hf_logits(hf, tokens))
    return root, tokens, out


def _jobs(root: Path, models: dict, layouts: dict[str, list]) -> list:
    return [(str(models[name]["hf"]), str(models[name]["ckpt"]), layout,
             str(root / f"{name}_tp{layout[0]}pp{layout[1]}ep{layout[2]}etp{layout[3]}cp{(layout[4:] or (1,))[0]}.pt"))
            for name, mine in layouts.items() for layout in mine]


def test_tiny_models_and_mapping_agree(moe_models):
    """The saved tiny models hold exactly the tensors the mapping names, with its shapes."""
    _, _, models = moe_models
    for m in models.values():
        arch = parse_arch(read_config(m["hf"]))
        tensors = hf_tensors(m["hf"])
        assert {k: tuple(v.shape) for k, v in tensors.items()} == hf_mapping.hf_shapes(arch)


@pytest.mark.slow
def test_logits_and_gradients_world2(moe_models):
    """TP1 (as DP2), EP2, PP2 and TP2 (sequence parallel, expert TP 2) logits, and TP2 x EP2 with
    expert TP 1, equal transformers'; a backward pass at EP2 gives EP1's gradients (finite, within
    fp32 rounding)."""
    root, tokens, models = moe_models
    both = [(1, 1, 1, None), (1, 1, 2, None), (1, 2, 1, None), (2, 1, 1, None)]  # (tp, pp, ep, etp)
    jobs = _jobs(root, models, {"A": both, "B": both + [(2, 1, 2, 1)]})
    launch(_logits_worker, 2, jobs, tokens)
    _check_logits(jobs, models)
    grads = {}
    tokens = tokens[:, :23]  # inputs of 22 tokens: split in two by sequence parallelism at TP2
    for ep in (1, 2):
        out = str(root / f"grads_ep{ep}")
        launch(_grads_worker, 2, str(models["A"]["hf"]), ep, tokens, out)
        merged: dict[str, torch.Tensor] = {}
        for rank in range(2):
            for k, v in torch.load(f"{out}.rank{rank}").items():
                assert k not in merged or torch.equal(merged[k], v), k  # replicas agree
                merged[k] = v
        grads[ep] = merged
    launch(_sp_grads_worker, 2, str(models["A"]["hf"]), str(models["A"]["ckpt"]), tokens,
           str(root / "grads_tp2"))
    grads["tp2"] = torch.load(root / "grads_tp2")
    assert len(grads["tp2"]) == 1 + 2 * 5  # final norm; per layer 2 norms, q/k norms, router
    assert grads[1].keys() == grads[2].keys() >= grads["tp2"].keys()
    sp_worst = 0.0
    for k, a in grads["tp2"].items():  # the TP-replicated parameters under sequence parallelism
        rel = (a - grads[1][k]).abs().max().item() / grads[1][k].abs().max().item()
        sp_worst = max(sp_worst, rel)
        assert rel <= GRAD_TOL, (k, rel)
    print(f"TP2 (SP) vs TP1 gradients of the replicated parameters: worst {sp_worst:.2e}")
    worst = 0.0
    for k, a in grads[1].items():
        b = grads[2][k]
        assert torch.isfinite(a).all() and torch.isfinite(b).all(), k
        scale = a.abs().max().item()
        assert scale > 0 or "output_layer" in k or "embedding" in k, k
        rel = (a - b).abs().max().item() / max(scale, 1e-30)
        worst = max(worst, rel)
        assert rel <= GRAD_TOL, (k, rel)
    print(f"EP2 vs EP1 gradients: worst max|dgrad|/max|grad| = {worst:.2e} over {len(grads[1])} tensors")


@pytest.mark.slow
def test_logits_world4(moe_models):
    """EP2 x PP2 and EP4 (one expert per rank) logits, and TP2 x EP2 (sequence parallel, expert
    TP 2) for A, equal transformers'; under context parallelism for A, CP2 x EP4 (the expert
    group spans the CP and DP ranks) and TP2 x CP2 x EP2 (sequence parallel: each TP rank routes
    its share of its CP rank's chunks)."""
    root, tokens, models = moe_models
    both = [(1, 2, 2, None), (1, 1, 4, None)]
    jobs = _jobs(root, models, {"A": both + [(2, 1, 2, None), (1, 1, 4, None, 2), (2, 1, 2, None, 2)],
                                "B": both})
    launch(_logits_worker, 4, jobs, tokens)
    _check_logits(jobs, models)


def _check_logits(jobs, models) -> None:
    for hf_dir, _, layout, out in jobs:
        name = Path(hf_dir).name
        got, ref = torch.load(out), models[name]["ref"]
        diff = (got - ref).abs().max().item()
        print(f"qwen3-moe {name} (tp, pp, ep, etp)={layout} max|dlogit|={diff:.3e}")
        assert got.shape == ref.shape
        assert diff <= TOL, (name, layout, diff)
        assert torch.equal(got.argmax(-1), ref.argmax(-1))
