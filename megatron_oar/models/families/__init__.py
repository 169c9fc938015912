"""The model families this package builds, one module each, and the registry that picks one.

A family maps its HF ``config.json`` onto :class:`~megatron_oar.models.arch.QwenArch` (refusing
what megatron's ``GPTModel`` here cannot build) and names its HF tensors (see
:class:`~megatron_oar.models.families.qwen2.Qwen2`, the base). Adding one is a module here
and an entry in :data:`FAMILIES`.
"""

from __future__ import annotations

from typing import Any

from megatron_oar.models.arch import ModelConfigError, QwenArch
from megatron_oar.models.families.qwen2 import Qwen2
from megatron_oar.models.families.qwen3 import Qwen3
from megatron_oar.models.families.qwen3_moe import Qwen3Moe

FAMILIES: tuple[Qwen2, ...] = (Qwen2(), Qwen3(), Qwen3Moe())
SUPPORTED_ARCHITECTURES = tuple(f.architecture for f in FAMILIES)
SUPPORTED_MODEL_TYPES = tuple(f.model_type for f in FAMILIES)
_BY_ARCHITECTURE = {f.architecture: f for f in FAMILIES}
_BY_MODEL_TYPE = {f.model_type: f for f in FAMILIES}


def family_for_config(hf: dict[str, Any]) -> Qwen2 | None:
    """The family of a config.json by ``architectures`` (first supported entry), else by
    ``model_type``; None if unsupported."""
    for a in hf.get("architectures") or []:
        if a in _BY_ARCHITECTURE:
            return _BY_ARCHITECTURE[a]
    return _BY_MODEL_TYPE.get(hf.get("model_type"))


def family_of(arch: QwenArch | None) -> Qwen2:
    """The family that parsed ``arch`` (None: Qwen2)."""
    return _BY_MODEL_TYPE["qwen2" if arch is None else arch.family]


def parse_arch(hf: dict[str, Any], source: str = "config.json") -> QwenArch:
    """The architecture of a config.json dict; ModelConfigError naming ``source`` if unsupported."""
    family = family_for_config(hf)
    if family is None:
        supported = ", ".join(f"{f.architecture} (model_type {f.model_type!r})" for f in FAMILIES)
        raise ModelConfigError(f"{source}: unsupported architecture "
                               f"{hf.get('architectures') or hf.get('model_type')!r}; "
                               f"supported: {supported}")
    return family.parse(hf, source)
