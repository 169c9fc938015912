"""Forward passes through megatron-core's own pipeline schedule.

``forward_map`` runs ``get_forward_backward_func()`` (forward only) over micro-batches and
applies a function to each micro-batch's vocab-parallel logits on the last pipeline stage;
other stages get ``None``. ``forward_logits`` uses it for the full-vocabulary logits (gathered
over TP, padded rows dropped; converter verify, tests), the rollout sync check for token
log-probs. Attribution passes use the same schedule with their own loss functions.

Tokens are right-padded to the model's sequence multiple (``models.padding``) and the logits
trimmed back before ``fn`` sees them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

from megatron_oar.models.padding import pad_to, padded_length, sequence_multiple, trim


def position_ids_for(tokens: torch.Tensor) -> torch.Tensor:
    return torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand_as(tokens)


@torch.no_grad()
def forward_map(model, tokens: torch.Tensor, fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                micro_batch_size: int | None = None) -> torch.Tensor | None:
    """``cat(fn(logits, micro_tokens))`` over micro-batches of ``tokens [B, S]``, forward only.

    ``logits`` are the vocab-parallel ``[mbs, S, V/TP]`` logits of one micro-batch (the pass runs
    on tokens padded to the model's sequence multiple, trimmed back to ``S`` for ``fn``). Runs in
    eval mode (the previous mode is restored); the result is on the last pipeline stage, else None.
    """
    b, s = tokens.shape
    mbs = micro_batch_size or b
    if b % mbs:
        raise ValueError(f"batch {b} is not divisible by micro_batch_size {mbs}")
    length = padded_length(s, sequence_multiple(model.config))
    micro = list(torch.split(pad_to(tokens, length), mbs))
    outputs: list[torch.Tensor] = []

    def step(data_iter, m):
        batch = next(data_iter)
        logits = m(batch, position_ids_for(batch), attention_mask=None)

        def collect(out):
            outputs.append(fn(trim(out, s), trim(batch, s)))
            return torch.zeros((), device=out.device), {}

        return logits, collect

    was_training = model.training
    model.eval()
    try:
        get_forward_backward_func()(
            forward_step_func=step,
            data_iterator=iter(micro),
            model=[model],
            num_microbatches=len(micro),
            seq_length=length,
            micro_batch_size=mbs,
            forward_only=True,
        )
    finally:
        model.train(was_training)
    if not parallel_state.is_pipeline_last_stage():
        return None
    return torch.cat(outputs)


def forward_logits(model, tokens: torch.Tensor, micro_batch_size: int | None = None,
                   vocab_size: int | None = None) -> torch.Tensor | None:
    """Logits ``[B, S, vocab]`` for ``tokens [B, S]`` (identical on every rank's input)."""

    def gather(out, _):
        full = gather_from_tensor_model_parallel_region(out)
        return full if vocab_size is None else full[..., :vocab_size]

    return forward_map(model, tokens, gather, micro_batch_size)
