"""torch inductor's on-disk cache, one per ATen CPU dispatch level.

vLLM compiles a few CPU kernels with ``torch.compile`` even in eager mode (its sampler's
reductions). Inductor generates their C++ for the vector ISA that ``ATEN_CPU_CAPABILITY``
selects (``torch._inductor.cpu_vec_isa.pick_vec_isa``), but its FX graph cache key does not
include that level: code cached by a run at the CPU's own level (``at::vec::Vectorized``, AVX-512)
is reloaded by a run under ``ATEN_CPU_CAPABILITY=default``, whose compile has no ``at::vec``, and
g++ fails (``CppCompileError: 'at::vec' has not been declared``; torch 2.13). Every vLLM world of
the suite under ``make test-kernels``' scalar level failed so. One cache directory per level
avoids it; a user's own ``TORCHINDUCTOR_CACHE_DIR`` is left alone. (Inductor writes its default
directory into ``TORCHINDUCTOR_CACHE_DIR`` the first time it looks it up, which importing
megatron-core already does: that value is torch's, not a user's, and is replaced.)
"""

from __future__ import annotations

import os


def separate_cache_per_cpu_capability() -> str | None:
    """Point ``TORCHINDUCTOR_CACHE_DIR`` at ``<torch's default>_<level>`` where
    ``ATEN_CPU_CAPABILITY`` is set and the cache directory is torch's default (unset, or set to it
    by inductor itself); the directory chosen, or None where nothing changed. Call it before
    anything compiles: inductor reads the variable on every lookup."""
    level = os.environ.get("ATEN_CPU_CAPABILITY", "").strip().lower()
    if not level:
        return None
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    default = default_cache_dir()
    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if chosen is not None and os.path.abspath(chosen) != os.path.abspath(default):
        return None
    path = f"{default}_{''.join(c for c in level if c.isalnum())}"
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = path
    return path
