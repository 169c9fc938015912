"""torch inductor's on-disk cache, one per ATen CPU dispatch level.

vLLM compiles a few CPU kernels with ``torch.compile`` even in eager mode (its sampler's
reductions). Inductor generates their C++ for the vector ISA that ``ATEN_CPU_CAPABILITY``
selects (``torch._inductor.cpu_vec_isa.pick_vec_isa``), but its FX graph cache key does not
include that level: code cached by a run at the CPU's own level (``at::vec::Vectorized``, AVX-512)
is reloaded by a run under ``ATEN_CPU_CAPABILITY=default``, whose compile has no ``at::vec``, and
g++ fails (``CppCompileError: 'at::vec' has not been declared``; torch 2.13). Every vLLM world of
the suite under ``make test-kernels``' scalar level failed so. One cache directory per level
avoids it; a user's own ``TORCHINDUCTOR_CACHE_DIR`` is left alone.
"""

from __future__ import annotations

import os


def separate_cache_per_cpu_capability() -> str | None:
    """Point ``TORCHINDUCTOR_CACHE_DIR`` at ``<torch's default>_<level>`` where
    ``ATEN_CPU_CAPABILITY`` is set and the cache directory is not; the directory chosen, or None
    where nothing changed. Call it before anything compiles (inductor fixes the directory on
    first use)."""
    level = os.environ.get("ATEN_CPU_CAPABILITY", "").strip().lower()
    if not level or "TORCHINDUCTOR_CACHE_DIR" in os.environ:
        return None
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    path = f"{default_cache_dir()}_{''.join(c for c in level if c.isalnum())}"
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = path
    return path
