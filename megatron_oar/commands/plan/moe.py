"""``oar plan``'s arithmetic for mixture-of-experts models (Qwen3-MoE): what changes when a
decoder layer's MLP is megatron-core's ``MoELayer`` split over expert parallelism.

Each rank holds ``num_experts / EP`` experts of its stage's MoE layers, each split over ETP, next
to the dense parts split over TP; the experts' Adam state is split over the expert-data-parallel
group (world / (ETP x EP x PP)), the dense parts' over DP. A MoE layer's activations add the
router's and the routed copies'. The plan also prints the total and active parameters, the
experts' memory per GPU and the alltoall dispatcher's bytes per token and MoE layer; FLOPs count
the active parameters (``models/flops.py``), and decode reads the experts its tokens are routed
to.

Layout (megatron-core's "MoE parallel folding"): the attention, norms, router and embeddings are
split as in a dense model, over TP (and PP), and replicated over DP = world / (TP x PP); the
routed experts of a MoE layer are split over EP (``num_experts / EP`` whole experts per rank) and
each expert over ETP (expert tensor parallel, its ``moe_intermediate_size``), and replicated over
the expert-data-parallel group, EDP = world / (ETP x EP x PP). The router (``num_experts x
hidden``) is not split: every TP rank holds it whole. Megatron's distributed optimizer shards
each parameter's Adam state over the data-parallel group its gradients are reduced in: DP for
the dense parameters, EDP for the experts' (megatron-core's ``expert_data_parallel_group``).

Dispatcher: megatron's ``alltoall`` token dispatcher sends each token it holds (with sequence
parallelism, 1/TP of a micro-batch's) to its ``moe_topk`` experts' EP ranks and the experts'
outputs back (dispatch + combine); with uniform routing ``(EP-1)/EP`` of those copies leave the
rank. With ETP > 1 the received rows are all-gathered over the ETP group (and reduce-scattered
back). The backward moves the same bytes again.

Activations of a MoE layer, per token a rank holds, in 16-bit elements: the dense layer's norm
and attention terms (``activations._layer_act_bytes``), the router's fp32 logits and probabilities
(``2 x num_experts`` fp32), and per routed copy (``moe_topk`` of them, times ETP: each ETP rank
sees every row of its experts) the permuted input (``hidden``) and FC1's output and SwiGLU's
(``3 x moe_intermediate_size / ETP``).
"""

from __future__ import annotations

from megatron_oar.models.arch import QwenArch
from megatron_oar.models.flops import mlp_weights


def expert_layout(a: QwenArch, world: int, tp: int, pp: int, ep: int, etp: int | None) -> dict:
    """``{ep, etp, edp, experts_per_rank}`` of a layout (``etp`` None: megatron's default, TP)."""
    etp = tp if etp is None else etp
    return {"ep": ep, "etp": etp, "edp": world // (etp * ep * pp),
            "experts_per_rank": a.num_experts // ep}


def stage_layers(a: QwenArch, pp: int, stage: int) -> range:
    n = a.num_layers // pp
    return range(stage * n, (stage + 1) * n)


def moe_layers_in_stage(a: QwenArch, pp: int, stage: int) -> int:
    return sum(a.is_moe_layer(i) for i in stage_layers(a, pp, stage))


def expert_params(a: QwenArch, ep: int = 1, etp: int = 1) -> int:
    """The routed experts' parameters of one MoE layer on one rank (``num_experts / EP`` experts,
    each split over ETP)."""
    return (a.num_experts // ep) * mlp_weights(a, a.moe_intermediate_size) // etp


# ------------------------------------------------------------------------------ activations

def moe_mlp_act_bytes(a: QwenArch, s: int, b: float, tp: int, etp: int) -> float:
    """Bytes a MoE layer's router and experts keep for backward per rank, for ``b`` sequences of
    ``s`` tokens (the rank holds ``s*b/TP`` of them: MoE with TP needs sequence parallelism)."""
    per_token = (2 * 4 * a.num_experts                                     # fp32 logits, probs
                 + 2 * a.moe_topk * (etp * a.hidden_size + 3 * a.moe_intermediate_size))
    return per_token * s * b / tp


# ------------------------------------------------------------------------------ traffic

def dispatcher_bytes_per_token(a: QwenArch, ep: int, etp: int, dtype_bytes: int) -> dict:
    """Bytes one rank receives per token it holds and MoE layer, forward, with the ``alltoall``
    dispatcher at uniform routing: ``{all_to_all, etp_gather, total}`` (dispatch + combine)."""
    row = a.moe_topk * a.hidden_size * dtype_bytes
    a2a = 2 * row * (ep - 1) / ep
    gather = 2 * row * (etp - 1)
    return {"all_to_all": a2a, "etp_gather": gather, "total": a2a + gather}


def experts_read_fraction(a: QwenArch, concurrent: int) -> float:
    """The expected fraction of a MoE layer's experts one decode step reads when ``concurrent``
    tokens each pick ``moe_topk`` of ``num_experts`` (uniform routing)."""
    return 1.0 - (1.0 - a.moe_topk / a.num_experts) ** max(1, concurrent)

