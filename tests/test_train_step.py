"""The trainer's Megatron passes on one CPU rank (gloo), against transformers: the old-logprob
pass matches, OAR-G credit is non-uniform and sums to T, and one ``update_step`` raises the
log-probs of the A > 0 rows and lowers those of the A < 0 rows (tests/train_step_check.py;
tests/gpu/test_gpu_train_step.py runs the same on CUDA)."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from tests import train_step_check
from tests.distributed import launch


def _worker(root: str) -> None:
    res = train_step_check.run(Path(root))
    (Path(root) / "result.pkl").write_bytes(pickle.dumps(res))


@pytest.mark.slow
def test_update_follows_the_advantages(tmp_path):
    launch(_worker, 1, str(tmp_path))
    res = pickle.loads((tmp_path / "result.pkl").read_bytes())
    train_step_check.check(res, logprob_tol=1e-4)
