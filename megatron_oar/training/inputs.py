"""What the trainer feeds Megatron: the training prompts and, each step, this DP rank's batch.

* :func:`load_examples`: the training problems of ``data`` (files, or the synthetic task's
  training side), checked against ``train.prompts_per_step``.
* :class:`TrainBatch`: a :class:`~megatron_oar.models.sequence_batch.SequenceBatch` (so the
  attribution passes take it as it is) with the training tensors: loss mask, vLLM's log-probs,
  the group advantage, and what the passes of the step fill in.
* :func:`build_train_batch`: a step's samples -> this DP rank's rows (``training.dp_split``) as one.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from megatron_oar.models.sequence_batch import SequenceBatch


def load_examples(cfg, tokenizer):
    """The training problems (``cfg``: a :class:`~megatron_oar.config.Config`)."""
    from megatron_oar.config import ConfigError
    from megatron_oar.data import make_arithmetic, read_examples

    d = cfg.data
    if d.synthetic is not None:  # the chain task: the training side of its hash split
        split = "train" if d.synthetic.task == "chain" else None
        return make_arithmetic(d.synthetic.n, d.synthetic.seed, d.synthetic, split=split)
    examples, stats = read_examples(d.train_files, d.field_map or d.fields, strict=d.strict,
                                    tokenizer=tokenizer, max_prompt_tokens=d.max_prompt_tokens,
                                    template=d.template, limit=d.limit)
    if len(examples) < cfg.train.prompts_per_step:
        raise ConfigError(f"data.train_files: {len(examples)} usable examples ({stats.malformed} "
                          f"malformed, {stats.too_long} too long), fewer than "
                          f"train.prompts_per_step={cfg.train.prompts_per_step}")
    return examples


@dataclass(kw_only=True)
class TrainBatch(SequenceBatch):
    """This DP rank's sequences of one step (prompt + response, right-padded); ``sample_ids``
    are the rows' indices in the step's global batch (OAR-G's noise seeds)."""

    loss_mask: torch.Tensor         # [B, L] response tokens that get a loss (overlong filter)
    rollout_logprobs: torch.Tensor  # [B, L] vLLM's log-probs (the mismatch metric)
    seq_adv: torch.Tensor           # [B] group advantage
    old_logprobs: torch.Tensor | None = None  # [B, L] theta_old (old_logprob_pass)
    entropy: torch.Tensor | None = None       # [B, L]
    ref_logprobs: torch.Tensor | None = None  # [B, L] reference policy (loss.kl_coef > 0)
    advantages: torch.Tensor | None = None    # [B, L] token advantages (credit assignment)
    # [B, L, n, k] top-k experts per token of this pipeline stage's n MoE layers, -1 where none
    # (model.routing_replay: recorded by the old-logprob pass, or vLLM's; training.routing_replay)
    routed_experts: torch.Tensor | None = None

    def select(self, rows: torch.Tensor | list[int]) -> TrainBatch:
        """The rows ``rows`` of every per-sequence tensor, trimmed to their longest sequence."""
        rows = torch.as_tensor(rows, dtype=torch.long)
        length = int(self.lengths[rows.to(self.lengths.device)].max())
        out = {}
        for f in fields(self):
            t = getattr(self, f.name)
            if t is not None:
                t = t[rows.to(t.device)]
                out[f.name] = t[:, :length] if t.dim() >= 2 else t
        return TrainBatch(**out)


def build_train_batch(samples, rows: list[int], seq_adv: torch.Tensor, *, pad_id: int,
                      overlong_filter: bool, device) -> TrainBatch:
    """The ``rows`` of a step's ``samples`` (:class:`~megatron_oar.training.collect.Sample`) as
    padded tensors on ``device``. A response that hit the length limit is marked truncated (the
    probes read no outcome there); with ``overlong_filter`` it also gets no loss and no
    advantage."""
    picked = [samples[i] for i in rows]
    length = max(len(s.prompt_ids) + len(s.response_ids) for s in picked)
    b = len(picked)
    tokens = torch.full((b, length), pad_id, dtype=torch.long)
    mask = torch.zeros(b, length, dtype=torch.bool)
    rollout_lp = torch.zeros(b, length)
    prompt_lens, lengths = torch.zeros(b, dtype=torch.long), torch.zeros(b, dtype=torch.long)
    truncated = torch.tensor([s.finish_reason == "length" for s in picked])
    for i, s in enumerate(picked):
        p, n = len(s.prompt_ids), len(s.prompt_ids) + len(s.response_ids)
        tokens[i, :n] = torch.tensor(s.prompt_ids + s.response_ids)
        rollout_lp[i, p:n] = torch.tensor(s.logprobs)
        prompt_lens[i], lengths[i] = p, n
        mask[i, p:n] = not (overlong_filter and truncated[i])
    adv = seq_adv[rows] * mask.any(dim=-1)  # overlong-filtered rows: no loss, not scored
    return TrainBatch(tokens.to(device), prompt_lens.to(device), lengths.to(device),
                      torch.tensor(rows, device=device), truncated, loss_mask=mask.to(device),
                      rollout_logprobs=rollout_lp.to(device), seq_adv=adv.to(device))
