"""Which fused kernels megatron-core will use here, said once in the log.

apex is not on the package registry, so on most installs megatron-core falls back to torch
implementations (WrappedTorchNorm for RMSNorm, no gradient-accumulation fusion, unfused
softmax). When apex, Transformer Engine or megatron's fused softmax kernel is importable, it is
used.
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


@dataclass(frozen=True)
class KernelReport:
    apex: bool
    transformer_engine: bool
    grad_accum_fusion: bool  # apex's fused_weight_gradient_mlp_cuda
    norm: str
    masked_softmax: bool = False  # megatron's scaled_masked_softmax_cuda (local-spec attention)

    def line(self) -> str:
        return (
            f"kernels: apex={'yes' if self.apex else 'no'} "
            f"transformer_engine={'yes' if self.transformer_engine else 'no'} "
            f"norm={self.norm} grad_accum_fusion={'on' if self.grad_accum_fusion else 'off'} "
            f"masked_softmax_fusion={'on' if self.masked_softmax else 'off'} "
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
    if te:
        norm = "transformer_engine (fused in linear_qkv / linear_fc1)"
    elif apex:
        norm = "apex FusedLayerNorm"
    else:
        norm = "torch (megatron WrappedTorchNorm fallback)"
    return KernelReport(apex=apex, transformer_engine=te, grad_accum_fusion=grad_fusion, norm=norm,
                        masked_softmax=softmax)


def log_kernel_report() -> KernelReport:
    report = kernel_report()
    log.info(report.line())
    return report
