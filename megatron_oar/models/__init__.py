"""Hugging Face model families (Qwen2 / Qwen2.5, Qwen3) as megatron-core GPTModel.

``arch`` (the parsed architecture), ``families`` (one module per family: its config.json
mapping and HF tensor names, and the registry), ``builder`` (options, TransformerConfig, layer
spec, ``build_gpt_model``), ``hf_mapping`` / ``gpt_layout`` (HF <-> megatron tensors).
"""

from megatron_oar.models.arch import ModelConfigError, QwenArch, read_hf_config
from megatron_oar.models.builder import DTYPES, ModelOptions, build_gpt_model, check_layout
from megatron_oar.models.families import FAMILIES, SUPPORTED_ARCHITECTURES, parse_arch

__all__ = ["DTYPES", "FAMILIES", "ModelConfigError", "ModelOptions", "QwenArch",
           "SUPPORTED_ARCHITECTURES", "build_gpt_model", "check_layout", "parse_arch",
           "read_hf_config"]
