"""The trainer's Megatron passes on one CPU rank (gloo), against transformers: the old-logprob
pass matches, OAR-G credit is non-uniform and sums to T, and one ``update_step`` raises the
log-probs of the A > 0 rows and lowers those of the A < 0 rows (tests/train_step_check.py;
tests/gpu/test_gpu_train_step.py runs the same on CUDA). fp16 runs megatron's dynamic loss
scaling: its gradient norm equals fp32's, and an overflow skips the update without counting as
a non-finite failure."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from tests import train_step_check
from tests.distributed import launch


def _worker(root: str, dtype: str, adv_scale: float) -> None:
    res = train_step_check.run(Path(root), dtype=dtype, adv_scale=adv_scale)
    (Path(root) / "result.pkl").write_bytes(pickle.dumps(res))


def _run(root: Path, dtype: str = "fp32", adv_scale: float = 1.0) -> dict:
    root.mkdir()
    launch(_worker, 1, str(root), dtype, adv_scale)
    return pickle.loads((root / "result.pkl").read_bytes())


@pytest.mark.slow
def test_update_follows_the_advantages(tmp_path):
    res = _run(tmp_path / "fp32")
    train_step_check.check(res, logprob_tol=1e-4)
    assert not res["overflow"]


@pytest.mark.slow
def test_fp16_loss_scaling(tmp_path):
    fp32 = _run(tmp_path / "fp32")
    fp16 = _run(tmp_path / "fp16", "fp16")
    train_step_check.check(fp16, logprob_tol=5e-2)
    # gradients unscaled exactly once: the norm is fp32's up to fp16 rounding
    assert fp16["grad_norm"] == pytest.approx(fp32["grad_norm"], rel=1e-2)
    huge = _run(tmp_path / "overflow", "fp16", adv_scale=1e6)
    assert huge["overflow"] and not huge["applied"] and huge["changed"] == 0.0
