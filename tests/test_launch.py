"""Launch scripts and ``oar launch`` (nemo-run), on CPU: dry runs only, nothing is started.

The shell scripts run with ``DRYRUN=1`` (they print the exact command); Slurm is faked with an
``scontrol`` first on PATH. ``oar launch --dryrun`` builds the real nemo-run task and executor and
prints the torchrun command (local) or the full sbatch script (Slurm); invalid layouts are refused
before nemo-run is even imported.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_oar import cli
from megatron_oar.commands import launch

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "launch_scripts"
G7 = "examples/qwen2.5-7b_oar_g.yaml"
P7 = "examples/qwen2.5-7b_oar_p.yaml"
G32 = "examples/qwen2.5-32b_oar_g.yaml"
LAUNCH_VARS = ("MASTER_ADDR", "MASTER_PORT", "NNODES", "NODE_RANK", "GPUS_PER_NODE", "RESUME",
               "TORCHRUN", "CONFIG", "OAR_REPO", "DRYRUN", "MAX_RESTARTS", "MAX_REQUEUES", "RDZV_ID")


def _env(**extra: str) -> dict[str, str]:
    """This process's environment without any launch or Slurm variables, plus ``extra``."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("SLURM_") and k not in LAUNCH_VARS and k not in launch.parse_env_sh()}
    return {**env, "DRYRUN": "1", **extra}


def _sh(script: str, *args: str, cwd: Path = REPO, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPTS / script), *args], cwd=cwd, env=_env(**env),
                          capture_output=True, text=True, timeout=60)


# ------------------------------------------------------------------------------- shell scripts

@pytest.mark.parametrize("path", sorted(p.name for p in SCRIPTS.iterdir()
                                        if p.suffix in (".sh", ".sbatch")))
def test_scripts_parse(path):
    subprocess.run(["bash", "-n", str(SCRIPTS / path)], check=True, capture_output=True)


def test_single_node_dryrun(tmp_path):
    r = _sh("torchrun_single_node.sh", "my.yaml", "train.steps=10", "credit=grpo", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout == ("torchrun --standalone --nproc-per-node 8 --max-restarts 3 -m megatron_oar.commands.train "
                        "--config my.yaml --resume auto train.steps=10 credit=grpo\n")


def test_single_node_env_knobs(tmp_path):
    r = _sh("torchrun_single_node.sh", "my.yaml", "rollout.gpu_memory_utilization=0.4",
            "train.steps=1", cwd=tmp_path, GPUS_PER_NODE="4", RESUME="none", MAX_RESTARTS="0")
    assert r.returncode == 0, r.stderr
    # vLLM's GPU share is a config override like any other, passed on as given
    assert r.stdout == ("torchrun --standalone --nproc-per-node 4 --max-restarts 0 -m megatron_oar.commands.train "
                        "--config my.yaml --resume none rollout.gpu_memory_utilization=0.4 train.steps=1\n")


def test_no_gpu_memory_variable():
    """The vLLM GPU share has one source, the config key: no script or env.sh reads a variable."""
    for path in [*SCRIPTS.iterdir(), launch.ENV_SH, Path(launch.__file__)]:
        if path.is_file():
            assert "OAR_ROLLOUT_GPU_MEMORY_UTILIZATION" not in path.read_text(), path


@pytest.mark.parametrize("wrapper,config", [("qwen2.5-7b_oar_g.sh", G7), ("qwen2.5-7b_oar_p.sh", P7)])
def test_7b_wrappers(wrapper, config, tmp_path):
    r = _sh(wrapper, "train.steps=10", cwd=tmp_path)  # from anywhere: they cd to the repo root
    assert r.returncode == 0, r.stderr
    assert r.stdout == ("torchrun --standalone --nproc-per-node 8 --max-restarts 3 -m megatron_oar.commands.train "
                        f"--config {config} --resume auto train.steps=10\n")
    assert (REPO / config).is_file()


def test_usage_without_config():
    for script in ("torchrun_single_node.sh", "torchrun_multi_node.sh", "slurm.sbatch"):
        r = _sh(script)
        assert r.returncode == 2 and "usage:" in r.stderr and not r.stdout, script


def test_multi_node_from_variables():
    r = _sh("torchrun_multi_node.sh", "c.yaml", "train.steps=3", MASTER_ADDR="node-0", NNODES="4")
    assert r.returncode == 0, r.stderr
    # an elastic rendezvous: a failed node restarts every node's workers (tests/test_faults.py)
    assert r.stdout == ("torchrun --nnodes 4 --rdzv-backend c10d --rdzv-endpoint node-0:29500 "
                        "--rdzv-id megatron-oar --max-restarts 3 --nproc-per-node 8 -m megatron_oar.commands.train "
                        "--config c.yaml --resume auto train.steps=3\n")


@pytest.fixture
def fake_slurm(tmp_path):
    """A fake ``scontrol show hostnames`` first on PATH, and a job step's SLURM_* variables."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"
    scontrol.write_text('#!/bin/bash\n[[ "$1 $2 $3" == "show hostnames gpu-[07-09]" ]] || exit 3\n'
                        "printf 'gpu-07\\ngpu-08\\ngpu-09\\n'\n")
    scontrol.chmod(0o755)
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "123", "SLURM_NNODES": "3",
            "SLURM_NODEID": "1", "SLURM_JOB_NODELIST": "gpu-[07-09]", "SLURM_GPUS_ON_NODE": "8",
            "SLURM_SUBMIT_DIR": str(REPO)}


def test_multi_node_from_slurm(fake_slurm):
    r = _sh("torchrun_multi_node.sh", G32, **fake_slurm)
    assert r.returncode == 0, r.stderr
    assert r.stdout == ("torchrun --nnodes 3 --rdzv-backend c10d --rdzv-endpoint gpu-07:29500 --rdzv-id 123 "
                        "--max-restarts 3 --nproc-per-node 8 -m megatron_oar.commands.train "
                        f"--config {G32} --resume auto\n")
    # a variable that is set wins over Slurm's
    r = _sh("torchrun_multi_node.sh", G32, **fake_slurm, MASTER_ADDR="10.0.0.1", MASTER_PORT="6000",
            RDZV_ID="run7")
    assert "--rdzv-endpoint 10.0.0.1:6000 --rdzv-id run7 " in r.stdout


def test_multi_node_missing_variables():
    r = _sh("torchrun_multi_node.sh", "c.yaml", MASTER_ADDR="node-0")
    assert r.returncode == 2 and not r.stdout
    assert "NNODES not set" in r.stderr and "srun" in r.stderr


def test_sbatch_dryrun(fake_slurm, tmp_path):
    r = _sh("slurm.sbatch", G32, "train.steps=2", cwd=tmp_path, **fake_slurm, NODE_RANK="5")
    assert r.returncode == 0, r.stderr
    assert r.stdout == ("srun --ntasks-per-node=1 --kill-on-bad-exit=1 "
                        f"launch_scripts/torchrun_multi_node.sh {G32} train.steps=2\n")
    text = (SCRIPTS / "slurm.sbatch").read_text()
    for flag in ("--nodes=", "--ntasks-per-node=1", "--gpus-per-node=8", "--exclusive", "--time=",
                 "--output=", "--requeue", "--signal=B:USR1@600"):
        assert f"#SBATCH {flag}" in text
    assert "sbatch --nodes 4 --account X" in text


def test_one_preemption_grace():
    """Slurm's warning, torchrun's wait for the workers and the config's grace are one number."""
    from megatron_oar.config import LaunchConfig

    grace = LaunchConfig().preemption_grace_s
    assert f"#SBATCH --signal=B:USR1@{grace}\n" in (SCRIPTS / "slurm.sbatch").read_text()
    env = launch.parse_env_sh()
    assert env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == str(grace)
    assert "SIGUSR1" in env["PET_SIGNALS_TO_HANDLE"].split(",")
    assert launch.elastic_env(LaunchConfig())["PET_SIGNALS_TO_HANDLE"] == env["PET_SIGNALS_TO_HANDLE"]


# ---------------------------------------------------------------------------------------- env.sh

def test_env_sh_parse():
    env = launch.parse_env_sh()
    assert env["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    assert env["TOKENIZERS_PARALLELISM"] == "false"
    assert "PYTORCH_CUDA_ALLOC_CONF" not in env and "VLLM_USE_V1" not in env
    text = (SCRIPTS / "env.sh").read_text()
    assert not re.search(r"^\s*export PYTORCH_CUDA_ALLOC_CONF", text, re.M)


def test_env_sh_is_one_file():
    """``oar launch`` reads the package's env.sh (there after a non-editable install); the file the
    scripts source is a symlink to it, not a copy that could drift."""
    assert launch.ENV_SH == Path(launch.__file__).parents[1] / "resources" / "env.sh"
    assert (SCRIPTS / "env.sh").is_symlink()
    assert (SCRIPTS / "env.sh").resolve() == launch.ENV_SH.resolve()


def test_env_sh_matches_bash():
    """What bash exports from env.sh is what parse_env_sh reads, and exported values win."""
    out = subprocess.run(["bash", "-c", f'source {SCRIPTS / "env.sh"} && env -0'],
                         env={**_env(), "NCCL_DEBUG": "INFO"}, capture_output=True, text=True,
                         check=True).stdout
    exported = dict(item.split("=", 1) for item in out.split("\0") if "=" in item)
    for name, value in launch.parse_env_sh().items():
        assert exported[name] == ("INFO" if name == "NCCL_DEBUG" else value), name


def test_env_sh_parser_rejects_other_lines(tmp_path):
    bad = tmp_path / "env.sh"
    bad.write_text('export A="${A:-1}"\nexport B=2\n')
    with pytest.raises(launch.ConfigError, match=r"env.sh:2: expected export NAME="):
        launch.parse_env_sh(bad)


# ----------------------------------------------------------------------------------- oar launch

@pytest.fixture
def in_repo(monkeypatch):
    monkeypatch.chdir(REPO)  # the example configs' relative paths


def _launch(capsys, *argv: str) -> tuple[int, str, str]:
    rc = cli.main(["launch", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_launch_local_dryrun(capsys, in_repo, tmp_path):
    rc, out, err = _launch(capsys, "--config", G7, "--dryrun", "--resume", "none",
                           "train.steps=10", "credit=grpo", f"launch.slurm.job_dir={tmp_path}/jobs")
    assert rc == 0, err
    assert "export CUDA_DEVICE_MAX_CONNECTIONS=1\n" in out and "export NCCL_DEBUG=WARN\n" in out
    assert f'export PATH={Path(sys.executable).parent}:"$PATH"\n' in out  # this env's torchrun
    torchrun = [line for line in out.splitlines() if line.startswith("torchrun ")]
    assert len(torchrun) == 1
    assert "--nnodes 1 --nproc-per-node 8 " in torchrun[0]
    assert torchrun[0].endswith(f"-m megatron_oar.commands.train --config {G7} --resume none "
                                f"train.steps=10 credit=grpo launch.slurm.job_dir={tmp_path}/jobs")
    assert not (tmp_path / "jobs").exists()  # a dry run writes only to a temporary directory


def test_launch_gpu_memory_override(capsys, in_repo):
    rc, out, err = _launch(capsys, "--config", G7, "--dryrun", "--gpus-per-node", "4",
                           "rollout.gpu_memory_utilization=0.4", "train.steps=2")
    assert rc == 0, err
    assert "--nproc-per-node 4 " in out
    assert ("--config examples/qwen2.5-7b_oar_g.yaml rollout.gpu_memory_utilization=0.4 "
            "train.steps=2 launch.gpus_per_node=4") in out
    # and it is validated like any other setting
    rc, _, err = _launch(capsys, "--config", G7, "--dryrun", "rollout.gpu_memory_utilization=1.5")
    assert rc == 2 and "rollout.gpu_memory_utilization" in err


def test_launch_keeps_logging(capsys, in_repo):
    """nemo-run resets the root logger; the in-process caller gets its own back."""
    import io
    import logging

    root = logging.getLogger()
    mine = logging.StreamHandler(io.StringIO())
    root.addHandler(mine)

    def ours():  # pytest's own capture handlers come and go with its phases
        return [h for h in root.handlers if not type(h).__module__.startswith("_pytest")], root.level

    before = ours()
    try:
        assert _launch(capsys, "--config", G7, "--dryrun")[0] == 0
        assert ours() == before and mine in root.handlers
    finally:
        root.removeHandler(mine)


def test_launch_slurm_dryrun(capsys, in_repo, tmp_path):
    rc, out, err = _launch(capsys, "--config", G32, "--dryrun", "launch.slurm.account=proj_rl",
                           "launch.slurm.partition=batch", "launch.env.EXTRA=a b",
                           f"launch.slurm.job_dir={tmp_path}/jobs")
    assert rc == 0, err
    assert re.search(r"^#SBATCH --nodes=4$", out, re.M)  # launch.nodes of the 32B config
    for line in ("#SBATCH --account=proj_rl", "#SBATCH --partition=batch",
                 "#SBATCH --gpus-per-node=8", "#SBATCH --ntasks-per-node=1", "#SBATCH --exclusive",
                 "#SBATCH --time=2-00:00:00", "#SBATCH --job-name=qwen2.5-32b_oar_g",
                 "export CUDA_DEVICE_MAX_CONNECTIONS=1", "export TORCH_NCCL_AVOID_RECORD_STREAMS=1",
                 "export EXTRA='a b'"):
        assert re.search(f"^{re.escape(line)}$", out, re.M), line
    srun = [line for line in out.splitlines() if line.startswith("srun ")]
    assert len(srun) == 1
    assert "torchrun " in srun[0] and "--nnodes 4 --nproc-per-node 8 " in srun[0]
    assert f"--chdir {tmp_path}/jobs/experiments/qwen2.5-32b_oar_g/" in srun[0]
    assert f"-m megatron_oar.commands.train --config {G32} " in srun[0]
    assert "sbatch --requeue --parsable" in out and f"-> {REPO}" in out
    # fault tolerance: SIGUSR1 before the time limit, torchrun restarts, requeues after a failure
    for line in ("#SBATCH --signal=USR1@600", "export PET_MAX_RESTARTS=3",
                 "export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=600", "export TORCHX_MAX_RETRIES=3"):
        assert re.search(f"^{re.escape(line)}$", out, re.M), line
    assert "scontrol requeue" in out
    assert not (tmp_path / "jobs").exists()


def test_launch_flags_become_overrides(capsys, in_repo):
    rc, out, err = _launch(capsys, "--config", G7, "--executor", "slurm", "--nodes", "2",
                           "--dryrun")
    assert rc == 0, err
    assert re.search(r"^#SBATCH --nodes=2$", out, re.M) and "--nnodes 2 " in out
    assert "launch.executor=slurm launch.nodes=2" in out


@pytest.mark.slow
def test_shim_writes_nothing(tmp_path):
    """``python launch_scripts/nemo_run_launch.py``, from another directory, with a fresh HOME:
    the dry run leaves no file behind (no job dir, no ~/.nemo_run)."""
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir(), work.mkdir()
    env = {k: v for k, v in _env(HOME=str(home)).items() if k not in ("DRYRUN", "NEMORUN_HOME")}
    r = subprocess.run([sys.executable, str(SCRIPTS / "nemo_run_launch.py"), "--config",
                        str(REPO / G32), "--dryrun"], cwd=work, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "#SBATCH --nodes=4" in r.stdout and f"--chdir {work}/slurm_jobs/" in r.stdout
    assert list(work.iterdir()) == [] and list(home.iterdir()) == []


@pytest.mark.parametrize("overrides,message", [
    (["parallel.tp=3"], "parallel.tp"),                           # 8 GPUs; 28 heads, 4 KV groups
    (["parallel.tp=8"], "parallel.tp=8 does not divide num_attention_heads=28"),
    (["parallel.pp=5"], "parallel.pp"),                           # 28 layers
    (["--gpus-per-node", "5", "parallel.tp=1", "parallel.pp=5"],
     "parallel.pp=5 does not divide num_hidden_layers=28"),
    (["train.batching=padded", "train.micro_batch_size=3"], "train.micro_batch_size"),  # 512, DP 4
    (["train.batching=padded", "train.prompts_per_step=63"], "train.micro_batch_size*DP"),
    (["train.group_size=5", "train.prompts_per_step=63"], "not divisible by the data-parallel size 4"),
    (["--nodes", "2"], "launch.nodes=2: the local executor runs on this node only"),
    (["--arch", "qwen2.5-9b"], "--arch 'qwen2.5-9b': unknown"),
    (["train.stepz=1"], "unknown key 'train.stepz'"),
])
def test_launch_refuses_before_building(overrides, message, capsys, in_repo, monkeypatch):
    monkeypatch.setitem(sys.modules, "nemo_run", None)  # importing nemo-run would fail
    rc, out, err = _launch(capsys, "--config", G7, "--dryrun", *overrides)
    assert rc == 2 and not out
    assert err.startswith("oar launch: ") and err.count("\n") == 1 and message in err, err


def test_real_slurm_submission_needs_account(capsys, in_repo, monkeypatch):
    monkeypatch.setitem(sys.modules, "nemo_run", None)
    rc, out, err = _launch(capsys, "--config", G32)  # executor slurm, no account: not submitted
    assert rc == 2 and err.startswith("oar launch: launch.slurm.account: not set")
    rc, out, err = _launch(capsys, "--config", G32, "launch.slurm.account=a")
    assert rc == 2 and err.startswith("oar launch: launch.slurm.partition: not set")


def test_model_without_config_or_preset(capsys, in_repo, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "nemo_run", None)
    rc, _, err = _launch(capsys, "--config", G7, "--dryrun", f"model.path={tmp_path}/my-model")
    assert rc == 2 and "pass --arch" in err
