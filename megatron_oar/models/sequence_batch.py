"""The token batch every Megatron pass works on: attribution takes a ``SequenceBatch``, the
trainer's passes a ``TrainBatch`` (``training/inputs.py``), which is one with training tensors.

Each row is ``prompt + response`` starting at position 0 and right-padded to ``L``. Every
``[B, L]`` tensor in this package (importance, score masks) uses these full-sequence positions;
position ``p``'s logits predict token ``p + 1``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SequenceBatch:
    tokens: torch.Tensor  # [B, L] int64
    prompt_lens: torch.Tensor  # [B]: the response starts here
    lengths: torch.Tensor  # [B]: prompt + response, <= L
    sample_ids: torch.Tensor | None = None  # [B] stable ids (noise seeds); default 0..B-1
    # [B] bool: generation stopped at the length limit (vLLM finish_reason "length", no EOS);
    # the probe sites read no outcome at a truncation point. Default: none truncated
    truncated: torch.Tensor | None = None

    def __post_init__(self) -> None:
        b, length = self.tokens.shape
        if self.prompt_lens.shape != (b,) or self.lengths.shape != (b,):
            raise ValueError(f"prompt_lens and lengths must be [{b}], got "
                             f"{tuple(self.prompt_lens.shape)} and {tuple(self.lengths.shape)}")
        if (self.lengths > length).any() or (self.prompt_lens < 1).any() \
                or (self.prompt_lens > self.lengths).any():
            raise ValueError("need 1 <= prompt_len <= length <= tokens.shape[1] on every row")
        if self.sample_ids is None:
            self.sample_ids = torch.arange(b)
        if self.truncated is None:
            self.truncated = torch.zeros(b, dtype=torch.bool)
        self.truncated = torch.as_tensor(self.truncated, dtype=torch.bool).cpu()
        if self.truncated.shape != (b,):
            raise ValueError(f"truncated must be [{b}], got {tuple(self.truncated.shape)}")

    @property
    def size(self) -> int:
        return self.tokens.shape[0]

    def positions(self) -> torch.Tensor:
        return torch.arange(self.tokens.shape[1], device=self.tokens.device).expand_as(self.tokens)

    def response_mask(self) -> torch.Tensor:
        """[B, L] True on response tokens."""
        pos = self.positions()
        return (pos >= self.prompt_lens.unsqueeze(-1)) & (pos < self.lengths.unsqueeze(-1))

    def response_ids(self, row: int) -> list[int]:
        return self.tokens[row, int(self.prompt_lens[row]):int(self.lengths[row])].tolist()
