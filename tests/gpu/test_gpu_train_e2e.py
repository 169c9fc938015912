"""`oar train` end to end on one GPU (issue 32, step 4): the user's command on a tiny config,
CUDA vLLM colocated with sleep/wake, bf16, a checkpoint every step, then a resumed run; each
phase's GPU memory (`mem/<phase>_used_gib`) printed next to `oar plan`'s figures for the same
config. Local spec unless Transformer Engine imports (then `model.spec=te`).

Skipped without CUDA or vLLM. Cost on one H100: ~2-3 min (two runs, each building vLLM).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_oar.training.logger import read_metrics

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (no GPU on this machine)"),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM"),
]
ROOT = Path(__file__).resolve().parents[2]
REWARD = ["rewards.format_weight=1.0", "rewards.accuracy_weight=0.0",
          "rewards.format_pattern=.*[0-9].*"]


def _oar_train(hf: Path, run_dir: Path, steps: int, log: Path) -> None:
    spec = "te" if importlib.util.find_spec("transformer_engine") else "local"
    cmd = [sys.executable, "-m", "megatron_oar.cli", "train", "--config",
           str(ROOT / "examples" / "tiny_cpu.yaml"), f"model.path={hf}", f"run_dir={run_dir}",
           f"model.spec={spec}", "model.dtype=bf16", "parallel.tp=1", "launch.gpus_per_node=1",
           "rollout.dtype=bf16", "rollout.sleep_level=2", "rollout.enforce_eager=false",
           "rollout.gpu_memory_utilization=0.3", "rollout.max_model_len=128",
           f"train.steps={steps}", "train.eval_interval=0", "checkpoint.interval=1",
           "checkpoint.export_hf_at_end=false", "log.tensorboard=false",
           "attribution.probe.warmup_steps=0", *REWARD]
    with open(log, "w") as f:
        proc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=600,
                              env={k: v for k, v in os.environ.items() if k != "LOCAL_RANK"})
    assert proc.returncode == 0, log.read_text()[-4000:]


def test_oar_train_on_gpu_with_vllm_then_resume(tmp_path):
    from megatron_oar.repro.demo_model import make_demo_model

    hf = make_demo_model(tmp_path / "hf", hidden_size=256, intermediate_size=512,
                         num_attention_heads=4, num_key_value_heads=2)
    run = tmp_path / "run"
    _oar_train(hf, run, 2, tmp_path / "first.log")
    first_steps = {r.get("step") for r in read_metrics(run)}
    assert {1, 2} <= first_steps, first_steps
    _oar_train(hf, run, 3, tmp_path / "resumed.log")
    text = (tmp_path / "resumed.log").read_text()
    records = read_metrics(run)
    steps = sorted({r.get("step") for r in records if r.get("step") is not None})
    print("GPU-FIGURE e2e_steps =", steps)
    assert 3 in steps, text[-3000:]
    mem = {k: round(v, 3) for r in records for k, v in r.items()
           if k.startswith("mem/") and isinstance(v, (int, float))}
    print("GPU-FIGURE e2e_memory =", json.dumps(mem))
    sync = [r.get("rollout/logprob_mismatch") for r in records if "rollout/logprob_mismatch" in r]
    print("GPU-FIGURE e2e_logprob_mismatch =", sync)
    for key in ("perf/mfu", "time/step_seconds"):
        print(f"GPU-FIGURE e2e_{key} =", [r.get(key) for r in records if key in r])
    plan = subprocess.run([sys.executable, "-m", "megatron_oar.cli", "plan", "--config",
                           str(ROOT / "examples" / "tiny_cpu.yaml"), f"model.path={hf}",
                           "model.dtype=bf16", "parallel.tp=1", "launch.gpus_per_node=1",
                           "rollout.gpu_memory_utilization=0.3"],
                          cwd=ROOT, capture_output=True, text=True)
    print("GPU-FIGURE e2e_plan =", plan.stdout[-3000:], plan.stderr[-1000:])
