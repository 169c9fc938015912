"""``oar plan``: will a config fit its cluster, and how long will a step take?

Everything here is arithmetic on the config and the model's ``config.json`` (or its published
preset, :mod:`megatron_oar.models.presets`); nothing is allocated. One file per part:

* :mod:`.hardware`: the GPU planned for (memory, peak FLOP/s, HBM bandwidth, efficiencies).
* :mod:`.params`: parameters per layer and per rank of a pipeline stage, as megatron-core's
  ``GPTModel`` shards them; the model's total and active parameters.
* :mod:`.moe`: what a mixture-of-experts layer changes (experts per rank, expert DP, its
  activations, the dispatcher's bytes).
* :mod:`.activations`: what each Megatron pass keeps on the GPU (under context parallelism, a
  rank's ``1/CP`` of each row plus the K/V it gathers).
* :mod:`.memory`: memory per GPU in each phase of the trainer's loop (Megatron's resident
  state, the phase's working set, what vLLM holds then, the reserve).
* :mod:`.step_time`: time per phase of a step (FLOPs at a stated MFU, decode by a roofline,
  context parallelism's K/V exchange).
* :mod:`.budget_search` and :mod:`.budgets`: the searches (largest token budget that fits, longest
  response) and the token budgets sized by the memory model (``oar train`` chooses with them too).
* :mod:`.planner`: one config's :class:`Plan`: the above put together, the verdict, the advice,
  the weight sync's traffic, exact OAR-P's cost warning.
* :mod:`.report`: the plan as text, the summary and ``--table`` rows.
* :mod:`.command`: the ``oar plan`` command line.
"""

from megatron_oar.commands.plan.activations import budget_rows, logits_bytes, update_activation_bytes
from megatron_oar.commands.plan.budget_search import ATTRIBUTION_BUDGET, COPY_BUDGET, TRAIN_BUDGET, at_length
from megatron_oar.commands.plan.budgets import budget_specs, choose_token_budgets
from megatron_oar.commands.plan.command import main
from megatron_oar.commands.plan.hardware import GIB, Hardware
from megatron_oar.commands.plan.memory import VLLM_ASLEEP_GIB, VLLM_OVERHEAD_GIB, trainer_phases
from megatron_oar.commands.plan.params import (
    active_params,
    layer_param_split,
    layer_params,
    stage_param_split,
    stage_params,
    total_params,
)
from megatron_oar.commands.plan.planner import (
    OAR_P_MAX_COST,
    Plan,
    longest_response,
    make_plan,
    oar_p_cost_warning,
    oar_p_over_cost,
    plan_config,
    with_credit,
)
from megatron_oar.commands.plan.report import SUMMARY_HEADER, TABLE_HEADER, length_rows, render, summary_row

__all__ = [
    "ATTRIBUTION_BUDGET", "COPY_BUDGET", "GIB", "OAR_P_MAX_COST", "SUMMARY_HEADER", "TABLE_HEADER",
    "TRAIN_BUDGET", "VLLM_ASLEEP_GIB", "VLLM_OVERHEAD_GIB", "Hardware", "Plan", "active_params",
    "at_length", "budget_rows", "budget_specs", "choose_token_budgets", "layer_param_split", "layer_params",
    "length_rows", "logits_bytes", "longest_response", "main", "make_plan", "oar_p_cost_warning", "oar_p_over_cost",
    "plan_config", "render", "stage_param_split", "stage_params", "summary_row", "total_params",
    "trainer_phases", "update_activation_bytes", "with_credit",
]
