"""Test helpers around the package's tiny-model builders."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from megatron_oar.models.tiny import (  # noqa: F401
    SMALL,
    SMALL_QWEN3,
    SMALL_QWEN3_MOE,
    make_tiny_qwen2,
    make_tiny_qwen3,
    make_tiny_qwen3_moe,
    make_tokenizer,
)


def hf_logits(hf_dir: Path, tokens: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return model(tokens).logits


def read_config(hf_dir: Path) -> dict:
    return json.loads((Path(hf_dir) / "config.json").read_text())
