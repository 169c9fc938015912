"""``oar plan``: will a config fit its cluster, and how long will a step take?

Everything here is arithmetic on the config and the model's ``config.json`` (or its published
preset, :mod:`megatron_oar.models.presets`); nothing is allocated. Per GPU it adds up:

* **Megatron's resident state**, per rank of the largest pipeline stage. Parameters counted layer
  by layer exactly as megatron-core's ``GPTModel`` shards them (``tests/test_plan.py`` checks the
  count against a real model). Bytes per parameter as in Megatron-LM's distributed-optimizer notes
  (docs/source/api-guide/dist_optimizer.md): bf16/fp16 weights 2 + fp32 gradient buffer 4
  (``grad_reduce_in_fp32``) + Adam state 12 (fp32 master, m, v) divided by DP with the distributed
  optimizer; fp32 weights 4 + 4 + 8. FP8 adds TE's 1-byte weight copy and its transpose (2 bytes
  per linear weight). A reference model (``loss.kl_coef > 0``) adds one more copy of the weights.
* **Activations** of the passes that run while vLLM sleeps, the largest of them:
  - update (train mode): per layer and token, following Korthikanti et al. 2022, "Reducing
    Activation Recomputation in Large Transformer Models" (Sec. 4), re-derived for Qwen2 (GQA,
    SwiGLU, RMSNorm, no dropout) in 16-bit elements: the two norm inputs and the QKV and FC1 inputs
    (4h, split by TP only with sequence parallelism), Q/K/V ((a+2g)d), the attention output (ad),
    FC1's output (2f) and SwiGLU's output (f), split by TP; plus the attention matrix (a*s per
    token, 6 bytes: fp32 softmax and its bf16 copy) only with megatron's unfused attention
    (``model.attention=unfused``) and without selective recompute; TE's fused attention and PyTorch
    SDPA (the defaults, ``models/sdpa_attention.py``) keep none. Full recompute keeps only each
    layer's input (h) plus one layer's activations. With 1F1B pipelining the first stage holds
    ``min(pp, micro-batches)`` micro-batches in flight (Narayanan et al. 2021, Sec. 2.2). The last
    stage adds the logits: with ``train.logits_chunk_tokens`` (the default) those of one chunk
    (chunk*V/TP, 14 bytes: :func:`logits_bytes`), else of a whole micro-batch (s*b*V/TP, 10 bytes:
    bf16 output, fp32 log-softmax, fp32 gradient).
  - old-logprob and reference passes (forward only): one layer's working set plus the logits.
  - OAR-G: a forward that keeps activations for one backward to the input embeddings. It runs in
    eval mode, where megatron-core does **not** recompute, so it is sized without recompute at
    ``attribution.max_tokens_per_micro_batch`` tokens of full-length rows (``padded``:
    ``attribution.micro_batch_size`` rows; an upper bound: megatron's frozen-weight linears keep
    no inputs), plus the fp32 input-embedding gradient.
  - token budgets left unset are chosen per phase (:func:`choose_token_budgets`, searched by
    :mod:`megatron_oar.commands.plan_budgets`), and a token budget holds max(budget, s) / s
    full-length rows (a longer row runs alone).
  - OAR-P: forward only, ``attribution.max_tokens_per_copy_micro_batch`` tokens of masked
    copies (``padded``: ``attribution.perturb_micro_batch_size`` copies), one layer at a time.
  - screened OAR-P: OAR-G's activations, then OAR-P's (the larger of the two).
* **vLLM**, colocated: awake during generation it holds ``rollout.gpu_memory_utilization`` of the
  GPU (its weights, rollout-TP sharded, and the KV cache in what is left after ``VLLM_OVERHEAD``);
  asleep (``rollout.sleep_level >= 1``) it keeps ``VLLM_ASLEEP`` and its level-1 weights move to
  host memory. KV bytes per token: 2 (K and V) * layers * KV heads per rollout rank * head_dim *
  2 bytes (vLLM docs, "Memory and KV cache").
* ``Hardware.reserve_gib`` for the CUDA context, NCCL buffers and allocator fragmentation.
* **Mixture of experts** (Qwen3-MoE; :mod:`megatron_oar.commands.plan_moe` has the formulas):
  each rank holds ``num_experts / EP`` experts of its stage's MoE layers, each split over ETP,
  next to the dense parts split over TP; the experts' Adam state is split over the
  expert-data-parallel group (world / (ETP x EP x PP)), the dense parts' over DP. A MoE layer's
  activations add the router's and the routed copies'. The plan also prints the total and
  active parameters, the experts' memory per GPU and the alltoall dispatcher's bytes per token
  and MoE layer; FLOPs count the active parameters (``models/flops.py``), and decode reads the
  experts its tokens are routed to.

The weight sync's traffic: the bytes one rank receives per step, TP all-gathers and PP
broadcasts, the largest over the pipeline stages (``rollout.weight_sync.sync_traffic``, the
formula ``tests/test_rollout.py`` checks against what a sync measures), for the path the config
takes (shards where ``parallel.tp == rollout.tp`` and ``rollout.sync_shards``) and the
full-tensor path.

Memory is added up for every phase of the trainer's loop (``training/phases.py``: wake weights,
sync, wake KV cache, generate, sleep, logprob, attribution, update, and the evaluation's), as
Megatron's resident state + the phase's Megatron working set (a weight-sync bucket, or the pass's
activations) + what vLLM holds then (nothing, its weights, or its weights and KV cache) + reserve; the peak
per GPU is the largest phase.

Time per step, at worst-case lengths unless ``--response-tokens`` says otherwise (padded
micro-batches, ``train.batching`` / ``attribution.batching`` ``padded``, still process every
sequence at the longest length; token budgets at its own): Megatron passes as FLOPs
(``models/flops.py``) at a stated MFU (forward 2 FLOPs per matmul parameter per token plus causal attention
2*L*a*d*s; backward 2x forward; OAR-G's input-gradient-only backward 1x; OAR-P one forward per
scored token; screened OAR-P OAR-G plus ``screen_fraction`` of OAR-P), generation by a roofline
over decode steps (weights and KV cache read once per step at a stated fraction of HBM bandwidth,
or compute-bound at the MFU).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from megatron_oar.commands import plan_moe
from megatron_oar.commands.plan_budgets import (
    ATTRIBUTION_BUDGET,
    COPY_BUDGET,
    TRAIN_BUDGET,
    BudgetChoice,
    BudgetSpec,
    at_length,
    choose_budgets,
    longest_true,
    with_budgets,
)
from megatron_oar.commands.plan_moe import expert_params
from megatron_oar.models import QwenArch, parse_arch
from megatron_oar.models.families import family_of
from megatron_oar.models.flops import (
    attention_weights,
    forward_flops,
    linear_weights,
    matmul_params,
    mlp_weights,
    router_weights,
)
from megatron_oar.rollout.weight_sync import expert_target, moe_layer_reload_bytes, sync_traffic
from megatron_oar.training.phases import CHECKPOINT, EVAL, NOTHING, STEP, WEIGHTS, WEIGHTS_KV_CACHE, Phase

GIB = 1024 ** 3
VLLM_OVERHEAD_GIB = 2.0  # vLLM's activations, sampler and CUDA graphs while awake
VLLM_ASLEEP_GIB = 1.0    # what a sleeping engine keeps on the GPU


@dataclass(frozen=True)
class Hardware:
    """One GPU and the efficiencies the time estimate assumes (H100 SXM defaults)."""

    gpu_mem_gib: float = 80.0
    peak_tflops: float = 989.0   # dense bf16 (NVIDIA H100 SXM datasheet)
    hbm_tb_s: float = 3.35       # HBM3 bandwidth
    mfu: float = 0.35            # model-FLOPs utilisation assumed for Megatron passes
    bandwidth_eff: float = 0.6   # fraction of HBM bandwidth a decode step reaches
    reserve_gib: float = 4.0     # CUDA context, NCCL buffers, fragmentation


# ------------------------------------------------------------------------------ parameters

def layer_param_split(a: QwenArch, tp: int = 1, i: int = 0, *, ep: int = 1,
                      etp: int | None = None) -> tuple[int, int]:
    """``(dense, expert)`` parameters of decoder layer ``i`` on one rank. Dense: the linears and
    the QKV bias (Qwen2) split by TP, two RMSNorm weights and Qwen3's q/k RMSNorms (head_dim each)
    that every rank holds whole, and a MoE layer's router (whole on every rank). Expert: a MoE
    layer's ``num_experts / EP`` experts, each split over ETP (default: TP)."""
    qkv_bias = (a.num_heads + 2 * a.num_kv_heads) * a.head_dim if a.qkv_bias else 0
    norms = 2 * a.hidden_size + (2 * a.head_dim if a.qk_norm else 0)
    if a.is_moe_layer(i):
        return ((attention_weights(a) + qkv_bias) // tp + norms + router_weights(a),
                expert_params(a, ep, tp if etp is None else etp))
    return (linear_weights(a) + qkv_bias) // tp + norms, 0


def layer_params(a: QwenArch, tp: int = 1, i: int = 0, *, ep: int = 1, etp: int | None = None) -> int:
    """Parameters of decoder layer ``i`` on one rank (:func:`layer_param_split`, both parts)."""
    return sum(layer_param_split(a, tp, i, ep=ep, etp=etp))


def stage_param_split(a: QwenArch, tp: int, pp: int, stage: int, vocab_multiple: int = 128, *,
                      ep: int = 1, etp: int | None = None) -> tuple[int, int]:
    """``(dense, expert)`` parameters on one rank of pipeline ``stage`` (megatron-core's GPTModel
    sharding; the embedding, output layer and final norm are dense)."""
    vocab = a.padded_vocab_size(vocab_multiple) * a.hidden_size // tp
    dense = experts = 0
    for i in plan_moe.stage_layers(a, pp, stage):
        d, e = layer_param_split(a, tp, i, ep=ep, etp=etp)
        dense, experts = dense + d, experts + e
    first, last = stage == 0, stage == pp - 1
    if first:
        dense += vocab  # word embeddings
    if last:
        dense += a.hidden_size  # final norm
        # the output layer; tied embeddings keep a copy on the last stage when pp > 1
        if not a.tie_word_embeddings or not first:
            dense += vocab
    return dense, experts


def stage_params(a: QwenArch, tp: int, pp: int, stage: int, vocab_multiple: int = 128, *,
                 ep: int = 1, etp: int | None = None) -> int:
    """Parameters on one rank of pipeline ``stage`` (megatron-core's GPTModel sharding)."""
    return sum(stage_param_split(a, tp, pp, stage, vocab_multiple, ep=ep, etp=etp))


def total_params(a: QwenArch) -> int:
    """Parameters of the HF model (unpadded vocabulary, as model cards count them)."""
    vocab = a.vocab_size * a.hidden_size
    return (sum(layer_params(a, 1, i) for i in range(a.num_layers)) + a.hidden_size
            + vocab * (1 if a.tie_word_embeddings else 2))


def active_params(a: QwenArch) -> int:
    """Parameters one token uses (model cards' "activated"): :func:`total_params` less, in every
    MoE layer, the experts it is not routed to (attention, embeddings, norms, router and the
    ``moe_topk`` experts remain); a dense model's total."""
    moe_layers = sum(a.is_moe_layer(i) for i in range(a.num_layers))
    return total_params(a) - moe_layers * (a.num_experts - a.moe_topk) * mlp_weights(
        a, a.moe_intermediate_size)


# ------------------------------------------------------------------------------ activations

def _layer_act_bytes(a: QwenArch, s: int, b: float, tp: int, sp: bool, flash: bool,
                     keep_linear_inputs: bool = True, *, moe: bool = False, etp: int = 1) -> float:
    """Bytes one layer keeps for backward for ``b`` sequences of ``s`` tokens (16-bit); ``moe``:
    a MoE layer, whose router and experts (:func:`plan_moe.moe_mlp_act_bytes`) replace FC1's and
    SwiGLU's outputs."""
    h, f, d = a.hidden_size, a.intermediate_size, a.head_dim
    norm_and_linear_inputs = (4 if keep_linear_inputs else 2) * h
    sharded = (a.num_heads + 2 * a.num_kv_heads) * d + a.num_heads * d + (0 if moe else 3 * f)
    per_token = 2 * (norm_and_linear_inputs / (tp if sp else 1) + sharded / tp)
    if not flash:
        per_token += 6 * a.num_heads / tp * s
    experts = plan_moe.moe_mlp_act_bytes(a, s, b, tp, etp) if moe else 0.0
    return per_token * s * b + experts


def _stage_act_bytes(a: QwenArch, s: int, b: float, tp: int, pp: int, sp: bool, flash: bool,
                     etp: int = 1) -> float:
    """Bytes the layers of the heaviest pipeline stage keep for backward (one micro-batch)."""
    dense = _layer_act_bytes(a, s, b, tp, sp, flash)
    if not a.is_moe:
        return dense * (a.num_layers // pp)
    moe = _layer_act_bytes(a, s, b, tp, sp, flash, moe=True, etp=etp)
    n_moe = max(plan_moe.moe_layers_in_stage(a, pp, k) for k in range(pp))
    return moe * n_moe + dense * (a.num_layers // pp - n_moe)


def _one_layer_act_bytes(a: QwenArch, s: int, b: float, tp: int, sp: bool, flash: bool,
                         etp: int = 1) -> float:
    """The working set of one layer at a time: the larger of a dense and a MoE layer's."""
    dense = _layer_act_bytes(a, s, b, tp, sp, flash)
    if not a.is_moe:
        return dense
    moe = _layer_act_bytes(a, s, b, tp, sp, flash, moe=True, etp=etp)
    return moe if all(a.moe_layers) else max(moe, dense)


def update_activation_bytes(a: QwenArch, *, s: int, b: float, tp: int, pp: int, sp: bool,
                            flash: bool, recompute: str | None, microbatches: int,
                            etp: int = 1) -> float:
    layers = a.num_layers // pp
    in_flight = min(pp, microbatches)
    if recompute == "full":
        kept = 2 * a.hidden_size * s * b / (tp if sp else 1) * layers * in_flight
        return kept + _one_layer_act_bytes(a, s, b, tp, sp, flash, etp)
    flash = flash or recompute == "selective"
    return _stage_act_bytes(a, s, b, tp, pp, sp, flash, etp) * in_flight


def logits_bytes(a: QwenArch, s: int, b: float, tp: int, vocab_multiple: int, chunk: int = 0) -> float:
    """The last stage's logits working set for a micro-batch of ``b`` rows of ``s`` tokens.
    Whole (``chunk`` 0): ``s*b*V/TP`` entries at 10 bytes (bf16 output, fp32 log-softmax, fp32
    gradient). Chunked (``train.logits_chunk_tokens``, ``models/chunked_logits.py``): at most
    ``chunk`` positions at 14 bytes (the bf16 matmul output, fp32 logits, their exponentials or
    probabilities, the gradient in fp32 and bf16), plus the gathered hidden states and their
    gradient (``s*b*h``, 2 + 2 bytes)."""
    vocab = a.padded_vocab_size(vocab_multiple) / tp
    if not chunk:
        return 10.0 * s * b * vocab
    return 14.0 * min(chunk, s * b) * vocab + 4.0 * s * b * a.hidden_size


# ------------------------------------------------------------------------------ the plan

@dataclass
class Plan:
    model: str
    source: str
    params_b: float
    layout: dict
    active_params_b: float = 0.0  # parameters a token uses (a dense model's: all of them)
    memory_gib: dict = field(default_factory=dict)   # per GPU, by component
    phases_gib: dict = field(default_factory=dict)   # per GPU, by phase of the trainer's loop
    phase_vllm_holds: dict = field(default_factory=dict)  # phase -> what vLLM holds (phases.NOTHING, ...)
    vllm: dict = field(default_factory=dict)
    sync: dict = field(default_factory=dict)         # weight-sync bytes received per rank per step
    moe: dict = field(default_factory=dict)          # a MoE model's experts, layout and traffic
    flops: dict = field(default_factory=dict)        # per step, PFLOP
    time_s: dict = field(default_factory=dict)       # per step, by phase
    hardware: dict = field(default_factory=dict)
    budgets: dict = field(default_factory=dict)      # token budgets: tokens, chosen (keys), phase_gib
    longest_response_tokens: int | None = None      # the longest response that fits (--response-tokens)
    warnings: list = field(default_factory=list)
    fits: bool = True
    reasons: list = field(default_factory=list)
    advice: list = field(default_factory=list)

    @property
    def peak_gib(self) -> float:
        return max(self.phases_gib.values())

    @property
    def rollout_peak_gib(self) -> float:
        """The largest phase while vLLM is (partly) awake: waking, syncing, generating."""
        return max(g for k, g in self.phases_gib.items() if self.phase_vllm_holds[k] != NOTHING)

    @property
    def train_peak_gib(self) -> float:
        """The largest phase while vLLM sleeps: the Megatron passes."""
        return max(g for k, g in self.phases_gib.items() if self.phase_vllm_holds[k] == NOTHING)


def make_plan(cfg, hf_config: dict, *, nodes: int, gpus_per_node: int, hw: Hardware,
              source: str = "config.json", response_tokens: int | None = None,
              prompt_tokens: int | None = None) -> Plan:
    """The plan for ``cfg`` (a :class:`megatron_oar.config.Config`) on ``nodes`` x
    ``gpus_per_node`` GPUs; lengths default to the config's maxima (the worst case)."""
    a = parse_arch(hf_config, source=source)
    world = nodes * gpus_per_node
    budgets = choose_token_budgets(cfg, hf_config, world=world, hw=hw, source=source)
    cfg = with_budgets(cfg, budgets.tokens)  # the unset ones chosen, the set ones kept
    m, par, t, r = cfg.model, cfg.parallel, cfg.train, cfg.rollout
    dp = world // (par.tp * par.pp)
    prompt = prompt_tokens if prompt_tokens is not None else cfg.data.max_prompt_tokens
    resp = response_tokens if response_tokens is not None else r.max_new_tokens
    s = prompt + resp
    samples = t.prompts_per_step * t.group_size
    rows = samples // t.mini_batches // dp  # per rank per optimizer step
    microbatches = _train_microbatches(cfg, rows=rows, s=s)

    experts = plan_moe.expert_layout(a, world, par.tp, par.pp, par.ep, par.etp)
    mem = _resident_memory(cfg, a, dp, experts["edp"])
    resident = sum(mem.values())
    act = _activation_memory(cfg, a, s=s, dp=dp, samples=samples, microbatches=microbatches)
    mem.update({f"activations: {k}": v for k, v in act.items()})
    v = _vllm_memory(cfg, a, hw, world=world, samples=samples)
    # every phase of the trainer's loop (training/phases.py): Megatron's resident state, the
    # phase's Megatron working set, and what vLLM holds on the GPU then
    vllm_mem = {NOTHING: v["asleep"], WEIGHTS: min(v["share"], v["asleep"] + v["weights"]),
                WEIGHTS_KV_CACHE: v["share"]}
    sync = _sync_traffic(cfg, a, world)
    # a gathered bucket + its TP shards in flight, and the MoE layer vLLM's reload holds
    work = {None: 0.0, "sync": 2.0 * r.bucket_bytes + sync["moe_layer_reload_gib"] * GIB,
            "forward": act["old-logprob"], "attribution": act["attribution"], "update": act["update"]}
    phases = {p.name: resident + work[p.megatron] + vllm_mem[p.vllm_holds] + hw.reserve_gib * GIB
              for p in trainer_phases(cfg)}
    plan = Plan(
        model=f"{family_of(a).name}, {a.num_layers} layers, hidden {a.hidden_size}",
        source=source, params_b=total_params(a) / 1e9, active_params_b=active_params(a) / 1e9,
        layout={"nodes": nodes, "gpus": world, "tp": par.tp, "pp": par.pp, "dp": dp,
                "sequence_parallel": par.sequence_parallel, "recompute": m.recompute, "fp8": m.fp8,
                "rollout_tp": r.tp, "engines": v["engines"], "seq_len": s, "sleep_level": r.sleep_level,
                "micro_batches_per_rank": microbatches,
                **({"ep": experts["ep"], "etp": experts["etp"], "edp": experts["edp"]} if a.is_moe else {})},
        memory_gib={k: x / GIB for k, x in mem.items()},
        phases_gib={k: x / GIB for k, x in phases.items()},
        phase_vllm_holds={p.name: p.vllm_holds for p in trainer_phases(cfg)},
        vllm={"share_gib": v["share"] / GIB, "weights_gib": v["weights"] / GIB,
              "kv_cache_gib": max(0.0, v["kv_cache"]) / GIB, "kv_tokens": v["kv_tokens"],
              "sequences_per_engine": v["seqs_per_engine"], "concurrent_sequences": v["concurrent"],
              "host_offload_gib_per_node": (v["weights"] * gpus_per_node / GIB
                                            if r.sleep_level == 1 else 0.0)},
        budgets={"tokens": budgets.tokens, "chosen": budgets.chosen, "phase_gib": budgets.phase_gib},
        warnings=list(budgets.warnings),
        sync=sync,
        moe=_moe_summary(cfg, a, experts) if a.is_moe else {},
        hardware=asdict(hw))
    _verdict(plan, cfg, hw, v)
    if not plan.fits:
        plan.advice = _advice(plan, cfg, mem, act["update"], act["attribution"])
    _estimate_time(plan, cfg, a, hw, world=world, samples=samples, prompt=prompt, resp=resp,
                   longest=cfg.data.max_prompt_tokens + r.max_new_tokens, engines=v["engines"],
                   concurrent=max(1, v["concurrent"]),
                   kv_per_token=v["kv_per_token"], vllm_weights=v["weights"])
    return plan


OAR_P_MAX_COST = 4.0  # oar plan --oar-p-max-cost: exact OAR-P's step over GRPO's that warns


def plan_config(cfg, hf_config: dict, *, nodes: int, gpus_per_node: int, hw: Hardware,
                source: str = "config.json", response_tokens: int | None = None,
                oar_p_max_cost: float = OAR_P_MAX_COST, longest: bool = True) -> Plan:
    """``oar plan``'s plan: :func:`make_plan` for ``cfg`` set to generate ``response_tokens``-token
    responses (:func:`at_length`; default: ``rollout.max_new_tokens``), with the longest response
    that fits (``longest``) and exact OAR-P's cost warning."""
    if response_tokens is not None:
        cfg = at_length(cfg, response_tokens)
    kw = dict(nodes=nodes, gpus_per_node=gpus_per_node, hw=hw, source=source)
    plan = make_plan(cfg, hf_config, **kw)
    if longest:
        plan.longest_response_tokens = longest_response(cfg, hf_config, **kw)
    warning = oar_p_cost_warning(cfg, hf_config, plan, max_cost=oar_p_max_cost, **kw)
    if warning:
        plan.warnings.append(warning)
    return plan


def longest_response(cfg, hf_config: dict, **kw) -> int:
    """The longest response (a multiple of ``LENGTH_STEP`` tokens, up to the model's positions)
    for which ``cfg`` at that length (:func:`at_length`, token budgets chosen per length) fits;
    0 when not even ``LENGTH_STEP`` tokens do."""
    a = parse_arch(hf_config, source=kw.get("source", "config.json"))
    hi = a.max_position_embeddings - cfg.data.max_prompt_tokens
    return longest_true(lambda n: make_plan(at_length(cfg, n), hf_config, **kw).fits, hi)


def with_credit(cfg, credit: str):
    out = copy.deepcopy(cfg)
    out.credit = credit
    out.sync()
    return out


def oar_p_over_cost(cfg, hf_config: dict, plan: Plan, *, max_cost: float, **kw) -> dict | None:
    """For exact OAR-P (``credit=oar_p``) whose estimated step costs more than ``max_cost`` times
    GRPO's at the same length: its ``ratio`` to GRPO's step and the ``grpo`` and screened OAR-P
    (``screened``) step seconds; None otherwise."""
    if cfg.credit != "oar_p":
        return None
    grpo = make_plan(with_credit(cfg, "grpo"), hf_config, **kw).time_s["total"]
    ratio = plan.time_s["total"] / grpo
    if ratio <= max_cost:
        return None
    screened = make_plan(with_credit(cfg, "oar_p_screened"), hf_config, **kw).time_s["total"]
    return {"ratio": ratio, "grpo": grpo, "screened": screened}


def oar_p_cost_warning(cfg, hf_config: dict, plan: Plan, *, max_cost: float, **kw) -> str | None:
    """:func:`oar_p_over_cost`'s case as a warning, naming screened OAR-P and its estimated step."""
    cost = oar_p_over_cost(cfg, hf_config, plan, max_cost=max_cost, **kw)
    if cost is None:
        return None
    return (f"exact OAR-P costs {cost['ratio']:.1f}x GRPO's step at {cfg.rollout.max_new_tokens:,}-token "
            f"responses ({plan.time_s['total']:,.0f} s against {cost['grpo']:,.0f} s; over --oar-p-max-cost "
            f"{max_cost:g}): screened OAR-P (credit=oar_p_screened, attribution.screen_fraction="
            f"{cfg.attribution.screen_fraction:g}) would cost {cost['screened']:,.0f} s per step "
            f"({cost['screened'] / cost['grpo']:.1f}x GRPO)")


def _resident_memory(cfg, a: QwenArch, dp: int, edp: int = 1) -> dict[str, float]:
    """Bytes per GPU of Megatron's resident state on the heaviest pipeline stage. A MoE model's
    expert parameters keep their Adam state sharded over the expert-data-parallel group
    (``edp``), the others over DP."""
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


def budget_rows(tokens: int, s: int) -> float:
    """Full-length rows of ``s`` tokens a token budget of ``tokens`` holds, as a bound on its
    tokens: a row longer than the budget runs alone (``models/micro_batches.py``)."""
    return max(tokens, s) / s


def _act_setup(cfg):
    m, par = cfg.model, cfg.parallel
    # no s x s matrix: TE's fused attention (the TE spec) and SDPA (the local spec's default,
    # models/sdpa_attention.py) alike; only megatron's unfused attention keeps it
    flash = m.attention != "unfused"
    return par.tp, par.pp, par.sequence_parallel, flash, par.tp if par.etp is None else par.etp


def _train_activations(cfg, a: QwenArch, *, s: int, mbs: float, microbatches: int) -> tuple[float, float]:
    """``(update, old-logprob)`` activation bytes for micro-batches of ``mbs`` full-length rows."""
    tp, pp, sp, flash, etp = _act_setup(cfg)
    chunk, vm = cfg.train.logits_chunk_tokens, cfg.model.vocab_multiple
    update = update_activation_bytes(a, s=s, b=mbs, tp=tp, pp=pp, sp=sp, flash=flash,
                                     recompute=cfg.model.recompute, microbatches=microbatches, etp=etp)
    update += logits_bytes(a, s, mbs, tp, vm, chunk)
    forward = _one_layer_act_bytes(a, s, mbs, tp, sp, flash, etp) + logits_bytes(a, s, mbs, tp, vm, chunk)
    return update, forward


def _oar_g_activations(cfg, a: QwenArch, *, s: int, seqs: float, samples: int, dp: int) -> float:
    """OAR-G (eval mode, no recompute): a forward keeping activations for the input-gradient
    backward, ``seqs`` full-length rows per micro-batch, plus the fp32 input-embedding gradient."""
    tp, pp, sp, flash, etp = _act_setup(cfg)
    return (_stage_act_bytes(a, s, seqs, tp, pp, sp, flash, etp)
            * min(pp, max(1, math.ceil(samples / (seqs * dp)))) + 4.0 * s * seqs * a.hidden_size)


def _oar_p_activations(cfg, a: QwenArch, *, s: int, copies: float) -> float:
    """OAR-P: forward only over ``copies`` full-length masked copies, one layer at a time."""
    tp, _, sp, flash, etp = _act_setup(cfg)
    return _one_layer_act_bytes(a, s, copies, tp, sp, flash, etp)


def _train_microbatches(cfg, *, rows: int, s: int) -> int:
    """Micro-batches per rank per optimizer step of ``rows`` rows of ``s`` tokens."""
    if cfg.train.batching == "padded":
        return rows // cfg.train.micro_batch_size
    return math.ceil(rows * s / max(cfg.micro_batch_tokens, s))


def _activation_memory(cfg, a: QwenArch, *, s: int, dp: int, samples: int,
                       microbatches: int) -> dict[str, float]:
    """Activation bytes per GPU of the passes that run while vLLM sleeps: ``update``,
    ``old-logprob`` and ``attribution``, at the config's token budgets (or rows)."""
    at = cfg.attribution_config()  # its nulls: the training keys
    # rows of a full-length micro-batch: token budgets (and packing) hold micro_batch_tokens tokens
    mbs = (budget_rows(cfg.micro_batch_tokens, s) if cfg.train.batching != "padded"
           else cfg.train.micro_batch_size)
    update, forward = _train_activations(cfg, a, s=s, mbs=mbs, microbatches=microbatches)
    attr = 0.0
    budgeted = at.batching == "token_budget"
    if cfg.uses_attribution and at.method in ("oar_g", "oar_p_screened"):
        seqs = budget_rows(at.max_tokens_per_micro_batch, s) if budgeted else at.micro_batch_size
        attr = _oar_g_activations(cfg, a, s=s, seqs=seqs, samples=samples, dp=dp)
    if cfg.uses_attribution and at.method in ("oar_p", "oar_p_screened"):  # screened: the larger
        copies = (budget_rows(at.max_tokens_per_copy_micro_batch, s) if budgeted
                  else at.perturb_micro_batch_size)
        attr = max(attr, _oar_p_activations(cfg, a, s=s, copies=copies))
    return {"update": update, "old-logprob": forward, "attribution": attr}


def budget_specs(cfg, a: QwenArch, *, world: int, hw: Hardware) -> tuple[list[BudgetSpec], int]:
    """The token budgets ``cfg`` runs with, each with the bytes per GPU of the phase it sizes as a
    function of the budget (Megatron's resident state, vLLM asleep, the reserve and the pass's
    activations), at the longest sequence the run can see (``data.max_prompt_tokens`` +
    ``rollout.max_new_tokens``); and that length. The training budget sizes the update and the
    old-logprob pass; the attribution budgets OAR-G's micro-batches (OAR-P: its teacher's forward,
    left to the training budget as before) and OAR-P's copies."""
    par, t = cfg.parallel, cfg.train
    dp = world // (par.tp * par.pp)
    s = cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens
    samples = t.prompts_per_step * t.group_size
    rows = samples // t.mini_batches // dp  # per rank per optimizer step
    experts = plan_moe.expert_layout(a, world, par.tp, par.pp, par.ep, par.etp)
    base = (sum(_resident_memory(cfg, a, dp, experts["edp"]).values())
            + _vllm_memory(cfg, a, hw, world=world, samples=samples)["asleep"] + hw.reserve_gib * GIB)
    specs = []
    if t.batching != "padded":
        def train_bytes(b: int) -> float:
            mbs = budget_rows(b, s)
            return base + max(_train_activations(cfg, a, s=s, mbs=mbs,
                                                 microbatches=math.ceil(rows * s / max(b, s))))
        specs.append(BudgetSpec(TRAIN_BUDGET, t.max_tokens_per_micro_batch, "update", train_bytes,
                                lo=s, hi=rows * s // par.pp))  # >= PP micro-batches in flight
    at = cfg.attribution_config()
    if cfg.uses_attribution and at.batching == "token_budget":
        if at.method in ("oar_g", "oar_p_screened"):
            specs.append(BudgetSpec(
                ATTRIBUTION_BUDGET, cfg.attribution.max_tokens_per_micro_batch, "attribution",
                lambda b: base + _oar_g_activations(cfg, a, s=s, seqs=budget_rows(b, s), samples=samples, dp=dp),
                lo=s, hi=math.ceil(samples / dp) * s // par.pp))
        if at.method in ("oar_p", "oar_p_screened"):
            specs.append(BudgetSpec(
                COPY_BUDGET, cfg.attribution.max_tokens_per_copy_micro_batch, "attribution",
                lambda b: base + _oar_p_activations(cfg, a, s=s, copies=budget_rows(b, s)),
                lo=s, hi=cfg.rollout.max_new_tokens * s))  # every copy of one row
    return specs, s


def choose_token_budgets(cfg, hf_config: dict, *, world: int, hw: Hardware,
                         source: str = "config.json") -> BudgetChoice:
    """The token budgets a run of ``cfg`` on ``world`` GPUs of ``hw.gpu_mem_gib`` uses: those the
    config leaves unset chosen as the largest that fit their phase, those it sets kept (with a
    warning where they do not fit). ``oar plan`` and ``oar train`` both call this."""
    a = parse_arch(hf_config, source=source)
    specs, s = budget_specs(cfg, a, world=world, hw=hw)
    return choose_budgets(specs, hw.gpu_mem_gib * GIB, seq_len=s)


def _moe_summary(cfg, a: QwenArch, experts: dict) -> dict:
    """A MoE model's experts, their layout and memory per rank (the heaviest stage), and the
    alltoall dispatcher's traffic."""
    m, par = cfg.model, cfg.parallel
    wbytes = 4 if m.dtype == "fp32" else 2
    split = max((stage_param_split(a, par.tp, par.pp, k, m.vocab_multiple, ep=par.ep, etp=par.etp)
                 for k in range(par.pp)), key=sum)
    opt = (12 if wbytes == 2 else 8) / (experts["edp"] if cfg.optim.use_distributed_optimizer else 1)
    return {**experts, "num_experts": a.num_experts, "topk": a.moe_topk,
            "moe_layers_per_stage": max(plan_moe.moe_layers_in_stage(a, par.pp, k) for k in range(par.pp)),
            "dense_params_per_rank_b": split[0] / 1e9, "expert_params_per_rank_b": split[1] / 1e9,
            "expert_state_gib_per_rank": split[1] * (wbytes + 4 + opt) / GIB,
            "dispatcher_kib_per_token_layer": {
                k: v / 1024 for k, v in plan_moe.dispatcher_bytes_per_token(
                    a, experts["ep"], experts["etp"], wbytes).items()}}


def _vllm_memory(cfg, a: QwenArch, hw: Hardware, *, world: int, samples: int) -> dict[str, float]:
    """vLLM's share of a GPU, its weights and KV cache (bytes), what it keeps asleep, and how many
    sequences each engine runs at once."""
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
            "asleep": VLLM_ASLEEP_GIB * GIB if r.sleep_level >= 1 else share}


def _sync_traffic(cfg, a: QwenArch, world: int) -> dict:
    """GiB one rank receives per weight sync (the worst pipeline stage), on the path the config
    takes and on the full-tensor path; ``expert_tp``: the vLLM TP slices the experts travel in
    (1: whole); ``moe_layer_reload_gib``: one MoE layer's experts as vLLM's reload holds them."""
    par, r = cfg.parallel, cfg.rollout
    wbytes = 4 if cfg.model.dtype == "fp32" else 2

    def worst(shards: bool, expert_tp: int) -> dict:
        stages = sync_traffic(a, tp=par.tp, pp=par.pp, dtype_bytes=wbytes, shards=shards,
                              vocab_multiple=cfg.model.vocab_multiple, ep=par.ep, etp=par.etp,
                              expert_tp=expert_tp)
        out = {k: v / GIB for k, v in max(stages, key=lambda x: x["total"]).items()}
        if not a.is_moe:
            del out["ep_gather"]
        return out

    shards = r.sync_shards and par.tp == r.tp > 1
    cut = a.is_moe and expert_target(world_size=world, pp=par.pp, rank=0, vllm_tp=r.tp,
                                     moe_intermediate_size=a.moe_intermediate_size, enabled=r.sync_shards)
    expert_tp = cut.tp if cut else 1
    return {"shards": shards, "expert_tp": expert_tp, **worst(shards, expert_tp),
            "full_tensors_gib": worst(False, 1)["total"],
            "moe_layer_reload_gib": moe_layer_reload_bytes(a, wbytes, expert_tp) / GIB}


def _verdict(plan: Plan, cfg, hw: Hardware, v: dict[str, float]) -> None:
    """Sets ``plan.fits`` and its reasons: a phase over the GPU's memory, or a vLLM share that
    leaves too little KV cache."""
    r, cap = cfg.rollout, hw.gpu_mem_gib
    over = {phase: gib for phase, gib in plan.phases_gib.items() if gib > cap}
    if over:
        plan.fits = False
        plan.reasons.append(f"phases {', '.join(over)} need up to {max(over.values()):.1f} GiB "
                            f"per GPU > {cap:g} GiB")
    if v["weights"] + VLLM_OVERHEAD_GIB * GIB >= v["share"]:
        plan.fits = False
        plan.reasons.append(
            f"vLLM's weights ({v['weights'] / GIB:.1f} GiB at rollout.tp={r.tp}) leave no KV cache in "
            f"rollout.gpu_memory_utilization={r.gpu_memory_utilization} of {cap:g} GiB")
    elif v["kv_tokens"] < r.max_model_len:
        plan.fits = False
        plan.reasons.append(f"vLLM's KV cache holds {v['kv_tokens']} tokens < rollout.max_model_len="
                            f"{r.max_model_len}")


def trainer_phases(cfg) -> list[Phase]:
    """The phases the trainer runs for ``cfg``: a step, an evaluation when
    ``train.eval_interval`` is set, a checkpoint (at least the last step's); a phase that
    repeats is listed once."""
    seen: dict[str, Phase] = {}
    for p in STEP + (EVAL if cfg.train.eval_interval else ()) + CHECKPOINT:
        if p.name != "attribution" or cfg.uses_attribution:
            seen.setdefault(p.name, p)
    return list(seen.values())


def _advice(plan, cfg, mem, act_update, act_attr) -> list[str]:
    tips = []
    if plan.train_peak_gib >= plan.rollout_peak_gib:
        at, s = cfg.attribution_config(), plan.layout["seq_len"]
        if act_attr >= act_update and at.batching == "padded" and at.micro_batch_size > 1:
            tips.append("attribution runs without recompute: lower attribution.micro_batch_size")
        if act_attr >= act_update and at.batching == "token_budget" and at.max_tokens_per_micro_batch > s:
            tips.append("attribution runs without recompute: lower attribution.max_tokens_per_micro_batch "
                        f"(now {at.max_tokens_per_micro_batch} tokens)")
        if cfg.model.recompute != "full":
            tips.append("model.recompute=full")
        if not cfg.parallel.sequence_parallel and cfg.parallel.tp > 1:
            tips.append("parallel.sequence_parallel=true")
        if cfg.train.batching == "padded" and cfg.train.micro_batch_size > 1:
            tips.append("a smaller train.micro_batch_size")
        if cfg.train.batching != "padded" and cfg.micro_batch_tokens > s:
            tips.append(f"a smaller train.max_tokens_per_micro_batch (now {cfg.micro_batch_tokens} tokens)")
    else:
        tips.append("a smaller rollout.gpu_memory_utilization (if the KV cache still holds a "
                    "sequence)")
    if mem["optimizer"] + mem["gradients"] > 0.3 * plan.hardware["gpu_mem_gib"] * GIB:
        tips.append("more model parallelism (parallel.tp / parallel.pp"
                    + (" / parallel.ep" if plan.moe else "") + ") or more nodes")
    return tips


def _estimate_time(plan: Plan, cfg, a: QwenArch, hw: Hardware, *, world, samples, prompt, resp, longest,
                   engines, concurrent, kv_per_token, vllm_weights) -> None:
    s = prompt + resp
    n_mm = matmul_params(a)
    attn_per_token = 2 * a.num_layers * a.num_heads * a.head_dim * s  # causal: mean context s/2
    fwd_token = 2 * n_mm + attn_per_token
    t, at = cfg.train, cfg.attribution_config()
    # padded micro-batches run every sequence at the longest possible length; token budgets
    # (and packing) at its own, up to a few per cent of padding to a micro-batch's longest
    fwd_seq = {"logprob": forward_flops(a, [longest if t.batching == "padded" else s]),
               "update": forward_flops(a, [longest if t.batching == "padded" else s]),
               "attribution": forward_flops(a, [longest if at.batching == "padded" else s])}
    fe = {"logprob": 1.0 + (1.0 if cfg.loss.kl_coef > 0 else 0.0),  # old-logprob (+ reference)
          "update": t.ppo_epochs * (3.0 + (1.0 if cfg.model.recompute == "full" else 0.0))}
    if cfg.uses_attribution and at.method == "oar_g":
        fe["attribution"] = 2.0  # noisy forward + input-gradient-only backward
    elif cfg.uses_attribution and at.method == "oar_p_screened":  # OAR-G, then its top fraction
        fe["attribution"] = 2.0 + math.ceil(at.screen_fraction * resp)
    elif cfg.uses_attribution:
        fe["attribution"] = float(resp)  # one forward per scored token (upper bound: all)
    else:
        fe["attribution"] = 0.0
    megatron_flop = {k: v * fwd_seq[k] * samples for k, v in fe.items()}
    rate = world * hw.peak_tflops * 1e12 * hw.mfu
    times = {k: v / rate for k, v in megatron_flop.items()}

    # generation: prefill at the MFU, decode by a roofline per step
    seqs = math.ceil(samples / engines)
    rtp = cfg.rollout.tp
    prefill = seqs * prompt * fwd_token / (rtp * hw.peak_tflops * 1e12 * hw.mfu)
    waves = math.ceil(seqs / concurrent)
    ctx = prompt + resp / 2
    if a.is_moe:  # a decode step reads the experts its tokens are routed to, not all of them
        moe_layers = sum(a.is_moe_layer(i) for i in range(a.num_layers))
        experts = moe_layers * expert_params(a) / total_params(a)  # their share of the weights
        vllm_weights *= 1 - experts + experts * plan_moe.experts_read_fraction(a, concurrent)
    step_bytes = vllm_weights + concurrent * ctx * kv_per_token
    step_flop = concurrent * (2 * n_mm + 4 * a.num_layers * a.num_heads * a.head_dim * ctx) / rtp
    per_step = max(step_bytes / (hw.hbm_tb_s * 1e12 * hw.bandwidth_eff),
                   step_flop / (hw.peak_tflops * 1e12 * hw.mfu))
    times = {"generate": prefill + waves * resp * per_step, **times}
    gen_flop = samples * s * fwd_token
    plan.flops = {"generate": gen_flop / 1e15, **{k: v / 1e15 for k, v in megatron_flop.items()}}
    plan.time_s = {k: v for k, v in times.items() if v > 0}
    plan.time_s["total"] = sum(plan.time_s.values())


# ------------------------------------------------------------------------------ output

def render(plan: Plan, name: str) -> str:
    L, v, moe = plan.layout, plan.vllm, plan.moe
    active = f", {plan.active_params_b:.2f}B active" if moe else ""
    experts = f", EP {L['ep']} x ETP {L['etp']} (expert DP {L['edp']})" if moe else ""
    lines = [f"# plan: {name} ({plan.params_b:.2f}B parameters{active}, {plan.source})",
             f"{L['nodes']} node(s), {L['gpus']} GPUs of {plan.hardware['gpu_mem_gib']:g} GiB; "
             f"TP {L['tp']} x PP {L['pp']} x DP {L['dp']}{experts}, "
             f"SP {'on' if L['sequence_parallel'] else 'off'}, "
             f"recompute {L['recompute'] or 'none'}, FP8 {L['fp8'] or 'off'}; vLLM TP {L['rollout_tp']} "
             f"({L['engines']} engines); sequences of {L['seq_len']} tokens, "
             f"{L['micro_batches_per_rank']} micro-batches per rank per optimizer step", "",
             "| per GPU | GiB |", "|---|---:|"]
    lines += [f"| {k} | {g:.2f} |" for k, g in plan.memory_gib.items() if g > 0]
    lines += [f"| vLLM awake (weights {v['weights_gib']:.1f} + KV cache {v['kv_cache_gib']:.1f} "
              f"+ overhead) | {v['share_gib']:.2f} |",
              "", "| phase of the loop | vLLM holds | peak GiB |", "|---|---|---:|"]
    never_sleeps = f"{WEIGHTS_KV_CACHE} (sleep_level 0)"
    lines += [f"| {k} | {plan.phase_vllm_holds[k] if L['sleep_level'] else never_sleeps} | {g:.1f} |"
              for k, g in plan.phases_gib.items()]
    lines += [f"| **peak, rollout phases** | | **{plan.rollout_peak_gib:.1f}** |",
              f"| **peak, Megatron passes** | | **{plan.train_peak_gib:.1f}** |", "",
              f"vLLM: KV cache {v['kv_tokens']:,} tokens per engine, {v['concurrent_sequences']} of "
              f"{v['sequences_per_engine']} sequences at once; host memory for sleeping weights "
              f"{v['host_offload_gib_per_node']:.0f} GiB per node", "",
              sync_line(plan.sync), ""]
    if moe:
        lines += moe_lines(moe) + [""]
    lines += ["| phase | PFLOP | s |", "|---|---:|---:|"]
    lines += [f"| {k} | {plan.flops.get(k, 0):.1f} | {sec:.1f} |"
              for k, sec in plan.time_s.items() if k != "total"]
    lines += [f"| **step** | {sum(plan.flops.values()):.1f} | **{plan.time_s['total']:.1f}** |", "",
              f"(at {plan.hardware['mfu']:.0%} MFU of {plan.hardware['peak_tflops']:g} TFLOP/s, "
              f"decode at {plan.hardware['bandwidth_eff']:.0%} of {plan.hardware['hbm_tb_s']:g} TB/s)"]
    lines += budget_lines(plan)
    if plan.longest_response_tokens is not None:
        lines.append(f"longest response that fits: {plan.longest_response_tokens:,} tokens "
                     "(rollout.max_new_tokens; unset token budgets chosen for each length)")
    lines += [f"warning: {w}" for w in plan.warnings]
    if plan.fits:
        lines.append(f"\nFITS: peak {plan.peak_gib:.1f} of {plan.hardware['gpu_mem_gib']:g} GiB per GPU")
    else:
        lines.append("\nDOES NOT FIT: " + "; ".join(plan.reasons))
        if plan.advice:
            lines.append("try: " + "; ".join(plan.advice))
    return "\n".join(lines)


def budget_lines(plan: Plan) -> list[str]:
    """``token budgets: KEY N (chosen|set, PHASE GiB), ...``: one line, none without budgets."""
    b = plan.budgets
    if not b.get("tokens"):
        return []
    parts = [f"{k} {n:,} ({'chosen' if k in b['chosen'] else 'set'}, {b['phase_gib'][k]:.1f} GiB)"
             for k, n in b["tokens"].items()]
    return ["", "token budgets: " + ", ".join(parts)]


def sync_line(sync: dict) -> str:
    """``weight sync: X GiB received per rank per step (of which TP gather ..., PP ...)``."""
    line = (f"weight sync: {sync['total']:.2f} GiB received per rank per step (of which TP gather "
            f"{sync['tp_gather']:.2f}, PP broadcast {sync['pp_broadcast']:.2f})")
    if "ep_gather" in sync:
        line = line[:-1] + f", EP gather {sync['ep_gather']:.2f})"
    how = [w for w, on in (("as shards", sync["shards"]),
                           (f"experts as 1/{sync.get('expert_tp', 1)} slices", sync.get("expert_tp", 1) > 1)) if on]
    if how:
        line += f", {' and '.join(how)}; full tensors would be {sync['full_tensors_gib']:.2f} GiB"
    if sync.get("moe_layer_reload_gib"):
        line += f"; vLLM's reload holds {sync['moe_layer_reload_gib']:.2f} GiB of one MoE layer"
    return line


def moe_lines(moe: dict) -> list[str]:
    """A MoE plan's experts per rank and its dispatcher traffic, two lines."""
    d = moe["dispatcher_kib_per_token_layer"]
    return [f"MoE: {moe['num_experts']} experts, {moe['topk']} per token, "
            f"{moe['moe_layers_per_stage']} MoE layers per pipeline stage; per GPU "
            f"{moe['dense_params_per_rank_b']:.2f}B dense + {moe['expert_params_per_rank_b']:.2f}B expert "
            f"parameters ({moe['experts_per_rank']} experts per MoE layer per EP rank), the experts' "
            f"weights + gradients + Adam {moe['expert_state_gib_per_rank']:.2f} GiB",
            f"dispatcher (alltoall, uniform routing): {d['total']:.1f} KiB received per rank per token "
            f"per MoE layer in a forward (all-to-all {d['all_to_all']:.1f}, ETP all-gather "
            f"{d['etp_gather']:.1f}); a backward moves as much again"]


def summary_row(name: str, plan: Plan) -> str:
    L = plan.layout
    model_states = plan.memory_gib['weights'] + plan.memory_gib['gradients'] + plan.memory_gib['optimizer']
    experts = f", EP {L['ep']}" if plan.moe else ""
    return (f"| {name} | {L['nodes']}x{L['gpus'] // L['nodes']} | {L['tp']}/{L['pp']}/{L['dp']}{experts} | "
            f"{L['rollout_tp']} | {model_states:.1f} | "
            f"{plan.rollout_peak_gib:.1f} | {plan.train_peak_gib:.1f} | "
            f"{plan.vllm['kv_tokens'] // 1000}k | {plan.time_s['total']:.0f} | "
            f"{'fits' if plan.fits else 'does not fit'} |")


SUMMARY_HEADER = ("| config | nodes x GPUs | TP/PP/DP | vLLM TP | weights+grads+Adam GiB | "
                  "rollout peak GiB | train peak GiB | KV tokens/engine | step s | verdict |\n"
                  "|---|---|---|---:|---:|---:|---:|---:|---:|---|")


TABLE_LENGTHS = (8192, 16384, 32768)
TABLE_HEADER = ("| config | longest response | response tokens | verdict | peak GiB | token budgets "
                "(train / OAR-G / OAR-P copies) | otherwise |\n|---|---:|---:|---|---:|---|---|")


def _knob_plans(cfg, hf_config: dict, *, nodes: int, gpus_per_node: int, **kw):
    """``(knob, plan)`` for the knobs :func:`length_rows` tries on a plan that does not fit, in
    order: sequence parallelism (TP > 1), full recompute, both, then 2x and 4x the nodes (more data
    parallelism: less optimizer state per GPU) alone and with both; a knob the config already has,
    or a layout the batch does not divide into, is skipped."""
    from megatron_oar.config import ConfigError, validate

    memory = [[]]
    if cfg.parallel.tp > 1 and not cfg.parallel.sequence_parallel:
        memory.append(["parallel.sequence_parallel=true"])
    if cfg.model.recompute != "full":
        memory.append(["model.recompute=full"])
    if len(memory) == 3:
        memory.append(memory[1] + memory[2])
    for mult in (1, 2, 4):
        for knobs in (memory if mult == 1 else [[], memory[-1]] if len(memory) > 1 else [[]]):
            if mult == 1 and not knobs:
                continue
            c = copy.deepcopy(cfg)
            for knob in knobs:
                key, value = knob.split("=")
                section, name = key.split(".")
                setattr(getattr(c, section), name, True if value == "true" else value)
            c.sync()
            try:
                validate(c, world_size=nodes * mult * gpus_per_node, hf_config=hf_config)
            except ConfigError:
                continue
            label = knobs + ([f"{mult}x nodes ({nodes * mult * gpus_per_node} GPUs)"] if mult > 1 else [])
            yield " and ".join(label), make_plan(c, hf_config, nodes=nodes * mult,
                                                 gpus_per_node=gpus_per_node, **kw)


def length_rows(name: str, cfg, hf_config: dict, *, nodes: int, gpus_per_node: int, hw: Hardware,
                source: str = "config.json", lengths=TABLE_LENGTHS,
                oar_p_max_cost: float = OAR_P_MAX_COST) -> list[str]:
    """Rows of ``oar plan --table``: ``cfg`` at each response length, whether it fits, its peak,
    the token budgets it runs with, and otherwise the first knob that makes it fit."""
    kw = dict(nodes=nodes, gpus_per_node=gpus_per_node, hw=hw, source=source)
    a = parse_arch(hf_config, source=source)
    longest = longest_response(cfg, hf_config, **kw)
    rows = []
    for n in lengths:
        if cfg.data.max_prompt_tokens + n > a.max_position_embeddings:
            rows.append(f"| {name} | {longest:,} | {n:,} | beyond the model's {a.max_position_embeddings:,} "
                        "positions | | | |")
            continue
        c = at_length(cfg, n)
        plan = make_plan(c, hf_config, **kw)
        b = plan.budgets["tokens"]
        budgets = " / ".join(f"{b[k]:,}" if k in b else "-" for k in (TRAIN_BUDGET, ATTRIBUTION_BUDGET, COPY_BUDGET))
        otherwise = []
        if not plan.fits:
            knob = next((k for k, pl in _knob_plans(c, hf_config, **kw) if pl.fits), None)
            otherwise.append(f"needs {knob}" if knob else "fits with none of SP, full recompute, 4x nodes: "
                             + "; ".join(plan.reasons))
        cost = oar_p_over_cost(c, hf_config, plan, max_cost=oar_p_max_cost, **kw)
        if cost:
            otherwise.append(f"screened OAR-P: {cost['screened']:,.0f} s per step against exact OAR-P's "
                             f"{plan.time_s['total']:,.0f} s")
        rows.append(f"| {name} | {longest:,} | {n:,} | {'fits' if plan.fits else 'does not fit'} | "
                    f"{plan.peak_gib:.1f} | {budgets} | {'; '.join(otherwise) or '-'} |")
    return rows


def main(argv: list[str] | None = None) -> int:
    from megatron_oar.config import ConfigError, load_config, validate
    from megatron_oar.models import ModelConfigError
    from megatron_oar.models.presets import resolve_hf_config

    p = argparse.ArgumentParser(prog="oar plan", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, nargs="+",
                   help="YAML config(s); with several, one summary table")
    p.add_argument("--nodes", type=int, help="default: the config's launch.nodes")
    p.add_argument("--gpus-per-node", type=int, help="default: launch.gpus_per_node")
    p.add_argument("--gpu-mem-gib", type=float, help="default: launch.gpu_mem_gib")
    p.add_argument("--arch", help="a preset (models/presets.py: Qwen2.5, Qwen3, Qwen3-MoE) when "
                   "model.path has no config.json here")
    p.add_argument("--mfu", type=float, default=Hardware.mfu)
    p.add_argument("--peak-tflops", type=float, default=Hardware.peak_tflops)
    p.add_argument("--hbm-tb-s", type=float, default=Hardware.hbm_tb_s)
    p.add_argument("--response-tokens", type=int,
                   help="plan responses of this many tokens: rollout.max_new_tokens (and "
                   "rollout.max_model_len raised to hold the prompt and them); default: the config's")
    p.add_argument("--oar-p-max-cost", type=float, default=OAR_P_MAX_COST,
                   help="warn when exact OAR-P's step costs more than this many GRPO steps")
    p.add_argument("--table", action="store_true",
                   help="one row per config and response length (--lengths): fits, peak, budgets, "
                   "the knob it needs otherwise")
    p.add_argument("--lengths", type=int, nargs="+", default=list(TABLE_LENGTHS),
                   help="response lengths of --table")
    p.add_argument("--json", action="store_true", help="print the plan(s) as JSON")
    p.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = p.parse_args(argv)
    # `--config a.yaml b.yaml key=value`: nargs="+" also takes the overrides
    overrides = [c for c in args.config if "=" in c] + args.overrides
    plans, table = [], []
    for path in (Path(c) for c in args.config if "=" not in c):
        try:
            cfg = load_config(path, overrides)
            if args.response_tokens is not None:
                cfg = at_length(cfg, args.response_tokens)
            nodes = args.nodes or cfg.launch.nodes
            gpn = args.gpus_per_node or cfg.launch.gpus_per_node
            hf, source = resolve_hf_config(cfg.model.path, args.arch)
            validate(cfg, world_size=nodes * gpn, hf_config=hf)
        except (ConfigError, ModelConfigError) as e:
            print(f"oar plan: {e}", file=sys.stderr)
            return 2
        hw = Hardware(gpu_mem_gib=args.gpu_mem_gib or cfg.launch.gpu_mem_gib, mfu=args.mfu,
                      peak_tflops=args.peak_tflops, hbm_tb_s=args.hbm_tb_s)
        kw = dict(nodes=nodes, gpus_per_node=gpn, hw=hw, source=source, oar_p_max_cost=args.oar_p_max_cost)
        if args.table:
            table.extend(length_rows(path.stem, cfg, hf, lengths=args.lengths, **kw))
            continue
        plans.append((path.stem, plan_config(cfg, hf, **kw)))
    if args.table:
        print(TABLE_HEADER)
        print("\n".join(table))
        return 0
    if args.json:
        print(json.dumps({n: asdict(pl) for n, pl in plans}, indent=2))
    elif len(plans) == 1:
        print(render(plans[0][1], plans[0][0]))
    else:
        print(SUMMARY_HEADER)
        print("\n".join(summary_row(n, pl) for n, pl in plans))
    return 0 if all(pl.fits for _, pl in plans) else 1


if __name__ == "__main__":
    sys.exit(main())
