"""Vocab-parallel statistics against the same computation on the full, unpadded vocabulary:
top-k (the oracle's substitutes), entropy and target log-probs, at TP1 and TP2 (gloo)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.distributed import launch

VOCAB, PADDED = 13, 16  # three padded rows at the end


def _logits() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, PADDED, generator=g)
    x[..., VOCAB:] = 50.0  # padded rows must never win
    x[0, 0, 3] = x[0, 0, 9] = 9.0  # a tie across the two TP halves
    return x


def _reference(x: torch.Tensor, targets: torch.Tensor) -> dict:
    true = x[..., :VOCAB]
    logp = true.log_softmax(-1)
    return {"top": true.topk(2, dim=-1).values, "entropy": -(logp.exp() * logp).sum(-1),
            "target": logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)}


def _compute(tp_rank: int, tp: int) -> dict:
    from megatron_oar.models import vocab_parallel as vp

    x = _logits()
    local = x.chunk(tp, dim=-1)[tp_rank]
    targets = torch.arange(10).reshape(2, 5) % VOCAB
    values, ids = vp.top_k(local, VOCAB, 2)
    return {"top": values, "ids": ids, "entropy": vp.entropy(local, VOCAB),
            "target": vp.target_logprobs(local, targets, VOCAB), "targets": targets}


def _check(out: dict) -> None:
    x = _logits()
    ref = _reference(x, out["targets"])
    torch.testing.assert_close(out["top"], ref["top"])
    assert (out["ids"] < VOCAB).all()
    # the ids point at the values they came with (ties may list either id first)
    torch.testing.assert_close(x.gather(-1, out["ids"]), out["top"])
    assert set(out["ids"][0, 0].tolist()) == {3, 9}
    torch.testing.assert_close(out["entropy"], ref["entropy"])
    torch.testing.assert_close(out["target"], ref["target"])


def test_tp1():
    from megatron_oar.runtime import destroy_runtime, init_runtime

    init_runtime()
    try:
        _check(_compute(0, 1))
    finally:
        destroy_runtime()


def _tp2_worker(out_dir: str) -> None:
    from megatron.core import parallel_state as ps

    from megatron_oar.runtime import ParallelConfig, init_runtime

    init_runtime(ParallelConfig(tp=2))
    torch.save(_compute(ps.get_tensor_model_parallel_rank(), 2),
               Path(out_dir) / f"{torch.distributed.get_rank()}.pt")


@pytest.mark.slow
def test_tp2(tmp_path):
    launch(_tp2_worker, 2, str(tmp_path))
    for f in sorted(tmp_path.glob("*.pt")):
        _check(torch.load(f))
