"""The token budgets a run uses, sized by ``oar plan``'s memory model: each budget's phase bytes
as a function of the budget (:func:`budget_specs`), handed to the searches of
:mod:`megatron_oar.commands.plan.budget_search` (:func:`choose_token_budgets`; ``oar plan`` and
``oar train`` both call it). A token budget holds max(budget, s) / s full-length rows (a longer
row runs alone).
"""

from __future__ import annotations

import math

from megatron_oar.commands.plan import moe as plan_moe
from megatron_oar.commands.plan.activations import (
    _oar_g_activations,
    _oar_p_activations,
    _train_activations,
    budget_rows,
)
from megatron_oar.commands.plan.budget_search import (
    ATTRIBUTION_BUDGET,
    COPY_BUDGET,
    TRAIN_BUDGET,
    BudgetChoice,
    BudgetSpec,
    choose_budgets,
)
from megatron_oar.commands.plan.hardware import GIB, Hardware
from megatron_oar.commands.plan.memory import _resident_memory, _vllm_memory
from megatron_oar.models import QwenArch, parse_arch


def budget_specs(cfg, a: QwenArch, *, world: int, hw: Hardware) -> tuple[list[BudgetSpec], int]:
    """The token budgets ``cfg`` runs with on ``world`` GPUs (all of them, the rollout ones too),
    each with the bytes per GPU of the phase it sizes as a
    function of the budget (Megatron's resident state, vLLM asleep, the reserve and the pass's
    activations), at the longest sequence the run can see (``data.max_prompt_tokens`` +
    ``rollout.max_new_tokens``); and that length. The training budget sizes the update and the
    old-logprob pass; the attribution budgets OAR-G's micro-batches (OAR-P: its teacher's forward,
    left to the training budget as before) and OAR-P's copies."""
    par, t = cfg.parallel, cfg.train
    world = cfg.rollout.training_world_size(world)  # rollout.placement=separate: the GPUs that train
    dp = world // (par.tp * par.pp * par.cp)  # the CP ranks of a DP rank share its rows
    s = cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens
    samples = t.prompts_per_step * t.group_size
    rows = samples // t.mini_batches // dp  # per rank per optimizer step
    experts = plan_moe.expert_layout(a, world, par.tp, par.pp, par.ep, par.etp)
    base = (sum(_resident_memory(cfg, a, dp * par.cp, experts["edp"]).values())
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
