"""Resuming a training checkpoint at another TP / PP / CP (``megatron_oar/training/step_checkpoint.py``).

Slow (24 s run alone on 2 CPU cores before the CP2 layout was added, 30 s with it under other
users' load, the rank pool's start included; it reuses the session's tiny Qwen2,
``trainer_checkpoint``): one 2-rank job trains it for one update at TP2 and at PP2, saves
(``fully_reshardable``; at TP2 also ``dp_reshardable``) and runs two more updates, and the same
at CP2 (context parallel, saved ``dp_reshardable``: megatron's distributed optimizer shards over
DP x CP, so a change of CP is one of DP x CP); a 1-rank job loads each checkpoint at TP1 PP1 CP1
and runs the same two updates. Their losses must equal the uninterrupted runs' to fp32 rounding
(the second one depends on the restored Adam moments); the TP2 ``dp_reshardable`` one must be
refused, naming what changed and what may.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from tests.distributed import launch, save_gathered
from tests.tolerances import ModelShape, reduction_tol

LAYOUTS = {"tp2": (2, 1, 1), "pp2": (1, 2, 1), "cp2": (1, 1, 2)}  # saved at (tp, pp, cp); resumed at 1, 1, 1
SHARDING = {"tp2": "fully_reshardable", "pp2": "fully_reshardable", "cp2": "dp_reshardable"}
VOCAB = 256  # the tokens drawn (below the model's vocabulary)


@pytest.fixture
def model(trainer_checkpoint) -> Path:
    """The session's tiny Qwen2 (2 layers, 2 heads: TP2 and PP2 fit)."""
    return trainer_checkpoint


def _policy(model: str, tp: int, pp: int, cp: int = 1):
    from megatron_oar.config import ModelConfig, OptimConfig
    from megatron_oar.models import read_hf_config
    from megatron_oar.runtime import ParallelConfig, init_runtime
    from megatron_oar.training.policy import build_policy

    init_runtime(ParallelConfig(tp=tp, pp=pp, cp=cp))
    return build_policy(read_hf_config(Path(model) / "hf" / "config.json"),
                        ModelConfig(path=model, dtype="fp32", spec="local"), OptimConfig(lr=1e-2),
                        checkpoint=model, total_optimizer_steps=8)


def _vocab(model: str) -> int:
    return json.loads((Path(model) / "hf" / "config.json").read_text())["vocab_size"]


def _update(policy, step: int, vocab: int) -> float:
    """Collective: one PPO update on a fixed batch of step ``step``; its loss (before the update)."""
    from megatron_oar.algorithms import PolicyLossConfig
    from megatron_oar.training.inputs import TrainBatch
    from megatron_oar.training.policy_passes import update_step

    g = torch.Generator().manual_seed(step)
    lengths, pos = torch.tensor([9, 12, 7, 10]), torch.arange(12)
    tokens = torch.randint(3, VOCAB, (4, 12), generator=g) * (pos < lengths[:, None])
    mask = (pos >= 4) & (pos < lengths[:, None])
    seq_adv = torch.tensor([1.0, -0.5, 0.7, -1.0])
    batch = TrainBatch(tokens, torch.full((4,), 4), lengths, torch.arange(4), loss_mask=mask,
                       rollout_logprobs=torch.zeros(tokens.shape), seq_adv=seq_adv,
                       old_logprobs=torch.full(tokens.shape, -5.5), advantages=seq_adv[:, None] * mask)
    res = update_step(policy, batch, PolicyLossConfig(), vocab, 2)
    assert res.applied
    return res.stats["loss"]


def _save(policy, model: str, root: str, sharding: str) -> None:
    from megatron_oar.models.model_checkpoint import CheckpointMeta
    from megatron_oar.training import step_checkpoint as ckpt

    ckpt.save_checkpoint(root, 1, policy, {"sampler": {"step": 1}}, CheckpointMeta.read(model),
                         Path(model) / "hf", optim_sharding=sharding)


def _run_worker(model: str, root: str, out: str) -> None:
    losses = {}
    for name, (tp, pp, cp) in LAYOUTS.items():
        policy = _policy(model, tp, pp, cp)
        _update(policy, 1, _vocab(model))
        _save(policy, model, f"{root}/{name}", SHARDING[name])
        if name == "tp2":
            _save(policy, model, f"{root}/tp2_dp_reshardable", "dp_reshardable")
        losses[name] = [_update(policy, 2, _vocab(model)), _update(policy, 3, _vocab(model))]
    save_gathered(losses, out)


def _resume_worker(model: str, root: str, out: str) -> None:
    from megatron_oar.models.model_checkpoint import CheckpointError
    from megatron_oar.training import step_checkpoint as ckpt

    records = []
    handler = logging.Handler()
    handler.emit = lambda r: records.append(r.getMessage())
    logging.getLogger(ckpt.__name__).addHandler(handler)
    res = {}
    for name in LAYOUTS:
        policy = _policy(model, 1, 1)
        ckpt.load_checkpoint(ckpt.step_dir(f"{root}/{name}", 1), policy)
        res[name] = [_update(policy, 2, _vocab(model)), _update(policy, 3, _vocab(model))]
    try:
        ckpt.load_checkpoint(ckpt.step_dir(f"{root}/tp2_dp_reshardable", 1), _policy(model, 1, 1))
    except CheckpointError as e:
        res["refused"] = str(e)
    save_gathered({**res, "log": records}, out)


@pytest.mark.slow
def test_resume_at_another_tp_and_pp(model, tmp_path):
    launch(_run_worker, 2, str(model), str(tmp_path), str(tmp_path / "run.pt"))
    launch(_resume_worker, 1, str(model), str(tmp_path), str(tmp_path / "resumed.pt"))
    run, resumed = torch.load(tmp_path / "run.pt")[0], torch.load(tmp_path / "resumed.pt")[0]
    # the next two steps' losses: fp32 rounding apart (tests/tolerances.py): the update before
    # them (a forward, a backward, the sum over the batch's 38 tokens), then their own forward
    shape = ModelShape.from_hf(json.loads((Path(model) / "hf" / "config.json").read_text()))
    tol = reduction_tol(*shape.grad_chain(12, 38), *shape.logprob_chain(12))
    for name in LAYOUTS:
        assert resumed[name] == pytest.approx(run[name], rel=tol, abs=tol), name
    state = json.loads((tmp_path / "tp2" / "step_00000001" / "trainer_state.json").read_text())
    assert state["layout"] == {"tp": 2, "pp": 1, "cp": 1, "ep": 1, "etp": 2, "dp": 1, "world_size": 2,
                               "distributed_optimizer": True}
    assert state["optim_sharding"] == "fully_reshardable"
    cp2 = json.loads((tmp_path / "cp2" / "step_00000001" / "trainer_state.json").read_text())
    assert (cp2["layout"]["cp"], cp2["layout"]["dp"], cp2["optim_sharding"]) == (2, 1, "dp_reshardable")
    meta = json.loads((tmp_path / "pp2" / "step_00000001" / "oar_checkpoint.json").read_text())
    assert (meta["written_tp"], meta["written_pp"]) == (1, 2)
    assert any("RNG states are not restored" in m and "tp, world_size" in m for m in resumed["log"])
    assert any("RNG states are not restored" in m and "cp, world_size" in m for m in resumed["log"])
    refused = resumed.get("refused", "")
    for needle in ("tp2_dp_reshardable/step_00000001", "tp 2 -> 1", "dp_reshardable",
                   "data-parallel and world sizes may change", "checkpoint.optim_sharding=fully_reshardable"):
        assert needle in refused, (needle, refused)
