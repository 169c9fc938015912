"""The CPU runtime: layout validation, gloo worlds and megatron's parallel_state, the CPU
backend (CUDA device / RNG redirection), the kernel report, and megatron's pipeline
schedule doing forward *and* backward on CPU.

Anything that calls ``cpu_backend.enable()`` runs in spawned worker processes (it patches
``torch.cuda`` for the whole process); workers assert and save what they saw under
``out_dir`` for the parent to compare across ranks.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pytest
import torch

from megatron_oar.runtime import ParallelConfig, kernels, validate_layout
from tests.distributed import launch, launch_and_load, launch_fresh, save_gathered

# ----------------------------------------------------------------------- validate_layout


@pytest.mark.parametrize("world,cfg,needles", [
    (4, ParallelConfig(tp=3), ["world size 4", "tp*pp = 3*1"]),
    (4, ParallelConfig(tp=2, pp=3), ["world size 4", "tp*pp = 2*3"]),
    (4, ParallelConfig(tp=0), ["parallel.tp", ">= 1", "got 0"]),
    (4, ParallelConfig(pp=0), ["parallel.pp", ">= 1"]),
    (4, ParallelConfig(tp=-2), ["parallel.tp", "got -2"]),
    (4, ParallelConfig(tp=1, sequence_parallel=True), ["parallel.sequence_parallel",
                                                         "parallel.tp > 1"]),
    (4, ParallelConfig(tp=2, cp=4), ["world size 4", "parallel.tp*parallel.pp*parallel.cp = 2*1*4"]),
    (4, ParallelConfig(cp=0), ["parallel.cp", ">= 1", "got 0"]),
], ids=["tp3_world4", "tp2pp3_world4", "tp0", "pp0", "tp_negative", "sp_tp1", "tp2cp4_world4", "cp0"])
def test_validate_layout_errors_name_the_field(world, cfg, needles):
    with pytest.raises(ValueError) as exc:
        validate_layout(world, cfg)
    for needle in needles:
        assert needle in str(exc.value)


@pytest.mark.parametrize("world,cfg,dp", [
    (1, ParallelConfig(), 1), (2, ParallelConfig(), 2), (2, ParallelConfig(tp=2), 1),
    (8, ParallelConfig(tp=2, pp=2), 2), (8, ParallelConfig(pp=4), 2),
    (4, ParallelConfig(tp=2, sequence_parallel=True), 2),
    (8, ParallelConfig(tp=2, cp=2), 2), (4, ParallelConfig(cp=4), 1),
])
def test_validate_layout_returns_dp(world, cfg, dp):
    assert validate_layout(world, cfg) == dp


def test_env_int_names_the_variable(monkeypatch):
    from megatron_oar.runtime.distributed import _env_int

    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(ValueError, match="WORLD_SIZE='two'"):
        _env_int("WORLD_SIZE", 1)
    monkeypatch.setenv("WORLD_SIZE", "")
    assert _env_int("WORLD_SIZE", 1) == 1
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert _env_int("WORLD_SIZE", 1) == 8


# --------------------------------------------------------------------------- kernels


def test_kernel_report_matches_environment():
    import importlib.util

    line = kernels.kernel_report().line()
    assert line.startswith("kernels available: ") and "apex=" in line
    has_apex = importlib.util.find_spec("apex") is not None
    assert ("apex=yes" if has_apex else "apex=no") in line
    if not torch.cuda.is_available():
        assert "transformer_engine=no" in line and "device=cpu" in line
        assert "fused_weight_gradient=no" in line


def test_kernel_report_without_apex(monkeypatch):
    monkeypatch.setattr(kernels, "_has", lambda module: False)
    report = kernels.kernel_report()
    assert not report.apex and not report.transformer_engine
    line = report.line()
    assert "apex=no" in line
    assert not report.masked_softmax and "scaled_masked_softmax=no" in line


def test_masked_softmax_fusion_follows_its_kernel(monkeypatch):
    """The fusion is on only where megatron's kernel imports (a CUDA bf16 model without it
    crashed in attention): checked on the TransformerConfig the model is built from."""
    from megatron_oar.models import ModelOptions, parse_arch
    from megatron_oar.models.builder import transformer_config
    from tests.test_config import HF

    arch = parse_arch(HF["tiny"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for present in (False, True):
        monkeypatch.setattr(kernels, "_has", lambda module, p=present: p and module == "scaled_masked_softmax_cuda")
        assert kernels.kernel_report().masked_softmax is present
        cfg = transformer_config(arch, ModelOptions(spec="local", dtype="bf16"), 1, 1)
        assert cfg.masked_softmax_fusion is present


def test_moe_permute_fusion_follows_transformer_engine(monkeypatch):
    """megatron's MoE token (un)permutation runs fused where Transformer Engine's kernels import
    with CUDA (megatron's ``moe_utils`` takes them from TE), and stays off elsewhere (this CPU
    machine): checked on the TransformerConfig a MoE model is built from."""
    from megatron.core.transformer.moe import moe_utils

    from megatron_oar.models import ModelOptions, parse_arch
    from megatron_oar.models.builder import transformer_config
    from tests.test_qwen3_moe import QWEN3_30B_A3B

    arch = parse_arch(QWEN3_30B_A3B)
    assert not kernels.kernel_report().moe_permute  # here: no CUDA, no TE
    assert not transformer_config(arch, ModelOptions(spec="local"), 1, 1).moe_permute_fusion
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for present in (False, True):  # TE importable: megatron's moe_utils then has its kernels
        monkeypatch.setattr(kernels, "_has", lambda module, p=present: p and module == "transformer_engine")
        for name in kernels.FUSED_PERMUTE:
            monkeypatch.setattr(moe_utils, name, (lambda *a: None) if present else None, raising=False)
        assert kernels.kernel_report().moe_permute is present
        cfg = transformer_config(arch, ModelOptions(spec="local", dtype="bf16"), 1, 1)
        assert cfg.moe_permute_fusion is present


def test_kernel_report_with_apex(monkeypatch, caplog):
    monkeypatch.setattr(kernels, "_has", lambda module: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    report = kernels.kernel_report()
    # Transformer Engine and apex's fused grad kernels need CUDA even when importable
    assert report.apex and not report.transformer_engine and not report.grad_accum_fusion
    line = report.line()
    assert "apex=yes" in line and "transformer_engine=no" in line
    # the machine's line claims no kernel in use: Qwen's RMSNorm never runs apex's FusedLayerNorm
    # (it asserts LayerNorm), and the gradient-accumulation fusion is off in every config built
    assert "FusedLayerNorm" not in line and "norm=" not in line and "fusion=on" not in line
    with caplog.at_level("INFO", logger=kernels.__name__):
        assert kernels.log_kernel_report() == report
    assert line in caplog.text


def test_cpu_backend_refuses_cuda_machines(monkeypatch):
    from megatron_oar.runtime import cpu_backend

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(RuntimeError, match="CUDA"):
        cpu_backend.enable()


# -------------------------------------------------------------- gloo world / parallel_state


def _runtime_worker(out_dir: str, tp: int) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_oar.runtime import ParallelConfig, init_runtime

    rank = int(os.environ["RANK"])
    # Bad layouts fail naming the field before any process group exists.
    with pytest.raises(ValueError, match=r"world size 2 is not divisible by tp\*pp = 4\*1"):
        init_runtime(ParallelConfig(tp=4))
    assert not dist.is_initialized()

    info = init_runtime(ParallelConfig(tp=tp))

    def group_sum(group) -> float:
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t, group=group)
        return t.item()

    seen = dict(
        info=dict(rank=info.rank, world_size=info.world_size, local_rank=info.local_rank,
                  tp=info.tp, pp=info.pp, dp=info.dp, backend=info.backend,
                  device=str(info.device)),
        dist_backend=dist.get_backend(), dist_world=dist.get_world_size(),
        ps_tp=ps.get_tensor_model_parallel_world_size(),
        ps_pp=ps.get_pipeline_model_parallel_world_size(),
        ps_dp=ps.get_data_parallel_world_size(),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        dp_rank=ps.get_data_parallel_rank(),
        # the groups are real: all-reduce over each sums exactly its members' (rank + 1)
        tp_sum=group_sum(ps.get_tensor_model_parallel_group()),
        dp_sum=group_sum(ps.get_data_parallel_group()),
    )
    # Re-initialising with the same layout keeps it; another layout replaces it.
    again = init_runtime(ParallelConfig(tp=tp))
    assert again == info
    other = 3 - tp  # 2 -> 1, 1 -> 2
    relaid = init_runtime(ParallelConfig(tp=other))
    seen["relaid"] = dict(tp=relaid.tp, dp=relaid.dp,
                          ps_tp=ps.get_tensor_model_parallel_world_size(),
                          ps_dp=ps.get_data_parallel_world_size())
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(seen))


@pytest.mark.slow
@pytest.mark.parametrize("tp,dp", [(2, 1), (1, 2)], ids=["tp2", "tp1_dp2"])
def test_init_runtime_two_process_gloo(tmp_path, tp, dp):
    launch(_runtime_worker, 2, str(tmp_path), tp)
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert seen["info"] == dict(rank=rank, world_size=2, local_rank=rank, tp=tp, pp=1, dp=dp,
                                    backend="gloo", device="cpu")
        assert seen["dist_backend"] == "gloo" and seen["dist_world"] == 2
        assert (seen["ps_tp"], seen["ps_pp"], seen["ps_dp"]) == (tp, 1, dp)
        assert seen["tp_rank"] == (rank if tp == 2 else 0)
        assert seen["dp_rank"] == (rank if dp == 2 else 0)
        assert seen["tp_sum"] == (3.0 if tp == 2 else rank + 1.0)
        assert seen["dp_sum"] == (3.0 if dp == 2 else rank + 1.0)
        assert seen["relaid"] == dict(tp=3 - tp, dp=3 - dp, ps_tp=3 - tp, ps_dp=3 - dp)


def _timeouts_worker(model: str, out: str) -> None:
    """Every process group's timeout, as its gloo backend holds it (what each collective waits)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_oar.config import load_config
    from megatron_oar.training.run_context import start_run

    cfg = load_config(Path(__file__).parents[1] / "examples" / "tiny_cpu.yaml",
                      [f"model.path={model}", "parallel.tp=1", "parallel.timeout_minutes=7"])
    ctx = start_run(cfg)  # init_runtime and the trainer's control group
    groups = {"world": dist.group.WORLD, "control": ctx.control,
              "tp": ps.get_tensor_model_parallel_group(), "pp": ps.get_pipeline_model_parallel_group(),
              "dp": ps.get_data_parallel_group(), "dp_gloo": ps.get_data_parallel_group_gloo(),
              "dp_cp_gloo": ps.get_data_parallel_group_gloo(with_context_parallel=True)}
    seen = {name: g._get_backend(torch.device("cpu")).options._timeout.total_seconds() / 60
            for name, g in groups.items()}
    Path(out, f"timeouts_rank{dist.get_rank()}.json").write_text(json.dumps(seen))


@pytest.mark.slow
def test_every_group_has_the_configured_timeout(trainer_checkpoint, tmp_path):
    """parallel.timeout_minutes reaches megatron's groups (gloo ones included) and the control
    group, not only the world's (both got torch's and megatron's 30 minutes). 2 ranks, ~3 s."""
    launch(_timeouts_worker, 2, str(trainer_checkpoint), str(tmp_path))
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"timeouts_rank{rank}.json").read_text())
        assert seen == dict.fromkeys(seen, 7.0), seen  # minutes


# ------------------------------------------------------------------ CPU backend and RNG


def _cpu_backend_worker(out_dir: str) -> None:
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    from megatron_oar.runtime import ParallelConfig, cpu_backend, init_runtime

    rank = int(os.environ["RANK"])
    assert not cpu_backend.is_enabled()
    # Without the backend this torch build has no CUDA at all.
    with pytest.raises((RuntimeError, AssertionError)):
        torch.zeros(2, device="cuda")

    cpu_backend.enable()
    cpu_backend.enable()  # idempotent
    assert cpu_backend.is_enabled()
    cpu = torch.device("cpu")
    z = torch.zeros(2, device="cuda")
    assert z.device == cpu and torch.equal(z, torch.zeros(2))
    assert torch.tensor([1.5], device="cuda:0").device == cpu
    assert torch.arange(3, device=torch.device("cuda")).tolist() == [0, 1, 2]
    for moved in (torch.ones(1).to("cuda"), torch.ones(1).to(device="cuda"),
                  torch.ones(1).to(torch.device("cuda", 0)), torch.ones(1).cuda(),
                  torch.ones(1).cuda(0)):
        assert moved.device == cpu and moved.item() == 1.0
    half = torch.ones(1).to("cuda", torch.float64)
    assert half.device == cpu and half.dtype == torch.float64
    assert torch.cuda.current_device() == 0
    assert torch.empty(1, device=torch.cuda.current_device()).device == cpu
    assert torch.cuda.synchronize() is None
    assert (torch.ones(2, device="cuda") + torch.ones(2)).tolist() == [2.0, 2.0]

    def draw() -> dict[str, torch.Tensor]:
        tracker = get_cuda_rng_tracker()
        a = torch.rand(4, device="cuda")
        with tracker.fork():
            f1 = torch.rand(4, device="cuda")
            drop = torch.nn.functional.dropout(torch.ones(64, device="cuda"), p=0.5)
        with tracker.fork():
            f2 = torch.rand(4, device="cuda")
        b = torch.rand(4, device="cuda")
        return dict(a=a, f1=f1, drop=drop, f2=f2, b=b)

    init_runtime(ParallelConfig(tp=2, seed=123))
    assert ps.get_tensor_model_parallel_rank() == rank
    run1 = draw()
    init_runtime(ParallelConfig(tp=2, seed=123))  # a second run with the same seed
    run2 = draw()
    init_runtime(ParallelConfig(tp=2, seed=123))
    plain = [torch.rand(4), torch.rand(4)]  # the default stream with no fork in between
    init_runtime(ParallelConfig(tp=2, seed=124))
    other = draw()
    torch.save(dict(run1=run1, run2=run2, plain=plain, other=other),
               Path(out_dir, f"rank{rank}.pt"))


@pytest.mark.slow
def test_cpu_backend_devices_and_rng_tracker(tmp_path):
    launch_fresh(_cpu_backend_worker, 2, str(tmp_path))  # checks a new process's state first
    r = [torch.load(tmp_path / f"rank{i}.pt") for i in (0, 1)]
    for rank, seen in enumerate(r):
        run1, run2, plain, other = seen["run1"], seen["run2"], seen["plain"], seen["other"]
        for k in run1:  # same seed -> identical, inside and outside the fork
            assert torch.equal(run1[k], run2[k]), (rank, k)
        # the fork leaves the default (data-parallel) stream exactly where it was
        assert torch.equal(run1["a"], plain[0]) and torch.equal(run1["b"], plain[1])
        # the forked stream advances from one fork to the next
        assert not torch.equal(run1["f1"], run1["f2"])
        # megatron's seeds: default stream = seed, TP stream = seed + 2718 + tp_rank
        assert torch.equal(run1["a"], torch.rand(4, generator=torch.Generator().manual_seed(123)))
        g = torch.Generator().manual_seed(123 + 2718 + rank)
        assert torch.equal(run1["f1"], torch.rand(4, generator=g))
        assert 0 < int((run1["drop"] == 0).sum()) < 64
        # another seed gives other numbers
        assert not torch.equal(other["a"], run1["a"])
        assert not torch.equal(other["f1"], run1["f1"])
    # TP ranks: different inside the fork, identical outside it
    assert not torch.equal(r[0]["run1"]["f1"], r[1]["run1"]["f1"])
    assert not torch.equal(r[0]["run1"]["drop"], r[1]["run1"]["drop"])
    assert torch.equal(r[0]["run1"]["a"], r[1]["run1"]["a"])
    assert torch.equal(r[0]["run1"]["b"], r[1]["run1"]["b"])


# ------------------------------------------------------- pipeline schedule forward+backward

LAYERS_PER_STAGE = 2


def _pp_train_worker(out_dir: str) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_oar.models import ModelOptions, build_gpt_model
    from megatron_oar.models.forward import position_ids_for
    from megatron_oar.runtime import ParallelConfig, init_runtime
    from tests.tiny import SMALL

    cfg = {**SMALL, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}
    assert cfg["num_hidden_layers"] == 2 * LAYERS_PER_STAGE
    rank = int(os.environ["RANK"])
    info = init_runtime(ParallelConfig(pp=2))
    assert (info.pp, info.dp) == (2, 1)
    stage = ps.get_pipeline_model_parallel_rank()
    assert stage == rank
    model = build_gpt_model(cfg, ModelOptions())
    tokens = torch.randint(0, cfg["vocab_size"], (4, 16),
                           generator=torch.Generator().manual_seed(0))
    micro = list(tokens.split(2))  # two micro-batches: a real 1F1B schedule

    def step(data_iter, m):
        batch = next(data_iter)
        out = m(batch, position_ids_for(batch), attention_mask=None)

        def loss_func(logits):
            loss = logits.float().mean()
            # clone: the schedule divides the returned loss in place by num_microbatches
            return loss, {"loss": loss.detach().clone()}

        return out, loss_func

    model.train()
    model.zero_grad()
    losses = get_forward_backward_func()(
        forward_step_func=step, data_iterator=iter(micro), model=[model],
        num_microbatches=len(micro), seq_length=tokens.shape[1], micro_batch_size=2,
        forward_only=False)

    def global_name(name: str) -> str:  # stage-local layer numbers -> global ones
        return re.sub(r"^decoder\.layers\.(\d+)\.",
                      lambda m: f"decoder.layers.{int(m.group(1)) + stage * LAYERS_PER_STAGE}.",
                      name)

    mine = {}
    for name, p in model.named_parameters():
        assert p.grad is not None, f"stage {stage}: {name} got no gradient"
        assert torch.isfinite(p.grad).all(), f"stage {stage}: {name}"
        assert p.grad.abs().sum() > 0, f"stage {stage}: {name} has an all-zero gradient"
        mine[global_name(name)] = (p.detach().clone(), p.grad.detach().clone())
    if stage == 0:
        assert losses == [] and "embedding.word_embeddings.weight" in mine
    else:
        assert len(losses) == 2 and "output_layer.weight" in mine
    gathered: list = [None, None]
    dist.all_gather_object(gathered, dict(params=mine,
                                          losses=[d["loss"].item() for d in losses]))

    # Reference: the same weights as one unpipelined model, plain autograd, same loss scale
    # (the schedule divides each micro-batch loss by the number of micro-batches).
    relaid = init_runtime(ParallelConfig())
    assert (relaid.pp, relaid.dp) == (1, 2)
    ref = build_gpt_model(cfg, ModelOptions())
    params = {**gathered[0]["params"], **gathered[1]["params"]}
    ref_params = dict(ref.named_parameters())
    assert set(ref_params) == set(params)
    with torch.no_grad():
        for name, p in ref_params.items():
            p.copy_(params[name][0])
    ref.train()
    ref_losses = []
    for mb in micro:
        loss = ref(mb, position_ids_for(mb), attention_mask=None).float().mean()
        (loss / len(micro)).backward()
        ref_losses.append(loss.item())
    report = {"losses": gathered[1]["losses"], "ref_losses": ref_losses, "grad_rel_err": {}}
    for name, p in ref_params.items():
        got = params[name][1]
        report["grad_rel_err"][name] = ((got - p.grad).abs().max() / p.grad.abs().max()).item()
    report["names"] = {r: sorted(gathered[r]["params"]) for r in (0, 1)}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(report))


@pytest.mark.slow
def test_pipeline_schedule_forward_backward_pp2(tmp_path):
    launch(_pp_train_worker, 2, str(tmp_path))
    report = json.loads((tmp_path / "rank0.json").read_text())
    names = report["names"]
    # both stages hold (and trained) their own half of the model
    assert any(n.startswith("decoder.layers.0.") for n in names["0"])
    assert any(n.startswith("decoder.layers.1.") for n in names["0"])
    assert not any(n.startswith(("decoder.layers.2.", "output_layer")) for n in names["0"])
    assert any(n.startswith("decoder.layers.3.") for n in names["1"])
    assert "decoder.final_layernorm.weight" in names["1"] and "output_layer.weight" in names["1"]
    assert not any(n.startswith(("decoder.layers.0.", "embedding")) for n in names["1"])
    # the pipelined losses and gradients are those of the unpipelined model
    assert len(report["losses"]) == 2
    for got, ref in zip(report["losses"], report["ref_losses"]):
        assert got == pytest.approx(ref, rel=1e-5, abs=1e-7)
    bad = {n: e for n, e in report["grad_rel_err"].items() if not e < 1e-4}
    assert bad == {}, bad
    assert len(report["grad_rel_err"]) == len(names["0"]) + len(names["1"])


def test_one_process_world_leaves_no_rendezvous_behind(monkeypatch):
    """A plain-python init_runtime sets torchrun's variables for itself and removes them again,
    so a child process started later does not try the old (possibly reused) port."""
    from megatron_oar.runtime import destroy_runtime, init_runtime

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")  # one the caller set stays
    init_runtime()
    try:
        assert os.environ["MASTER_PORT"] and os.environ["WORLD_SIZE"] == "1"
    finally:
        destroy_runtime()
    assert "MASTER_PORT" not in os.environ and "RANK" not in os.environ
    assert os.environ["MASTER_ADDR"] == "127.0.0.1"


# ------------------------------------------------- one rank's long work, the others waiting

def _long_work_worker(out: str) -> None:
    """The default group's timeout cut to 2 s: one rank's 4-second work (rank 0's eval export,
    the verify reference on another rank) must not leave the others in a default-group
    collective past it."""
    from datetime import timedelta
    from types import SimpleNamespace

    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    import megatron_oar.eval.run_eval as run_eval
    from megatron_oar.runtime import init_runtime
    from megatron_oar.runtime.distributed import on_one_rank

    init_runtime(ParallelConfig())
    c10d._set_pg_timeout(timedelta(seconds=2), None)
    res = {}
    cfg = SimpleNamespace(checkpoint=SimpleNamespace(convert_timeout_minutes=1.0))
    saved = run_eval.prepare_job

    def slow(outcome):
        def prepare(_cfg):
            time.sleep(4)
            if isinstance(outcome, Exception):
                raise outcome
            return outcome
        return prepare

    try:
        run_eval.prepare_job = slow("the job")
        res["job"] = run_eval.share_job(cfg)
        run_eval.prepare_job = slow(ValueError("eval.model='x': no such directory"))
        try:
            run_eval.share_job(cfg)
        except ValueError as e:
            res["error"] = str(e)
    finally:
        run_eval.prepare_job = saved

    def reference():
        time.sleep(4)
        return "reference"

    res["one_rank"] = on_one_rank(reference, src=1, timeout_minutes=1.0, setting="s", what="the reference")
    dist.barrier()  # the default group is fine afterwards
    save_gathered(res, out)


@pytest.mark.slow
def test_one_rank_works_while_the_others_wait_past_the_collective_timeout(tmp_path):
    """``oar eval``'s export on rank 0 (``share_job``) and ``oar-convert verify``'s HF reference on
    the reporting rank (``on_one_rank``) take longer than the default group's timeout (2 s here,
    ``parallel.timeout_minutes`` in a run: after it NCCL ends the process); the other ranks wait
    on a gloo group sized for the work. 2 ranks, about 10 s."""
    ranks = launch_and_load(_long_work_worker, 2, tmp_path / "long.pt")
    for rank, res in enumerate(ranks):
        assert res["job"] == "the job", rank
        assert res["error"] == "eval.model='x': no such directory", rank
        assert res["one_rank"] == ("reference" if rank == 1 else None), rank


def test_pruned_checkpoints_are_deleted_in_the_background(tmp_path, monkeypatch):
    """Rank 0 prunes old checkpoints (``checkpoint.keep_last``) while the other ranks wait at a
    barrier: the deletion runs in a thread, so a slow file system keeps no one waiting; the
    pruned step is renamed away at once (never listed), and gone once the deletion ends."""
    import threading

    from megatron_oar.training import step_checkpoint as ckpt

    for step in (1, 2):
        d = ckpt.step_dir(tmp_path, step)
        d.mkdir()
        (d / ckpt.STATE_FILE).write_text("{}")
    release, real = threading.Event(), ckpt.shutil.rmtree

    def slow_rmtree(path, ignore_errors=False):
        release.wait(30)
        real(path, ignore_errors=ignore_errors)

    monkeypatch.setattr(ckpt.shutil, "rmtree", slow_rmtree)
    done = threading.Event()
    worker = threading.Thread(target=lambda: (ckpt._publish(tmp_path, ckpt.step_dir(tmp_path, 2), 2, 1), done.set()))
    worker.start()
    try:
        assert done.wait(10), "pruning blocked rank 0 until the deletion ended"
        assert [s for s, _ in ckpt.complete_checkpoints(tmp_path)] == [2]
    finally:
        release.set()
        worker.join()
    assert ckpt.wait_for_deletions(30)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_00000002"]


# ------------------------------------------------------------- the CPU check of NCCL's rules

def _nccl_rules_worker(out: str) -> None:
    import torch.distributed as dist

    from megatron_oar.runtime import gloo_group, init_runtime
    from megatron_oar.runtime.roles import CrossGroup
    from megatron_oar.testing import nccl_rules

    res = {}
    with nccl_rules.enabled():
        init_runtime(ParallelConfig())
        device = torch.device("cuda", torch.cuda.current_device())  # what a GPU run writes

        def refused(fn) -> str:
            try:
                fn()
            except nccl_rules.NcclRuleError as e:
                return "dtype" if "dtype" in str(e) else "host" if "host" in str(e) else str(e)
            return "taken"

        ok = torch.ones(3, device=device)
        res["device"] = refused(lambda: dist.all_reduce(ok))
        res["derived"] = refused(lambda: dist.all_reduce((ok * 2).view(3, 1).contiguous()))
        res["host"] = refused(lambda: dist.all_reduce(torch.ones(3)))
        res["from_list"] = refused(lambda: dist.all_reduce(torch.tensor([1, 2])))
        res["cpu_copy"] = refused(lambda: dist.all_reduce(ok.cpu()))
        res["moved"] = refused(lambda: dist.all_reduce(torch.ones(3).cuda()))
        res["int16"] = refused(lambda: dist.all_reduce(ok.to(torch.int16)))
        res["bool"] = refused(lambda: dist.all_reduce(ok.bool()))
        res["gather_list"] = refused(lambda: dist.all_gather([torch.empty(3), torch.empty(3)], ok))
        gloo = gloo_group()
        res["gloo"] = refused(lambda: dist.all_reduce(torch.ones(3), group=gloo))  # host-side group
        cross = CrossGroup(dist.group.WORLD, dist.get_rank(), (0, 1), nccl=True)
        res["cross"] = refused(lambda: cross.broadcast(torch.ones(3), 0))
    res["off"] = refused(lambda: dist.all_reduce(torch.ones(3)))
    save_gathered(res, out)


@pytest.mark.slow
def test_nccl_rules_check_on_cpu(tmp_path):
    """The tests' CPU check of NCCL's rules (``testing/nccl_rules.py``): on a group that is NCCL on
    a GPU, a tensor made for the device passes; one built on the host (no ``device=``, a list,
    ``.cpu()``) or of a dtype NCCL lacks (int16) is refused; a ``backend="gloo"`` group takes
    host tensors; a cross-role group marked ``nccl`` is checked; nothing is checked once it is off.
    2 ranks, about 2 s in a warm pool."""
    for res in launch_and_load(_nccl_rules_worker, 2, tmp_path / "rules.pt"):
        assert res == {"device": "taken", "derived": "taken", "host": "host", "from_list": "host",
                       "cpu_copy": "host", "moved": "taken", "int16": "dtype", "bool": "taken",
                       "gather_list": "host", "gloo": "taken", "cross": "host", "off": "taken"}, res
