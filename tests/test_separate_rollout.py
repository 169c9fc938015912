"""The separate placement (``rollout.placement=separate``, issue 43): training ranks and rollout
ranks in one torchrun world.

* ``test_world_split_and_bucket_transfer`` (fast, one job of 3 gloo ranks, about 3 s): the world
  splits into 2 training ranks and 1 rollout rank, each role with its own default group;
  weight buckets (fp32, bf16, a 0-dim tensor) and objects travel between the roles exactly;
  a send posted without waiting does not block the sender's next receive.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.distributed import launch


def _split_worker(out: str) -> None:
    import torch.distributed as dist

    from megatron_oar.rollout.transfer import recv_buckets, recv_object, send_buckets, send_object
    from megatron_oar.rollout.weight_sync import WeightBucket
    from megatron_oar.runtime.roles import ROLLOUT, TRAIN, split_world

    roles = split_world(1, timeout_minutes=1)
    report = {"role": roles.role, "role_rank": roles.role_rank, "default_size": dist.get_world_size(),
              "default_rank": dist.get_rank()}
    # the role's own default group: a collective over it involves only that role
    t = torch.ones(1)
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
    Path(out, f"rank{roles.global_rank}.json").write_text(json.dumps(report))


def test_world_split_and_bucket_transfer(tmp_path):
    launch(_split_worker, 3, str(tmp_path))
    r = [json.loads((tmp_path / f"rank{i}.json").read_text()) for i in range(3)]
    assert [x["role"] for x in r] == ["train", "train", "rollout"]
    assert [(x["default_rank"], x["default_size"]) for x in r] == [(0, 2), (1, 2), (0, 1)]
    assert [x["role_sum"] for x in r] == [2.0, 2.0, 1.0]
    assert r[2]["names"] == ["a.weight", "b.weight", "c.scalar"] and r[2]["equal"]
    assert r[2]["version"] == 7 and r[2]["after"] == {"after": "answer"}
    assert r[0]["answer"] == {"answer": 42}
    assert r[0]["counts"] == {"bytes": 78, "tensors": 3, "buckets": 2, "max": 74}
