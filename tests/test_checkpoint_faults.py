"""Training checkpoints under faults (``megatron_oar/training/step_checkpoint.py``).

Slow tests: 2 spawned gloo ranks (DP=2, distributed optimizer), a tiny Qwen2 and the real
``save_checkpoint`` / ``load_checkpoint``:

* a rank SIGKILLed between the weight and optimizer shards (``OAR_FAULTS``) leaves the previous
  checkpoint the newest resumable one; the partial ``.tmp`` is ignored and the next save removes it;
* a truncated file or a flipped byte in the newest checkpoints makes ``resume=auto`` fall back to
  the newest one that verifies, with a warning naming the file, and that one loads with the
  weights it was saved with (verification collective on both ranks);
* ENOSPC from megatron's real shard write (in its forked writer processes) on one rank, and from
  ``OAR_FAULTS`` on one rank outside any collective: both ranks raise the same
  ``CheckpointWriteError``, no temp directory is left, ``latest`` still names the previous step,
  which loads, and the next save succeeds.

Fast tests (hand-made checkpoints): ``restarted`` overrides ``resume``, a checkpoint without a
manifest is accepted, a crash between the renames of a re-save keeps a checkpoint.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import zlib
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from megatron_oar.models.model_checkpoint import CheckpointError
from megatron_oar.training import step_checkpoint as ckpt
from tests.distributed import launch, launch_and_load, launch_fresh, save_gathered
from tests.processes import alive, wait_gone
from tests.tiny import make_tiny_qwen2

LOGGER = "megatron_oar.training.step_checkpoint"


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    """A converted tiny Qwen2 checkpoint."""
    from checkpoints_convert.convert import hf_to_megatron

    root = tmp_path_factory.mktemp("ckpt_faults")
    hf = make_tiny_qwen2(root / "hf", seed=11, num_hidden_layers=2, vocab_size=256)
    hf_to_megatron(hf, root / "ckpt", progress=False)
    return root / "ckpt"


# ------------------------------------------------------------------- worker-side helpers

def _in_process_write_results() -> None:
    """Megatron passes its shard writer's results through a ``Manager().Queue()``, whose server
    process it spawns on the first save (seconds here) and which outlives a rank that a test
    kills. A synchronous save produces and consumes them in the rank's own process (the forked
    writers report through their own queue), so a plain queue does the same job."""
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    filesystem_async._results_queue = queue.Queue()


def _policy(model: str):
    """Collective: the runtime (gloo, DP=world) and a policy with the distributed optimizer."""
    from megatron_oar.config import ModelConfig, OptimConfig
    from megatron_oar.models import read_hf_config
    from megatron_oar.runtime import ParallelConfig, init_runtime
    from megatron_oar.training.policy import build_policy

    _in_process_write_results()
    init_runtime(ParallelConfig())
    return build_policy(read_hf_config(Path(model) / "hf" / "config.json"),
                        ModelConfig(path=model, dtype="fp32", spec="local"), OptimConfig(lr=1e-2),
                        checkpoint=model, total_optimizer_steps=8)


def _train(policy, seed: int) -> None:
    """Collective: one optimizer step on seeded random gradients (Adam state and LR schedule move)."""
    g = torch.Generator().manual_seed(seed)
    policy.model.zero_grad_buffer()
    policy.optimizer.zero_grad()
    for _, p in sorted(policy.gpt.named_parameters()):
        p.main_grad.copy_(torch.randn(p.shape, generator=g))
    policy.model.finish_grad_sync()
    assert policy.optimizer.step()[0]
    policy.scheduler.step(increment=1)


def _weights(policy) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in policy.gpt.state_dict().items()
            if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _save(root: str, step: int, policy, model: str) -> Path:
    from megatron_oar.models.model_checkpoint import CheckpointMeta

    saved = ckpt.save_checkpoint(root, step, policy, {"sampler": {"step": step}}, CheckpointMeta.read(model),
                                 Path(model) / "hf", keep_last=0)
    ckpt.wait_for_deletions()  # rank 0's leftovers go in the background: listed below, so wait
    return saved


def _capture_log() -> list[str]:
    """This process's step_checkpoint log messages (INFO and up), as they are emitted."""
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(f"{record.levelname} {record.getMessage()}")

    logger = logging.getLogger(LOGGER)
    logger.setLevel(logging.INFO)
    logger.addHandler(Keep())
    return records


def _resume_and_load(policy, root: str, expected: str) -> dict:
    """Collective: resolve_resume("auto") and load; what was chosen and whether the weights match."""
    path = ckpt.resolve_resume("auto", root)
    ckpt.load_checkpoint(path, policy)
    return {"resumed": path.name, "weights_match": _same(_weights(policy), torch.load(expected))}


# -------------------------------------------------------------------- a run with 3 saves

def _saved_run_worker(model: str, root: str, out: str) -> None:
    """Saves steps 1-3; then resumes on both ranks from a damaged copy (see _damage)."""
    import torch.distributed as dist

    policy = _policy(model)
    for step in (1, 2, 3):
        _train(policy, seed=step)
        _save(f"{root}/ckpts", step, policy, model)
        if dist.get_rank() == 0:
            torch.save(_weights(policy), f"{root}/weights_{step}.pt")
    if dist.get_rank() == 0:
        _damage(Path(root))
    dist.barrier()
    log = _capture_log()
    res = _resume_and_load(policy, f"{root}/damaged", f"{root}/weights_1.pt")
    save_gathered({**res, "log": log}, out)


@pytest.fixture(scope="module")
def saved_run(model, tmp_path_factory) -> Path:
    """``ckpts/step_0000000{1,2,3}`` saved by 2 ranks, ``weights_{1,2,3}.pt`` (the weights at each),
    and ``fallback.pt``: per rank, what ``resume=auto`` chose and loaded from ``damaged/``."""
    root = tmp_path_factory.mktemp("saved_run")
    launch(_saved_run_worker, 2, str(model), str(root), str(root / "fallback.pt"))
    return root


def _copy_run(saved_run: Path, tmp_path: Path) -> Path:
    return shutil.copytree(saved_run / "ckpts", tmp_path / "ckpts")


def _manifest(step_path: Path) -> dict:
    return json.loads((step_path / ckpt.STATE_FILE).read_text())[ckpt.MANIFEST_KEY]


def _largest(step_path: Path, sub: str) -> str:
    """The biggest file of ``sub/`` in the manifest (a real shard)."""
    files = {rel: e["size"] for rel, e in _manifest(step_path).items() if rel.startswith(sub + "/")}
    return max(files, key=files.get)


def _truncate(step_path: Path, rel: str) -> tuple[int, int]:
    """Cuts ``rel`` to half its size; ``(new size, manifest size)``."""
    f = step_path / rel
    size = f.stat().st_size
    os.truncate(f, size // 2)
    return size // 2, size


def _flip_byte(step_path: Path, rel: str) -> None:
    f = step_path / rel
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x40
    f.write_bytes(bytes(data))


@pytest.mark.slow
def test_manifest_covers_every_file(saved_run):
    step = saved_run / "ckpts" / "step_00000003"
    manifest = _manifest(step)
    on_disk = {p.relative_to(step).as_posix() for p in step.rglob("*") if p.is_file()}
    assert set(manifest) == on_disk - {ckpt.STATE_FILE}
    assert {"model/.metadata", "optim/.metadata", "rng/rank_00000.pt", "rng/rank_00001.pt",
            "oar_checkpoint.json", "hf/config.json"} <= set(manifest)
    for rel, entry in manifest.items():
        data = (step / rel).read_bytes()
        assert entry == {"size": len(data), "crc32": f"{zlib.crc32(data):08x}"}, rel
    assert ckpt.verify_checkpoint(step) == []
    assert (saved_run / "ckpts" / "latest").read_text().strip() == "step_00000003"


@pytest.mark.slow
def test_truncated_newest_falls_back(saved_run, tmp_path, caplog):
    root = _copy_run(saved_run, tmp_path)
    rel = _largest(root / "step_00000003", "optim")
    now, was = _truncate(root / "step_00000003", rel)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert ckpt.resolve_resume("auto", root) == root / "step_00000002"
    warning = f"step_00000003/{rel}: {now} bytes, the manifest says {was}"
    assert any(r.levelno == logging.WARNING and warning in r.getMessage()
               and str(root / "step_00000003") in r.getMessage() for r in caplog.records), caplog.text
    with pytest.raises(CheckpointError, match=f"checkpoint.resume=.*step_00000003: .*{warning}"):
        ckpt.resolve_resume(str(root / "step_00000003"), root)


@pytest.mark.slow
def test_flipped_byte_falls_back(saved_run, tmp_path, caplog):
    root = _copy_run(saved_run, tmp_path)
    rel = _largest(root / "step_00000003", "model")
    _flip_byte(root / "step_00000003", rel)
    (root / "step_00000002" / "rng" / "rank_00001.pt").unlink()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert ckpt.resolve_resume("auto", root) == root / "step_00000001"
    text = caplog.text
    crc = _manifest(root / "step_00000003")[rel]["crc32"]
    assert f"step_00000003/{rel}: CRC32 " in text and f"the manifest says {crc} (same size" in text, text
    assert "step_00000002/rng/rank_00001.pt: missing" in text, text
    assert "resuming from" in text and "step_00000001" in text


@pytest.mark.slow
def test_unparsable_state_and_nothing_verifies(saved_run, tmp_path, caplog):
    root = _copy_run(saved_run, tmp_path)
    (root / "step_00000003" / ckpt.STATE_FILE).write_text('{"step": 3, "manif')
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert ckpt.resolve_resume("auto", root) == root / "step_00000002"
    assert "step_00000003/trainer_state.json: unreadable" in caplog.text
    for step in ("step_00000001", "step_00000002"):
        _truncate(root / step, _largest(root / step, "model"))
    with pytest.raises(CheckpointError, match="none of its 3 checkpoints verifies"):
        ckpt.resolve_resume("auto", root)


def _damage(run: Path) -> tuple[str, str]:
    """``damaged/``: a copy of ``ckpts/`` with step 3's largest optimizer shard truncated and a byte
    of step 2's largest model shard flipped; returns those two files."""
    root = shutil.copytree(run / "ckpts", run / "damaged")
    truncated = _largest(root / "step_00000003", "optim")
    _truncate(root / "step_00000003", truncated)
    flipped = _largest(root / "step_00000002", "model")
    _flip_byte(root / "step_00000002", flipped)
    return truncated, flipped


@pytest.mark.slow
def test_fallback_loads_the_weights_of_that_step(saved_run):
    """Both ranks verify (disjoint files), agree on step 1, and load exactly its weights."""
    res = torch.load(saved_run / "fallback.pt")
    for r in res:
        assert r["resumed"] == "step_00000001" and r["weights_match"], r
    truncated = _largest(saved_run / "ckpts" / "step_00000003", "optim")
    flipped = _largest(saved_run / "ckpts" / "step_00000002", "model")
    warnings = [m for m in res[0]["log"] if m.startswith("WARNING")]
    assert any(f"step_00000003/{truncated}: " in m for m in warnings), warnings
    assert any(f"step_00000002/{flipped}: CRC32" in m for m in warnings), warnings
    assert not res[1]["log"]  # rank 0 logs


# ---------------------------------------------------------------------- kill inside a save

def _kill_worker(model: str, root: str) -> None:
    import torch.distributed as dist

    from megatron_oar.testing import faults

    os.environ[faults.ENV] = "kill@checkpoint.shards:step=2:rank=1"
    faults.reset()
    policy = _policy(model)
    _train(policy, seed=1)
    _save(f"{root}/ckpts", 1, policy, model)
    if dist.get_rank() == 0:
        torch.save(_weights(policy), f"{root}/weights_1.pt")
    _train(policy, seed=2)
    _save(f"{root}/ckpts", 2, policy, model)  # rank 1 is killed between the shard saves
    raise AssertionError("unreachable: rank 1 was to be killed inside the save of step 2")


def _after_kill_worker(model: str, root: str, out: str) -> None:
    policy = _policy(model)
    res = _resume_and_load(policy, f"{root}/ckpts", f"{root}/weights_1.pt")
    _train(policy, seed=2)
    saved = _save(f"{root}/ckpts", 2, policy, model)
    save_gathered({**res, "saved": saved.name, "verifies": ckpt.verify_checkpoint(saved) == []}, out)


@pytest.mark.slow
def test_kill_inside_save_keeps_the_previous_checkpoint(model, tmp_path):
    with pytest.raises((mp.ProcessExitedException, mp.ProcessRaisedException)):
        launch_fresh(_kill_worker, 2, str(model), str(tmp_path))  # a rank dies: its own world
    root = tmp_path / "ckpts"
    partial = root / ".step_00000002.tmp"
    assert (partial / "model" / ".metadata").is_file() and not (partial / ckpt.STATE_FILE).exists()
    assert not any((partial / "optim").iterdir())  # killed before the optimizer shards
    assert ckpt.complete_checkpoints(root) == [(1, root / "step_00000001")]
    assert ckpt.resolve_resume("auto", root) == root / "step_00000001"

    res = launch_and_load(_after_kill_worker, 2, tmp_path / "out.pt", str(model), str(tmp_path))
    for r in res:
        assert r == {"resumed": "step_00000001", "weights_match": True, "saved": "step_00000002",
                     "verifies": True}, r
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000001", "step_00000002"]


# ----------------------------------------------------------------------------- ENOSPC

def _no_space_in_shard_writes() -> None:
    """Makes megatron's shard writer fail as a full disk would: a few bytes land in the shard file,
    then ``write`` raises ENOSPC. The writes run in processes forked from this one, which inherit
    the patch."""
    import io

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    def full_disk(*args, **kwargs):
        stream = next(a for a in args if isinstance(a, io.IOBase))
        stream.write(b"\0" * 64)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    filesystem_async._write_item = full_disk


def _failed_save(root: str, step: int, policy, model: str) -> dict:
    """The error of a save expected to fail, and what it left under ``root``. Every rank looks before
    any rank goes on (rank 0's next save would otherwise create its ``.tmp`` directory while rank 1
    is still listing)."""
    import torch.distributed as dist

    result, error = {"message": None}, None
    try:
        _save(root, step, policy, model)
    except ckpt.CheckpointWriteError as e:
        error = e
    ckpt.wait_for_deletions()  # rank 0 removes the partial save in the background
    dist.barrier()
    if error is not None:
        result = {"message": str(error), "errno": error.errno,
                  "left": sorted(p.name for p in Path(root).iterdir()),
                  "latest": (Path(root) / "latest").read_text().strip()}
    dist.barrier()
    return result


def _enospc_worker(model: str, root: str, out: str) -> None:
    import torch.distributed as dist
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from megatron_oar.testing import faults

    ckpts = f"{root}/ckpts"
    policy = _policy(model)
    _train(policy, seed=1)
    _save(ckpts, 1, policy, model)
    if dist.get_rank() == 0:
        torch.save(_weights(policy), f"{root}/weights_1.pt")
    _train(policy, seed=2)
    real_write = filesystem_async._write_item
    if dist.get_rank() == 1:
        _no_space_in_shard_writes()
    in_write = _failed_save(ckpts, 2, policy, model)
    filesystem_async._write_item = real_write
    os.environ[faults.ENV] = "enospc@checkpoint.shards:step=2:rank=1"
    faults.reset()
    injected = _failed_save(ckpts, 2, policy, model)
    res = _resume_and_load(policy, ckpts, f"{root}/weights_1.pt")
    saved = _save(ckpts, 2, policy, model)
    save_gathered({"in_write": in_write, "injected": injected, **res,
                   "then": sorted(p.name for p in Path(ckpts).iterdir()),
                   "verifies": ckpt.verify_checkpoint(saved) == []}, out)


@pytest.mark.slow
def test_enospc_raises_on_every_rank_and_keeps_the_previous_checkpoint(model, tmp_path):
    res = launch_and_load(_enospc_worker, 2, tmp_path / "out.pt", str(model), str(tmp_path))
    final = tmp_path / "ckpts" / "step_00000002"
    for case, phase in (("in_write", "optimizer shards"), ("injected", "model shards")):
        assert res[0][case]["message"] == res[1][case]["message"], case  # the same error everywhere
        for r in res:
            err = r[case]
            assert err["message"] is not None, f"{case}: no CheckpointWriteError"
            assert err["errno"] == errno.ENOSPC
            assert err["left"] == ["latest", "step_00000001"] and err["latest"] == "step_00000001"
            msg = err["message"]
            assert msg.startswith(f"checkpoint step 2 was not saved to {final}: No space left on device ("), msg
            assert f"rank 1, {phase}: " in msg and "[Errno 28] No space left on device" in msg, msg
            assert msg.endswith("The partial save .step_00000002.tmp was removed; the previous checkpoint "
                                "step_00000001 is kept and latest is unchanged"), msg
    assert "RuntimeError: Worker failure" in res[0]["in_write"]["message"]  # from the forked writer
    assert "OAR_FAULTS at checkpoint.shards (step 2, rank 1)" in res[0]["injected"]["message"]
    for r in res:
        assert r["resumed"] == "step_00000001" and r["weights_match"]
        assert r["then"] == ["latest", "step_00000001", "step_00000002"] and r["verifies"]


# ---------------------------------------------- fast: hand-made checkpoints, no process group

def _fake_checkpoint(root: Path, step: int, manifest: bool = True) -> Path:
    """A step directory with a few files and a trainer_state.json (with a manifest of them)."""
    path = ckpt.step_dir(root, step)
    (path / "model").mkdir(parents=True)
    (path / "model" / "__0_0.distcp").write_bytes(os.urandom(1000 + step))
    (path / "oar_checkpoint.json").write_text("{}\n")
    state = {"step": step}
    if manifest:
        state[ckpt.MANIFEST_KEY] = {
            rel: {"size": len(data), "crc32": f"{zlib.crc32(data):08x}"}
            for rel in ("model/__0_0.distcp", "oar_checkpoint.json") if (data := (path / rel).read_bytes())}
    (path / ckpt.STATE_FILE).write_text(json.dumps(state))
    return path


def test_restarted_overrides_resume(tmp_path, caplog):
    root = tmp_path / "ckpts"
    assert ckpt.resolve_resume("none", root, restarted=True) is None  # nothing saved yet
    other = _fake_checkpoint(tmp_path / "other_run", 7)
    assert ckpt.resolve_resume(str(other), root, restarted=True) == other
    _fake_checkpoint(root, 1)
    newest = _fake_checkpoint(root, 2)
    assert ckpt.resolve_resume("none", root) is None
    assert ckpt.resolve_resume(str(other), root) == other
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert ckpt.resolve_resume("none", root, restarted=True) == newest
        assert ckpt.resolve_resume(str(other), root, restarted=True) == newest
        assert ckpt.resolve_resume("auto", root, restarted=True) == newest
    assert f"torchrun restart: resuming from this run's newest verified checkpoint {newest}" in caplog.text
    _flip_byte(newest, "model/__0_0.distcp")
    assert ckpt.resolve_resume("none", root, restarted=True) == root / "step_00000001"


def test_checkpoint_without_manifest_is_accepted(tmp_path, caplog):
    root = tmp_path / "ckpts"
    _fake_checkpoint(root, 1)
    old = _fake_checkpoint(root, 2, manifest=False)
    _flip_byte(old, "model/__0_0.distcp")  # nothing to check it against
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert ckpt.resolve_resume("auto", root) == old
        assert ckpt.resolve_resume(str(old), root) == old
    assert f"{old} has no integrity manifest (saved before manifests existed): accepted unverified" in caplog.text
    (old / ckpt.STATE_FILE).write_text("not json")
    assert ckpt.resolve_resume("auto", root) == root / "step_00000001"
    with pytest.raises(CheckpointError, match="step_00000002/trainer_state.json: unreadable"):
        ckpt.resolve_resume(str(old), root)
    with pytest.raises(CheckpointError, match="nowhere/trainer_state.json: missing"):
        ckpt.resolve_resume(str(tmp_path / "nowhere"), root)


def test_crash_between_the_renames_of_a_resave_keeps_a_checkpoint(tmp_path):
    """Re-saving step 2: the old directory was moved to .old, the crash came before the new one
    was renamed into place. The .old one is listed and resumed from; the next save puts it back."""
    from megatron_oar.eval.run_eval import resolve_model

    root = tmp_path / "ckpts"
    _fake_checkpoint(root, 1)
    step2 = _fake_checkpoint(root, 2)
    old = root / ".step_00000002.old"
    os.replace(step2, old)
    shutil.copytree(old, root / ".step_00000002.tmp")
    assert ckpt.complete_checkpoints(root)[-1] == (2, old)
    assert ckpt.find_latest(root) == old
    assert resolve_model(root) == (old.resolve(), True)  # oar eval of the checkpoint root
    assert ckpt.resolve_resume("auto", root) == old
    ckpt._clean_leftovers(root)
    assert ckpt.wait_for_deletions(30)  # the leftovers are deleted in the background
    assert sorted(p.name for p in root.iterdir()) == ["step_00000001", "step_00000002"]
    assert ckpt.verify_checkpoint(step2) == []
    # a crash after the second rename: .old is stale and removed
    shutil.copytree(step2, old)
    assert ckpt.find_latest(root) == step2
    ckpt._clean_leftovers(root)
    assert ckpt.wait_for_deletions(30)
    assert sorted(p.name for p in root.iterdir()) == ["step_00000001", "step_00000002"]


_SAVE_THEN_DIE = """
import multiprocessing, os, signal, sys
import torch
from megatron.core.dist_checkpointing import ShardedTensor
from megatron_oar.models.model_checkpoint import dist_save
from megatron_oar.runtime import init_runtime

init_runtime()
dist_save({"w": ShardedTensor.from_rank_offsets("w", torch.arange(8.0), replica_id=0)}, sys.argv[1])
print(" ".join(str(p.pid) for p in multiprocessing.active_children()), flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # as the OOM killer or a node fault would
"""


@pytest.mark.slow
def test_a_killed_rank_leaves_no_writer_process(tmp_path):
    """megatron's torch_dist writer keeps a multiprocessing Manager server per process; a rank
    killed after a save must not leave it running (one per torchrun restart, 270 MB each)."""
    import subprocess
    import sys

    from megatron_oar.runtime import env_without_launcher

    (tmp_path / "ckpt").mkdir()
    out, err = tmp_path / "stdout", tmp_path / "stderr"  # files: a leftover child would hold a pipe open
    with out.open("w") as o, err.open("w") as e:
        r = subprocess.run([sys.executable, "-c", _SAVE_THEN_DIE, str(tmp_path / "ckpt")], stdout=o,
                           stderr=e, timeout=300, env=env_without_launcher())
    assert r.returncode == -9, err.read_text()[-3000:]
    helpers = [int(p) for p in out.read_text().split()]
    assert helpers, out.read_text()  # the writer's Manager server, a child of the killed process

    # a zombie (dead, re-parented to pytest, not yet reaped) is not alive
    left = wait_gone(lambda: {p: "" for p in helpers if alive(p)})
    for p in left:
        os.kill(p, 9)
    assert not left, f"helper processes {sorted(left)} outlived the killed rank"
