"""A tiny Qwen3-MoE under the Transformer Engine spec on one GPU (issue 44, step 4).

1. The model: converted from transformers and built with ``model.spec=te`` (the experts are
   megatron's ``TEGroupedMLP``: grouped GEMM), the ``alltoall`` token dispatcher (``auto`` on
   CUDA) and TE's fused permutation where it imports. Its logits against transformers' on the
   same weights (fp32 and bf16) and against the local spec's (``SequentialMLP``, the CPU tests'
   path); one backward reaches every expert's grouped weights.
2. R3 end to end: ``oar train`` with ``model.routing_replay=rollout`` and OAR-G, CUDA vLLM
   returning its routed experts, two steps. The old-logprob pass and the update replay vLLM's
   routing; ``routing/agree_rollout_old`` (the share of vLLM's top-k choices that Megatron's
   routers would make on their own) and ``routing/agree_rollout_update`` are logged and printed,
   with vLLM's log-prob mismatch.

Every figure is printed (``pytest -s``, ``GPU-FIGURE``) for docs/gpu-validation.md. Skipped
without CUDA and TE (and vLLM for part 2). Cost on one H100/H200: ~2 min (four model builds,
one `oar train` run building vLLM).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.gpu.figures import record

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (no GPU on this machine)"),
    pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is None,
                       reason="needs Transformer Engine (pip install 'megatron-oar[gpu]')"),
]
ROOT = Path(__file__).resolve().parents[2]
# 8 experts of width 128, top-2, head_dim 64 (vLLM's CUDA attention), both layers MoE
MOE = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
           num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128, intermediate_size=512,
           num_hidden_layers=2)
TOL = {"fp32": 2e-3, "bf16": 0.15}  # TF32 may be on in fp32; bf16 keeps ~3 digits of O(1) logits




@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    from checkpoints_convert.convert import hf_to_megatron
    from megatron_oar.models.tiny import make_tiny_qwen3_moe

    root = tmp_path_factory.mktemp("moe")
    hf = make_tiny_qwen3_moe(root / "hf", seed=3, **MOE)
    hf_to_megatron(hf, root / "ckpt", progress=False)
    tokens = torch.randint(3, 1000, (2, 48), generator=torch.Generator().manual_seed(0))
    return hf, root / "ckpt", tokens


def _megatron_logits(ckpt: Path, spec: str, dtype: str, tokens: torch.Tensor, backward: bool = False):
    from megatron_oar.models import ModelOptions, build_gpt_model, read_hf_config
    from megatron_oar.models.builder import resolve_moe_dispatcher
    from megatron_oar.models.forward import forward_logits
    from megatron_oar.models.model_checkpoint import load_model
    from megatron_oar.runtime import ParallelConfig, destroy_runtime, init_runtime

    init_runtime(ParallelConfig())
    try:
        opts = ModelOptions(spec=spec, dtype=dtype)
        model = build_gpt_model(read_hf_config(ckpt / "hf"), opts)  # on the device as built
        meta = load_model(model, ckpt)
        experts = {type(m).__name__ for n, m in model.named_modules() if n.endswith("mlp.experts")}
        info = dict(experts=sorted(experts), dispatcher=resolve_moe_dispatcher(opts),
                    grouped_gemm=bool(model.config.moe_grouped_gemm),
                    permute_fusion=bool(model.config.moe_permute_fusion))
        if backward:
            model.train()
            ids = tokens.cuda()
            pos = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
            logits = model(ids, pos, None)[..., :meta.vocab_size]  # [B, S, V], causal
            logits.float().logsumexp(-1).mean().backward()
            grads = {n: float(p.grad.abs().max()) if p.grad is not None else None
                     for n, p in model.named_parameters() if ".experts." in n}
            info["expert_grads_max_abs"] = grads
            return logits.detach().float(), info
        with torch.no_grad():
            return forward_logits(model, tokens.cuda(), vocab_size=meta.vocab_size).float(), info
    finally:
        destroy_runtime()


def _hf_logits(hf: Path, dtype: str, tokens: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    torch_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    ref = AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch_dtype).cuda().eval()
    with torch.no_grad():
        return ref(tokens.cuda()).logits.float()


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_te_grouped_gemm_moe_matches_transformers_and_local(converted, dtype):
    hf, ckpt, tokens = converted
    te_logits, info = _megatron_logits(ckpt, "te", dtype, tokens)
    local_logits, local_info = _megatron_logits(ckpt, "local", dtype, tokens)
    ref = _hf_logits(hf, dtype, tokens)
    figures = {}
    for name, got in (("te_vs_hf", te_logits), ("local_vs_hf", local_logits), ("te_vs_local", None)):
        a, b = (te_logits, local_logits) if got is None else (got, ref)
        figures[name] = dict(max_abs=round(float((a - b).abs().max()), 6),
                             top1=round(float((a.argmax(-1) == b.argmax(-1)).float().mean()), 4))
    record(f"moe_te_{dtype}", dict(te=info, local=local_info, **figures))
    assert info["experts"] == ["TEGroupedMLP"] and info["grouped_gemm"], info
    assert info["dispatcher"] == "alltoall", info
    assert local_info["experts"] == ["SequentialMLP"], local_info
    # bf16: transformers routes on bf16 router logits, megatron on fp32 ones (moe_router_dtype),
    # so near-tied experts flip between them (the H200 run: 0.22 max, top-1 0.958, the same for
    # the local spec); the TE spec is held to the local spec there, to transformers in fp32
    checked = ("te_vs_hf", "te_vs_local") if dtype == "fp32" else ("te_vs_local",)
    for name in checked:
        assert figures[name]["max_abs"] <= TOL[dtype] and figures[name]["top1"] >= 0.97, figures


def test_te_grouped_gemm_backward_reaches_every_expert(converted):
    _, ckpt, tokens = converted
    _, info = _megatron_logits(ckpt, "te", "bf16", tokens, backward=True)
    grads = info.pop("expert_grads_max_abs")
    record("moe_te_backward", dict(info, expert_params=len(grads),
                                    min_grad=min((g for g in grads.values() if g is not None), default=None)))
    assert grads and all(g is not None and g > 0 for g in grads.values()), grads


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM")
def test_r3_oar_train_under_te_with_vllm_routing(converted, tmp_path):
    from megatron_oar.training.logger import read_metrics

    hf, _, _ = converted
    run = tmp_path / "run"
    log = tmp_path / "train.log"
    cmd = [sys.executable, "-m", "megatron_oar.cli", "train", "--config",
           str(ROOT / "examples" / "tiny_cpu.yaml"), f"model.path={hf}", f"run_dir={run}",
           "model.spec=te", "model.dtype=bf16", "model.routing_replay=rollout", "credit=oar_g",
           r"attribution.probe.answer_pattern=(\d+)", "parallel.tp=1", "launch.gpus_per_node=1",
           "rollout.dtype=bf16", "rollout.enforce_eager=true", "rollout.gpu_memory_utilization=0.2",
           "rollout.max_model_len=128", "train.steps=2", "train.eval_interval=0",
           "checkpoint.interval=100", "checkpoint.export_hf_at_end=false", "log.tensorboard=false",
           "attribution.probe.warmup_steps=0", "rewards.format_weight=1.0",
           "rewards.accuracy_weight=0.0", "rewards.format_pattern=.*[0-9].*"]
    with open(log, "w") as f:
        proc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=420,
                              env={k: v for k, v in os.environ.items() if k != "LOCAL_RANK"})
    text = log.read_text()
    records = read_metrics(run) if (run / "logs").exists() else []
    keys = ("routing/agree_rollout_old", "routing/agree_rollout_update", "routing/load_max_mean",
            "rollout/logprob_mismatch", "attribution/scored_sequences", "loss/loss")
    record("moe_r3_e2e", dict(rc=proc.returncode, steps=[r.get("step") for r in records],
                               **{k: [r.get(k) for r in records if k in r] for k in keys}))
    assert proc.returncode == 0, text[-4000:]
    steps = [r for r in records if r.get("step") is not None and "routing/agree_rollout_old" in r]
    assert [r["step"] for r in steps] == [1, 2], text[-3000:]
    for r in steps:
        assert 0.0 <= r["routing/agree_rollout_old"] <= 1.0
        # the update replays the same routing on the weights the old-logprob pass used (first
        # mini-batch): its own choices agree with vLLM's as much as the old pass's did
        assert 0.0 <= r["routing/agree_rollout_update"] <= 1.0
