"""``oar plan``'s parameter counts: per decoder layer, per rank of a pipeline stage, and the
model's total and active parameters. Counted layer by layer exactly as megatron-core's
``GPTModel`` shards them (``tests/test_plan.py`` checks the count against a real model).
"""

from __future__ import annotations

from megatron_oar.commands.plan import moe as plan_moe
from megatron_oar.commands.plan.moe import expert_params
from megatron_oar.models import QwenArch
from megatron_oar.models.flops import attention_weights, linear_weights, mlp_weights, router_weights


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
