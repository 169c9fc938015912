"""Qwen3-MoE (``Qwen3MoeForCausalLM``, e.g. Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention
(per-head q/k RMSNorm, no q/k/v bias, explicit ``head_dim``) with a mixture-of-experts block in
place of the dense MLP, as megatron-core's ``MoELayer``.

The block (transformers' ``Qwen3MoeSparseMoeBlock``): a bias-free router ``mlp.gate`` gives each
token ``num_experts`` logits; softmax over all of them, the top ``num_experts_per_tok``, and with
``norm_topk_prob`` those weights renormalised to sum to 1; the token's output is the weighted sum
of its experts' SwiGLU MLPs (``moe_intermediate_size`` wide), no shared expert, no capacity limit.
Layer ``i`` is a MoE layer when ``i`` is not in ``mlp_only_layers`` and ``(i + 1) %
decoder_sparse_step == 0``; the others are dense MLPs of ``intermediate_size``. Megatron's
``moe_layer_freq`` takes that pattern as a list, so every pattern is representable; a config
with no MoE layer at all (or no experts) is refused: it is a dense Qwen3.

Megatron's router reproducing it (``moe_utils.topk_routing_with_score_function``, score function
``softmax``): with ``norm_topk_prob`` the top-k is taken on the logits and the softmax over those
k (``moe_router_pre_softmax=False``), which is the renormalised top-k of the full softmax; without
it, the softmax over all experts comes first and its top-k values are used as they are
(``moe_router_pre_softmax=True``). No scaling factor, no group-limited routing, no expert bias.
RL-safe defaults: the load-balancing loss is off (``moe_router_load_balancing_type="none"``,
coefficient 0, no z-loss) and the router's logits and softmax run in fp32
(``moe_router_dtype="fp32"``); ``model.freeze_router`` keeps its weight out of the update.

Names: the router is ``mlp.router.weight`` (HF ``mlp.gate.weight``); the MoE layer's MLP-input
norm is a module of its own, ``pre_mlp_layernorm`` (under the Transformer Engine spec too, where
a dense layer fuses it into ``linear_fc1``); expert ``e``'s ``[gate; up]`` and down projections
are ``mlp.experts.local_experts.{e}.linear_fc1/linear_fc2.weight`` (local spec,
``SequentialMLP``) or ``mlp.experts.linear_fc1.weight{e}`` / ``linear_fc2.weight{e}`` (TE spec,
``TEGroupedMLP``). The mapping here numbers experts globally (as at EP=1); a model built at
EP > 1 holds ``num_experts / EP`` of them numbered from 0 on each rank
(:func:`global_expert_name` renumbers). In a torch_dist checkpoint megatron's own experts
``sharded_state_dict`` (``SequentialMLP`` and ``TEGroupedMLP`` alike) stores them as
``mlp.experts.experts.linear_fc1/linear_fc2.weight`` with an axis of global expert ids
(:func:`megatron_oar.models.hf_mapping.checkpoint_layout`).
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

import torch

from megatron_oar.models.arch import ModelConfigError, QwenArch
from megatron_oar.models.families.qwen3 import Qwen3
from megatron_oar.models.gpt_layout import FC2_W, PROJ_W, QKV_B, QKV_W, Getter, norm_names

ROUTER_W = "mlp.router.weight"
PRE_MLP_NORM = "pre_mlp_layernorm.weight"  # a MoE layer's MLP-input norm, either spec
HF_ROUTER = "mlp.gate.weight"

_EXPERT_RE = {
    "local": re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$"),
    "te": re.compile(r"^mlp\.experts\.(linear_fc[12])\.weight(\d+)$"),
}


def expert_name(spec: str, e: int, fc: str) -> str:
    """Megatron layer-relative name of expert ``e``'s ``fc`` (``linear_fc1`` / ``linear_fc2``)."""
    if spec == "local":
        return f"mlp.experts.local_experts.{e}.{fc}.weight"
    if spec == "te":
        return f"mlp.experts.{fc}.weight{e}"
    raise ValueError(f"unknown layer spec {spec!r}; expected 'local' or 'te'")


def parse_expert_name(name: str) -> tuple[str, int, str] | None:
    """``(spec, expert, fc)`` of an expert weight's layer-relative name, else None."""
    m = _EXPERT_RE["local"].match(name)
    if m:
        return "local", int(m.group(1)), m.group(2)
    m = _EXPERT_RE["te"].match(name)
    if m:
        return "te", int(m.group(2)), m.group(1)
    return None


def global_expert_name(name: str, offset: int) -> str:
    """A model's layer-relative name with its local expert index shifted by ``offset`` (this EP
    rank's first expert: ``ep_rank * num_experts / EP``); other names unchanged."""
    parsed = parse_expert_name(name)
    if parsed is None:
        return name
    spec, e, fc = parsed
    return expert_name(spec, e + offset, fc)


def _int_field(hf: dict[str, Any], key: str, source: str, *, default: int | None = None,
               minimum: int = 1) -> int:
    value = hf.get(key, default)
    if value is None:
        raise ModelConfigError(f"{source}: missing field {key!r}")
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ModelConfigError(f"{source}: {key}={value!r} must be an integer >= {minimum}")
    return value


class Qwen3Moe(Qwen3):
    name = "Qwen3-MoE"
    architecture = "Qwen3MoeForCausalLM"
    model_type = "qwen3_moe"

    # ------------------------------------------------------------------ config.json -> arch

    def parse(self, hf: dict[str, Any], source: str = "config.json") -> QwenArch:
        # transformers writes num_experts as num_local_experts (Qwen3MoeConfig.attribute_map);
        # the released config.json files say num_experts
        experts = hf.get("num_experts")
        key = "num_experts"
        if experts is None and hf.get("num_local_experts") is not None:
            experts, key = hf["num_local_experts"], "num_local_experts"
        if experts is None:
            raise ModelConfigError(f"{source}: missing field 'num_experts' ({self.architecture} "
                                   "needs its number of routed experts)")
        if isinstance(experts, bool) or not isinstance(experts, int) or experts < 1:
            raise ModelConfigError(f"{source}: {key}={experts!r}: a {self.name} model needs at "
                                   "least one expert (without experts it is a dense Qwen3: "
                                   "Qwen3ForCausalLM)")
        topk = _int_field(hf, "num_experts_per_tok", source)
        if topk > experts:
            raise ModelConfigError(f"{source}: num_experts_per_tok={topk} exceeds {key}={experts}")
        moe_width = _int_field(hf, "moe_intermediate_size", source)
        step = _int_field(hf, "decoder_sparse_step", source, default=1)
        if hf.get("shared_expert_intermediate_size"):
            raise ModelConfigError(
                f"{source}: shared_expert_intermediate_size="
                f"{hf['shared_expert_intermediate_size']!r}: {self.name} has no shared expert "
                "(that is Qwen2-MoE's block, not supported)")
        layers = _int_field(hf, "num_hidden_layers", source)
        mlp_only = hf.get("mlp_only_layers") or []
        if not isinstance(mlp_only, list) or any(
                isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < layers for i in mlp_only):
            raise ModelConfigError(f"{source}: mlp_only_layers={mlp_only!r} must list layer "
                                   f"indices in [0, {layers})")
        moe_layers = tuple(i not in mlp_only and (i + 1) % step == 0 for i in range(layers))
        if not any(moe_layers):
            raise ModelConfigError(
                f"{source}: decoder_sparse_step={step} and mlp_only_layers={mlp_only} leave no "
                f"MoE layer in {layers} layers (a dense model is a Qwen3ForCausalLM)")
        if "intermediate_size" not in hf:
            if not all(moe_layers):
                raise ModelConfigError(f"{source}: missing field 'intermediate_size' (the width "
                                       "of its dense layers, mlp_only_layers / decoder_sparse_step)")
            hf = {**hf, "intermediate_size": moe_width}  # unused: every layer is a MoE layer
        norm_topk = hf.get("norm_topk_prob", False)  # Qwen3MoeConfig's default
        if not isinstance(norm_topk, bool):
            raise ModelConfigError(f"{source}: norm_topk_prob={norm_topk!r} must be true or false")
        if topk == 1 and norm_topk:
            # every token's one weight is then 1 (the router gets no gradient); megatron's
            # softmax over the top-1 logit would be the same, but megatron refuses it
            raise ModelConfigError(f"{source}: num_experts_per_tok=1 with norm_topk_prob=true "
                                   "(every routing weight 1) is not supported: megatron's router "
                                   "refuses a softmax over the top-1 logit")
        arch = super().parse(hf, source)
        return replace(arch, num_experts=experts, moe_topk=topk, moe_intermediate_size=moe_width,
                       norm_topk_prob=norm_topk, moe_layers=moe_layers)

    def megatron_config(self, arch: QwenArch) -> dict[str, Any]:
        """Qwen3's fields and the MoE block's: experts, top-k, the layer pattern and the router
        (see the module docstring); the builder adds the layout and kernel choices (EP, ETP,
        token dispatcher, grouped GEMM)."""
        pattern = [int(x) for x in arch.moe_layers]
        return {
            **super().megatron_config(arch),
            "num_moe_experts": arch.num_experts,
            "moe_ffn_hidden_size": arch.moe_intermediate_size,
            "moe_router_topk": arch.moe_topk,
            "moe_layer_freq": 1 if all(pattern) else pattern,
            "moe_shared_expert_intermediate_size": None,
            "moe_router_score_function": "softmax",
            # norm_topk_prob: softmax over the top-k logits == the renormalised top-k of the full
            # softmax; without it, the full softmax's top-k values as they are
            "moe_router_pre_softmax": not arch.norm_topk_prob,
            "moe_router_topk_scaling_factor": None,
            "moe_router_num_groups": None,
            "moe_router_group_topk": None,
            "moe_router_enable_expert_bias": False,
            "moe_expert_capacity_factor": None,  # dropless, as transformers
            # RL: no load-balancing loss (it would add a gradient the policy loss does not have)
            "moe_router_load_balancing_type": "none",
            "moe_aux_loss_coeff": 0.0,
            "moe_z_loss_coeff": None,
            "moe_input_jitter_eps": None,
            "moe_router_dtype": "fp32",
        }

    # ------------------------------------------------------------------ HF <-> megatron names

    def expert_names(self, spec: str, arch: QwenArch) -> list[str]:
        return [expert_name(spec, e, fc) for e in range(arch.num_experts)
                for fc in ("linear_fc1", "linear_fc2")]

    def moe_layer_names(self, spec: str, arch: QwenArch) -> list[str]:
        return (self.attention_names(spec, arch) + [PROJ_W, PRE_MLP_NORM, ROUTER_W]
                + self.expert_names(spec, arch))

    def layer_names(self, spec: str, arch: QwenArch | None) -> list[str]:
        """A MoE layer's names (every layer of the released configs); a dense layer's are
        Qwen3's (:meth:`layer_names_at`)."""
        if arch is None or not arch.is_moe:
            return super().layer_names(spec, arch)
        return self.moe_layer_names(spec, arch)

    def layer_names_at(self, spec: str, arch: QwenArch | None, i: int) -> list[str]:
        if arch is not None and arch.is_moe and not arch.is_moe_layer(i):
            return super().layer_names(spec, arch)
        return self.layer_names(spec, arch)

    def moe_one_to_one(self, spec: str, arch: QwenArch) -> dict[str, str]:
        """A MoE layer's megatron layer-relative name -> HF name, for tensors stored as is."""
        dense = self.one_to_one(spec, arch)
        attn_norm = norm_names(spec)[0]
        out = {k: v for k, v in dense.items() if k not in (norm_names(spec)[1], FC2_W)}
        out.update({attn_norm: dense[attn_norm], PRE_MLP_NORM: "post_attention_layernorm.weight",
                    ROUTER_W: HF_ROUTER})
        out.update({expert_name(spec, e, "linear_fc2"): f"mlp.experts.{e}.down_proj.weight"
                    for e in range(arch.num_experts)})
        return out

    def layer_shapes(self, arch: QwenArch) -> dict[str, tuple[int, ...]]:
        """A MoE layer's megatron names (TE spec) -> whole (TP=1, EP=1) shapes, one entry per
        expert (a dense layer's: :meth:`layer_shapes_at`)."""
        if not arch.is_moe:
            return super().layer_shapes(arch)
        h, f, e = arch.hidden_size, arch.moe_intermediate_size, arch.num_experts
        shapes = {**super().layer_shapes(replace(arch, num_experts=0)), PRE_MLP_NORM: (h,),
                  ROUTER_W: (e, h)}
        for x in range(e):
            shapes[expert_name("te", x, "linear_fc1")] = (2 * f, h)
            shapes[expert_name("te", x, "linear_fc2")] = (h, f)
        return {k: shapes[k] for k in self.moe_layer_names("te", arch)}

    def layer_shapes_at(self, arch: QwenArch, i: int) -> dict[str, tuple[int, ...]]:
        if arch.is_moe and not arch.is_moe_layer(i):
            return super().layer_shapes(replace(arch, num_experts=0))
        return self.layer_shapes(arch)

    def hf_layer_shapes(self, arch: QwenArch) -> dict[str, tuple[int, ...]]:
        """A MoE layer's HF tensors, in HF's order (a dense layer's: :meth:`hf_layer_shapes_at`)."""
        dense = super().hf_layer_shapes(arch)
        if not arch.is_moe:
            return dense
        h, f, e = arch.hidden_size, arch.moe_intermediate_size, arch.num_experts
        shapes = {k: v for k, v in dense.items() if not k.startswith("mlp.")}
        shapes[HF_ROUTER] = (e, h)
        for x in range(e):
            shapes.update({f"mlp.experts.{x}.gate_proj.weight": (f, h),
                           f"mlp.experts.{x}.up_proj.weight": (f, h),
                           f"mlp.experts.{x}.down_proj.weight": (h, f)})
        return shapes

    def hf_layer_shapes_at(self, arch: QwenArch, i: int) -> dict[str, tuple[int, ...]]:
        if arch.is_moe and not arch.is_moe_layer(i):
            return super().hf_layer_shapes(arch)
        return self.hf_layer_shapes(arch)

    def hf_to_mcore(self, get: Getter, arch: QwenArch, i: int, name: str,
                    spec: str) -> torch.Tensor:
        if not arch.is_moe_layer(i) or name in (QKV_W, QKV_B):
            return super().hf_to_mcore(get, arch, i, name, spec)
        p = f"model.layers.{i}."
        if name in self.moe_layer_names(spec, arch):
            direct = self.moe_one_to_one(spec, arch)
            if name in direct:
                return get(p + direct[name])
            parsed = parse_expert_name(name)
            if parsed is not None and parsed[2] == "linear_fc1":
                e = parsed[1]
                return torch.cat([get(f"{p}mlp.experts.{e}.gate_proj.weight"),
                                  get(f"{p}mlp.experts.{e}.up_proj.weight")])
        raise self._refuse("source", name, arch, spec)

    def mcore_to_hf(self, arch: QwenArch, i: int, name: str, tensor: torch.Tensor,
                    spec: str) -> list[tuple[str, torch.Tensor]]:
        if not arch.is_moe_layer(i) or name in (QKV_W, QKV_B):
            return super().mcore_to_hf(arch, i, name, tensor, spec)
        p = f"model.layers.{i}."
        if name in self.moe_layer_names(spec, arch):
            direct = self.moe_one_to_one(spec, arch)
            if name in direct:
                return [(p + direct[name], tensor)]
            parsed = parse_expert_name(name)
            if parsed is not None and parsed[2] == "linear_fc1":
                e = parsed[1]
                gate, up = torch.chunk(tensor, 2, dim=0)
                return [(f"{p}mlp.experts.{e}.gate_proj.weight", gate.contiguous()),
                        (f"{p}mlp.experts.{e}.up_proj.weight", up.contiguous())]
        raise self._refuse("name", name, arch, spec)

    def _refuse(self, what: str, name: str, arch: QwenArch, spec: str) -> KeyError:
        return KeyError(f"no HF {what} for megatron layer parameter {name!r} (spec {spec!r}, "
                        f"{self.name}: num_experts={arch.num_experts})")

