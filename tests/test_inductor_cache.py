"""``runtime/inductor_cache.py``: one torch inductor cache per ATen CPU dispatch level.

Cost: under 1 s, one process, nothing compiled. What the separate directory prevents (vLLM's
compiled sampler kernels, cached at the CPU's own level, failing to rebuild under
``ATEN_CPU_CAPABILITY=default``) is exercised by ``make test-kernels-quick``, which runs a vLLM
rollout under that level after ``make test`` has filled the native cache.
"""

from __future__ import annotations

import os

from megatron_oar.runtime.inductor_cache import separate_cache_per_cpu_capability


def test_each_dispatch_level_gets_its_own_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # torch's default directory lives in the temp dir
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    seen = {}
    for level in ("default", "AVX2", "avx512"):
        monkeypatch.setenv("ATEN_CPU_CAPABILITY", level)
        monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
        seen[level] = separate_cache_per_cpu_capability()
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == seen[level]
    assert len(set(seen.values())) == 3
    assert all(p.startswith(str(tmp_path)) and "torchinductor_" in p for p in seen.values())
    assert seen["AVX2"].endswith("_avx2")
    # inductor writes its default into the variable on first lookup (importing megatron-core
    # does one): that is torch's choice, not a user's, and is replaced
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    torch_default = cache_dir()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == torch_default
    assert separate_cache_per_cpu_capability() == seen["avx512"] != torch_default


def test_native_level_and_a_users_directory_are_left_alone(monkeypatch):
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    assert separate_cache_per_cpu_capability() is None
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "default")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/somewhere/mine")
    assert separate_cache_per_cpu_capability() is None
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == "/somewhere/mine"
