"""Forward passes through megatron-core's own pipeline schedule.

``forward_logits`` runs ``get_forward_backward_func()`` (forward only) over micro-batches and
returns the full-vocabulary logits (gathered over TP, padded rows dropped) on the last
pipeline stage; other stages get ``None``. Used by the converter's verify and the tests; the
trainer and attribution passes use the same schedule with their own loss functions.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region


def position_ids_for(tokens: torch.Tensor) -> torch.Tensor:
    return torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand_as(tokens)


@torch.no_grad()
def forward_logits(model, tokens: torch.Tensor, micro_batch_size: int | None = None,
                   vocab_size: int | None = None) -> torch.Tensor | None:
    """Logits ``[B, S, vocab]`` for ``tokens [B, S]`` (identical on every rank's input)."""
    b, s = tokens.shape
    mbs = micro_batch_size or b
    if b % mbs:
        raise ValueError(f"batch {b} is not divisible by micro_batch_size {mbs}")
    micro = list(torch.split(tokens, mbs))
    outputs: list[torch.Tensor] = []

    def step(data_iter, m):
        batch = next(data_iter)
        logits = m(batch, position_ids_for(batch), attention_mask=None)

        def collect(out):
            full = gather_from_tensor_model_parallel_region(out)
            outputs.append(full if vocab_size is None else full[..., :vocab_size])
            return torch.zeros((), device=out.device), {}

        return logits, collect

    model.eval()
    get_forward_backward_func()(
        forward_step_func=step,
        data_iterator=iter(micro),
        model=[model],
        num_microbatches=len(micro),
        seq_length=s,
        micro_batch_size=mbs,
        forward_only=True,
    )
    if not parallel_state.is_pipeline_last_stage():
        return None
    return torch.cat(outputs)
