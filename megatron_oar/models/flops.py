"""Model FLOPs of the Megatron passes, for ``oar plan``'s time estimate and the trainer's MFU.

The usual accounting (Megatron-LM, PaLM's MFU): a forward costs 2 FLOPs per matmul parameter per
token (the decoder layers' linears and the output layer; embeddings and norms are not matmuls)
plus causal attention, ``QK^T`` and ``AV`` at 2 FLOPs per multiply-add over a mean context of
half the sequence: ``2 * layers * heads * head_dim * n^2`` for a sequence of ``n`` tokens. A full
backward costs 2 forwards; OAR-G's input-gradient-only backward 1 (no weight gradients).
Activation recompute is not counted (MFU counts the model's FLOPs, not the hardware's).

A mixture-of-experts layer counts the parameters a token's matmuls use, its *active* ones: the
router (``num_experts x hidden``) and the ``moe_topk`` experts the token is routed to, not the
others. The MFU of a MoE model is therefore measured against its active parameters (the usual
MoE accounting: a model's FLOPs are those of the parameters a token activates). Routing
weights, permutation and the dispatcher's communication are not counted.
"""

from __future__ import annotations

from collections.abc import Iterable

from megatron_oar.models.arch import QwenArch

# dense bf16 peak TFLOP/s per GPU by device name (NVIDIA datasheets, SXM parts; no sparsity)
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "H800": 989.0, "A100": 312.0, "A800": 312.0,
               "B200": 2250.0, "GB200": 2500.0, "L40S": 362.0}


def attention_weights(a: QwenArch) -> int:
    """Weights of one decoder layer's attention linears, whole (QKV and the output projection)."""
    qkv = (a.num_heads + 2 * a.num_kv_heads) * a.head_dim
    return a.hidden_size * qkv + a.num_heads * a.head_dim * a.hidden_size


def mlp_weights(a: QwenArch, width: int) -> int:
    """Weights of one SwiGLU MLP of ``width`` (gated FC1 and FC2): a dense layer's MLP
    (``intermediate_size``) or one expert (``moe_intermediate_size``)."""
    return 3 * a.hidden_size * width


def router_weights(a: QwenArch) -> int:
    """Weights of one MoE layer's router (``num_experts x hidden``; 0 for a dense model)."""
    return a.num_experts * a.hidden_size


def linear_weights(a: QwenArch) -> int:
    """Weights of one dense decoder layer's linears, whole (QKV, proj, gated FC1, FC2): the
    parameters its matmuls use, and what FP8 keeps extra copies of."""
    return attention_weights(a) + mlp_weights(a, a.intermediate_size)


def layer_matmul_params(a: QwenArch, i: int) -> int:
    """Parameters a token's matmuls use in decoder layer ``i``: a dense layer's linears, or for a
    MoE layer the attention, the router and the ``moe_topk`` experts it is routed to."""
    if not a.is_moe_layer(i):
        return linear_weights(a)
    return (attention_weights(a) + router_weights(a)
            + a.moe_topk * mlp_weights(a, a.moe_intermediate_size))


def matmul_params(a: QwenArch) -> int:
    """Parameters taking part in a token's matmuls (layers' linears and the output layer); for a
    MoE model its active ones (the top-k experts, not all of them)."""
    return sum(layer_matmul_params(a, i) for i in range(a.num_layers)) + a.vocab_size * a.hidden_size


def forward_flops(a: QwenArch, lengths: Iterable[int], output_positions: int | None = None) -> float:
    """FLOPs of one forward over sequences of ``lengths`` tokens; ``output_positions``: the
    number of positions the output layer runs at (default: every token; the attribution passes
    compute logits at the probe positions only)."""
    lengths = list(lengths)
    tokens = sum(lengths)
    skipped = 0 if output_positions is None else tokens - output_positions
    return (2.0 * matmul_params(a) * tokens - 2.0 * a.vocab_size * a.hidden_size * skipped
            + 2.0 * a.num_layers * a.num_heads * a.head_dim * sum(n * n for n in lengths))


def peak_tflops(device_name: str) -> float | None:
    """The dense bf16 peak of a GPU named ``device_name`` (``torch.cuda.get_device_name``),
    None for anything not in :data:`PEAK_TFLOPS` (and for CPUs)."""
    upper = device_name.upper()
    for name in sorted(PEAK_TFLOPS, key=len, reverse=True):  # GB200 before B200
        if name in upper:
            return PEAK_TFLOPS[name]
    return None
