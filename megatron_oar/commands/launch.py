"""``oar launch``: check a config against the cluster it names, then start it with nemo-run.

    oar launch --config X.yaml [--executor local|slurm] [--nodes N] [--gpus-per-node G]
               [--arch PRESET] [--resume auto|none|DIR] [--dryrun] [key=value ...]
    python launch_scripts/nemo_run_launch.py ...     (the same)

Every flag is written into the config as an override (``--nodes 4`` is ``launch.nodes=4``), so
the config is the one source. The whole config is validated for its world
(``launch.nodes * launch.gpus_per_node``) and its model's shape (``model.path``'s config.json, or
the published Qwen2.5 architecture its name or ``--arch`` refers to) before anything is built or
submitted; a config that cannot work prints ``oar launch: <message naming the key>`` and exits 2.

The task is ``torchrun ... -m megatron_oar.commands.train --config X.yaml [--resume R] [key=value ...]``
with ``launch.gpus_per_node`` processes on each of ``launch.nodes`` nodes:

* ``local``: nemo-run's LocalExecutor on this node (one node only); waits and tails the logs.
* ``slurm``: nemo-run's SlurmExecutor, from a login node (LocalTunnel): an sbatch script under
  ``launch.slurm.job_dir``, one srun task per node, torchrun with a c10d rendezvous on the first
  node. The job runs in a ``code`` symlink to the directory ``oar launch`` was started in (a shared
  file system), so the config's relative paths mean what they mean here. Submits and returns.

Fault tolerance (docs/running-for-days.md): torchrun restarts the worker group up to
``launch.max_restarts`` times (``PET_MAX_RESTARTS``), each restart resuming from the newest
checkpoint; Slurm jobs ask for SIGUSR1 ``launch.preemption_grace_s`` before the time limit, on
which the workers checkpoint and exit, and nemo-run's script then requeues the job, up to
``launch.slurm.max_requeues`` times.

The job's environment sets the defaults of ``env.sh`` (``megatron_oar/resources/env.sh``, shipped
in the package; ``launch_scripts/env.sh`` links to it) with ``launch.env`` on top; a value exported
in the calling shell does not override them (the rest of it is inherited). vLLM's share of the GPU
is the config's ``rollout.gpu_memory_utilization`` alone (an override like any other).
``--dryrun`` prints what would run (the torchrun command, or the full sbatch script) and writes
nothing outside a temporary directory.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import re
import shlex
import sys
import tempfile
from pathlib import Path

from megatron_oar import resources
from megatron_oar.config import EXECUTORS, ConfigError, load_config, validate

ENV_SH = resources.path("env.sh")  # the package's copy: there after any install
PYTHON_BIN = str(Path(sys.executable).parent)  # where this environment's torchrun is
_EXPORT = re.compile(r'export ([A-Za-z_][A-Za-z0-9_]*)="\$\{\1:-([^"$`\\]*)\}"')


def parse_env_sh(path: str | Path = ENV_SH) -> dict[str, str]:
    """The defaults of env.sh: every ``export NAME="${NAME:-default}"`` line, in order. Comments
    and blank lines are skipped; any other line is an error (env.sh stays this simple)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: not found (the launch environment; see launch_scripts/README.md)")
    env: dict[str, str] = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _EXPORT.fullmatch(line)
        if m is None:
            raise ConfigError(f'{path}:{n}: expected export NAME="${{NAME:-default}}", got {line!r}')
        env[m.group(1)] = m.group(2)
    return env


def elastic_env(launch) -> dict[str, str]:
    """torchrun's fault-tolerance settings from ``launch`` (a :class:`LaunchConfig`), as the
    ``PET_*`` variables torchrun reads for its flags: restarts of the worker group, the signals it
    forwards to the workers (SIGUSR1 too), how long it then waits for their checkpoint, and a
    fresh rendezvous store per restart (env.sh says why)."""
    return {"PET_MAX_RESTARTS": str(launch.max_restarts),
            "PET_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1",
            "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(launch.preemption_grace_s),
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="oar launch", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="YAML config (see examples/)")
    p.add_argument("--executor", choices=EXECUTORS, help="default: the config's launch.executor")
    p.add_argument("--nodes", type=int, help="launch.nodes")
    p.add_argument("--gpus-per-node", type=int, help="launch.gpus_per_node")
    p.add_argument("--arch", help="Qwen2.5 preset (e.g. qwen2.5-32b) when model.path has no "
                                  "config.json here and its name is not a preset")
    p.add_argument("--resume", help="auto | none | a checkpoint step directory (checkpoint.resume)")
    p.add_argument("--dryrun", action="store_true", help="print what would run; start nothing")
    p.add_argument("overrides", nargs="*", help="key=value config overrides")
    return p.parse_intermixed_args(argv)


def _flag_overrides(args: argparse.Namespace) -> list[str]:
    flags = {"launch.executor": args.executor, "launch.nodes": args.nodes,
             "launch.gpus_per_node": args.gpus_per_node}
    return [f"{key}={value}" for key, value in flags.items() if value is not None]


def _checked_config(args: argparse.Namespace, overrides: list[str]):
    """The config the job will load, validated for its cluster; raises ConfigError."""
    from megatron_oar.models import ModelConfigError
    from megatron_oar.models.presets import resolve_hf_config

    resume = [f"checkpoint.resume={args.resume}"] if args.resume else []
    cfg = load_config(args.config, overrides + resume)
    try:
        hf_config, _ = resolve_hf_config(cfg.model.path, args.arch)
    except ModelConfigError as e:
        raise ConfigError(str(e)) from None
    validate(cfg, world_size=cfg.launch.world_size, hf_config=hf_config)
    launch = cfg.launch
    if launch.executor == "local" and launch.nodes != 1:
        raise ConfigError(f"launch.nodes={launch.nodes}: the local executor runs on this node only; "
                          "use --executor slurm (launch.executor=slurm) for several nodes")
    if launch.executor == "slurm" and not args.dryrun:
        for key in ("account", "partition"):
            if not getattr(launch.slurm, key):
                raise ConfigError(f"launch.slurm.{key}: not set; Slurm needs it to submit (set it in "
                                  f"the YAML or pass launch.slurm.{key}=...)")
    return cfg


def _executor(cfg, name: str, env: dict[str, str], job_dir: Path, workdir: Path):
    import nemo_run as run
    from nemo_run.core.execution.slurm import SlurmJobDetails

    launch = cfg.launch
    if launch.executor == "local":  # torchx prepends a PATH given here to the inherited one
        return run.LocalExecutor(ntasks_per_node=launch.gpus_per_node, nodes=1, launcher="torchrun",
                                 env_vars={**env, "PATH": PYTHON_BIN})
    s = launch.slurm
    mounts = list(s.container_mounts)
    if s.container_image and f"{workdir}:{workdir}" not in mounts:
        mounts.append(f"{workdir}:{workdir}")  # the code symlink points here
    return run.SlurmExecutor(
        account=s.account, partition=s.partition, time=s.time, nodes=launch.nodes,
        # torchrun launcher: one srun task per node, each starting gpus_per_node processes
        ntasks_per_node=1, gpus_per_node=launch.gpus_per_node,
        torchrun_nproc_per_node=launch.gpus_per_node, exclusive=True if s.exclusive else None,
        container_image=s.container_image, container_mounts=mounts, launcher="torchrun",
        # the sbatch script exports these unquoted: quote them for the shell
        env_vars={k: shlex.quote(v) for k, v in env.items()},
        tunnel=run.LocalTunnel(job_dir=str(job_dir / "experiments")),
        # no copy of the code: <job>/code is a symlink to workdir, made at submission
        packager=run.GitArchivePackager(symlink_from_remote_dir=str(workdir)),
        job_details=SlurmJobDetails(job_name=name),
        # on the nodes' own environment (shared file system), the torchrun next to this Python
        setup_lines=None if s.container_image else f'export PATH={shlex.quote(PYTHON_BIN)}:"$PATH"',
        job_name_prefix=f"{name}-",  # unused with job_details.job_name, but nemo-run needs one
        # SIGUSR1 to every process of the job step this long before the time limit: the workers
        # stop at the next phase boundary and checkpoint (torchrun forwards it too:
        # PET_SIGNALS_TO_HANDLE); the
        # failed exit makes nemo-run's script requeue the job while retries remain
        signal=f"USR1@{launch.preemption_grace_s}", retries=s.max_requeues,
    )


@contextlib.contextmanager
def _nemo_run_quietly(to_stderr: bool):
    """nemo-run's rich console talks on stdout and resets the root logger: keep our stdout for
    the dry run's output and give the caller its logging back."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        with contextlib.redirect_stdout(sys.stderr) if to_stderr else contextlib.nullcontext():
            yield
    finally:
        root.handlers[:], root.level = handlers, level


def _dryrun_text(exp, executor: str, env: dict[str, str]) -> str:
    job = exp.jobs[0]
    if executor == "slurm":
        tunnel_dir = Path(job.executor.tunnel.job_dir)
        script = next(Path(exp._exp_dir).glob("*_sbatch.sh"))  # written by the dry run
        target = tunnel_dir / script.name
        code = tunnel_dir / Path(job.executor.job_dir).name / "code"
        return (f"# oar launch --dryrun: nemo-run would write {target}\n"
                f"# and submit it with: sbatch --requeue --parsable {target}\n"
                f"# ({code} -> {Path.cwd()}, a symlink made at submission)\n"
                + script.read_text().rstrip("\n") + "\n")
    request = job._dryrun_info.request  # torchx PopenRequest: what LocalScheduler would Popen
    replica = next(iter(request.role_params.values()))[0]
    exports = "".join(f"export {k}={shlex.quote(v)}\n" for k, v in env.items())
    exports += f'export PATH={shlex.quote(PYTHON_BIN)}:"$PATH"\n'
    return (f"# oar launch --dryrun: nemo-run would run, in {replica.cwd}:\n{exports}"
            + shlex.join(replica.args) + "\n")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    overrides = [*args.overrides, *_flag_overrides(args)]
    try:
        cfg = _checked_config(args, overrides)
        env = {**parse_env_sh(), **elastic_env(cfg.launch), **cfg.launch.env}
    except ConfigError as e:
        print(f"oar launch: {e}", file=sys.stderr)
        return 2
    env = {k: v for k, v in env.items() if v != ""}

    train_args = ["--config", args.config, *(["--resume", args.resume] if args.resume else []),
                  *overrides]
    executor = cfg.launch.executor
    name = cfg.launch.slurm.job_name or Path(cfg.run_dir).name
    job_dir = Path(cfg.launch.slurm.job_dir).resolve()

    with _nemo_run_quietly(to_stderr=True):  # its first use may reconfigure logging too
        import nemo_run as run

        script = run.Script(path="megatron_oar.commands.train", m=True, entrypoint="python", args=train_args)
    if args.dryrun:
        with tempfile.TemporaryDirectory(prefix="oar-launch-") as tmp:
            with _nemo_run_quietly(to_stderr=True):
                with run.Experiment(name, executor=_executor(cfg, name, env, job_dir, Path.cwd()),
                                    base_dir=tmp, log_level="WARNING", clean_mode=True) as exp:
                    exp.add(script, name=name)
                    exp.dryrun(log=False, delete_exp_dir=False)
                    text = _dryrun_text(exp, executor, env)
        print(text, end="")
        return 0

    with _nemo_run_quietly(to_stderr=False):
        with run.Experiment(name, executor=_executor(cfg, name, env, job_dir, Path.cwd()),
                            base_dir=str(job_dir)) as exp:
            exp.add(script, name=name, tail_logs=executor == "local")
            exp.run(detach=executor == "slurm", tail_logs=executor == "local")
        job = exp.jobs[0]
    if executor == "slurm":
        print(f"oar launch: submitted {job.handle} (logs under {job_dir})")
        return 0
    from torchx.specs import AppState

    return 0 if job.state == AppState.SUCCEEDED else 1


if __name__ == "__main__":
    sys.exit(main())
