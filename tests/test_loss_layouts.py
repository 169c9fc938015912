"""GSPO, GSPO-token and CISPO with rollout corrections through the trainer's ``update_step``:
the loss, the gradients and the updated weights do not depend on the micro-batch grouping
(``padded`` rows of one vs ``token_budget``), and the loss, the gradient norm and the loss
statistics not on the layout (DP2, TP2, PP2), at fp32 rounding (tolerances: tests/tolerances.py).
The sequence-level quantities (GSPO's ratio, a sequence-level TIS / MIS weight) are exact only because every micro-batch
holds whole rows.

Cost: one pooled world of 2 ranks running every layout, loss and grouping in one job (a policy
built per layout, 18 updates of the scaled tiny Qwen2, each from the checkpoint's weights and a
fresh Adam state). Measured on the 2 shared cores at a load average of 20-37 (other users): 4 s
of setup and 15 s of updates (DP2 1 s, TP2 9 s, PP2 5 s); the world pool and the shared scaled
checkpoint are the suite's.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import launch_and_load, save_gathered
from tests.test_attribution import SEQ_ADV, make_batch
from tests.test_micro_batches import GRAD_TOL, LOGPROB_TOL, assert_same_update

BUDGET = 60  # padded tokens per micro-batch: the 5 rows (widths 13..29) fall into several groups
LR = 1e-3
LAYOUTS = [(1, 1), (2, 1), (1, 2)]  # (tp, pp) in a world of 2: DP2, TP2, PP2
CONFIGS = {  # bounds narrow enough that vLLM's log-probs below (old + 0.1 noise) hit them
    "gspo+tis_sequence": dict(policy_loss="gspo", agg="seq_mean_token_mean", rollout_correction="tis",
                              rollout_correction_level="sequence", rollout_correction_high=1.2),
    "gspo_token+icepop": dict(policy_loss="gspo_token", agg="seq_mean_token_mean",
                              rollout_correction="icepop", rollout_correction_low=0.9,
                              rollout_correction_high=1.1),
    "cispo+mis_sequence": dict(policy_loss="cispo", agg="token_mean", rollout_correction="mis",
                               rollout_correction_level="sequence", rollout_correction_low=0.7,
                               rollout_correction_high=1.4, cispo_clip_high=0.05),
}


def _perturbed(shape, seed: int, scale: float) -> torch.Tensor:
    return scale * torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _setup(ckpt: str):
    """The policy from the checkpoint, and the whole test batch with its old log-probs (the
    policy's, moved by fixed noise, so ratios differ from 1 and the clips act) and vLLM's
    (moved again, so the corrections truncate and mask)."""
    from pathlib import Path

    from transformers import AutoTokenizer

    from megatron_oar.config import ModelConfig, OptimConfig
    from megatron_oar.models import read_hf_config
    from megatron_oar.training.inputs import TrainBatch
    from megatron_oar.training.policy import build_policy
    from megatron_oar.training.policy_passes import old_logprob_pass

    ckpt = Path(ckpt)
    hf = read_hf_config(ckpt / "hf")
    policy = build_policy(hf, ModelConfig(path=str(ckpt), spec="local"),
                          OptimConfig(lr=LR, use_distributed_optimizer=False), checkpoint=ckpt,
                          total_optimizer_steps=4)
    seqs = make_batch(AutoTokenizer.from_pretrained(str(ckpt / "hf")))
    full = TrainBatch(seqs.tokens, seqs.prompt_lens, seqs.lengths, seqs.sample_ids,
                      loss_mask=seqs.response_mask(), rollout_logprobs=torch.zeros(seqs.tokens.shape),
                      seq_adv=SEQ_ADV)
    lp, _, _ = old_logprob_pass(policy.model, full, hf["vocab_size"], 1)
    full.old_logprobs = lp + _perturbed(lp.shape, 0, 0.05)
    full.rollout_logprobs = full.old_logprobs + _perturbed(lp.shape, 1, 0.1)
    return policy, full, hf["vocab_size"]


def _update(policy, start: list[torch.Tensor], full, vocab: int, rows: list[int], batching: str,
            name: str) -> dict:
    """One ``update_step`` on ``rows`` of the test batch from the checkpoint's weights ``start``
    and a fresh Adam state (each run starts where a newly built policy would)."""
    from megatron_oar.algorithms import PolicyLossConfig
    from megatron_oar.training.policy_passes import update_step

    with torch.no_grad():
        for p, w in zip(policy.gpt.parameters(), start):
            p.copy_(w)
    policy.optimizer.optimizer.state.clear()
    cfg = PolicyLossConfig(**CONFIGS[name])
    mask = full.loss_mask
    token_weights = (1.0 if cfg.policy_loss == "gspo"  # GSPO: one advantage per sequence
                     else 0.5 + torch.rand(mask.shape, generator=torch.Generator().manual_seed(2)))
    full.advantages = SEQ_ADV[:, None] * token_weights * mask
    result = update_step(policy, full.select(rows), cfg, vocab, 1, batching=batching, max_tokens=BUDGET)
    return {"loss": result.stats["loss"], "grad_norm": result.grad_norm, "applied": result.applied,
            "stats": result.stats, "grads": [p.main_grad.clone() for p in policy.gpt.parameters()],
            "weights": [p.detach().clone() for p in policy.gpt.parameters()]}


def _worker(ckpt: str, out: str) -> None:
    from megatron.core import parallel_state as ps

    from megatron_oar.runtime import ParallelConfig, init_runtime

    results = {}
    for tp, pp in LAYOUTS:
        init_runtime(ParallelConfig(tp=tp, pp=pp))
        dp, d = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        rows = list(range(d, 5, dp))  # the trainer's split of the step's rows over DP
        policy, full, vocab = _setup(ckpt)
        start = [p.detach().clone() for p in policy.gpt.parameters()]
        for name in CONFIGS:
            for batching in ("padded", "token_budget"):
                results[(tp, pp, name, batching)] = _update(policy, start, full, vocab, rows, batching, name)
    save_gathered(results, out)


@pytest.fixture(scope="module")
def runs(scaled_checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("loss_layouts") / "runs.pt"
    return launch_and_load(_worker, 2, out, str(scaled_checkpoint))


@pytest.mark.slow
def test_losses_do_not_depend_on_the_micro_batches(runs):
    for rank, res in enumerate(runs):
        for (tp, pp, name, batching), budget in res.items():
            if batching != "token_budget":
                continue
            assert_same_update(budget, res[(tp, pp, name, "padded")], f"rank {rank} tp{tp} pp{pp} {name}", LR)


@pytest.mark.slow
def test_losses_do_not_depend_on_the_layout(runs):
    dp2 = runs[0]
    for (tp, pp, name, batching), res in dp2.items():
        want = dp2[(1, 1, name, batching)]
        # tolerances: tests/tolerances.py (the loss and its statistics: a forward's; the norm: a backward's)
        assert res["loss"] == pytest.approx(want["loss"], rel=LOGPROB_TOL), (tp, pp, name, batching)
        assert res["grad_norm"] == pytest.approx(want["grad_norm"], rel=GRAD_TOL), (tp, pp, name, batching)
        for key, value in want["stats"].items():
            assert res["stats"][key] == pytest.approx(value, rel=LOGPROB_TOL, abs=LOGPROB_TOL), (tp, pp, name, key)


@pytest.mark.slow
def test_the_clips_and_corrections_act(runs):
    """The perturbed log-probs make every mechanism under test do something."""
    stats = {name: runs[0][(1, 1, name, "padded")]["stats"] for name in CONFIGS}
    for name, s in stats.items():
        assert 0 < s["clip_frac"] < 1, (name, s["clip_frac"])
        assert s["mismatch_kl"] > 0, name
    assert stats["gspo+tis_sequence"]["rollout_truncated_frac"] > 0
    assert stats["gspo_token+icepop"]["rollout_masked_frac"] > 0
    assert 0 < stats["cispo+mis_sequence"]["rollout_masked_frac"] < 1
