"""A random Qwen2 of a given shape as the trainer's Megatron policy in a gloo world of one, and
synthetic batches of it: the suites where FLOPs, not Python, decide the times (``oar bench
batching``, ``oar bench attribution-flops``)."""

from __future__ import annotations

import argparse
import contextlib
import tempfile
from collections.abc import Iterator
from pathlib import Path


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The model's shape (default: 57.7M parameters, head_dim 64, GQA 8/2, vocab 32768)."""
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--ffn", type=int, default=1536)
    p.add_argument("--vocab", type=int, default=32768)


def describe(args, params: int) -> str:
    import torch

    return (f"random Qwen2, hidden {args.hidden}, {args.layers} layers, {args.heads}/{args.kv_heads} heads, "
            f"ffn {args.ffn}, vocab {args.vocab} ({params / 1e6:.1f}M parameters), fp32, one process"
            + (f" on one {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""))


@contextlib.contextmanager
def random_policy(args, max_positions: int, optimizer_steps: int) -> Iterator:
    """``(policy, arch)``: the policy (``training.policy.build_policy``, local spec, TP1/PP1) of a
    random Qwen2 of ``args``' shape, converted through the HF checkpoint path as a user's model
    would be, and its :class:`~megatron_oar.models.arch.QwenArch`."""
    from checkpoints_convert.convert import hf_to_megatron
    from megatron_oar.config import ModelConfig, OptimConfig
    from megatron_oar.models import parse_arch, read_hf_config
    from megatron_oar.models.tiny import make_tiny_qwen2
    from megatron_oar.runtime import ParallelConfig, destroy_runtime, init_runtime
    from megatron_oar.training.policy import build_policy

    with tempfile.TemporaryDirectory() as tmp:
        hf = make_tiny_qwen2(Path(tmp) / "hf", vocab_size=args.vocab, hidden_size=args.hidden,
                             intermediate_size=args.ffn, num_hidden_layers=args.layers,
                             num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                             max_position_embeddings=max_positions)
        ckpt = Path(tmp) / "ckpt"
        hf_to_megatron(hf, ckpt, progress=False)
        init_runtime(ParallelConfig())
        try:
            hf_config = read_hf_config(ckpt / "hf")
            policy = build_policy(hf_config, ModelConfig(path=str(ckpt), spec="local"), OptimConfig(lr=1e-6),
                                  checkpoint=ckpt, total_optimizer_steps=optimizer_steps)
            yield policy, parse_arch(hf_config)
        finally:
            destroy_runtime()


def random_batch(prompt: int, responses: list[int], vocab: int, seed: int = 0):
    """A :class:`~megatron_oar.training.inputs.TrainBatch` of random tokens: a ``prompt``-token
    prompt and a response of each length in ``responses``, a random advantage per row."""
    import torch

    from megatron_oar.training.inputs import TrainBatch

    g = torch.Generator().manual_seed(seed)
    rows = len(responses)
    lengths = prompt + torch.tensor(responses)
    tokens = torch.zeros(rows, int(lengths.max()), dtype=torch.long)
    for i, n in enumerate(lengths.tolist()):
        tokens[i, :n] = torch.randint(3, vocab, (n,), generator=g)
    pos = torch.arange(tokens.shape[1])
    mask = (pos >= prompt) & (pos < lengths[:, None])
    adv = torch.randn(rows, generator=g)
    # where the policy's runtime put the model: the current CUDA device when there is one
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    return TrainBatch(tokens.to(dev), torch.full((rows,), prompt, device=dev), lengths.to(dev),
                      torch.arange(rows, device=dev), loss_mask=mask.to(dev),
                      rollout_logprobs=torch.zeros(tokens.shape, device=dev), seq_adv=adv.to(dev))
