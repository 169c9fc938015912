"""``oar plan``'s plan of one config on its cluster: memory per phase, time per step, the verdict
and what to try when it does not fit, the MoE summary and the weight sync's traffic, the
longest response that fits, and exact OAR-P's cost warning.

The weight sync's traffic: the bytes one rank receives per step, TP all-gathers and PP
broadcasts, the largest over the pipeline stages (``rollout.weight_sync.sync_traffic``, the
formula ``tests/test_rollout.py`` checks against what a sync measures), for the path the config
takes (shards where ``parallel.tp == rollout.tp`` and ``rollout.sync_shards``) and the
full-tensor path.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field

from megatron_oar.commands.plan import moe as plan_moe
from megatron_oar.commands.plan.activations import _activation_memory, _train_microbatches
from megatron_oar.commands.plan.budget_search import LENGTH_STEP, at_length, longest_true, with_budgets
from megatron_oar.commands.plan.budgets import choose_token_budgets
from megatron_oar.commands.plan.hardware import GIB, Hardware
from megatron_oar.commands.plan.memory import (
    VLLM_OVERHEAD_GIB,
    _resident_memory,
    _vllm_memory,
    phase_bytes,
    trainer_phases,
)
from megatron_oar.commands.plan.params import active_params, stage_param_split, total_params
from megatron_oar.commands.plan.step_time import cp_kv_traffic, estimate_time
from megatron_oar.models import QwenArch, parse_arch
from megatron_oar.models.families import family_of
from megatron_oar.rollout.stage_send import largest_unit_bytes, separate_sync_traffic
from megatron_oar.rollout.weight_sync import expert_target, moe_layer_reload_bytes, sync_traffic
from megatron_oar.training.phases import NOTHING


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
    cp: dict = field(default_factory=dict)           # parallel.cp > 1: the K/V exchange (step_time.cp_kv_traffic)
    longest_response_tokens: int | None = None      # the longest response that fits (--response-tokens)
    warnings: list = field(default_factory=list)
    fits: bool = True
    reasons: list = field(default_factory=list)
    advice: list = field(default_factory=list)

    rollout_gpu_gib: float | None = None  # the separate placement: a rollout GPU's peak

    @property
    def rollout_peak_gib(self) -> float:
        """The largest phase while vLLM is (partly) awake: waking, syncing, generating; in the
        separate placement a rollout GPU's peak."""
        if self.rollout_gpu_gib is not None:
            return self.rollout_gpu_gib
        return max(g for k, g in self.phases_gib.items() if self.phase_vllm_holds[k] != NOTHING)

    @property
    def peak_gib(self) -> float:
        return max(max(self.phases_gib.values()), self.rollout_gpu_gib or 0.0)

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
    gpus = nodes * gpus_per_node
    world = cfg.rollout.training_world_size(gpus)  # the GPUs that train (all of them colocated)
    budgets = choose_token_budgets(cfg, hf_config, world=gpus, hw=hw, source=source)
    cfg = with_budgets(cfg, budgets.tokens)  # the unset ones chosen, the set ones kept
    m, par, t, r = cfg.model, cfg.parallel, cfg.train, cfg.rollout
    dp = world // (par.tp * par.pp * par.cp)  # the CP ranks of a DP rank share its rows
    prompt = prompt_tokens if prompt_tokens is not None else cfg.data.max_prompt_tokens
    resp = response_tokens if response_tokens is not None else r.max_new_tokens
    s = prompt + resp
    samples = t.prompts_per_step * t.group_size
    rows = samples // t.mini_batches // dp  # per rank per optimizer step
    microbatches = _train_microbatches(cfg, rows=rows, s=s)

    experts = plan_moe.expert_layout(a, world, par.tp, par.pp, par.ep, par.etp)
    mem = _resident_memory(cfg, a, dp * par.cp, experts["edp"])
    resident = sum(mem.values())
    act = _activation_memory(cfg, a, s=s, dp=dp, samples=samples, microbatches=microbatches)
    mem.update({f"activations: {k}": v for k, v in act.items()})
    v = _vllm_memory(cfg, a, hw, world=r.ranks if r.separate else world, samples=samples)
    sync = _sync_traffic(cfg, a, world)
    # the separate placement: vLLM's reload holds the MoE layer on a rollout GPU, not here
    phases = phase_bytes(cfg, hw, resident=resident, act=act, vllm=v,
                         moe_layer_reload=0.0 if r.separate else sync["moe_layer_reload_gib"] * GIB,
                         bucket=sync["bucket_gib"] * GIB)
    plan = Plan(
        model=f"{family_of(a).name}, {a.num_layers} layers, hidden {a.hidden_size}",
        source=source, params_b=total_params(a) / 1e9, active_params_b=active_params(a) / 1e9,
        layout={"nodes": nodes, "gpus": gpus, "training_gpus": world, "placement": r.placement,
                "rollout_gpus": r.ranks if r.separate else world, "max_staleness": r.max_staleness,
                "tp": par.tp, "pp": par.pp, "cp": par.cp, "dp": dp,
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
    if r.separate:  # a rollout GPU: the engine's share, a received bucket (the largest tensor's
        # when past rollout.bucket_mb), one MoE layer as vLLM's reload holds it, the reserve
        plan.rollout_gpu_gib = v["share"] / GIB + sync["bucket_gib"] + sync["moe_layer_reload_gib"] + hw.reserve_gib
    _verdict(plan, cfg, hw, v)
    if not plan.fits:
        plan.advice = _advice(plan, cfg, mem, act["update"], act["attribution"])
    plan.flops, plan.time_s = estimate_time(
        cfg, a, hw, world=world, samples=samples, prompt=prompt, resp=resp,
        longest=cfg.data.max_prompt_tokens + r.max_new_tokens, engines=v["engines"],
        concurrent=max(1, v["concurrent"]), kv_per_token=v["kv_per_token"], vllm_weights=v["weights"],
        gpus_per_node=gpus_per_node)
    plan.cp = cp_kv_traffic(cfg, a, hw, world=world, samples=samples, s=s, gpus_per_node=gpus_per_node,
                            longest=cfg.data.max_prompt_tokens + r.max_new_tokens, resp=resp)
    if r.separate:
        plan.time_s = separate_step_time(plan.time_s, r.max_staleness,
                                         broadcast_s=total_params(a) * 2 / (hw.net_gb_s * 1e9))
    return plan


def separate_step_time(time_s: dict, max_staleness: int, *, broadcast_s: float) -> dict:
    """The separate placement's step: Megatron's passes on the training GPUs and generation on
    the rollout GPUs, plus the weight broadcast (``sync``: the bf16 model over one link from
    training rank 0). At ``max_staleness`` 0 they take turns (the sum); from 1 on the next batch
    is generated while this one trains: the slower of the two, plus the broadcast."""
    out = {**{k: v for k, v in time_s.items() if k != "total"}, "sync": broadcast_s}
    train = sum(v for k, v in out.items() if k not in ("generate", "sync"))
    gen = out.get("generate", 0.0)
    out["total"] = (max(gen, train) if max_staleness else gen + train) + broadcast_s
    return out


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
    0 when not even ``LENGTH_STEP`` tokens do. A model with fewer positions after the prompt than
    ``LENGTH_STEP`` (the tiny configs) is searched token by token up to them."""
    a = parse_arch(hf_config, source=kw.get("source", "config.json"))
    hi = a.max_position_embeddings - cfg.data.max_prompt_tokens
    step = LENGTH_STEP if hi >= LENGTH_STEP else 1
    return longest_true(lambda n: make_plan(at_length(cfg, n), hf_config, **kw).fits, hi, step)


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


def _sync_traffic(cfg, a: QwenArch, world: int) -> dict:
    """GiB one rank receives per weight sync (the worst pipeline stage), on the path the config
    takes and on the full-tensor path; ``expert_tp``: the vLLM TP slices the experts travel in
    (1: whole); ``moe_layer_reload_gib``: one MoE layer's experts as vLLM's reload holds them;
    ``bucket_gib``: the largest bucket (``rollout.bucket_mb``, or the largest tensor past it).

    The separate placement (``rollout.placement=separate``) has a path of its own
    (``rollout/stage_send.py``): each stage's first rank gathers its stage's TP shards (and
    experts) and sends them whole (``tp_gather``, ``ep_gather``: that rank's; no PP broadcast,
    no other training rank receives anything); each rollout rank receives the whole model
    (``rollout_rank_gib``); the experts travel whole, so vLLM's reload holds whole ones."""
    par, r = cfg.parallel, cfg.rollout
    wbytes = 4 if cfg.model.dtype == "fp32" else 2
    bucket = max(r.bucket_bytes, largest_unit_bytes(a, wbytes, cfg.model.vocab_multiple, ep=par.ep)) / GIB
    if r.separate:
        t = separate_sync_traffic(a, tp=par.tp, pp=par.pp, dtype_bytes=wbytes,
                                  vocab_multiple=cfg.model.vocab_multiple, ep=par.ep, etp=par.etp)
        stages = sync_traffic(a, tp=par.tp, pp=par.pp, dtype_bytes=wbytes, shards=False,
                              vocab_multiple=cfg.model.vocab_multiple, ep=par.ep, etp=par.etp)
        worst = max(stages, key=lambda x: x["tp_gather"] + x["ep_gather"])
        out = {"placement": "separate", "shards": False, "expert_tp": 1, "tp_gather": worst["tp_gather"] / GIB,
               "pp_broadcast": 0.0, "total": t["sender_gather"] / GIB, "rollout_rank_gib": t["rollout_rank"] / GIB,
               "bucket_gib": bucket, "moe_layer_reload_gib": moe_layer_reload_bytes(a, wbytes, 1) / GIB}
        if a.is_moe:
            out["ep_gather"] = worst["ep_gather"] / GIB
        return out

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
            "full_tensors_gib": worst(False, 1)["total"], "bucket_gib": bucket,
            "moe_layer_reload_gib": moe_layer_reload_bytes(a, wbytes, expert_tp) / GIB}


def _verdict(plan: Plan, cfg, hw: Hardware, v: dict[str, float]) -> None:
    """Sets ``plan.fits`` and its reasons: a phase over the GPU's memory, or a vLLM share that
    leaves too little KV cache."""
    r, cap = cfg.rollout, hw.gpu_mem_gib
    over = {phase: gib for phase, gib in plan.phases_gib.items() if gib > cap}
    if plan.rollout_gpu_gib is not None and plan.rollout_gpu_gib > cap:
        plan.fits = False
        plan.reasons.append(
            f"a rollout GPU needs {plan.rollout_gpu_gib:.1f} GiB > {cap:g} GiB "
            f"(rollout.gpu_memory_utilization={r.gpu_memory_utilization}, a received bucket of "
            f"{plan.sync['bucket_gib']:.2f} GiB (rollout.bucket_mb={r.bucket_mb:g}, or the largest tensor)"
            + (f", one MoE layer of {plan.sync['moe_layer_reload_gib']:.2f} GiB as vLLM's reload holds it"
               if plan.sync.get("moe_layer_reload_gib") else "")
            + " and the reserve): lower rollout.gpu_memory_utilization")
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


def cp_refusals(cfg) -> list[str]:
    """What in ``cfg`` does not run under context parallelism yet (the config's own refusals,
    ``config._cp_unsupported``): empty when ``parallel.cp > 1`` would run."""
    from megatron_oar.config import _cp_unsupported

    return _cp_unsupported(cfg)


def _advice(plan, cfg, mem, act_update, act_attr) -> list[str]:
    tips = []
    if plan.train_peak_gib >= plan.rollout_peak_gib:
        at, s = cfg.attribution_config(), plan.layout["seq_len"]
        if act_attr >= act_update and at.batching == "padded" and at.micro_batch_size > 1:
            tips.append("lower attribution.micro_batch_size")
        if act_attr >= act_update and at.batching == "token_budget" and at.max_tokens_per_micro_batch > s:
            tips.append("lower attribution.max_tokens_per_micro_batch "
                        f"(now {at.max_tokens_per_micro_batch} tokens)")
        if cfg.model.recompute != "full":
            tips.append("model.recompute=full")
        if not cfg.parallel.sequence_parallel and cfg.parallel.tp > 1:
            tips.append("parallel.sequence_parallel=true")
        if cfg.train.batching == "padded" and cfg.train.micro_batch_size > 1:
            tips.append("a smaller train.micro_batch_size")
        if cfg.train.batching != "padded" and cfg.micro_batch_tokens > s:
            tips.append(f"a smaller train.max_tokens_per_micro_batch (now {cfg.micro_batch_tokens} tokens)")
        if cfg.parallel.cp == 1:
            why = cp_refusals(cfg)
            tips.append("parallel.cp=2 or 4 (each rank runs 1/CP of a row)" if not why else
                        f"not parallel.cp yet: it does not run with {'; '.join(why)}")
    else:
        tips.append("a smaller rollout.gpu_memory_utilization (if the KV cache still holds a "
                    "sequence)")
    if mem["optimizer"] + mem["gradients"] > 0.3 * plan.hardware["gpu_mem_gib"] * GIB:
        tips.append("more model parallelism (parallel.tp / parallel.pp"
                    + (" / parallel.ep" if plan.moe else "") + ") or more nodes")
    return tips
