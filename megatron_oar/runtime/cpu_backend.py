"""Run megatron-core's own modules and pipeline schedules on CPU (gloo), unmodified.

megatron-core assumes CUDA in a handful of places (see DESIGN.md section 3):

* the pipeline schedules and p2p communication create tensors on ``"cuda"`` /
  ``torch.cuda.current_device()`` and call ``torch.cuda.synchronize()``;
* rotary embeddings move ``inv_freq`` to ``torch.cuda.current_device()``;
* the RNG tracker (``model_parallel_cuda_manual_seed``, ``_get_cuda_rng_state``,
  ``_set_cuda_rng_state``) reads and writes the CUDA generator;
* the optimizers (mixed-precision, distributed, grad clipping) assert
  ``param.type() == 'torch.cuda.FloatTensor'`` (and the Half/BFloat16 names);
* context parallelism's rotary slicing (``get_pos_emb_on_this_cp_rank``) builds its index with
  ``pin_memory=True``, which a CPU-only torch refuses;
* custom autograd functions allocate on ``torch.cuda.current_device()`` in their backward too
  (``tensor_parallel.mappings._gather_along_first_dim``, the backward of the reduce-scatter that
  the MoE ``allgather`` token dispatcher combines expert outputs with at EP > 1), and autograd
  runs a backward outside the Python function-mode stack the forward ran under.

:func:`enable` redirects exactly these: a :class:`~torch.overrides.TorchFunctionMode`
maps every CUDA device argument to CPU, drops ``pin_memory=True``, and answers ``Tensor.type()`` with the CUDA type
name (``torch.cuda.FloatTensor`` for a CPU float tensor), ``torch.cuda.current_device`` answers 0 (which
the mode maps to CPU), ``synchronize`` is a no-op, and "the CUDA generator" becomes the
CPU default generator, so megatron's RNG-tracker forks (dropout in TP regions) work and
stay deterministic. Autograd does not carry the mode into a custom function's ``backward``
(``BackwardCFunction.apply``), so the backend re-enters it there. It is a no-op when CUDA is
available, and it refuses to run then.

:func:`patch_megatron_moe_without_te` is for megatron's MoE router without Transformer Engine
(CPU or GPU): ``moe_utils`` names ``te_general_gemm`` only when TE imports, and its router's
gating linear tests it for None, a NameError without TE.
"""

from __future__ import annotations

import contextlib
import logging
import threading

import torch
from torch.overrides import TorchFunctionMode

log = logging.getLogger(__name__)

_lock = threading.Lock()
_mode: CudaToCpuMode | None = None
# modes a test stacks on the backend's (``testing/nccl_rules.py``), re-entered with it in backward
_backward_modes: list[type[TorchFunctionMode]] = []


def add_backward_mode(mode: type[TorchFunctionMode]) -> None:
    """Also enter ``mode()`` (inside the backend's) where a custom function's backward re-enters
    the backend's mode."""
    _backward_modes.append(mode)


def remove_backward_mode(mode: type[TorchFunctionMode]) -> None:
    if mode in _backward_modes:
        _backward_modes.remove(mode)


def _is_cuda(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    # A bare int device means a CUDA ordinal to torch.
    return isinstance(device, int) and not isinstance(device, bool)


class CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA device arguments of any torch call to CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # megatron's optimizers check ``param.type() == 'torch.cuda.FloatTensor'``
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if ".cuda." not in name else name
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs = {**kwargs, "device": torch.device("cpu")}
        if kwargs.get("pin_memory"):  # pinned memory is for host-to-GPU copies
            kwargs = {**kwargs, "pin_memory": False}
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], torch.device("cpu"), *args[2:])
        return func(*args, **kwargs)


def _cpu_get_rng_state(device="cuda", clone=False, graph_safe=False):
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state, device=-1, graph_safe=False):
    torch.set_rng_state(new_state)


def _backward_in_mode(apply):
    """``BackwardCFunction.apply`` that re-enters the CPU mode when autograd called it without
    any function mode (a custom function's backward, e.g. megatron's gather in the MoE
    dispatcher's reduce-scatter backward, allocating on ``torch.cuda.current_device()``)."""

    def wrapped(self, *args):
        if _mode is not None and torch._C._len_torch_function_stack() == 0:
            with contextlib.ExitStack() as stack:
                for mode in [CudaToCpuMode, *_backward_modes]:
                    stack.enter_context(mode())
                return apply(self, *args)
        return apply(self, *args)

    wrapped.__wrapped__ = apply
    return wrapped


def patch_megatron_moe_without_te() -> None:
    """Defines ``megatron.core.transformer.moe.moe_utils.te_general_gemm`` as None where
    Transformer Engine did not import (megatron's router then uses torch's matmul). Idempotent."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def is_enabled() -> bool:
    return _mode is not None


def enable() -> None:
    """Activate the CPU backend for this process (idempotent)."""
    global _mode
    if torch.cuda.is_available():
        raise RuntimeError("cpu_backend.enable() called on a machine with CUDA; use the CUDA path")
    with _lock:
        if _mode is not None:
            return
        from megatron.core.tensor_parallel import random as mrandom

        torch.cuda.current_device = lambda: 0
        torch.cuda.synchronize = lambda device=None: None
        torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
        torch.cuda.set_rng_state = lambda new_state, device="cuda": torch.set_rng_state(new_state)
        # torch.manual_seed itself calls torch.cuda.manual_seed_all: seed the CPU generator
        # directly, and leave _all a no-op (the CPU generator is already seeded by then).
        torch.cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
        torch.cuda.manual_seed_all = lambda seed: None
        mrandom._get_cuda_rng_state = _cpu_get_rng_state
        mrandom._set_cuda_rng_state = _cpu_set_rng_state
        from torch.autograd.function import BackwardCFunction

        BackwardCFunction.apply = _backward_in_mode(BackwardCFunction.apply)
        patch_megatron_moe_without_te()
        _mode = CudaToCpuMode()
        _mode.__enter__()
        log.info("megatron-core CPU backend enabled: cuda devices map to cpu, CUDA RNG = CPU RNG")
