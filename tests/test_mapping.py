"""Pure unit tests of megatron_oar.models.hf_mapping (no megatron runtime, no files)."""

from __future__ import annotations

import pytest
import torch

from megatron_oar.models import QwenArch, hf_mapping


def _arch(heads=8, groups=2, head_dim=4, layers=4, vocab=50, inter=24, tied=False) -> QwenArch:
    return QwenArch(vocab_size=vocab, hidden_size=heads * head_dim, intermediate_size=inter,
                    num_layers=layers, num_heads=heads, num_kv_heads=groups, head_dim=head_dim,
                    rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=64,
                    tie_word_embeddings=tied)


def _rows(n: int, base: float, hidden: int | None) -> torch.Tensor:
    """Rows whose values identify them: row r is base + r (+ column / 1000 for weights)."""
    r = torch.arange(n, dtype=torch.float32) + base
    if hidden is None:
        return r
    return r[:, None] + torch.arange(hidden, dtype=torch.float32)[None, :] / 1000


# ------------------------------------------------------------------------------------ qkv

@pytest.mark.parametrize("hidden", [32, None], ids=["weight", "bias"])
def test_merge_qkv_per_group_interleaving_hand_built(hidden):
    arch = _arch(heads=8, groups=2, head_dim=4)  # 4 query heads per group
    q = _rows(8 * 4, 0, hidden)      # 32 rows: group 0 = rows 0..15, group 1 = rows 16..31
    k = _rows(2 * 4, 1000, hidden)   # 8 rows: group 0 = rows 0..3, group 1 = rows 4..7
    v = _rows(2 * 4, 2000, hidden)
    merged = hf_mapping.merge_qkv(q, k, v, arch)

    expected = torch.cat([q[0:16], k[0:4], v[0:4],      # q_g0, k_g0, v_g0
                          q[16:32], k[4:8], v[4:8]])    # q_g1, k_g1, v_g1
    assert merged.shape == expected.shape == ((8 + 2 * 2) * 4, *q.shape[1:])
    assert torch.equal(merged, expected)
    # Row identities spelled out, so a wrong-but-consistent reshape cannot pass.
    first_col = merged if hidden is None else merged[:, 0]
    assert first_col.tolist() == ([float(i) for i in range(16)] + [1000.0 + i for i in range(4)]
                                  + [2000.0 + i for i in range(4)]
                                  + [float(i) for i in range(16, 32)]
                                  + [1004.0 + i for i in range(4)] + [2004.0 + i for i in range(4)])
    # A TP=2 shard is a plain dim-0 chunk holding exactly one whole query group.
    tp0, tp1 = merged.chunk(2)
    assert torch.equal(tp0, torch.cat([q[:16], k[:4], v[:4]]))
    assert torch.equal(tp1, torch.cat([q[16:], k[4:], v[4:]]))


@pytest.mark.parametrize("heads,groups,head_dim", [(8, 2, 4), (4, 4, 8), (6, 1, 2), (4, 2, 16)],
                         ids=["gqa", "mha", "mqa", "gqa_wide"])
@pytest.mark.parametrize("bias", [False, True], ids=["weight", "bias"])
def test_split_qkv_inverts_merge_qkv(heads, groups, head_dim, bias):
    arch = _arch(heads=heads, groups=groups, head_dim=head_dim)
    g = torch.Generator().manual_seed(heads * 100 + groups)
    tail = () if bias else (arch.hidden_size,)
    q = torch.randn(heads * head_dim, *tail, generator=g)
    k = torch.randn(groups * head_dim, *tail, generator=g)
    v = torch.randn(groups * head_dim, *tail, generator=g)
    merged = hf_mapping.merge_qkv(q, k, v, arch)
    assert merged.shape == ((heads + 2 * groups) * head_dim, *tail)
    q2, k2, v2 = hf_mapping.split_qkv(merged, arch)
    for a, b in ((q, q2), (k, k2), (v, v2)):
        assert b.is_contiguous()
        assert torch.equal(a, b)
    # and the other way round: merge(split(x)) == x for an arbitrary packed tensor
    packed = torch.randn_like(merged)
    assert torch.equal(hf_mapping.merge_qkv(*hf_mapping.split_qkv(packed, arch), arch), packed)


def test_merge_qkv_is_not_plain_concatenation_for_gqa():
    arch = _arch(heads=8, groups=2, head_dim=4)
    q, k, v = _rows(32, 0, 32), _rows(8, 1000, 32), _rows(8, 2000, 32)
    assert not torch.equal(hf_mapping.merge_qkv(q, k, v, arch), torch.cat([q, k, v]))
    # with a single group it is
    arch1 = _arch(heads=8, groups=1, head_dim=4)
    q, k, v = _rows(32, 0, 32), _rows(4, 1000, 32), _rows(4, 2000, 32)
    assert torch.equal(hf_mapping.merge_qkv(q, k, v, arch1), torch.cat([q, k, v]))


# ------------------------------------------------------------------------------ pad_vocab

def test_pad_vocab_appends_zero_rows():
    w = torch.randn(10, 3, dtype=torch.bfloat16) + 5
    p = hf_mapping.pad_vocab(w, 16)
    assert p.shape == (16, 3) and p.dtype == torch.bfloat16
    assert torch.equal(p[:10], w)
    assert torch.count_nonzero(p[10:]) == 0
    b = hf_mapping.pad_vocab(torch.ones(10), 12)  # 1-D too
    assert b.tolist() == [1.0] * 10 + [0.0, 0.0]


def test_pad_vocab_exact_and_too_small():
    w = torch.randn(16, 3)
    assert torch.equal(hf_mapping.pad_vocab(w, 16), w)
    with pytest.raises(ValueError, match="exceed padded size"):
        hf_mapping.pad_vocab(w, 8)


# --------------------------------------------------------------------- whole-layer mapping

def _hf_layer(arch: QwenArch, i: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h, d, inter = arch.hidden_size, arch.head_dim, arch.intermediate_size
    qd, kvd = arch.num_heads * d, arch.num_kv_heads * d
    shapes = {
        "input_layernorm.weight": (h,), "self_attn.q_proj.weight": (qd, h),
        "self_attn.q_proj.bias": (qd,), "self_attn.k_proj.weight": (kvd, h),
        "self_attn.k_proj.bias": (kvd,), "self_attn.v_proj.weight": (kvd, h),
        "self_attn.v_proj.bias": (kvd,), "self_attn.o_proj.weight": (h, qd),
        "post_attention_layernorm.weight": (h,), "mlp.gate_proj.weight": (inter, h),
        "mlp.up_proj.weight": (inter, h), "mlp.down_proj.weight": (h, inter),
    }
    return {f"model.layers.{i}.{n}": torch.randn(*s, generator=g) for n, s in shapes.items()}


@pytest.mark.parametrize("spec", ["local", "te"])
def test_layer_roundtrip_is_identity(spec):
    arch = _arch(heads=8, groups=2, head_dim=4, inter=24)
    i = 3
    hf = _hf_layer(arch, i)
    assert sorted(hf) == sorted(hf_mapping.hf_layer_names(arch, i))
    mc = hf_mapping.hf_to_mcore_layer(hf.__getitem__, arch, i, spec)
    assert list(mc) == hf_mapping.layer_names(spec)
    h = arch.hidden_size
    assert mc[hf_mapping.QKV_W].shape == ((8 + 2 * 2) * 4, h)
    assert mc[hf_mapping.QKV_B].shape == ((8 + 2 * 2) * 4,)
    assert mc[hf_mapping.FC1_W].shape == (2 * 24, h)
    p = f"model.layers.{i}."
    # gate first, then up
    assert torch.equal(mc[hf_mapping.FC1_W][:24], hf[p + "mlp.gate_proj.weight"])
    assert torch.equal(mc[hf_mapping.FC1_W][24:], hf[p + "mlp.up_proj.weight"])
    attn_norm, mlp_norm = hf_mapping.layer_names(spec)[0], hf_mapping.layer_names(spec)[4]
    assert torch.equal(mc[attn_norm], hf[p + "input_layernorm.weight"])
    assert torch.equal(mc[mlp_norm], hf[p + "post_attention_layernorm.weight"])

    back = hf_mapping.mcore_to_hf_layer(mc.__getitem__, arch, i, spec)
    assert sorted(back) == sorted(hf)
    for name, t in hf.items():
        assert back[name].shape == t.shape, name
        assert torch.equal(back[name], t), name


def test_layer_norm_names_per_spec_and_same_tensors():
    arch = _arch()
    hf = _hf_layer(arch, 0, seed=1)
    local = hf_mapping.hf_to_mcore_layer(hf.__getitem__, arch, 0, "local")
    te = hf_mapping.hf_to_mcore_layer(hf.__getitem__, arch, 0, "te")
    assert "input_layernorm.weight" in local and "pre_mlp_layernorm.weight" in local
    assert "self_attention.linear_qkv.layer_norm_weight" in te
    assert "mlp.linear_fc1.layer_norm_weight" in te
    assert "input_layernorm.weight" not in te
    for name, t in local.items():
        assert torch.equal(te[hf_mapping.rename_spec(name, "local", "te")], t), name


def test_unknown_spec_and_name():
    arch = _arch()
    with pytest.raises(ValueError, match="unknown layer spec"):
        hf_mapping.layer_names("transformer_engine")
    with pytest.raises(KeyError, match="no HF source"):
        hf_mapping.hf_to_mcore_layer_tensor(lambda n: torch.zeros(1), arch, 0, "bogus.weight", "te")
    with pytest.raises(KeyError, match="no HF source"):
        hf_mapping.hf_to_mcore_global(lambda n: torch.zeros(1), arch, "bogus", 64)


def test_rename_spec():
    assert hf_mapping.rename_spec("input_layernorm.weight", "local", "te") == \
        "self_attention.linear_qkv.layer_norm_weight"
    assert hf_mapping.rename_spec("pre_mlp_layernorm.weight", "local", "te") == \
        "mlp.linear_fc1.layer_norm_weight"
    assert hf_mapping.rename_spec("self_attention.linear_qkv.layer_norm_weight", "te", "local") == \
        "input_layernorm.weight"
    assert hf_mapping.rename_spec("mlp.linear_fc1.layer_norm_weight", "te", "local") == \
        "pre_mlp_layernorm.weight"
    # non-norm names and same-spec renames are untouched
    for name in (hf_mapping.QKV_W, hf_mapping.QKV_B, hf_mapping.PROJ_W, hf_mapping.FC1_W, hf_mapping.FC2_W):
        assert hf_mapping.rename_spec(name, "local", "te") == name
        assert hf_mapping.rename_spec(name, "te", "local") == name
    for spec in ("local", "te"):
        for name in hf_mapping.layer_names(spec):
            assert hf_mapping.rename_spec(name, spec, spec) == name
    # every name survives a round trip between the specs
    for name in hf_mapping.layer_names("local"):
        assert hf_mapping.rename_spec(hf_mapping.rename_spec(name, "local", "te"), "te", "local") == name
    assert [hf_mapping.rename_spec(n, "local", "te") for n in hf_mapping.layer_names("local")] == \
        hf_mapping.layer_names("te")


# ---------------------------------------------------------------------------- globals/names

@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_global_roundtrip_pads_and_trims_vocab(tied):
    arch = _arch(vocab=50, tied=tied)
    g = torch.Generator().manual_seed(7)
    hf = {hf_mapping.HF_EMBED: torch.randn(50, arch.hidden_size, generator=g),
          hf_mapping.HF_NORM: torch.randn(arch.hidden_size, generator=g)}
    if not tied:
        hf[hf_mapping.HF_HEAD] = torch.randn(50, arch.hidden_size, generator=g)
    padded = arch.padded_vocab_size(64)
    assert padded == 64
    keys = [hf_mapping.MC_EMBED, hf_mapping.MC_NORM] + ([] if tied else [hf_mapping.MC_HEAD])
    mc = {k: hf_mapping.hf_to_mcore_global(hf.__getitem__, arch, k, padded) for k in keys}
    assert mc[hf_mapping.MC_EMBED].shape == (64, arch.hidden_size)
    assert torch.count_nonzero(mc[hf_mapping.MC_EMBED][50:]) == 0
    back = hf_mapping.mcore_to_hf_global(mc.__getitem__, arch)
    assert sorted(back) == sorted(hf)
    for k, t in hf.items():
        assert torch.equal(back[k], t), k


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_hf_names(tied):
    arch = _arch(layers=3, tied=tied)
    names = hf_mapping.hf_names(arch)
    assert len(names) == len(set(names)) == 2 + 12 * 3 + (0 if tied else 1)
    assert (hf_mapping.HF_HEAD in names) is (not tied)
    assert "model.layers.2.mlp.up_proj.weight" in names
    assert not any(n.startswith("model.layers.3.") for n in names)
