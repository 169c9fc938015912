"""Qwen2 / Qwen2.5 as megatron-core GPTModel."""

from megatron_oar.models.qwen2 import (
    ModelConfigError,
    ModelOptions,
    QwenArch,
    build_gpt_model,
    check_layout,
    parse_arch,
    read_hf_config,
)

__all__ = ["ModelConfigError", "ModelOptions", "QwenArch", "build_gpt_model", "check_layout",
           "parse_arch", "read_hf_config"]
