"""Token log-probs and entropies from last-stage hidden states, the logits one chunk at a time.

The output layer (megatron's ``output_layer``, a vocab-parallel ``ColumnParallelLinear``; the
embedding weight when tied on the first stage) and the vocab-parallel softmax statistics run over
``chunk`` positions at a time (``train.logits_chunk_tokens``): a chunk's ``[chunk, V/TP]`` logits
exist only while its statistics are taken, in the forward and again in the backward, where they
are recomputed from the hidden states instead of being stored. Peak logits memory is then
O(chunk x V/TP) whatever the micro-batch (the unchunked path holds ``[tokens, V/TP]`` logits in
the model dtype, their float32 copy and the autograd intermediates of the softmax).

:func:`full_hidden` turns the model's ``[s, b, h]`` output (``post_process`` off:
:func:`hidden_states_out`) into ``[b, s, h]`` as megatron's output layer sees it: gathered over
the sequence under sequence parallelism (its backward reduce-scatters, summing the TP ranks'
partial input gradients), else copied into the TP region (backward all-reduce). The statistics
are exact for the full vocabulary across TP ranks and never include the padded vocabulary rows.

:class:`ChunkedTokenStats` has an analytic backward (no collective in it): with ``z`` a chunk's
logits divided by the sampling temperature ``T``, ``p = softmax(z)``, ``d lp/dz = onehot(target) - p``
and ``d H/dz = -p (log p + H)``, and the raw logits' gradient is that over ``T``.
The output weight's gradient is accumulated chunk by chunk in place: into the weight's
``main_grad`` where megatron's DDP gives it one (its float32 gradient buffer; the backward then
returns no weight gradient, so DDP's hook adds nothing twice, while a tied embedding's own
gradient still reaches ``main_grad`` through it), else into one float32 buffer returned in the
weight's dtype. No chunk makes a temporary of the weight's shape (``_add_weight_grad``: with a
float32 buffer and a bf16 model, the product is formed ``chunk`` vocabulary rows at a time, a
``[chunk, h]`` piece, smaller than the chunk's ``[chunk, V/TP]`` logits). This relies on
``overlap_grad_reduce=False`` (``training.policy``): with it on, megatron's hook asserts that a
gradient arrived.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.tensor_parallel import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)

from megatron_oar.models import vocab_parallel as vp
from megatron_oar.models.parallel import unwrap

# train.logits_chunk_tokens' default: a [4096, 152k / TP] float32 chunk is 2.3 GiB at TP 1, and
# a few of them (logits, probabilities, their gradient) live at once in the backward.
DEFAULT_CHUNK_TOKENS = 4096


def output_weight(gpt) -> torch.Tensor:
    """The output layer's vocab-parallel weight ``[V/TP, h]`` (the embedding's when tied and on
    the first stage). Not ``shared_embedding_or_output_weight()``: that looks at
    ``post_process``, which :func:`hidden_states_out` switches off."""
    if gpt.share_embeddings_and_output_weights and gpt.pre_process:
        return gpt.embedding.word_embeddings.weight
    return gpt.output_layer.weight


@contextlib.contextmanager
def hidden_states_out(model, on: bool = True):
    """While inside, the last pipeline stage returns its final-norm hidden states ``[s, b, h]``
    (sequence-scattered under SP) instead of logits: megatron-core's ``GPTModel._postprocess``
    returns them when ``post_process`` is off, before the output layer.

    ``post_process`` is back on while megatron's ``finalize_model_grads_func`` runs (the
    schedule calls it at the end of a training pass): with tied embeddings and pipeline
    parallelism it all-reduces the embedding's gradient over the first and last stages, and the
    last stage finds its copy through ``shared_embedding_or_output_weight()``, which returns
    None without ``post_process``: the last stage would skip the all-reduce the first stage
    waits in."""
    gpt = unwrap(model)
    config = gpt.config
    saved, finalize = gpt.post_process, config.finalize_model_grads_func
    if on:
        gpt.post_process = False
        if finalize is not None:
            config.finalize_model_grads_func = functools.partial(_as_built, gpt, saved, finalize)
    try:
        yield gpt
    finally:
        gpt.post_process = saved
        config.finalize_model_grads_func = finalize


def _as_built(gpt, post_process: bool, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` with ``gpt.post_process`` as built, then off again."""
    gpt.post_process = post_process
    try:
        return fn(*args, **kwargs)
    finally:
        gpt.post_process = False


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def full_hidden(gpt, hidden: torch.Tensor) -> torch.Tensor:
    """The model's ``[s, b, h]`` last-stage output as ``[b, s, h]`` over the whole sequence, in
    the output weight's dtype, with megatron's output-layer gradient semantics over TP."""
    hidden = hidden.to(output_weight(gpt).dtype)  # Float16Module hands the last stage fp32 back
    if gpt.config.sequence_parallel:
        hidden = gather_from_sequence_parallel_region(hidden)  # backward: reduce-scatter
    elif parallel_state.get_tensor_model_parallel_world_size() > 1:
        # backward: all-reduce. megatron-core 0.16's ``_reduce`` all-reduces ``grad.contiguous()``
        # and returns ``grad``: a non-contiguous gradient (the transpose's below, with more than
        # one row) would pass un-reduced, so the gradient reaching it is made contiguous first.
        hidden = _ContiguousGrad.apply(copy_to_tensor_model_parallel_region(hidden))
    return hidden.transpose(0, 1)


def _local_vocab(weight: torch.Tensor, vocab_size: int) -> tuple[int, int]:
    """``(start, valid)``: where this TP rank's vocabulary slice starts and how many of its rows
    are real (the rest pad the vocabulary)."""
    start = vp.vocab_slice(weight.shape[0])[0]
    return start, max(0, min(weight.shape[0], vocab_size - start))


def _local_targets(targets: torch.Tensor, start: int, valid: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(t, here)``: the targets as indices into this rank's real rows, and which are there."""
    t = targets - start
    return t, (t >= 0) & (t < valid)


def _tp_reduce(x: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        dist.all_reduce(x, op=op, group=parallel_state.get_tensor_model_parallel_group())
    return x


def _logits(hidden: torch.Tensor, weight: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """float32 logits of one chunk over the rank's real rows (``weight`` already cut to them),
    divided by ``temperature``."""
    z = F.linear(hidden, weight).float()
    return z if temperature == 1.0 else z.div_(temperature)


class ChunkedTokenStats(torch.autograd.Function):
    """``(log p(target), entropy)`` per row of ``hidden [N, h]`` under ``weight [V/TP, h]`` of
    ``softmax(logits / temperature)``, ``chunk`` rows at a time; all-reduced over TP; entropy is
    zeros unless ``with_entropy``."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, vocab_size: int, chunk: int, with_entropy: bool,
                temperature: float = 1.0):
        n = hidden.shape[0]
        start, valid = _local_vocab(weight, vocab_size)
        real = weight[:valid]
        f32 = dict(dtype=torch.float32, device=hidden.device)
        lp, ent = torch.zeros(n, **f32), torch.zeros(n, **f32)
        lse = torch.zeros(n, **f32)
        for a in range(0, n, chunk):
            b = min(n, a + chunk)
            z = _logits(hidden[a:b], real, temperature)  # [c, valid]
            m = z.amax(dim=-1) if valid else torch.full((b - a,), float("-inf"), **f32)
            m = _tp_reduce(m, dist.ReduceOp.MAX)
            z -= m.unsqueeze(-1)  # shifted
            e = z.exp()
            t, here = _local_targets(targets[a:b], start, valid)
            picked = (z.gather(-1, t.clamp(0, max(valid - 1, 0)).unsqueeze(-1)).squeeze(-1) if valid
                      else torch.zeros(b - a, **f32))
            sums = torch.stack([e.sum(-1), torch.where(here, picked, torch.zeros_like(picked)),
                                (e * z).sum(-1) if with_entropy else torch.zeros_like(picked)])
            sums = _tp_reduce(sums)
            lt = sums[0].log()
            lp[a:b] = sums[1] - lt
            if with_entropy:
                ent[a:b] = lt - sums[2] / sums[0]  # log sum e^(z-m) - E_p[z - m]
            lse[a:b] = lt + m
        ctx.save_for_backward(hidden, weight, targets, lse, ent)
        ctx.meta = (vocab_size, chunk, with_entropy, temperature)
        return lp, ent

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        hidden, weight, targets, lse, ent = ctx.saved_tensors
        vocab_size, chunk, with_entropy, temperature = ctx.meta
        n = hidden.shape[0]
        start, valid = _local_vocab(weight, vocab_size)
        real = weight[:valid]
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.zeros_like(hidden) if want_h else None
        into_main = want_w and getattr(weight, "main_grad", None) is not None
        if into_main:  # megatron's DDP gradient buffer: accumulated in place, nothing returned
            grad_w = weight.main_grad
        elif want_w:
            grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        else:
            grad_w = None

        none = (None,) * 5  # targets, vocab_size, chunk, with_entropy, temperature

        def result():
            w = None if grad_w is None or into_main else grad_w.to(weight.dtype)
            return grad_h, w, *none

        use_ent = with_entropy and g_ent is not None
        if valid == 0 or (g_lp is None and not use_ent):
            return result()
        for a in range(0, n, chunk):
            b = min(n, a + chunk)
            z = _logits(hidden[a:b], real, temperature)
            z -= lse[a:b].unsqueeze(-1)  # log p
            p = z.exp()
            if use_ent:  # d H / dz = -p (log p + H), H all-reduced in the forward
                g = z.add_(ent[a:b].unsqueeze(-1)).mul_(p).mul_(-g_ent[a:b].unsqueeze(-1))
            else:
                g = torch.zeros_like(p)
            if g_lp is not None:  # d lp / dz = onehot(target) - p
                gl = g_lp[a:b].unsqueeze(-1)
                g -= p.mul_(gl)
                t, here = _local_targets(targets[a:b], start, valid)
                rows = here.nonzero().squeeze(-1)
                g[rows, t[rows]] += gl[rows, 0]
            if temperature != 1.0:  # z = raw logits / temperature
                g.div_(temperature)
            g = g.to(weight.dtype)
            if want_h:
                grad_h[a:b] = g @ real
            if want_w:
                _add_weight_grad(grad_w[:valid], g, hidden[a:b], chunk)
        return result()


def _add_weight_grad(dest: torch.Tensor, g: torch.Tensor, hidden: torch.Tensor, block: int) -> None:
    """``dest += g^T @ hidden`` in place: ``dest [valid, h]`` (float32, or the model dtype), ``g
    [c, valid]`` and ``hidden [c, h]`` in the model dtype. One dtype throughout: ``addmm_`` into
    ``dest``, no temporary. A float32 ``dest`` with bf16/fp16 operands (``addmm_`` takes one dtype,
    and the GEMM with a float32 output, ``out_dtype``, is not in every torch's CUDA build):
    ``block`` vocabulary rows at a time, the ``[block, h]`` product in the operands' dtype (rounded
    as megatron's unfused weight gradient is) added into ``dest``."""
    if dest.dtype == hidden.dtype:
        dest.addmm_(g.t(), hidden)
        return
    for r in range(0, dest.shape[0], block):
        dest[r:r + block].add_(g[:, r:r + block].t() @ hidden)


def token_stats(gpt, hidden: torch.Tensor, targets: torch.Tensor, vocab_size: int, chunk: int,
                with_entropy: bool = True, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log p(target), entropy)`` of shape ``targets.shape`` from ``hidden [..., h]``
    (positions that predict ``targets``; :func:`full_hidden`), ``chunk`` positions at a time, of
    ``softmax(logits / temperature)`` (the rollout's sampling temperature)."""
    shape = targets.shape
    flat = hidden.reshape(-1, hidden.shape[-1])
    lp, ent = ChunkedTokenStats.apply(flat, output_weight(gpt), targets.reshape(-1), vocab_size, chunk,
                                      with_entropy, temperature)
    return lp.view(shape), ent.view(shape)


@torch.no_grad()
def map_logits(gpt, hidden: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor], chunk: int) -> torch.Tensor:
    """``fn(logits)`` of the vocab-parallel logits ``[c, V/TP]`` of ``hidden [..., h]``, ``chunk``
    positions at a time, reassembled to ``[..., *fn's trailing shape]`` (forward only)."""
    lead = hidden.shape[:-1]
    flat = hidden.reshape(-1, hidden.shape[-1])
    weight = output_weight(gpt)
    outs = [fn(F.linear(flat[a:a + chunk], weight)) for a in range(0, flat.shape[0], chunk)]
    out = torch.cat(outs)
    return out.view(*lead, *out.shape[1:])
