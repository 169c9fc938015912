"""Plain single-process references for OAR-G and OAR-P on a transformers model.

Written from the paper's definitions, one sequence at a time, with torch autograd and brute
force: the Megatron implementation must match these whatever its TP/PP layout.
"""

from __future__ import annotations

import torch

from megatron_oar.attribution.importance_passes import sample_noise
from megatron_oar.attribution.probes import ProbeSites
from megatron_oar.models.sequence_batch import SequenceBatch
from megatron_oar.seeds import OAR_G_NOISE, derive_seed


def probe(logits: torch.Tensor, sites: ProbeSites, row: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs over the vocabulary, mean answer log-likelihood) of one sequence's probe."""
    sel = sites.row == row
    pos, target = sites.pos[sel], sites.target[sel]
    logits = logits.double()
    logp = torch.log_softmax(logits[pos].mean(0), dim=-1)
    score = torch.log_softmax(logits[pos], dim=-1).gather(-1, target.unsqueeze(-1)).mean()
    return logp, score


def divergence(teacher, student, kind: str, clamp: bool, joint_importance: str = "drop"):
    if kind == "answer_joint":
        drop = teacher[1] - student[1]
        if clamp:
            drop = drop.abs() if joint_importance == "abs" else drop.clamp_min(0)
        return drop
    p = teacher[0].exp()
    return (p * (teacher[0] - student[0])).sum()


def _logits(model, ids=None, embeds=None) -> torch.Tensor:
    if embeds is not None:
        return model(inputs_embeds=embeds.unsqueeze(0)).logits[0]
    return model(ids.unsqueeze(0)).logits[0]


@torch.no_grad()
def oar_p(model, batch: SequenceBatch, sites: ProbeSites, rows: list[int], pad_id: int,
          joint_importance: str = "drop") -> torch.Tensor:
    out = torch.zeros(batch.tokens.shape)
    for i in rows:
        ids = batch.tokens[i, :int(batch.lengths[i])]
        teacher = probe(_logits(model, ids), sites, i)
        for t in sites.score_mask[i].nonzero().flatten().tolist():
            masked = ids.clone()
            masked[t] = pad_id
            student = probe(_logits(model, masked), sites, i)
            out[i, t] = divergence(teacher, student, sites.kinds[i], True, joint_importance)
    return out


def oar_g(model, batch: SequenceBatch, sites: ProbeSites, rows: list[int], sigma: float, seed: int,
          step: int, noise_device: str | None = None) -> torch.Tensor:
    """``noise_device``: where the noise is drawn (default: the model's; the CUDA generator draws
    other numbers than the CPU's, so a CPU reference of a CUDA run draws it there)."""
    out = torch.zeros(batch.tokens.shape)
    embed = model.get_input_embeddings()
    for i in rows:
        n = int(batch.lengths[i])
        ids = batch.tokens[i, :n]
        with torch.no_grad():
            emb = embed(ids)
            teacher = probe(_logits(model, ids), sites, i)
        noise = sample_noise(derive_seed(OAR_G_NOISE, seed, step, int(batch.sample_ids[i])), n, emb.shape[-1], sigma,
                             device=noise_device or emb.device).to(emb.device)
        x = (emb + noise * sites.score_mask[i, :n].unsqueeze(-1)).requires_grad_(True)
        student = probe(_logits(model, embeds=x), sites, i)
        divergence(teacher, student, sites.kinds[i], clamp=False).backward()
        out[i, :n] = (x.grad * emb).sum(-1).abs()
    return out * sites.score_mask
