"""``oar plan``'s time per step, phase by phase.

Time per step, at worst-case lengths unless ``--response-tokens`` says otherwise (padded
micro-batches, ``train.batching`` / ``attribution.batching`` ``padded``, still process every
sequence at the longest length; token budgets at its own): Megatron passes as FLOPs
(``models/flops.py``) at a stated MFU (forward 2 FLOPs per matmul parameter per token plus causal attention
2*L*a*d*s; backward 2x forward; OAR-G's input-gradient-only backward 1x; full recompute one
more forward in the update's and OAR-G's backward; OAR-P one forward per scored token;
screened OAR-P OAR-G plus ``screen_fraction`` of OAR-P), generation by a roofline
over decode steps (weights and KV cache read once per step at a stated fraction of HBM bandwidth,
or compute-bound at the MFU).

Context parallelism (``parallel.cp``): the FLOPs of a row are split over its CP ranks (the rate
above is the whole world's, CP ranks included), and the passes that run under CP add the K/V
exchange (:func:`cp_kv_traffic`): per layer, row and pass, each rank receives
``(CP - 1)/CP x s x 2 x kv_heads/TP x head_dim x 2 bytes`` in the forward (all-gather) and as much
in the backward (the gradients' reduce-scatter), a recomputed forward gathers again (the
attribution pass too: OAR-G's forward, input-gradient backward and recompute, each OAR-P copy's
forward); at
``Hardware.intra_node_gb_s`` (NVLink) where the TP x CP ranks fit in a node, else at
``Hardware.net_gb_s``. Under the local spec (SDPA over the gathered K/V) the exchange is not
overlapped and adds its time to the pass; under the TE spec the ring passes K/V while attention
runs, and the plan assumes it hidden (it reports the traffic, adds no time).
"""

from __future__ import annotations

import math

from megatron_oar.commands.plan import moe as plan_moe
from megatron_oar.commands.plan.activations import cp_local_tokens, cp_setup, kv_bytes_per_token
from megatron_oar.commands.plan.hardware import Hardware
from megatron_oar.commands.plan.moe import expert_params
from megatron_oar.commands.plan.params import total_params
from megatron_oar.models import QwenArch
from megatron_oar.models.flops import forward_flops, matmul_params


def cp_kv_row_layer_bytes(a: QwenArch, *, s: int, tp: int, cp: int) -> float:
    """Bytes one CP rank receives in one layer's K/V all-gather for a row of ``s`` tokens
    (padded to a multiple of ``2 x CP``): the other ranks' ``(CP - 1)/CP`` of it."""
    padded = cp_local_tokens(s, cp) * cp
    return (cp - 1) / cp * padded * kv_bytes_per_token(a, tp)


def attribution_forwards(cfg, resp: int) -> float:
    """Forward-equivalents per row of the attribution pass (0 without attribution): OAR-G's
    noisy forward and input-gradient backward (and its recomputed forward under full recompute),
    OAR-P's one forward per scored token (upper bound: every response token), screened OAR-P
    OAR-G's and ``screen_fraction`` of OAR-P's."""
    if not cfg.uses_attribution:
        return 0.0
    at = cfg.attribution_config()
    oar_g = 2.0 + (1.0 if cfg.model.recompute == "full" else 0.0)
    if at.method == "oar_g":
        return oar_g
    if at.method == "oar_p_screened":  # OAR-G, then its top fraction
        return oar_g + math.ceil(at.screen_fraction * resp)
    return float(resp)


def cp_kv_traffic(cfg, a: QwenArch, hw: Hardware, *, world: int, samples: int, longest: int,
                  s: int, gpus_per_node: int, resp: int | None = None) -> dict:
    """Context parallelism's K/V exchange per step: ``{}`` at ``CP = 1``; else the bytes a rank
    receives per layer of one full-length row (forward), per step by pass (GiB), the bandwidth
    (GB/s), the seconds by pass, and whether they add to the step (``exposed``: the local spec).
    ``resp``: the response tokens (OAR-P's copies; default ``rollout.max_new_tokens``)."""
    par, t = cfg.parallel, cfg.train
    cp, ring = cp_setup(cfg)
    if cp == 1:
        return {}
    rows = samples / (world // (par.tp * par.pp * cp))  # every CP rank runs its DP rank's rows
    padded = {"logprob": t.batching == "padded", "update": t.batching == "padded",
              "attribution": cfg.attribution_config().batching == "padded"}
    per_layer = {k: cp_kv_row_layer_bytes(a, s=longest if p else s, tp=par.tp, cp=cp) for k, p in padded.items()}
    recompute = 1.0 if cfg.model.recompute == "full" else 0.0
    # forward gathers; a backward reduce-scatters as much; a recomputed forward gathers again
    # (the attribution pass: attribution_forwards counts them alike)
    units = {"logprob": 1.0 + (1.0 if cfg.loss.kl_coef > 0 else 0.0), "update": t.ppo_epochs * (2.0 + recompute),
             "attribution": attribution_forwards(cfg, cfg.rollout.max_new_tokens if resp is None else resp)}
    units = {k: u for k, u in units.items() if u}
    gb_s = hw.intra_node_gb_s if par.tp * cp <= gpus_per_node else hw.net_gb_s
    step = {k: u * rows * (a.num_layers / par.pp) * per_layer[k] for k, u in units.items()}
    return {"row_layer_mib": per_layer["update"] / 2 ** 20, "step_gib": {k: v / 2 ** 30 for k, v in step.items()},
            "gb_s": gb_s, "seconds": {k: v / (gb_s * 1e9) for k, v in step.items()}, "exposed": not ring}


def estimate_time(cfg, a: QwenArch, hw: Hardware, *, world, samples, prompt, resp, longest,
                  engines, concurrent, kv_per_token, vllm_weights, gpus_per_node: int = 8) -> tuple[dict, dict]:
    """``(flops, time_s)`` of one step by phase: PFLOP, and seconds (with their ``total``)."""
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
    recompute = 1.0 if cfg.model.recompute == "full" else 0.0  # one more forward in a backward
    fe = {"logprob": 1.0 + (1.0 if cfg.loss.kl_coef > 0 else 0.0),  # old-logprob (+ reference)
          "update": t.ppo_epochs * (3.0 + recompute), "attribution": attribution_forwards(cfg, resp)}
    megatron_flop = {k: v * fwd_seq[k] * samples for k, v in fe.items()}
    rate = world * hw.peak_tflops * 1e12 * hw.mfu
    times = {k: v / rate for k, v in megatron_flop.items()}
    cp = cp_kv_traffic(cfg, a, hw, world=world, samples=samples, longest=longest, s=s,
                       gpus_per_node=gpus_per_node, resp=resp)
    if cp.get("exposed"):
        for k, sec in cp["seconds"].items():
            times[k] += sec

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
    flops = {"generate": gen_flop / 1e15, **{k: v / 1e15 for k, v in megatron_flop.items()}}
    time_s = {k: v for k, v in times.items() if v > 0}
    time_s["total"] = sum(time_s.values())
    return flops, time_s
