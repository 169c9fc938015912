"""Test-wide settings: hypothesis runs derandomised (the same examples on every machine) and
keeps no example database, so CI on a clean clone is reproducible."""

import pytest
from hypothesis import settings

settings.register_profile("oar", derandomize=True, database=None, deadline=None)
settings.load_profile("oar")


@pytest.fixture(scope="session")
def scaled_checkpoint(tmp_path_factory):
    """A converted tiny random Qwen2 (seed 5) with weights of std 0.3 instead of HF's 0.02, so
    that masking a token moves a probe well above fp32 rounding (with 0.02 the KLs are ~1e-5)."""
    from checkpoints_convert.convert import hf_to_megatron
    from tests.tiny import make_tiny_qwen2

    root = tmp_path_factory.mktemp("scaled_checkpoint")
    hf = make_tiny_qwen2(root / "hf", seed=5, initializer_range=0.3)
    hf_to_megatron(hf, root / "ckpt", progress=False)
    return root / "ckpt"
