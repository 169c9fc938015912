"""Qwen2 / Qwen2.5 (``Qwen2ForCausalLM``): config.json -> :class:`QwenArch`, and the HF names of
its tensors.

Qwen2 is a GPT with GQA, bias on q/k/v only, SwiGLU, RMSNorm and RoPE; 0.5B-3B tie the
embeddings. :class:`Qwen2` is also the base other dense Qwen families extend (see ``qwen3.py``):
they override :meth:`Qwen2.attention` (or :meth:`Qwen2.parse`) for their config fields and
:meth:`Qwen2.megatron_config` for megatron's, and add their extra layer tensors to
:meth:`Qwen2.attention_names`, :meth:`Qwen2.one_to_one` and :meth:`Qwen2.extra_shapes`.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_oar.models.arch import ModelConfigError, QwenArch
from megatron_oar.models.gpt_layout import (
    FC1_W,
    FC2_W,
    PROJ_W,
    QKV_B,
    QKV_W,
    Getter,
    merge_qkv,
    norm_names,
    split_qkv,
)

REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "vocab_size")


class Qwen2:
    name = "Qwen2"
    architecture = "Qwen2ForCausalLM"
    model_type = "qwen2"

    # ------------------------------------------------------------------ config.json -> arch

    def parse(self, hf: dict[str, Any], source: str = "config.json") -> QwenArch:
        """The architecture of ``hf`` (a config.json dict), or ModelConfigError naming ``source``."""
        for key in REQUIRED:
            if key not in hf:
                raise ModelConfigError(f"{source}: missing field {key!r}")
        if hf.get("use_sliding_window"):
            raise ModelConfigError(f"{source}: use_sliding_window=true is not supported")
        layer_types = set(hf.get("layer_types") or []) - {"full_attention"}
        if layer_types:
            raise ModelConfigError(f"{source}: layer_types {sorted(layer_types)} are not supported "
                                   "(only full_attention)")
        if hf.get("rope_scaling"):
            raise ModelConfigError(f"{source}: rope_scaling={hf['rope_scaling']!r} is not supported")
        if hf.get("hidden_act", "silu") != "silu":
            raise ModelConfigError(f"{source}: hidden_act={hf['hidden_act']!r}; {self.name} uses "
                                   "'silu'")
        heads = hf["num_attention_heads"]
        kv = hf.get("num_key_value_heads") or heads
        if heads % kv:
            raise ModelConfigError(f"{source}: num_attention_heads {heads} not divisible by "
                                   f"num_key_value_heads {kv}")
        rope_theta = hf.get("rope_theta")
        if rope_theta is None:  # transformers >= 5 nests it
            rope_theta = (hf.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        return QwenArch(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=kv,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            max_position_embeddings=hf.get("max_position_embeddings", 32768),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            family=self.model_type,
            **self.attention(hf, source),
        )

    def attention(self, hf: dict[str, Any], source: str) -> dict[str, Any]:
        """The family's attention fields of :class:`QwenArch`: ``head_dim``, ``qkv_bias``,
        ``qk_norm``."""
        return {"head_dim": hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
                "qkv_bias": True, "qk_norm": False}

    def megatron_config(self, arch: QwenArch) -> dict[str, Any]:
        """The family's ``TransformerConfig`` fields beyond the dense GPT ones the builder sets
        (``models/builder.py``: GQA, SwiGLU, RMSNorm, no linear biases)."""
        return {"add_qkv_bias": arch.qkv_bias, "qk_layernorm": arch.qk_norm}

    # ------------------------------------------------------------------ HF <-> megatron names

    def attention_names(self, spec: str, arch: QwenArch | None) -> list[str]:
        """Megatron layer-relative names from the attention-input norm up to (not incl.) o_proj."""
        return [norm_names(spec)[0], QKV_W] + ([QKV_B] if arch is None or arch.qkv_bias else [])

    def layer_names(self, spec: str, arch: QwenArch | None) -> list[str]:
        """Megatron layer-relative parameter names of one decoder layer under ``spec`` (arch
        None: the family's released configs)."""
        return self.attention_names(spec, arch) + [PROJ_W, norm_names(spec)[1], FC1_W, FC2_W]

    def layer_names_at(self, spec: str, arch: QwenArch | None, i: int) -> list[str]:
        """:meth:`layer_names` of decoder layer ``i`` (families whose layers differ, e.g.
        Qwen3-MoE's dense and MoE layers, override this)."""
        return self.layer_names(spec, arch)

    def one_to_one(self, spec: str, arch: QwenArch) -> dict[str, str]:
        """Megatron layer-relative name -> HF layer-relative name, for tensors stored as is."""
        attn_norm, mlp_norm = norm_names(spec)
        return {attn_norm: "input_layernorm.weight", mlp_norm: "post_attention_layernorm.weight",
                PROJ_W: "self_attn.o_proj.weight", FC2_W: "mlp.down_proj.weight"}

    def layer_shapes(self, arch: QwenArch) -> dict[str, tuple[int, ...]]:
        """Megatron layer-relative name (TE spec) -> whole (TP=1) shape."""
        h, f, d = arch.hidden_size, arch.intermediate_size, arch.head_dim
        qkv = (arch.num_heads + 2 * arch.num_kv_heads) * d
        attn_norm, mlp_norm = norm_names("te")
        shapes = {attn_norm: (h,), QKV_W: (qkv, h), QKV_B: (qkv,), PROJ_W: (h, arch.num_heads * d),
                  mlp_norm: (h,), FC1_W: (2 * f, h), FC2_W: (h, f), **self.extra_shapes(arch)}
        return {k: shapes[k] for k in self.layer_names("te", arch)}

    def layer_shapes_at(self, arch: QwenArch, i: int) -> dict[str, tuple[int, ...]]:
        """:meth:`layer_shapes` of decoder layer ``i`` (every layer alike here)."""
        return self.layer_shapes(arch)

    def extra_shapes(self, arch: QwenArch) -> dict[str, tuple[int, ...]]:
        """Megatron layer-relative name -> shape of the family's one-to-one attention tensors
        beyond Qwen2's (none here); HF has them after o_proj."""
        return {}

    def hf_layer_shapes(self, arch: QwenArch) -> dict[str, tuple[int, ...]]:
        """HF layer-relative name -> shape, in HF's order."""
        h, f, d = arch.hidden_size, arch.intermediate_size, arch.head_dim
        q, kv = arch.num_heads * d, arch.num_kv_heads * d
        shapes: dict[str, tuple[int, ...]] = {"input_layernorm.weight": (h,)}
        for x, rows in (("q", q), ("k", kv), ("v", kv)):
            shapes[f"self_attn.{x}_proj.weight"] = (rows, h)
            if arch.qkv_bias:
                shapes[f"self_attn.{x}_proj.bias"] = (rows,)
        shapes["self_attn.o_proj.weight"] = (h, q)
        direct = self.one_to_one("te", arch)
        shapes.update({direct[k]: v for k, v in self.extra_shapes(arch).items()})
        shapes.update({"post_attention_layernorm.weight": (h,), "mlp.gate_proj.weight": (f, h),
                       "mlp.up_proj.weight": (f, h), "mlp.down_proj.weight": (h, f)})
        return shapes

    def hf_layer_shapes_at(self, arch: QwenArch, i: int) -> dict[str, tuple[int, ...]]:
        """:meth:`hf_layer_shapes` of decoder layer ``i``."""
        return self.hf_layer_shapes(arch)

    def _refuse(self, what: str, name: str, arch: QwenArch, spec: str) -> KeyError:
        return KeyError(f"no HF {what} for megatron layer parameter {name!r} (spec {spec!r}, "
                        f"{self.name}: qkv_bias={arch.qkv_bias}, qk_norm={arch.qk_norm})")

    def hf_to_mcore(self, get: Getter, arch: QwenArch, i: int, name: str,
                    spec: str) -> torch.Tensor:
        """One megatron layer-relative tensor of decoder layer ``i``, reading only its HF sources."""
        p = f"model.layers.{i}."
        if name in self.layer_names_at(spec, arch, i):
            direct = self.one_to_one(spec, arch)
            if name in direct:
                return get(p + direct[name])
            if name in (QKV_W, QKV_B):
                kind = name.rsplit(".", 1)[1]
                return merge_qkv(*(get(f"{p}self_attn.{x}_proj.{kind}") for x in "qkv"), arch)
            if name == FC1_W:
                return torch.cat([get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")])
        raise self._refuse("source", name, arch, spec)

    def mcore_to_hf(self, arch: QwenArch, i: int, name: str, tensor: torch.Tensor,
                    spec: str) -> list[tuple[str, torch.Tensor]]:
        """One whole megatron layer-relative tensor of decoder layer ``i`` -> its HF tensor(s)."""
        p = f"model.layers.{i}."
        if name in self.layer_names_at(spec, arch, i):
            direct = self.one_to_one(spec, arch)
            if name in direct:
                return [(p + direct[name], tensor)]
            if name in (QKV_W, QKV_B):
                kind = name.rsplit(".", 1)[1]
                return [(f"{p}self_attn.{x}_proj.{kind}", t)
                        for x, t in zip("qkv", split_qkv(tensor, arch))]
            if name == FC1_W:
                gate, up = torch.chunk(tensor, 2, dim=0)
                return [(p + "mlp.gate_proj.weight", gate.contiguous()),
                        (p + "mlp.up_proj.weight", up.contiguous())]
        raise self._refuse("name", name, arch, spec)
