"""What each CPU dispatch level changes in the numbers: a measurement, not a test (``make test-kernels``
prints it before it runs the equality tests under each level).

One process per level runs the tests' tiny Qwen2 (``megatron_oar.models.tiny.SMALL``, transformers,
fp32) forward and backward on 5 rows of 32 tokens, and writes the log-probs and the gradients;
the parent compares every level with the native one (bit-identical or not, and by how much) and
with a float64 run (the rounding of each level itself), as a fraction of the tensor's largest
value and of the tolerance tests/tolerances.py allows for it.

    python -m tests.kernel_levels            # about 1 min on 2 cores (a process per level)

The levels: ``ATEN_CPU_CAPABILITY`` picks ATen's vectorised kernels (softmax, log-softmax, norms,
elementwise ops, reductions: ``default`` is the scalar build, then ``avx2``, ``avx512``; a level
above the CPU's falls back to the CPU's); MKL runs torch's fp32 GEMMs on x86
(``torch.__config__.show()``: ``BLAS_INFO=mkl``): ``MKL_ENABLE_INSTRUCTIONS`` caps its ISA (on an
AMD CPU MKL already takes its generic path, so it changes nothing there) and ``MKL_CBWR=COMPATIBLE``
forces its conditional-reproducibility path (SSE2 kernels, another blocking) on any x86 CPU;
``ONEDNN_MAX_CPU_ISA`` caps oneDNN's (torch's bf16 and some fused CPU paths, not these fp32 ones).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

LEVELS = {
    "native": {},
    "ATEN_CPU_CAPABILITY=default": {"ATEN_CPU_CAPABILITY": "default"},
    "ATEN_CPU_CAPABILITY=avx2": {"ATEN_CPU_CAPABILITY": "avx2"},
    "ATEN_CPU_CAPABILITY=avx512": {"ATEN_CPU_CAPABILITY": "avx512"},
    "MKL_ENABLE_INSTRUCTIONS=SSE4_2": {"MKL_ENABLE_INSTRUCTIONS": "SSE4_2"},
    "MKL_ENABLE_INSTRUCTIONS=AVX2": {"MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "MKL_CBWR=COMPATIBLE": {"MKL_CBWR": "COMPATIBLE"},
    "ONEDNN_MAX_CPU_ISA=AVX2": {"ONEDNN_MAX_CPU_ISA": "AVX2"},
    "ATEN_CPU_CAPABILITY=default MKL_CBWR=COMPATIBLE": {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE"},
}
ROWS, SEQ = 5, 32


def _run(out: str, dtype_name: str) -> None:
    """In this process: the tiny model's log-probs and gradients, saved to ``out``."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from megatron_oar.models.tiny import SMALL

    torch.set_num_threads(1)
    torch.manual_seed(5)
    model = Qwen2ForCausalLM(Qwen2Config(**SMALL, initializer_range=0.3))  # the scaled checkpoint's std
    dtype = getattr(torch, dtype_name)
    model = model.to(dtype)
    tokens = torch.randint(0, SMALL["vocab_size"], (ROWS, SEQ), generator=torch.Generator().manual_seed(0))
    logits = model(tokens).logits
    logp = torch.log_softmax(logits.float() if dtype == torch.float32 else logits, -1)
    picked = logp[:, :-1].gather(-1, tokens[:, 1:, None]).squeeze(-1)
    picked.mean().backward()
    torch.save({"logp": picked.detach().double(), "grads": [p.grad.double() for p in model.parameters()],
                "capability": torch.backends.cpu.get_cpu_capability()}, out)


def _rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max())


def main() -> None:
    import torch

    from tests.tolerances import tiny_shape

    shape = tiny_shape()
    logprob_tol = shape.logprob_tol(SEQ)
    grad_tol = shape.grad_tol(SEQ, ROWS * SEQ)
    root = Path(__file__).resolve().parents[1]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, env in [*LEVELS.items(), ("float64", {})]:
            out = str(Path(tmp) / f"{len(results)}.pt")
            dtype = "float64" if name == "float64" else "float32"
            subprocess.run([sys.executable, "-m", "tests.kernel_levels", "--run", out, dtype], check=True,
                           cwd=root, env={**os.environ, "PYTHONPATH": str(root), **env})
            results[name] = torch.load(out)
    native, exact = results["native"], results.pop("float64")
    print(f"tolerances (tests/tolerances.py): log-probs {logprob_tol:.2e}, gradients {grad_tol:.2e}")
    print("| level | ATen kernels | log-probs vs native | grads vs native | log-probs vs float64 | "
          "grads vs float64 (share of tolerance) |")
    print("|---|---|---|---|---|---|")
    for name, r in results.items():
        same = all(torch.equal(a, b) for a, b in zip([r["logp"], *r["grads"]], [native["logp"], *native["grads"]]))
        lp_n = _rel(r["logp"], native["logp"])
        g_n = max(_rel(a, b) for a, b in zip(r["grads"], native["grads"]))
        lp_x = _rel(r["logp"], exact["logp"])
        g_x = max(_rel(a, b) for a, b in zip(r["grads"], exact["grads"]))
        vs_native = "bit-identical" if same else f"{lp_n:.1e}"
        print(f"| {name} | {r['capability']} | {vs_native} | {g_n:.1e} | {lp_x:.1e} | "
              f"{g_x:.1e} ({g_x / grad_tol:.0%}) |")


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--run":
        _run(sys.argv[2], sys.argv[3])
    else:
        main()
