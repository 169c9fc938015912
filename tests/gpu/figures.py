"""A GPU test's figures for docs/gpu-validation.md: printed (``pytest -s``) and, where
``OAR_GPU_FIGURES`` names a file (``lent_gpu_run.sh tests``), appended to it as JSON lines."""

from __future__ import annotations

import json
import os


def record(name: str, value) -> None:
    print(f"GPU-FIGURE {name} = {json.dumps(value)}", flush=True)
    out = os.environ.get("OAR_GPU_FIGURES")
    if out:
        with open(out, "a") as f:
            f.write(json.dumps({name: value}) + "\n")
