"""Opt-in per-rollout credit records (``log.credit_records: N``): every N steps, each rollout's
response tokens with the importance, weights and token advantages the update used, one JSON
object per line in ``{run_dir}/credit_records/step_{step:06d}.dp{rank}.jsonl`` (one file per DP
replica, written by its first tensor-parallel rank on the last pipeline stage). ``oar analyze
credit`` reads them (:mod:`megatron_oar.eval.credit_profile`)::

    {"step": 3, "index": 17, "credit": "oar_g", "prompt": "...", "reference": "17",
     "reward": 0.0, "accuracy": 0.0, "seq_adv": -0.93,
     "token_ids": [...], "tokens": [" Take", " 14", ...],   # response tokens, decoded one by one
     "loss_mask": [1, ...],        # tokens with a loss
     "scored": [1, ...] | null,    # tokens the probe scored (null: no attribution in this scheme)
     "importance": [...] | null,   # raw importance I_t (0 where not scored)
     "weights": [...],             # w_t = A_t / A_i (1 for GRPO)
     "advantages": [...],          # A_t, what the policy loss used
     "entropy": [...],             # the old-logprob pass's token entropy
     "shaping": {"scheme": "oar", "tau": 0.4, ...}}

The cost is one device-to-host copy of five ``[B, L]`` tensors and a decode per token on the
recording steps; nothing is computed that the step does not already have.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import torch

from megatron_oar.fileio import atomic_write

DIR_NAME = "credit_records"


def record_rows(samples, batch, credit, *, importance: torch.Tensor | None,
                score_mask: torch.Tensor | None, tokenizer, step: int, method: str,
                shaping) -> list[dict]:
    """One dict per row of ``batch`` (a :class:`~megatron_oar.training.inputs.TrainBatch`),
    ``samples`` the step's global list (``batch.sample_ids`` index it)."""
    cpu = {name: t.detach().float().cpu() if t is not None else None for name, t in (
        ("mask", batch.loss_mask), ("imp", importance), ("scored", score_mask),
        ("w", credit.weights), ("adv", credit.advantages), ("ent", batch.entropy))}
    prompt_lens, lengths = batch.prompt_lens.tolist(), batch.lengths.tolist()
    seq_adv = batch.seq_adv.detach().float().cpu().tolist()
    out = []
    for i, idx in enumerate(batch.sample_ids.tolist()):
        s = samples[idx]
        p, n = prompt_lens[i], lengths[i]

        def row(name: str, cast=float):
            t = cpu[name]
            return None if t is None else [cast(v) for v in t[i, p:n].tolist()]

        out.append({
            "step": step, "index": idx, "credit": method,
            "prompt": tokenizer.decode(s.prompt_ids, skip_special_tokens=True),
            "reference": s.reference, "reward": float(s.reward), "accuracy": float(s.accuracy),
            "seq_adv": seq_adv[i], "token_ids": list(s.response_ids),
            "tokens": [tokenizer.decode([t]) for t in s.response_ids],
            "loss_mask": row("mask", int), "scored": row("scored", int), "importance": row("imp"),
            "weights": row("w"), "advantages": row("adv"), "entropy": row("ent"),
            "shaping": asdict(shaping)})
    return out


def write_credit_records(run_dir: str | Path, step: int, dp_rank: int, rows: list[dict]) -> Path:
    """``rows`` to ``{run_dir}/credit_records/step_{step:06d}.dp{dp_rank}.jsonl`` (temp + rename)."""
    path = Path(run_dir) / DIR_NAME / f"step_{step:06d}.dp{dp_rank}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    return atomic_write(path, lambda f: f.writelines(json.dumps(r) + "\n" for r in rows))
