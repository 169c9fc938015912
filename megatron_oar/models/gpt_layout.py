"""Names and tensor layouts of megatron-core's ``GPTModel`` that every model family shares.

* ``linear_qkv`` holds, per query group g, ``[q_g (heads_per_group * head_dim rows), k_g, v_g]``
  (weight and bias), so a TP shard is a plain chunk along dim 0 (:func:`merge_qkv`).
* ``linear_fc1`` is ``[gate; up]``.
* Norm names depend on the layer spec: the local spec has ``input_layernorm`` and
  ``pre_mlp_layernorm`` modules; the Transformer Engine spec fuses them into
  ``linear_qkv.layer_norm_weight`` / ``linear_fc1.layer_norm_weight``.
* The embedding (and an untied output layer) is padded to a multiple of the vocabulary
  (:func:`pad_vocab`); the HF side has the unpadded rows.

Which layer tensors an architecture has, and their HF names, is its family's mapping
(:mod:`megatron_oar.models.families`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from megatron_oar.models.arch import QwenArch

Getter = Callable[[str], torch.Tensor]  # a tensor by name (HF or megatron naming)

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


def norm_names(spec: str) -> tuple[str, str]:
    """(attention-input norm, MLP-input norm): megatron layer-relative names for a spec."""
    if spec not in _NORM_NAMES:
        raise ValueError(f"unknown layer spec {spec!r}; expected 'local' or 'te'")
    return _NORM_NAMES[spec]


def rename_spec(name: str, src: str, dst: str) -> str:
    """Maps a layer-relative norm name from one spec's naming to another's."""
    for a, b in zip(norm_names(src), norm_names(dst)):
        if name == a:
            return b
    return name


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
