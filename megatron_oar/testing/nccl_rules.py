"""A CPU check of NCCL's rules, for the tests: what would fail on the first GPU run fails on CPU.

On a GPU the default process group, megatron's groups (all but its ``*_gloo`` ones) and the
separate placement's ``weights_device`` group are NCCL; on CPU every one of them is gloo, which
takes any dtype and any (CPU) tensor. :func:`enabled` (a context manager, per process) checks
every tensor handed to a collective on such a group against what NCCL takes:

* **dtype**: NCCL's types as torch's ``ProcessGroupNCCL`` maps them (:data:`NCCL_DTYPES`: no
  ``int16``, no ``uint16``, no complex; ``bool`` travels as ``uint8``);
* **device**: a tensor the code built on the host (a factory call without ``device=`` or with
  ``device="cpu"``, ``.cpu()``, ``.to("cpu")``, ``torch.as_tensor`` of a list or an array, and
  whatever is computed from host tensors only) is a stray CPU tensor on a GPU, where NCCL raises.
  The CPU backend (``runtime/cpu_backend.py``) maps ``cuda`` to ``cpu``, so "on the device" cannot
  be read off a CPU tensor: a :class:`~torch.overrides.TorchFunctionMode` stacked on the backend's
  sees each call's device argument before the backend rewrites it and marks the host-built
  tensors (an attribute; propagated through ops whose tensor inputs are all host-built;
  ``.cuda()`` / ``.to("cuda")`` clears it). Tensors autograd makes carry no mark (they follow
  their inputs' device on a GPU).

Groups are told apart as on a GPU: a group made with ``backend="gloo"`` (``new_group``;
megatron's ``*_gloo`` groups, ``runtime.gloo_group``) is host-side and unchecked; the default
group and every other group are checked, and so is a :class:`~megatron_oar.runtime.roles.CrossGroup`
marked ``nccl`` (the ``weights_device`` group). A violation raises :class:`NcclRuleError`
naming the collective, the argument and the rule.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import threading

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

# torch's getNcclDataType (ProcessGroupNCCL.cpp): the dtypes NCCL collectives take
NCCL_DTYPES = frozenset({torch.int8, torch.uint8, torch.bool, torch.int32, torch.int64, torch.float16,
                         torch.bfloat16, torch.float32, torch.float64, torch.float8_e4m3fn, torch.float8_e5m2})

COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "_all_gather_base", "reduce_scatter",
               "reduce_scatter_tensor", "_reduce_scatter_base", "broadcast", "reduce", "all_to_all",
               "all_to_all_single", "gather", "scatter", "send", "recv", "batch_isend_irecv")
_HOST = "_oar_host_built"  # the attribute marking a host-built tensor
_FACTORIES = {torch.tensor, torch.as_tensor, torch.zeros, torch.ones, torch.empty, torch.full, torch.arange,
              torch.rand, torch.randn, torch.randint, torch.randperm, torch.linspace, torch.eye,
              torch.empty_strided, torch.frombuffer}


class NcclRuleError(AssertionError):
    """A collective on a group that is NCCL on a GPU was handed what NCCL refuses."""


def _device_kind(device) -> str | None:
    if device is None:
        return None
    if isinstance(device, int) and not isinstance(device, bool):
        return "cuda"
    return torch.device(device).type


def _asked(func, args, kwargs) -> str | None:
    """What a call asked for: "cpu" (``.cpu()``, a ``"cpu"`` string), "device" (any other device
    argument: ``cuda``, an ordinal, a ``torch.device`` the code computed, which is the run's
    device where it reads one off a tensor or ``torch.cuda``), or None (no device argument)."""
    if func is torch.Tensor.cpu:
        return "cpu"
    if func is torch.Tensor.cuda:
        return "device"
    device = kwargs.get("device")
    if device is None and func is torch.Tensor.to:
        device = next((a for a in args[1:] if isinstance(a, (str, torch.device, int)) and not isinstance(a, bool)),
                      None)
    if device is None:
        return None
    if isinstance(device, str) and device.split(":")[0] == "cpu":
        return "cpu"
    return "device"


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


def is_host_built(t: torch.Tensor) -> bool:
    return bool(getattr(t, _HOST, False))


def _mark(out, host: bool) -> None:
    for t in _tensors(out):
        try:
            setattr(t, _HOST, host)
        except (AttributeError, RuntimeError):  # pragma: no cover - a tensor subclass without __dict__
            pass


class HostTensorMode(TorchFunctionMode):
    """Marks host-built tensors (module docstring); stacked inside the CPU backend's mode, so it
    sees the device arguments the code wrote."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if name.endswith("_") and not name.startswith("_") or name in ("__setitem__", "__set__"):
            return out  # in place: the tensor keeps what it was
        asked = _asked(func, args, kwargs)
        if asked == "device":
            _mark(out, False)  # .cuda() on CPU hands back the same object: now "on the device"
            return out
        if asked == "cpu" and out is args[0]:
            if is_host_built(out):
                return out
            # .cpu() on CPU hands back the same object; on a GPU a copy, and the original stays
            # on the device: an alias of its own stands for the copy
            out = out.view_as(out)
        if asked == "cpu" or (asked is None and func in _FACTORIES):
            _mark(out, True)
            return out
        inputs = [t for t in _tensors(list(args) + list(kwargs.values()))]
        if inputs and all(is_host_built(t) for t in inputs):
            _mark(out, True)
        return out


class _Checker:
    def __init__(self) -> None:
        self.host_groups: list = []  # groups made with backend="gloo"
        self.originals: dict[str, object] = {}
        self.patched: list[tuple[object, str, object]] = []  # (module, name, original)
        self.mode: HostTensorMode | None = None
        self.violations = 0

    def is_device_group(self, group) -> bool:
        return not any(group is g for g in self.host_groups)

    def check(self, what: str, tensors) -> None:
        for i, t in enumerate(_tensors(tensors)):
            if t.dtype not in NCCL_DTYPES:
                self.violations += 1
                raise NcclRuleError(f"{what}: tensor {i} has dtype {t.dtype}, which NCCL does not take "
                                    f"(NCCL: {sorted(str(d) for d in NCCL_DTYPES)}); send it as bytes "
                                    "(a uint8 view) or in a wider type")
            if is_host_built(t):
                self.violations += 1
                raise NcclRuleError(f"{what}: tensor {i} ({t.dtype}{list(t.shape)}) was built on the host "
                                    "(no device= / .cpu()); on a GPU this NCCL group refuses a CPU tensor: "
                                    "create it with device= (or move it) first")


_checker: _Checker | None = None
_lock = threading.Lock()


def active() -> bool:
    return _checker is not None


def check_tensors(what: str, tensors) -> None:
    """For a group known to be NCCL on a GPU (``CrossGroup`` marked ``nccl``): checks ``tensors``."""
    if _checker is not None:
        _checker.check(what, tensors)


def _wrap_collective(name: str, fn):
    sig = inspect.signature(fn)

    def wrapped(*args, **kwargs):
        c = _checker
        if c is not None:
            try:
                bound = sig.bind(*args, **kwargs)
            except TypeError:
                return fn(*args, **kwargs)
            group = bound.arguments.get("group")
            if c.is_device_group(group):
                if name == "batch_isend_irecv":
                    tensors = [op.tensor for op in bound.arguments["p2p_op_list"]]
                else:
                    tensors = [v for k, v in bound.arguments.items() if k != "group"]
                c.check(f"torch.distributed.{name}", tensors)
        return fn(*args, **kwargs)

    wrapped.__wrapped__ = fn
    wrapped.__name__ = name
    return wrapped


def _wrap_new_group(fn):
    sig = inspect.signature(fn)

    def wrapped(*args, **kwargs):
        group = fn(*args, **kwargs)
        c = _checker
        if c is not None:
            backend = sig.bind(*args, **kwargs).arguments.get("backend")
            if backend is not None and str(backend).lower() == "gloo":
                c.host_groups.append(group)
        return group

    wrapped.__wrapped__ = fn
    return wrapped


def _replace_everywhere(checker: _Checker, originals: dict[str, object], wrappers: dict[str, object]) -> None:
    """``torch.distributed.<name>`` and every module global bound to the same function (megatron's
    ``mappings.dist_all_gather_func`` and the like), for megatron's and this project's modules."""
    by_id = {id(f): wrappers[n] for n, f in originals.items()}
    for n, w in wrappers.items():
        checker.patched.append((dist, n, originals[n]))
        setattr(dist, n, w)
    for mod_name, mod in list(sys.modules.items()):
        if mod is None or not mod_name.startswith(("megatron.", "megatron_oar.")):
            continue
        for attr, value in list(vars(mod).items()):
            w = by_id.get(id(value))
            if w is not None:
                checker.patched.append((mod, attr, value))
                setattr(mod, attr, w)


def enable() -> None:
    """Turns the check on in this process (before the groups are made, so that the gloo ones are
    known as such); idempotent. Needs the CPU backend (``runtime.cpu_backend``) where CUDA is
    absent: the mode stacks on it."""
    global _checker
    with _lock:
        if _checker is not None:
            return
        from megatron_oar.runtime import cpu_backend, roles

        if not torch.cuda.is_available():
            cpu_backend.enable()  # first: the mode must sit inside the backend's (see HostTensorMode)
        c = _Checker()
        originals = {n: getattr(dist, n) for n in COLLECTIVES if hasattr(dist, n)}
        wrappers = {n: _wrap_collective(n, f) for n, f in originals.items()}
        originals["new_group"] = dist.new_group
        wrappers["new_group"] = _wrap_new_group(dist.new_group)
        _replace_everywhere(c, originals, wrappers)
        c.mode = HostTensorMode()
        c.mode.__enter__()
        cpu_backend.add_backward_mode(HostTensorMode)
        roles.DEVICE_GROUP_CHECK = check_tensors
        _checker = c


def disable() -> None:
    """Undoes :func:`enable`."""
    global _checker
    with _lock:
        c = _checker
        if c is None:
            return
        from megatron_oar.runtime import cpu_backend, roles

        cpu_backend.remove_backward_mode(HostTensorMode)
        roles.DEVICE_GROUP_CHECK = None
        c.mode.__exit__(None, None, None)
        for mod, attr, value in reversed(c.patched):
            setattr(mod, attr, value)
        _checker = None


@contextlib.contextmanager
def enabled():
    """:func:`enable` for a block (:func:`disable` after it)."""
    enable()
    try:
        yield
    finally:
        disable()
