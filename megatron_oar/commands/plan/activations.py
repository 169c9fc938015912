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
- context parallelism (``parallel.cp``, ``models/context_parallel.py``): a row's tokens are
  split over the CP ranks, each running ``padded row / CP`` of them (:func:`cp_local_tokens`),
  so every per-layer term and the logits are taken at that length. Attention adds the K/V of
  other ranks' tokens (:func:`cp_kv_bytes`): under the local spec's SDPA each rank gathers the
  whole row's K/V of the layer it runs (``2 x kv_heads/TP x head_dim x 2 bytes x s``), and in
  the backward their gradient as much again; SDPA saves the gathered K/V for the backward, so
  without recompute every layer keeps it. Under the TE spec (ring attention, p2p) a rank holds
  two blocks of ``s / CP`` tokens' K/V at a time (the one it attends to and the one arriving),
  and in the backward their gradients. The per-token values gathered back to the whole row
  (log-prob and entropy, fp32) add ``8 x s`` bytes per row. The attribution passes run under CP
  as the update does: OAR-G's layers at ``padded row / CP`` tokens with the whole row's K/V (as
  the update's, under its recompute), its fp32 input-embedding gradient of this rank's tokens
  only, and the probes read from the last stage's hidden states gathered over CP
  (:func:`cp_probe_hidden_bytes`: the whole rows' hidden states, bf16, and in OAR-G's backward
  their gradient); OAR-P's copies (and the teacher) one layer at a time at ``padded row / CP``
  tokens, with the forward's K/V and the gathered hidden states.
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


def cp_local_tokens(s: int, cp: int) -> int:
    """The tokens one CP rank runs of a row of ``s``: the row padded to a multiple of ``2 x CP``,
    over ``CP`` (``s`` itself at ``CP = 1``)."""
    return s if cp == 1 else math.ceil(s / (2 * cp)) * 2


def kv_bytes_per_token(a: QwenArch, tp: int) -> int:
    """K and V of one token in one layer per TP rank, 16-bit."""
    return 2 * max(1, a.num_kv_heads // tp) * a.head_dim * 2


def cp_kv_bytes(a: QwenArch, *, s: int, b: float, tp: int, cp: int, ring: bool, backward: bool) -> float:
    """The K/V (and in a ``backward`` their gradients) a CP rank holds beyond its own while one
    layer runs on ``b`` rows of ``s`` tokens: the whole rows' (local spec, SDPA over the
    all-gathered K/V) or two blocks of ``s / CP`` tokens (``ring``: TE's p2p). 0 at ``CP = 1``."""
    if cp == 1:
        return 0.0
    held = 2 * cp_local_tokens(s, cp) if ring else s
    return kv_bytes_per_token(a, tp) * held * b * (2 if backward else 1)


def cp_gathered_bytes(s: int, b: float, cp: int) -> float:
    """The per-token log-probs and entropies (fp32) gathered back to whole rows under CP."""
    return 0.0 if cp == 1 else 8.0 * s * b


def cp_probe_hidden_bytes(a: QwenArch, s: int, b: float, cp: int, backward: bool) -> float:
    """The last stage's hidden states of ``b`` whole rows of ``s`` tokens, gathered over CP so
    the attribution probes read wherever a row's answer lives (``attribution/schedule.py``,
    bf16), and in a ``backward`` (OAR-G) their gradient; 0 at ``CP = 1`` (the probes read the
    stage's own output)."""
    return 0.0 if cp == 1 else 2.0 * a.hidden_size * s * b * (2 if backward else 1)


def update_activation_bytes(a: QwenArch, *, s: int, b: float, tp: int, pp: int, sp: bool,
                            flash: bool, recompute: str | None, microbatches: int,
                            etp: int = 1, cp: int = 1, ring: bool = True) -> float:
    """Bytes the update keeps for ``b`` rows of ``s`` tokens per micro-batch (``cp``: split over
    that many CP ranks, ``ring``: TE's ring attention, else the local spec's gathered K/V)."""
    layers = a.num_layers // pp
    in_flight = min(pp, microbatches)
    sl = cp_local_tokens(s, cp)
    kv = cp_kv_bytes(a, s=s, b=b, tp=tp, cp=cp, ring=ring, backward=True)  # one layer at a time
    if recompute == "full":
        kept = 2 * a.hidden_size * sl * b / (tp if sp else 1) * layers * in_flight
        return kept + _one_layer_act_bytes(a, sl, b, tp, sp, flash, etp) + kv
    if cp > 1 and not ring and recompute is None:  # SDPA saves every layer's gathered K/V
        kv += kv_bytes_per_token(a, tp) * (s - sl) * b * layers * in_flight
    flash = flash or recompute == "selective"
    return _stage_act_bytes(a, sl, b, tp, pp, sp, flash, etp) * in_flight + kv


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


def cp_setup(cfg) -> tuple[int, bool]:
    """``(cp, ring)``: the CP size and whether attention is TE's ring (the TE spec's attention;
    ``model.spec: auto`` plans for a GPU cluster, where it is the TE spec) rather than SDPA over
    the all-gathered K/V."""
    from megatron_oar.models.builder import resolve_attention

    m = cfg.model
    return cfg.parallel.cp, resolve_attention(m.attention, "local" if m.spec == "local" else "te") == "te"


def _train_activations(cfg, a: QwenArch, *, s: int, mbs: float, microbatches: int) -> tuple[float, float]:
    """``(update, old-logprob)`` activation bytes for micro-batches of ``mbs`` full-length rows."""
    tp, pp, sp, flash, etp = _act_setup(cfg)
    cp, ring = cp_setup(cfg)
    chunk, vm = cfg.train.logits_chunk_tokens, cfg.model.vocab_multiple
    sl = cp_local_tokens(s, cp)  # this rank's tokens of each row
    logits = logits_bytes(a, sl, mbs, tp, vm, chunk) + cp_gathered_bytes(s, mbs, cp)
    update = update_activation_bytes(a, s=s, b=mbs, tp=tp, pp=pp, sp=sp, flash=flash,
                                     recompute=cfg.model.recompute, microbatches=microbatches, etp=etp,
                                     cp=cp, ring=ring) + logits
    forward = (_one_layer_act_bytes(a, sl, mbs, tp, sp, flash, etp) + logits
               + cp_kv_bytes(a, s=s, b=mbs, tp=tp, cp=cp, ring=ring, backward=False))
    return update, forward


def _oar_g_activations(cfg, a: QwenArch, *, s: int, seqs: float, samples: int, dp: int) -> float:
    """OAR-G: a forward keeping activations for the input-gradient backward under the update's
    recompute (``model.recompute``), ``seqs`` full-length rows per micro-batch, plus the fp32
    input-embedding gradient (of this CP rank's tokens) and, under CP, the gathered hidden
    states the probes read."""
    tp, pp, sp, flash, etp = _act_setup(cfg)
    cp, ring = cp_setup(cfg)
    microbatches = max(1, math.ceil(samples / (seqs * dp)))
    return (update_activation_bytes(a, s=s, b=seqs, tp=tp, pp=pp, sp=sp, flash=flash,
                                    recompute=cfg.model.recompute, microbatches=microbatches, etp=etp,
                                    cp=cp, ring=ring)
            + 4.0 * cp_local_tokens(s, cp) * seqs * a.hidden_size
            + cp_probe_hidden_bytes(a, s, seqs, cp, backward=True))


def _oar_p_activations(cfg, a: QwenArch, *, s: int, copies: float) -> float:
    """OAR-P: forward only over ``copies`` full-length masked copies, one layer at a time (under
    CP: this rank's tokens of each, the whole copies' K/V and gathered hidden states)."""
    tp, _, sp, flash, etp = _act_setup(cfg)
    cp, ring = cp_setup(cfg)
    return (_one_layer_act_bytes(a, cp_local_tokens(s, cp), copies, tp, sp, flash, etp)
            + cp_kv_bytes(a, s=s, b=copies, tp=tp, cp=cp, ring=ring, backward=False)
            + cp_probe_hidden_bytes(a, s, copies, cp, backward=False))


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
