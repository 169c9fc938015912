"""Which fused kernels are importable here, and which ones a built model actually uses.

Two log lines, so neither claims what the other knows: :func:`kernel_report` says what imports
on this machine (apex, Transformer Engine, megatron's fused softmax and apex's fused
weight-gradient kernels; ``oar info`` and the runtime's start-up line), and
:func:`model_kernels_line` says what a built model uses, read from its ``TransformerConfig``
and layer spec (logged by ``build_gpt_model``). apex is not on the package registry, so on most
installs megatron-core falls back to torch implementations. An importable kernel is not a used
one: Qwen's RMSNorm never goes through apex's FusedLayerNorm (it asserts LayerNorm), and the
gradient-accumulation fusion is off in every config this package builds.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)


def _has(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def _on(flag) -> str:
    return "on" if flag else "off"


@dataclass(frozen=True)
class KernelReport:
    """What imports here (with CUDA where the kernel needs it); not what a model uses."""

    apex: bool
    transformer_engine: bool
    grad_accum_fusion: bool  # apex's fused_weight_gradient_mlp_cuda imports (the fusion stays off)
    masked_softmax: bool = False  # megatron's scaled_masked_softmax_cuda (local-spec attention)
    moe_permute: bool = False  # TE's fused MoE token permutation, as megatron's moe_utils imports it

    def line(self) -> str:
        return (
            f"kernels available: apex={_yes(self.apex)} "
            f"transformer_engine={_yes(self.transformer_engine)} "
            f"fused_weight_gradient={_yes(self.grad_accum_fusion)} "
            f"scaled_masked_softmax={_yes(self.masked_softmax)} "
            f"moe_fused_permute={_yes(self.moe_permute)} "
            f"device={'cuda' if torch.cuda.is_available() else 'cpu'}"
        )


def kernel_report() -> KernelReport:
    apex = _has("apex")
    te = torch.cuda.is_available() and _has("transformer_engine")
    grad_fusion = torch.cuda.is_available() and _has("fused_weight_gradient_mlp_cuda")
    # megatron's FusedScaleMaskSoftmax imports this kernel whenever the shape allows it (bf16 or
    # fp16, 16 < keys <= 4096, ...); a pip install rarely has it, so the fusion is only turned on
    # where it imports (measured on an H100 without it: bf16 attention crashed, 2026-11-23)
    softmax = torch.cuda.is_available() and _has("scaled_masked_softmax_cuda")
    return KernelReport(apex=apex, transformer_engine=te, grad_accum_fusion=grad_fusion,
                        masked_softmax=softmax, moe_permute=te and _fused_moe_permute())


# what megatron's ``moe_permute_fusion`` calls (``moe_utils``, imported from Transformer Engine;
# TransformerConfig refuses the fusion when one is missing)
FUSED_PERMUTE = ("fused_permute", "fused_permute_with_probs", "fused_sort_chunks_by_index",
                 "fused_sort_chunks_by_index_with_probs", "fused_unpermute")


def _fused_moe_permute() -> bool:
    """Whether megatron's ``moe_utils`` holds TE's fused permutation kernels (TE >= 2.1)."""
    try:
        from megatron.core.transformer.moe import moe_utils
    except ImportError:  # pragma: no cover - megatron-core is a dependency
        return False
    return all(getattr(moe_utils, name, None) is not None for name in FUSED_PERMUTE)


def log_kernel_report() -> KernelReport:
    report = kernel_report()
    log.info(report.line())
    return report


def model_kernels_line(config, spec: str, attention: str | None = None) -> str:
    """What a model built from megatron ``config`` with layer ``spec`` (``local``/``te``) and core
    ``attention`` (``te`` / ``sdpa`` / ``unfused``; None: the spec's default) uses."""
    attention = attention or ("te" if spec == "te" else "sdpa")
    if spec == "te":
        norm = "transformer_engine RMSNorm (fused into linear_qkv / linear_fc1; final TENorm)"
    else:
        norm = "torch RMSNorm (TorchRMSNorm, sequence-parallel capable)"
    attention = {
        "te": "transformer_engine DotProductAttention",
        "sdpa": "torch scaled_dot_product_attention (SDPAttention; its kernel is logged at the first call)",
        "unfused": ("megatron DotProductAttention (unfused, s x s scores) "
                    f"masked_softmax_fusion={_on(config.masked_softmax_fusion)}"),
    }[attention]
    recipe = getattr(config.fp8_recipe, "value", config.fp8_recipe)  # megatron's Fp8Recipe enum
    fp8 = f"{config.fp8} ({recipe})" if config.fp8 else "off"
    return (f"model kernels: spec={spec} norm={norm} attention={attention} "
            f"grad_accum_fusion={_on(config.gradient_accumulation_fusion)} "
            f"bias_activation_fusion={_on(config.bias_activation_fusion)} "
            f"bias_dropout_fusion={_on(config.bias_dropout_fusion)} "
            f"apply_rope_fusion={_on(config.apply_rope_fusion)} "
            f"persist_layer_norm={_on(config.persist_layer_norm)} "
            f"sequence_parallel={_on(config.sequence_parallel)} fp8={fp8}"
            + (f" moe_permute_fusion={_on(config.moe_permute_fusion)}" if config.num_moe_experts else ""))


_logged_model_lines: set[str] = set()


def log_model_kernels(config, spec: str, attention: str | None = None) -> str:
    """Logs :func:`model_kernels_line` once per distinct line in this process."""
    line = model_kernels_line(config, spec, attention)
    if line not in _logged_model_lines:
        _logged_model_lines.add(line)
        log.info(line)
    return line
