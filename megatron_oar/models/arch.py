"""The architecture description every model family parses ``config.json`` into.

:class:`QwenArch` holds the fields that define the network (what the builder, the converter,
the vLLM weight sync, ``oar plan`` and the FLOPs count read); ``family`` names the family in
:mod:`megatron_oar.models.families` that parsed it and owns its HF name mapping.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class ModelConfigError(ValueError):
    """A config.json or layout that this model builder cannot serve."""


@dataclass(frozen=True)
class QwenArch:
    """The fields of a Qwen2 / Qwen3 config.json that define the network.

    ``qkv_bias``: q/k/v projections carry a bias (Qwen2; Qwen3's ``attention_bias``, false).
    ``qk_norm``: per-head RMSNorm of size ``head_dim`` on queries and keys before RoPE (Qwen3).
    ``family``: the ``model_type`` of the family that parsed it (see ``models.families``).

    Mixture of experts (Qwen3-MoE; all zero / empty for a dense model): ``num_experts`` routed
    experts per MoE layer, ``moe_topk`` of them per token (HF ``num_experts_per_tok``), each a
    SwiGLU MLP of width ``moe_intermediate_size``; ``norm_topk_prob``: the top-k routing weights
    are renormalised to sum to 1; ``moe_layers``: per decoder layer, True where its MLP is the
    MoE block (the others are dense MLPs of width ``intermediate_size``).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = True
    qk_norm: bool = False
    family: str = "qwen2"
    num_experts: int = 0
    moe_topk: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    moe_layers: tuple[bool, ...] = ()

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, i: int) -> bool:
        """Decoder layer ``i`` (0-based, global) has the MoE block as its MLP."""
        return self.is_moe and self.moe_layers[i]

    def padded_vocab_size(self, multiple: int = 128) -> int:
        return int(math.ceil(self.vocab_size / multiple) * multiple)


def read_hf_config(path: str | Path) -> dict[str, Any]:
    """Reads ``config.json`` (a file or the directory holding it) with errors naming the file."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ModelConfigError(f"{path}: no such file (an HF model directory needs config.json)")
    try:
        cfg = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelConfigError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(cfg, dict):
        raise ModelConfigError(f"{path}: expected a JSON object, got {type(cfg).__name__}")
    return cfg
