"""Qwen2 / Qwen3 (dense) parameter mapping between Hugging Face and megatron-core names and
layouts, and the HF side files a checkpoint keeps next to its weights.

Everything here works on whole (TP=1) tensors of one layer at a time, which is what the
streaming converter and the vLLM weight sync need. megatron-core's own sharded state dict
takes care of TP/PP slicing of these global tensors.

Layouts:

* ``linear_qkv`` holds, per query group g, ``[q_g (heads_per_group * head_dim rows), k_g, v_g]``
  (weight and bias), so a TP shard is a plain chunk along dim 0.
* ``linear_fc1`` is ``[gate; up]``.
* Norm names depend on the layer spec: the local spec has ``input_layernorm`` and
  ``pre_mlp_layernorm`` modules; the Transformer Engine spec fuses them into
  ``linear_qkv.layer_norm_weight`` / ``linear_fc1.layer_norm_weight``.
* Which tensors a layer has depends on the architecture (:class:`QwenArch`): ``linear_qkv.bias``
  only with ``qkv_bias`` (Qwen2), and with ``qk_norm`` (Qwen3) the per-head q/k RMSNorm weights
  ``self_attention.{q,k}_layernorm.weight`` (HF ``self_attn.{q,k}_norm.weight``, ``[head_dim]``,
  the same name under both specs). Those are not TP-sharded: every TP rank holds the whole
  vector, and megatron checkpoints them as replicated over TP.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from megatron_oar.models.qwen2 import QwenArch

Getter = Callable[[str], torch.Tensor]

# Files copied next to the weights so a checkpoint can be turned back into an HF model.
HF_SIDE_FILES = (
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
    "vocab.json", "merges.txt", "special_tokens_map.json", "added_tokens.json",
    "tokenizer.model", "chat_template.jinja", "chat_template.json",
)

HF_EMBED = "model.embed_tokens.weight"
HF_NORM = "model.norm.weight"
HF_HEAD = "lm_head.weight"
MC_EMBED = "embedding.word_embeddings.weight"
MC_NORM = "decoder.final_layernorm.weight"
MC_HEAD = "output_layer.weight"
MC_LAYER_PREFIX = "decoder.layers."
# Checkpoint keys always use the TE names: megatron's local spec maps its norm modules to
# them (``sharded_state_dict_keys_map``), so one checkpoint loads under either spec.
CHECKPOINT_SPEC = "te"

# Layer-relative megatron names per spec.
_NORM_NAMES = {
    "local": ("input_layernorm.weight", "pre_mlp_layernorm.weight"),
    "te": ("self_attention.linear_qkv.layer_norm_weight", "mlp.linear_fc1.layer_norm_weight"),
}
QKV_W = "self_attention.linear_qkv.weight"
QKV_B = "self_attention.linear_qkv.bias"
Q_NORM = "self_attention.q_layernorm.weight"
K_NORM = "self_attention.k_layernorm.weight"
PROJ_W = "self_attention.linear_proj.weight"
FC1_W = "mlp.linear_fc1.weight"
FC2_W = "mlp.linear_fc2.weight"
# HF layer-relative names of the q/k norms (Qwen3) and of the q/k/v projections.
HF_Q_NORM = "self_attn.q_norm.weight"
HF_K_NORM = "self_attn.k_norm.weight"


def _check_spec(spec: str) -> None:
    if spec not in _NORM_NAMES:
        raise ValueError(f"unknown layer spec {spec!r}; expected 'local' or 'te'")


def norm_names(spec: str) -> tuple[str, str]:
    """(attention-input norm, MLP-input norm): megatron layer-relative names for a spec."""
    _check_spec(spec)
    return _NORM_NAMES[spec]


def layer_names(spec: str, arch: QwenArch | None = None) -> list[str]:
    """Megatron layer-relative parameter names for a spec ('local' or 'te') and architecture
    (None: Qwen2's, with the q/k/v bias and without q/k norms)."""
    attn_norm, mlp_norm = norm_names(spec)
    qkv_bias = True if arch is None else arch.qkv_bias
    qk_norm = False if arch is None else arch.qk_norm
    return ([attn_norm, QKV_W] + ([QKV_B] if qkv_bias else []) + ([Q_NORM, K_NORM] if qk_norm else [])
            + [PROJ_W, mlp_norm, FC1_W, FC2_W])


def rename_spec(name: str, src: str, dst: str) -> str:
    """Maps a layer-relative norm name from one spec's naming to another's."""
    for a, b in zip(_NORM_NAMES[src], _NORM_NAMES[dst]):
        if name == a:
            return b
    return name


def _hf_layer_shapes(arch: QwenArch, i: int) -> dict[str, tuple[int, ...]]:
    h, f, d = arch.hidden_size, arch.intermediate_size, arch.head_dim
    q, kv = arch.num_heads * d, arch.num_kv_heads * d
    p = f"model.layers.{i}."
    shapes: dict[str, tuple[int, ...]] = {"input_layernorm.weight": (h,)}
    for x, rows in (("q", q), ("k", kv), ("v", kv)):
        shapes[f"self_attn.{x}_proj.weight"] = (rows, h)
        if arch.qkv_bias:
            shapes[f"self_attn.{x}_proj.bias"] = (rows,)
    shapes["self_attn.o_proj.weight"] = (h, q)
    if arch.qk_norm:
        shapes[HF_Q_NORM] = (d,)
        shapes[HF_K_NORM] = (d,)
    shapes.update({"post_attention_layernorm.weight": (h,), "mlp.gate_proj.weight": (f, h),
                   "mlp.up_proj.weight": (f, h), "mlp.down_proj.weight": (h, f)})
    return {p + k: v for k, v in shapes.items()}


def hf_layer_names(arch: QwenArch, i: int) -> list[str]:
    """HF names of decoder layer ``i``'s tensors for this architecture."""
    return list(_hf_layer_shapes(arch, i))


def hf_names(arch: QwenArch) -> list[str]:
    return list(hf_shapes(arch))


def hf_shapes(arch: QwenArch) -> dict[str, tuple[int, ...]]:
    """Every HF tensor name of this architecture with the shape config.json implies."""
    h = arch.hidden_size
    shapes = {HF_EMBED: (arch.vocab_size, h), HF_NORM: (h,)}
    for i in range(arch.num_layers):
        shapes.update(_hf_layer_shapes(arch, i))
    if not arch.tie_word_embeddings:
        shapes[HF_HEAD] = (arch.vocab_size, h)
    return shapes


def checkpoint_shapes(arch: QwenArch, padded_vocab: int) -> dict[str, tuple[int, ...]]:
    """Global shapes of the torch_dist checkpoint's tensors (layer-stacked on axis 0)."""
    h, f, d, L = arch.hidden_size, arch.intermediate_size, arch.head_dim, arch.num_layers
    qkv = (arch.num_heads + 2 * arch.num_kv_heads) * d
    attn_norm, mlp_norm = _NORM_NAMES[CHECKPOINT_SPEC]
    layer = {attn_norm: (h,), QKV_W: (qkv, h), QKV_B: (qkv,), Q_NORM: (d,), K_NORM: (d,),
             PROJ_W: (h, arch.num_heads * d), mlp_norm: (h,), FC1_W: (2 * f, h), FC2_W: (h, f)}
    shapes = {MC_LAYER_PREFIX + k: (L, *layer[k]) for k in layer_names(CHECKPOINT_SPEC, arch)}
    shapes[MC_EMBED] = (padded_vocab, h)
    shapes[MC_NORM] = (h,)
    if not arch.tie_word_embeddings:
        shapes[MC_HEAD] = (padded_vocab, h)
    return shapes


def merge_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, arch: QwenArch) -> torch.Tensor:
    """HF q/k/v (weight [out, H] or bias [out]) -> megatron per-group interleaved qkv."""
    g, d = arch.num_kv_heads, arch.head_dim
    hpg = arch.num_heads // g
    tail = q.shape[1:]
    parts = (q.reshape(g, hpg * d, *tail), k.reshape(g, d, *tail), v.reshape(g, d, *tail))
    return torch.cat(parts, dim=1).reshape(-1, *tail)


def split_qkv(qkv: torch.Tensor, arch: QwenArch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`merge_qkv`."""
    g, d = arch.num_kv_heads, arch.head_dim
    hpg = arch.num_heads // g
    tail = qkv.shape[1:]
    grouped = qkv.reshape(g, (hpg + 2) * d, *tail)
    q, k, v = torch.split(grouped, [hpg * d, d, d], dim=1)
    return (q.reshape(-1, *tail).contiguous(), k.reshape(-1, *tail).contiguous(),
            v.reshape(-1, *tail).contiguous())


def pad_vocab(weight: torch.Tensor, padded: int) -> torch.Tensor:
    """Appends zero rows up to the padded vocabulary size."""
    extra = padded - weight.shape[0]
    if extra < 0:
        raise ValueError(f"vocab rows {weight.shape[0]} exceed padded size {padded}")
    if extra == 0:
        return weight
    return torch.cat([weight, weight.new_zeros(extra, *weight.shape[1:])])


def hf_to_mcore_layer_tensor(get: Getter, arch: QwenArch, i: int, name: str,
                             spec: str) -> torch.Tensor:
    """One megatron layer-relative tensor of decoder layer ``i``, reading only its HF sources."""
    p = f"model.layers.{i}."
    attn_norm, mlp_norm = norm_names(spec)
    if name == attn_norm:
        return get(p + "input_layernorm.weight")
    if name == mlp_norm:
        return get(p + "post_attention_layernorm.weight")
    if name == QKV_W or (name == QKV_B and arch.qkv_bias):
        kind = name.rsplit(".", 1)[1]
        return merge_qkv(*(get(f"{p}self_attn.{x}_proj.{kind}") for x in "qkv"), arch)
    if name in (Q_NORM, K_NORM) and arch.qk_norm:
        return get(p + (HF_Q_NORM if name == Q_NORM else HF_K_NORM))
    if name == PROJ_W:
        return get(p + "self_attn.o_proj.weight")
    if name == FC1_W:
        return torch.cat([get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")])
    if name == FC2_W:
        return get(p + "mlp.down_proj.weight")
    raise KeyError(f"no HF source for megatron layer parameter {name!r} (spec {spec!r}, "
                   f"qkv_bias={arch.qkv_bias}, qk_norm={arch.qk_norm})")


def hf_to_mcore_layer(get: Getter, arch: QwenArch, i: int, spec: str) -> dict[str, torch.Tensor]:
    """One decoder layer: megatron layer-relative name -> tensor, from an HF tensor getter."""
    return {n: hf_to_mcore_layer_tensor(get, arch, i, n, spec) for n in layer_names(spec, arch)}


def mcore_to_hf_layer_tensor(arch: QwenArch, i: int, name: str, tensor: torch.Tensor,
                             spec: str) -> list[tuple[str, torch.Tensor]]:
    """One whole megatron layer-relative tensor of decoder layer ``i`` -> its HF tensor(s)."""
    p = f"model.layers.{i}."
    attn_norm, mlp_norm = norm_names(spec)
    if name == attn_norm:
        return [(p + "input_layernorm.weight", tensor)]
    if name == mlp_norm:
        return [(p + "post_attention_layernorm.weight", tensor)]
    if name == QKV_W or (name == QKV_B and arch.qkv_bias):
        kind = name.rsplit(".", 1)[1]
        return [(f"{p}self_attn.{x}_proj.{kind}", t) for x, t in zip("qkv", split_qkv(tensor, arch))]
    if name in (Q_NORM, K_NORM) and arch.qk_norm:
        return [(p + (HF_Q_NORM if name == Q_NORM else HF_K_NORM), tensor)]
    if name == PROJ_W:
        return [(p + "self_attn.o_proj.weight", tensor)]
    if name == FC1_W:
        gate, up = torch.chunk(tensor, 2, dim=0)
        return [(p + "mlp.gate_proj.weight", gate.contiguous()), (p + "mlp.up_proj.weight", up.contiguous())]
    if name == FC2_W:
        return [(p + "mlp.down_proj.weight", tensor)]
    raise KeyError(f"no HF name for megatron layer parameter {name!r} (spec {spec!r}, "
                   f"qkv_bias={arch.qkv_bias}, qk_norm={arch.qk_norm})")


def mcore_to_hf_layer(get: Getter, arch: QwenArch, i: int, spec: str) -> dict[str, torch.Tensor]:
    """Inverse of :func:`hf_to_mcore_layer`; ``get`` takes layer-relative megatron names."""
    out: dict[str, torch.Tensor] = {}
    for name in layer_names(spec, arch):
        out.update(mcore_to_hf_layer_tensor(arch, i, name, get(name), spec))
    return out


def hf_to_mcore_global(get: Getter, arch: QwenArch, key: str, vocab_padded: int) -> torch.Tensor:
    """Non-layer tensors (embedding, final norm, untied output layer)."""
    if key == MC_EMBED:
        return pad_vocab(get(HF_EMBED), vocab_padded)
    if key == MC_NORM:
        return get(HF_NORM)
    if key == MC_HEAD:
        return pad_vocab(get(HF_HEAD), vocab_padded)
    raise KeyError(f"no HF source for megatron key {key!r}")


def mcore_to_hf_global_names(arch: QwenArch) -> list[str]:
    return [HF_EMBED, HF_NORM] + ([] if arch.tie_word_embeddings else [HF_HEAD])


def mcore_to_hf_global_tensor(get: Getter, arch: QwenArch, hf_name: str) -> torch.Tensor:
    """Embedding, final norm or (untied) lm_head, with padded vocab rows dropped."""
    if hf_name == HF_NORM:
        return get(MC_NORM)
    source = {HF_EMBED: MC_EMBED, HF_HEAD: MC_HEAD}[hf_name]
    return get(source)[: arch.vocab_size].contiguous()


def mcore_to_hf_global(get: Getter, arch: QwenArch) -> dict[str, torch.Tensor]:
    """All non-layer tensors in HF naming."""
    return {n: mcore_to_hf_global_tensor(get, arch, n) for n in mcore_to_hf_global_names(arch)}
