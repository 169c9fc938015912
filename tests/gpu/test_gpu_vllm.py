"""CUDA vLLM colocated with a Megatron model in one process (issue 32, steps 1 and 5).

Step 1, tiny Qwen2 (hidden 256, head_dim 64), local spec, bf16, CUDA graphs on: build, sync,
generate; sleep at the examples' level and show with ``torch.cuda.mem_get_info`` that the memory
came back; wake weights, sync changed Megatron weights, wake the KV cache, generate, check the
agreement; a partial wake followed by ``sleep()`` frees what woke (production-path fix 6a).
Step 5 (vLLM part): a tiny Qwen3-MoE synced from Megatron, and vLLM's returned routing.

Every figure is printed (``pytest -s``) for docs/gpu-validation.md. Skipped without CUDA or vLLM.
Cost on one H100: ~1-2 min (engine builds with CUDA-graph capture).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

from tests.gpu.figures import record

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (no GPU on this machine)"),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM"),
]
PROMPTS = [[11, 12, 13, 14], [21, 22, 23], [31, 32, 33, 34, 35]]
BF16_TOL = 0.1  # max |delta logprob| between vLLM and Megatron in bf16 (rounding, ~1e-2 mean)


def _used_gib() -> float:
    free, total = torch.cuda.mem_get_info()
    return (total - free) / 2**30


def _megatron(hf: Path, root: Path):
    from checkpoints_convert.convert import hf_to_megatron
    from megatron_oar.models import ModelOptions, build_gpt_model, read_hf_config
    from megatron_oar.models.model_checkpoint import load_model

    hf_to_megatron(hf, root / "ckpt", progress=False)
    # no .cuda(): the model is on the device as built, as the trainer uses it (an explicit .cuda()
    # here hid megatron-core's CPU-built MoE router until 2026-11-27)
    model = build_gpt_model(read_hf_config(hf), ModelOptions(spec="local", dtype="bf16"))
    load_model(model, root / "ckpt")
    return model


def _perturb(model) -> None:
    g = torch.Generator(device="cuda").manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g, device="cuda", dtype=torch.float32).to(p.dtype) * 0.05)


@pytest.fixture()
def runtime():
    from megatron_oar.runtime import ParallelConfig, destroy_runtime, init_runtime

    init_runtime(ParallelConfig())
    yield
    destroy_runtime()


def test_vllm_cuda_sleep_wake_sync(tmp_path, runtime):
    from megatron_oar.models.tiny import make_tiny_qwen2
    from megatron_oar.rollout import RolloutConfig, RolloutEngine
    from megatron_oar.rollout.engine import free_torch_cache

    hf = make_tiny_qwen2(tmp_path / "hf", seed=3, hidden_size=256, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=512, num_hidden_layers=4,
                         max_position_embeddings=512, head_dim=64)
    model = _megatron(hf, tmp_path)
    free_torch_cache()
    base = _used_gib()
    cfg = RolloutConfig(dtype="bf16", enforce_eager=os.environ.get("OAR_GPU_EAGER") == "1",
                        gpu_memory_utilization=0.3, max_model_len=256, max_num_seqs=32,
                        sleep_level=2, max_new_tokens=32, n=4, seed=5)
    engine = RolloutEngine(hf, cfg)
    try:
        import vllm

        record("vllm_version", vllm.__version__)
        record("vllm_v2_runner_env", os.environ.get("VLLM_USE_V2_MODEL_RUNNER"))
        assert engine.sleep_supported, "CUDA vLLM reports no sleep mode"
        awake = _used_gib()
        record("mem_used_gib", dict(before_engine=round(base, 3), engine_awake=round(awake, 3)))
        stats = engine.sync_weights(model)
        record("sync_first", dict(seconds=round(stats.seconds, 4), bytes=stats.bytes))
        batch = engine.generate(PROMPTS)
        agree = engine.check_sync(model, batch)
        record("check_sync_first", agree.__dict__)
        assert agree.max_abs_diff < BF16_TOL, agree

        engine.sleep()
        free_torch_cache()
        asleep = _used_gib()
        record("mem_asleep_gib", round(asleep, 3))
        assert asleep - base < 0.25 * (awake - base), (base, awake, asleep)

        # partial wakes, then sleep: back to the asleep level (fix 6a); at level 2 the KV cache
        # wakes with the weights (vLLM 0.24 restores its saved buffers on the first wake)
        for tags in (["weights"], ["kv_cache"]):
            engine.wake_up(tags)
            woke = _used_gib()
            engine.sleep()
            free_torch_cache()
            again = _used_gib()
            record(f"partial_wake_{tags[0]}", dict(awake_gib=round(woke, 3), after_sleep_gib=round(again, 3)))
            assert again - asleep < 0.05, (tags, asleep, again)

        # the trainer's handover: wake weights -> sync -> wake KV cache -> generate -> sleep
        _perturb(model)
        engine.wake_up(["weights"])
        stats = engine.sync_weights(model)
        engine.wake_up(["kv_cache"])
        batch2 = engine.generate(PROMPTS, seeds=batch.seeds)
        agree2 = engine.check_sync(model, batch2)
        record("check_sync_after_wake", agree2.__dict__)
        assert agree2.max_abs_diff < BF16_TOL, agree2
        assert batch2.response_ids != batch.response_ids  # the new weights sample differently
        many = [[(13 * i + j) % 400 + 1 for j in range(16)] for i in range(32)]
        tput = engine.generate(many, n=4, max_new_tokens=128, stop=[], stop_token_ids=[])
        record("generate_tokens_per_s", dict(tokens=tput.num_response_tokens,
                                             seconds=round(tput.gen_seconds, 4)))
        engine.sleep()
    finally:
        engine.shutdown()


def test_vllm_cuda_moe_sync_and_returned_routing(tmp_path, runtime):
    from megatron_oar.models.tiny import make_tiny_qwen3_moe
    from megatron_oar.rollout import RolloutConfig, RolloutEngine

    hf = make_tiny_qwen3_moe(tmp_path / "hf", seed=3, head_dim=64)
    model = _megatron(hf, tmp_path)
    for routed in (False, True):
        cfg = RolloutConfig(dtype="bf16", enforce_eager=True, gpu_memory_utilization=0.2,
                            max_model_len=256, max_num_seqs=16, sleep_level=0, max_new_tokens=16,
                            n=2, seed=5, return_routed_experts=routed)
        engine = RolloutEngine(hf, cfg)
        try:
            engine.sync_weights(model)
            batch = engine.generate(PROMPTS)
            agree = engine.check_sync(model, batch)
            record(f"moe_check_sync_routed_{routed}", agree.__dict__)
            assert agree.max_abs_diff < BF16_TOL, agree
            if routed:
                routing = getattr(batch, "routed_experts", None)
                first = None if routing is None else routing[0][0]
                record("moe_routed_experts_shape", None if first is None else list(first.shape))
                assert first is not None and first.shape[-1] == 2  # top-k of the tiny MoE
        finally:
            engine.shutdown()
