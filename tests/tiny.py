"""Tiny random Qwen2 checkpoints and tokenizers made on the spot (no downloads)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, vocab_size=1000,
             max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=1_000_000.0)


def make_tokenizer(out: Path, vocab_size: int = 1000) -> None:
    """A byte-level BPE tokenizer trained on a few arithmetic strings, saved HF-style."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=min(vocab_size - 8, 400),
                                  special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = [f"{a} + {b} = {a + b}. <answer>{a + b}</answer>" for a in range(40) for b in range(7)]
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>")
    fast.save_pretrained(str(out))


def make_tiny_qwen2(out: Path, *, tied: bool = False, seed: int = 0, dtype=torch.float32,
                    tokenizer: bool = True, **overrides) -> Path:
    """Writes a random Qwen2ForCausalLM (safetensors) to ``out`` and returns it."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(**{**SMALL, **overrides}, tie_word_embeddings=tied)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg).to(dtype)
    with torch.no_grad():  # non-trivial biases and norms, so mapping mistakes show
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.copy_(torch.randn_like(p) * 0.1 + (1.0 if "norm" in name else 0.0))
    out = Path(out)
    model.save_pretrained(str(out), safe_serialization=True)
    if tokenizer:
        make_tokenizer(out, cfg.vocab_size)
    return out


def hf_logits(hf_dir: Path, tokens: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), torch_dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return model(tokens).logits


def read_config(hf_dir: Path) -> dict:
    return json.loads((Path(hf_dir) / "config.json").read_text())
