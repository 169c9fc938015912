"""``oar plan``'s memory per GPU, phase by phase of the trainer's loop.

Per GPU it adds up:

* **Megatron's resident state**, per rank of the largest pipeline stage (parameters counted by
  :mod:`megatron_oar.commands.plan.params`). Bytes per parameter as in Megatron-LM's
  distributed-optimizer notes (docs/source/api-guide/dist_optimizer.md): bf16/fp16 weights 2 +
  fp32 gradient buffer 4 (``grad_reduce_in_fp32``) + Adam state 12 (fp32 master, m, v) divided by
  DP x CP with the distributed optimizer (context parallelism splits sequences, not weights: the
  CP ranks of a DP rank hold the same weights and gradients, and megatron shards the optimizer
  over the DP x CP group); fp32 weights 4 + 4 + 8. FP8 adds TE's 1-byte weight copy and
  its transpose (2 bytes per linear weight). A reference model (``loss.kl_coef > 0``) adds one
  more copy of the weights. A MoE model's experts keep their Adam state sharded over the
  expert-data-parallel group (:mod:`megatron_oar.commands.plan.moe`).
* **Activations** of the passes that run while vLLM sleeps:
  :mod:`megatron_oar.commands.plan.activations`.
* **vLLM**, separate placement (``rollout.placement=separate``): nothing on a training GPU; a
  rollout GPU holds ``rollout.gpu_memory_utilization`` of itself (weights and KV cache, awake for
  the whole run), the received weight bucket and the reserve (``Plan.rollout_gpu_gib``).
* **vLLM**, colocated: awake during generation it holds ``rollout.gpu_memory_utilization`` of the
  GPU (its weights, rollout-TP sharded, and the KV cache in what is left after ``VLLM_OVERHEAD``);
  asleep (``rollout.sleep_level >= 1``) it keeps ``VLLM_ASLEEP`` and its level-1 weights move to
  host memory. KV bytes per token: 2 (K and V) * layers * KV heads per rollout rank * head_dim *
  2 bytes (vLLM docs, "Memory and KV cache").
* ``Hardware.reserve_gib`` for the CUDA context, NCCL buffers and allocator fragmentation.

Memory is added up for every phase of the trainer's loop (``training/phases.py``: wake weights,
sync, wake KV cache, generate, sleep, logprob, attribution, update, and the evaluation's), as
Megatron's resident state + the phase's Megatron working set (a weight-sync bucket, or the pass's
activations) + what vLLM holds then (nothing, its weights, or its weights and KV cache) + reserve; the peak
per GPU is the largest phase.
"""

from __future__ import annotations

import math
from dataclasses import replace

from megatron_oar.commands.plan import moe as plan_moe
from megatron_oar.commands.plan.hardware import GIB, Hardware
from megatron_oar.commands.plan.moe import expert_params
from megatron_oar.commands.plan.params import stage_param_split, total_params
from megatron_oar.models import QwenArch
from megatron_oar.models.flops import attention_weights, mlp_weights
from megatron_oar.training.phases import CHECKPOINT, EVAL, NOTHING, STEP, WEIGHTS, WEIGHTS_KV_CACHE, Phase

VLLM_OVERHEAD_GIB = 2.0  # vLLM's activations, sampler and CUDA graphs while awake
VLLM_ASLEEP_GIB = 1.0    # what a sleeping engine keeps on the GPU


def _resident_memory(cfg, a: QwenArch, dp: int, edp: int = 1) -> dict[str, float]:
    """Bytes per GPU of Megatron's resident state on the heaviest pipeline stage. A MoE model's
    expert parameters keep their Adam state sharded over the expert-data-parallel group
    (``edp``), the others over ``dp`` (the caller's DP x CP)."""
    m, par = cfg.model, cfg.parallel
    wbytes = 4 if m.dtype == "fp32" else 2
    opt_bytes = 12 if wbytes == 2 else 8
    shard = cfg.optim.use_distributed_optimizer

    def stage(k: int) -> dict[str, float]:
        dense, experts = stage_param_split(a, par.tp, par.pp, k, m.vocab_multiple, ep=par.ep, etp=par.etp)
        # FP8 copies linear weights (attention, MLP, experts), not biases, norms or the router
        linear = sum(attention_weights(a) // par.tp + (
            expert_params(a, par.ep, par.tp if par.etp is None else par.etp) if a.is_moe_layer(i)
            else mlp_weights(a, a.intermediate_size) // par.tp) for i in plan_moe.stage_layers(a, par.pp, k))
        return {
            "weights": (dense + experts) * wbytes,
            "gradients": (dense + experts) * 4,
            "optimizer": dense * opt_bytes / (dp if shard else 1) + experts * opt_bytes / (edp if shard else 1),
            "fp8 weight copies": linear * 2 if m.fp8 else 0,
            "reference model": (dense + experts) * wbytes if cfg.loss.kl_coef > 0 else 0,
        }

    return max((stage(k) for k in range(par.pp)), key=lambda x: sum(x.values()))


def _vllm_memory(cfg, a: QwenArch, hw: Hardware, *, world: int, samples: int) -> dict[str, float]:
    """vLLM's share of a GPU, its weights and KV cache (bytes), what it keeps asleep, and how many
    sequences each engine runs at once. ``world``: the GPUs holding engines (every GPU colocated,
    the ``rollout.ranks`` rollout GPUs separate, where a training GPU holds no engine: ``asleep``
    0, and the engines never sleep)."""
    r = cfg.rollout
    engines = world // r.tp
    weights = total_params(a) * 2 / r.tp  # vLLM runs bf16 weights, vocab sharded by TP
    share = r.gpu_memory_utilization * hw.gpu_mem_gib * GIB
    kv_per_token = 2 * a.num_layers * max(1, a.num_kv_heads // r.tp) * a.head_dim * 2
    kv_cache = share - weights - VLLM_OVERHEAD_GIB * GIB
    kv_tokens = max(0, int(kv_cache // kv_per_token))
    seqs_per_engine = math.ceil(samples / engines)
    return {"engines": engines, "weights": weights, "share": share, "kv_per_token": kv_per_token,
            "kv_cache": kv_cache, "kv_tokens": kv_tokens, "seqs_per_engine": seqs_per_engine,
            "concurrent": min(seqs_per_engine, r.max_num_seqs, kv_tokens // max(1, r.max_model_len)),
            "asleep": 0.0 if r.separate else VLLM_ASLEEP_GIB * GIB if r.sleep_level >= 1 else share}


def trainer_phases(cfg) -> list[Phase]:
    """The phases the trainer runs for ``cfg``: a step, an evaluation when
    ``train.eval_interval`` is set, a checkpoint (at least the last step's); a phase that
    repeats is listed once."""
    seen: dict[str, Phase] = {}
    for p in STEP + (EVAL if cfg.train.eval_interval else ()) + CHECKPOINT:
        if p.name != "attribution" or cfg.uses_attribution:
            seen.setdefault(p.name, p)
    if cfg.rollout.separate:  # the engines are on the rollout GPUs: a training GPU holds none
        return [replace(p, vllm_holds=NOTHING) for p in seen.values()]
    return list(seen.values())


def phase_bytes(cfg, hw: Hardware, *, resident: float, act: dict[str, float],
                vllm: dict[str, float], moe_layer_reload: float = 0.0,
                bucket: float | None = None) -> dict[str, float]:
    """Bytes per GPU in every phase of the trainer's loop (:func:`trainer_phases`): Megatron's
    ``resident`` state, the phase's Megatron working set (a weight-sync bucket and, for a MoE
    model, the ``moe_layer_reload`` bytes of one MoE layer that vLLM's reload holds, or the pass's
    activations ``act``), what vLLM holds on the GPU then (:func:`_vllm_memory`'s ``vllm``), and
    the reserve. ``bucket``: the sync's largest bucket (default ``rollout.bucket_bytes``; a
    tensor past it, such as a 72B model's embedding, makes a bucket of its own)."""
    vllm_mem = {NOTHING: vllm["asleep"], WEIGHTS: min(vllm["share"], vllm["asleep"] + vllm["weights"]),
                WEIGHTS_KV_CACHE: vllm["share"]}
    # a gathered bucket + its TP shards in flight, and the MoE layer vLLM's reload holds
    bucket = cfg.rollout.bucket_bytes if bucket is None else bucket
    work = {None: 0.0, "sync": 2.0 * bucket + moe_layer_reload,
            "forward": act["old-logprob"], "attribution": act["attribution"], "update": act["update"]}
    return {p.name: resident + work[p.megatron] + vllm_mem[p.vllm_holds] + hw.reserve_gib * GIB
            for p in trainer_phases(cfg)}
