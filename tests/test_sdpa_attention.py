"""``models/sdpa_attention.py``: PyTorch SDPA as megatron's local core attention.

The module against megatron's unfused ``DotProductAttention`` built from the same config, in a
gloo world of one (TP1; the passes at TP2 and PP2, padded and packed, are tests/test_packing.py's):
outputs and input gradients, both in float64, agree to float64 rounding (tests/tolerances.py)
for causal GQA self-attention, an explicit mask, a single query, and packed THD rows against
each row alone; the builder wires ``model.attention`` into the layer spec and the kernel line;
bad settings are refused naming the key. Cost: about 3 s (one process, no ranks).
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import launch
from tests.tolerances import reduction_tol

HEADS, GROUPS, DIM = 4, 2, 16
DTYPE = torch.float64  # both modules compute in float64: a tolerance of float64 rounding, not fp32's
LONGEST = 13  # the longest sequence below
# scores (DIM), the softmax's sum and probabilities x values (the sequence); backwards the same
TOL = reduction_tol(DIM, LONGEST, LONGEST, DIM, LONGEST, LONGEST, dtype=DTYPE)


def _config(dtype=DTYPE):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(num_layers=1, hidden_size=HEADS * DIM, num_attention_heads=HEADS,
                             num_query_groups=GROUPS, kv_channels=DIM, attention_dropout=0.0,
                             hidden_dropout=0.0, use_cpu_initialization=True, params_dtype=dtype,
                             masked_softmax_fusion=False, attention_softmax_in_fp32=True)


def _pair():
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_oar.models.sdpa_attention import SDPAttention

    cfg = _config()
    kw = dict(config=cfg, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    return DotProductAttention(**kw), SDPAttention(**kw)


def _qkv(s: int, b: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(s, b, HEADS, DIM, generator=g, dtype=DTYPE, requires_grad=True)
    k = torch.randn(s, b, GROUPS, DIM, generator=g, dtype=DTYPE, requires_grad=True)
    v = torch.randn(s, b, GROUPS, DIM, generator=g, dtype=DTYPE, requires_grad=True)
    return q, k, v


def _run(module, q, k, v, mask=None, **kw):
    """(output, input gradients) of ``module`` on copies of ``q, k, v``."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = module(*leaves, mask, **kw)
    g = torch.Generator().manual_seed(99)
    (out * torch.randn(out.shape, generator=g, dtype=out.dtype)).sum().backward()
    return out.detach(), [t.grad for t in leaves]


def _assert_close(got, want, what: str) -> None:
    (out_g, grads_g), (out_w, grads_w) = got, want
    assert out_g.shape == out_w.shape, what
    assert (out_g - out_w).abs().max() <= TOL * out_w.abs().max(), what
    for a, b, name in zip(grads_g, grads_w, "qkv"):  # (one key: dq is 0 but for rounding)
        assert (a - b).abs().max() <= TOL * max(b.abs().max(), 1.0), f"{what}: d{name}"


def _module_checks() -> None:
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_oar.runtime import ParallelConfig, init_runtime

    init_runtime(ParallelConfig())
    unfused, sdpa = _pair()
    q, k, v = _qkv(11, 3, seed=0)
    _assert_close(_run(sdpa, q, k, v), _run(unfused, q, k, v), "causal GQA")
    # an explicit mask (True = masked out) is used alone, as megatron's softmax does
    mask = torch.rand(3, 1, 11, 11, generator=torch.Generator().manual_seed(1)) < 0.3
    mask[..., 0] = False  # every query keeps a key
    _assert_close(_run(sdpa, q, k, v, mask), _run(unfused, q, k, v, mask), "explicit mask")
    one = [t[:1] for t in (q, k, v)]
    _assert_close(_run(sdpa, *one), _run(unfused, *one), "one query")
    # packed THD: rows of 5, 1 and 7 tokens back to back; each equals the row run alone
    lengths = [5, 1, 7]
    cu = torch.tensor([0, 5, 6, 13], dtype=torch.int32)
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu,
                             cu_seqlens_kv_padded=cu, max_seqlen_q=7, max_seqlen_kv=7)
    tq, tk, tv = (t[:, 0] for t in _qkv(13, 1, seed=2))
    got_out, got_grads = _run(sdpa, tq, tk, tv, packed_seq_params=packed)
    assert got_out.shape == (13, HEADS * DIM)
    start = 0
    for n in lengths:
        rows = [t[start:start + n].unsqueeze(1) for t in (tq, tk, tv)]
        want_out, want_grads = _run(unfused, *rows)
        # the seeded output weights differ in shape: compare outputs, and gradients through a
        # row-only backward below
        assert (got_out[start:start + n] - want_out[:, 0]).abs().max() <= TOL * want_out.abs().max()
        start += n
    # gradients: a loss on one row only reaches that row's inputs
    leaves = [t.detach().clone().requires_grad_() for t in (tq, tk, tv)]
    sdpa(*leaves, None, packed_seq_params=packed)[6:13].sum().backward()
    for t in leaves:
        assert t.grad[:6].abs().max() == 0 and t.grad[6:].abs().max() > 0
    with pytest.raises(ValueError, match="packed .*take no attention_mask"):
        sdpa(tq, tk, tv, torch.zeros(1, 1, 13, 13, dtype=torch.bool), packed_seq_params=packed)


@pytest.mark.slow
def test_sdpa_equals_unfused_attention():
    launch(_module_checks, 1)


def test_model_attention_key(monkeypatch):
    from megatron_oar.models.builder import ModelConfigError, resolve_attention

    assert resolve_attention("auto", "local") == "sdpa"
    assert resolve_attention("auto", "te") == "te"
    assert resolve_attention("unfused", "te") == "unfused"
    with pytest.raises(ModelConfigError, match="model.attention='flash'; expected one of auto, sdpa"):
        resolve_attention("flash", "local")
    with pytest.raises(ModelConfigError, match="model.attention='te' needs model.spec=te"):
        resolve_attention("te", "local")


def test_config_names_the_attention_key():
    import megatron_oar.config as config_module
    from tests.test_config import HF, example, raises

    cfg = "qwen2.5-7b_oar_g.yaml"
    with raises(r"model.attention='flash': expected one of \['auto', 'sdpa', 'unfused', 'te'\]"):
        config_module.validate(example(cfg, "model.attention=flash"), world_size=8, hf_config=HF["7b"])
    with raises(r"train.batching=packed needs model.attention=auto, sdpa or te"):
        config_module.validate(example(cfg, "train.batching=packed", "model.attention=unfused"),
                               world_size=8, hf_config=HF["7b"])
    with raises(r"model.attention='te' needs model.spec=te"):
        config_module.validate(example(cfg, "model.spec=local", "model.attention=te"), world_size=8,
                               hf_config=HF["7b"])
    # packed under the local spec runs SDPA's THD path
    config_module.validate(example(cfg, "model.spec=local", "train.batching=packed"), world_size=8,
                           hf_config=HF["7b"])


def test_kernel_line_names_the_attention():
    from megatron_oar.runtime.kernels import model_kernels_line

    cfg = _config()
    assert "attention=torch scaled_dot_product_attention" in model_kernels_line(cfg, "local")
    assert "attention=megatron DotProductAttention (unfused" in model_kernels_line(cfg, "local", "unfused")
    assert "attention=transformer_engine" in model_kernels_line(cfg, "te")
