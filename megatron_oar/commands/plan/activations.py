"""``oar plan``'s activation bytes: what each Megatron pass keeps on the GPU while vLLM sleeps.

The passes that run while vLLM sleeps (the memory model, :mod:`megatron_oar.commands.plan.memory`,
takes the largest of them):

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
- OAR-G: a forward that keeps activations for one backward to the input embeddings, under the
  update's activation recompute (``model.recompute``: the pass runs in eval mode with megatron's
  recompute switched on, ``models/recompute.py``), so sized as the update's layers at
  ``attribution.max_tokens_per_micro_batch`` tokens of full-length rows (``padded``:
  ``attribution.micro_batch_size`` rows; an upper bound: megatron's frozen-weight linears keep
  no inputs), with ``min(pp, its micro-batches)`` in flight, plus the fp32 input-embedding
  gradient in place of the logits (the probes read a few positions): never more than the
  update's at the same token budget and micro-batches in flight.
- token budgets left unset are chosen per phase (:mod:`megatron_oar.commands.plan.budgets`),
  and a token budget holds max(budget, s) / s full-length rows (a longer row runs alone).
- OAR-P: forward only, ``attribution.max_tokens_per_copy_micro_batch`` tokens of masked
  copies (``padded``: ``attribution.perturb_micro_batch_size`` copies), one layer at a time.
- screened OAR-P: OAR-G's activations, then OAR-P's (the larger of the two).
"""

from __future__ import annotations

import math

from megatron_oar.commands.plan import moe as plan_moe
from megatron_oar.models import QwenArch


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
    """OAR-G: a forward keeping activations for the input-gradient backward under the update's
    recompute (``model.recompute``), ``seqs`` full-length rows per micro-batch, plus the fp32
    input-embedding gradient."""
    tp, pp, sp, flash, etp = _act_setup(cfg)
    microbatches = max(1, math.ceil(samples / (seqs * dp)))
    return (update_activation_bytes(a, s=s, b=seqs, tp=tp, pp=pp, sp=sp, flash=flash,
                                    recompute=cfg.model.recompute, microbatches=microbatches, etp=etp)
            + 4.0 * s * seqs * a.hidden_size)


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
