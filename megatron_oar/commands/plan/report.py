"""``oar plan``'s output: one plan as tables, several as a summary table, and ``--table``'s rows
(a config at each response length, with the knob that makes it fit otherwise)."""

from __future__ import annotations

import copy

from megatron_oar.commands.plan.budget_search import ATTRIBUTION_BUDGET, COPY_BUDGET, TRAIN_BUDGET, at_length
from megatron_oar.commands.plan.hardware import Hardware
from megatron_oar.commands.plan.planner import (
    OAR_P_MAX_COST,
    Plan,
    cp_refusals,
    longest_response,
    make_plan,
    oar_p_over_cost,
)
from megatron_oar.models import parse_arch
from megatron_oar.training.phases import WEIGHTS_KV_CACHE


def render(plan: Plan, name: str) -> str:
    L, v, moe = plan.layout, plan.vllm, plan.moe
    active = f", {plan.active_params_b:.2f}B active" if moe else ""
    experts = f", EP {L['ep']} x ETP {L['etp']} (expert DP {L['edp']})" if moe else ""
    lines = [f"# plan: {name} ({plan.params_b:.2f}B parameters{active}, {plan.source})",
             f"{L['nodes']} node(s), {L['gpus']} GPUs of {plan.hardware['gpu_mem_gib']:g} GiB; "
             f"TP {L['tp']} x PP {L['pp']}{cp_part(L)} x DP {L['dp']}{experts}, "
             f"SP {'on' if L['sequence_parallel'] else 'off'}, "
             f"recompute {L['recompute'] or 'none'}, FP8 {L['fp8'] or 'off'}; vLLM TP {L['rollout_tp']} "
             f"({L['engines']} engines); sequences of {L['seq_len']} tokens, "
             f"{L['micro_batches_per_rank']} micro-batches per rank per optimizer step",
             *placement_lines(plan), "",
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
    if plan.cp:
        lines += [cp_line(plan), ""]
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


def placement_lines(plan: Plan) -> list[str]:
    """The separate placement: which GPUs do what, a rollout GPU's memory, the step's overlap."""
    L = plan.layout
    if L.get("placement") != "separate":
        return []
    t = plan.time_s
    train = sum(v for k, v in t.items() if k not in ("generate", "sync", "total"))
    how = ("one step off: the slower of generation and training, plus the broadcast"
           if L["max_staleness"] else "generation, then training, then the broadcast (max_staleness 0)")
    return [f"separate placement: {L['training_gpus']} training GPUs, {L['rollout_gpus']} rollout GPUs "
            f"({L['engines']} vLLM engines, awake throughout); a rollout GPU needs "
            f"{plan.rollout_gpu_gib:.1f} GiB; per step generation {t.get('generate', 0):.1f} s, "
            f"training {train:.1f} s, weight broadcast {t['sync']:.1f} s: {how} "
            f"(rollout.max_staleness={L['max_staleness']})"]


def cp_part(L: dict) -> str:
    """`` x CP n`` in the layout where ``parallel.cp > 1``."""
    return f" x CP {L['cp']}" if L.get("cp", 1) > 1 else ""


def cp_line(plan: Plan) -> str:
    """Context parallelism's K/V exchange: per layer and row, per step, and what it costs."""
    c, L = plan.cp, plan.layout
    gib = sum(c["step_gib"].values())
    sec = sum(c["seconds"].values())
    how = (f"{sec:.1f} s added to the step (the local spec's SDPA gathers K/V before attention: "
           "not overlapped)" if c["exposed"] else
           f"{sec:.1f} s of transfers assumed hidden behind attention (TE's ring attention)")
    return (f"context parallelism: CP {L['cp']}, each rank runs 1/{L['cp']} of every row; K/V exchange "
            f"{c['row_layer_mib']:.1f} MiB received per rank per layer of a full-length row (forward; "
            f"the backward as much), {gib:.1f} GiB per rank per step at {c['gb_s']:g} GB/s: {how}")


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
    if sync.get("placement") == "separate":
        line = (f"weight sync (separate placement): each stage's first rank gathers {sync['total']:.2f} GiB "
                f"(TP gather {sync['tp_gather']:.2f}"
                + (f", EP gather {sync['ep_gather']:.2f}" if "ep_gather" in sync else "")
                + f"), no other training rank receives any; each rollout rank receives "
                f"{sync['rollout_rank_gib']:.2f} GiB per step, in buckets of up to {sync['bucket_gib']:.2f} GiB")
        if sync.get("moe_layer_reload_gib"):
            line += f"; vLLM's reload holds {sync['moe_layer_reload_gib']:.2f} GiB of one MoE layer (experts whole)"
        return line
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
    cp = f", CP {L['cp']}" if L.get("cp", 1) > 1 else ""
    return (f"| {name} | {L['nodes']}x{L['gpus'] // L['nodes']} | {L['tp']}/{L['pp']}/{L['dp']}{cp}{experts} | "
            f"{L['rollout_tp']} | {model_states:.1f} | "
            f"{plan.rollout_peak_gib:.1f} | {plan.train_peak_gib:.1f} | "
            f"{plan.vllm['kv_tokens'] // 1000}k | {plan.time_s['total']:.0f} | "
            f"{'fits' if plan.fits else 'does not fit'} |")


SUMMARY_HEADER = ("| config | nodes x GPUs | TP/PP/DP | vLLM TP | weights+grads+Adam GiB | "
                  "rollout peak GiB | train peak GiB | KV tokens/engine | step s | verdict |\n"
                  "|---|---|---|---:|---:|---:|---:|---:|---:|---|")


TABLE_LENGTHS = (8192, 16384, 32768, 65536)
TABLE_HEADER = ("| config | longest response | response tokens | verdict | peak GiB | token budgets "
                "(train / OAR-G / OAR-P copies) | otherwise |\n|---|---:|---:|---|---:|---|---|")


CP_KNOBS = (2, 4)  # parallel.cp values --table tries, where the config runs under CP


def _knob_plans(cfg, hf_config: dict, *, nodes: int, gpus_per_node: int, **kw):
    """``(knob, plan)`` for the knobs :func:`length_rows` tries on a plan that does not fit, in
    order: sequence parallelism (TP > 1), full recompute, both, then context parallelism
    (``parallel.cp`` 2 and 4, each alone and with both; only where the config runs under CP:
    not a MoE model, not packed batching), then 2x and 4x the nodes (more data
    parallelism: less optimizer state per GPU) alone and with both; a knob the config already has,
    or a layout the batch does not divide into (or the config refuses), is skipped."""
    from megatron_oar.config import ConfigError, validate

    memory = [[]]
    if cfg.parallel.tp > 1 and not cfg.parallel.sequence_parallel:
        memory.append(["parallel.sequence_parallel=true"])
    if cfg.model.recompute != "full":
        memory.append(["model.recompute=full"])
    if len(memory) == 3:
        memory.append(memory[1] + memory[2])
    both = memory[-1]
    if cfg.parallel.cp == 1 and not cp_refusals(cfg):
        for cp in CP_KNOBS:
            memory += [[f"parallel.cp={cp}"]] + ([both + [f"parallel.cp={cp}"]] if both else [])
    for mult in (1, 2, 4):
        for knobs in (memory if mult == 1 else [[], both] if both else [[]]):
            if mult == 1 and not knobs:
                continue
            c = copy.deepcopy(cfg)
            for knob in knobs:
                key, value = knob.split("=")
                section, name = key.split(".")
                setattr(getattr(c, section), name,
                        True if value == "true" else int(value) if value.isdigit() else value)
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
            cp_note = ("CP 2/4, " if c.parallel.cp == 1 and not cp_refusals(c) else "")
            otherwise.append(f"needs {knob}" if knob else f"fits with none of SP, full recompute, {cp_note}"
                             "4x nodes: " + "; ".join(plan.reasons))
        cost = oar_p_over_cost(c, hf_config, plan, max_cost=oar_p_max_cost, **kw)
        if cost:
            otherwise.append(f"screened OAR-P: {cost['screened']:,.0f} s per step against exact OAR-P's "
                             f"{plan.time_s['total']:,.0f} s")
        rows.append(f"| {name} | {longest:,} | {n:,} | {'fits' if plan.fits else 'does not fit'} | "
                    f"{plan.peak_gib:.1f} | {budgets} | {'; '.join(otherwise) or '-'} |")
    return rows
