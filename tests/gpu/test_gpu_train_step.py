"""CUDA: the trainer's Megatron passes (old-logprob pass, OAR-G credit, one update_step with
megatron's DDP and distributed optimizer over nccl) against transformers on GPU, in fp32 and
bf16. Skipped without CUDA; record runs in docs/gpu-validation.md."""

from __future__ import annotations

import pytest
import torch

from tests import train_step_check

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (no GPU on this machine)"),
]


@pytest.mark.parametrize("dtype, tol", [("fp32", 1e-4), ("bf16", 0.1)])
def test_update_follows_the_advantages_on_cuda(tmp_path, dtype, tol):
    res = train_step_check.run(tmp_path, dtype=dtype)
    train_step_check.check(res, logprob_tol=tol)
