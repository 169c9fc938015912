"""``oar repro``: the paper's Table 1 and Figures 3, 5, 6, 7 in miniature, on the chain testbed.

    oar repro --out repro_out                   # the default grid, 2 runs at a time on 2 cores
    oar repro --out repro_out --grid full       # the paper-style grid (5 seeds, every ablation)
    oar repro --out repro_out --report-only     # tables and figures again from what is there
    oar repro --out losses_out --grid losses    # the loss axis alone (GRPO and OAR-G x losses)
    oar repro --out credit_out --grid credit    # the credit testbed (tiny_credit_cpu.yaml)

1. One SFT start: a tiny Qwen2 warmed up on the chain task (``demo_model``), shared by every run
   and converted to a Megatron checkpoint once (``sft_megatron``), which every run starts from.
2. The runs (:func:`grid`): every credit method x seeds, same budget; tau, probe and suppression
   floor ablations of OAR-G; the loss axis: GRPO and OAR-G under the other policy losses
   (``loss.policy_loss``) and with a rollout correction (``loss.rollout_correction``), against
   their main runs (ppo_clip, no correction) with the same seeds. A run is
   ``python -m megatron_oar.commands.train`` on one process with the testbed config,
   ``model.path`` = the SFT start, its seed in the training, rollout and attribution seeds (the
   same seed means the same prompts and sampling seeds for every method, so differences to GRPO
   are paired). After training, pass@k of the exported model on held-out
   problems (HF sampling, the reward verifier). A finished run writes ``result.json`` and is never
   redone; an interrupted one resumes from its last checkpoint.
3. The causal-token oracle (``oar analyze oracle``) on the SFT start, once per outcome probe.
4. :mod:`megatron_oar.repro.report`: ``report.json``, ``repro.md``, ``curves.png``, ``recall.png``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

from megatron_oar import resources
from megatron_oar.fileio import atomic_write_text
from megatron_oar.methods import CREDIT_METHODS
from megatron_oar.repro.report import loss_label

CONFIG = resources.path("tiny_chain_cpu.yaml")  # the testbed config, shipped in the package
TESTBEDS = {"chain": "tiny_chain_cpu.yaml", "credit": "tiny_credit_cpu.yaml"}  # shipped configs
METHODS = CREDIT_METHODS


PAPER_ARM = "paper"  # the arm group's baseline: the ablation method's main run


def _ablation_arms() -> tuple[tuple[str, tuple[str, ...]], ...]:
    """The issue-54 arms of OAR-G (``repro/credit_arms.py: ARMS``, without ``credit=``)."""
    from megatron_oar.repro.credit_arms import ARMS

    return tuple((label.removeprefix("oar_g "), tuple(o for o in ovr if not o.startswith("credit=")))
                 for label, ovr in ARMS.items() if label.startswith("oar_g "))


@dataclass
class Grid:
    """What ``oar repro`` trains. The default fits 2 CPU cores in about an hour (measured figures
    in docs/repro.md); ``full`` is the paper-style grid."""

    methods: tuple[str, ...] = METHODS
    seeds: int = 3
    steps: int = 30
    eval_interval: int = 10
    taus: tuple[float, ...] = (0.0, 0.7, 1.0)         # plus the main runs' 0.4 (Table 3)
    probes: tuple[str, ...] = ("last_token", "answer_joint")  # plus answer_mean (Table 4)
    floors: tuple[float, ...] = (0.1,)               # plus the default 0 (A.1.4)
    ablation_method: str = "oar_g"
    ablation_seeds: int = 1
    # named arms of ablation_method (label, overrides): any setting, e.g. credit_arms.ARMS's;
    # reported beside its main run (the arm "paper") and GRPO, paired by seed
    arms: tuple[tuple[str, tuple[str, ...]], ...] = ()
    # the loss axis: these methods under each loss, and each correction (the main runs are
    # ppo_clip without correction), with loss_seeds seeds
    loss_methods: tuple[str, ...] = ("grpo", "oar_g")
    losses: tuple[str, ...] = ("gspo_token", "cispo")
    corrections: tuple[str, ...] = ("tis",)
    loss_seeds: int = 3
    pass_k: int = 8                                    # 0: no pass@k (held-out greedy accuracy only)
    pass_k_problems: int = 100
    oracle_trajectories: int = 40                      # 0: no oracle run
    oracle_control: bool = False                       # the oracle's control decode (--control)
    sft_steps: int | None = None                       # the warm-up; None: the demo's (CHAIN_SFT)
    sft_carry_slip: float | None = None                # its teacher's slip rate; None: CHAIN_SFT's
    sft_seed: int = 0                                  # the start's init and warm-up data: another start
    testbed: str = "chain"                             # the config (TESTBEDS) when none is given
    threshold: float = 0.6                             # steps to this held-out accuracy (report)
    overrides: list[str] = field(default_factory=list)  # for every run

    def config(self) -> Path:
        if self.testbed not in TESTBEDS:
            raise ValueError(f"testbed must be one of {sorted(TESTBEDS)}, got {self.testbed!r}")
        return resources.path(TESTBEDS[self.testbed])


GRIDS = {"default": Grid(),
         "full": Grid(seeds=5, steps=60, taus=(0.0, 0.7, 1.0), ablation_seeds=3, loss_seeds=5, pass_k=16,
                      pass_k_problems=200, oracle_trajectories=200),
         # the loss axis alone: GRPO and OAR-G under ppo_clip (their main runs), gspo_token and
         # cispo, and with TIS, at the default grid's seeds and budget, no ablations
         "losses": Grid(methods=("grpo", "oar_g"), taus=(), probes=(), floors=()),
         "tiny": Grid(methods=("grpo", "oar_g"), seeds=2, steps=2, eval_interval=1, taus=(1.0,),
                      probes=("last_token",), floors=(), losses=(), corrections=(), pass_k=2,
                      pass_k_problems=4,
                      oracle_trajectories=2, sft_steps=20,
                      # 48 held-out problems, not 200: the runs' evaluations, and the oracle's
                      # search for correct trajectories (all of them, for a 20-step SFT start)
                      overrides=["data.synthetic.eval_n=48"]),
         # the credit testbed (tiny_credit_cpu.yaml, docs/repro-credit.md): every credit method
         # but exact OAR-P (about 4x GRPO's step: out of the 90-minute budget), the same settings
         # for all, no ablations or loss axis. Fixed from a pilot of GRPO runs only (the reasons:
         # docs/repro-credit.md): the demo's warm-up (CHAIN_SFT, start 42.5%), 10 steps (GRPO
         # 76.6% there), evaluations every 2 steps, 12 seeds (+/- 2 points from the pilot's
         # spread), the threshold 70% (GRPO's seeds passed it between steps 4 and 10)
         "credit": Grid(methods=("grpo", "random", "entropy", "oar_g", "oar_p_screened"), seeds=12,
                        steps=10, eval_interval=2, taus=(), probes=(), floors=(), losses=(),
                        corrections=(), loss_seeds=0, pass_k=4, pass_k_problems=50,
                        oracle_trajectories=40, oracle_control=True, threshold=0.7, testbed="credit"),
         # the paper's Table 3 and the authors' choices in miniature on the credit testbed, and
         # our sign-aware variant (issue 54): GRPO and OAR-G (the arm "paper") as the credit grid
         # runs them, and OAR-G's arms (credit_arms.ARMS), all 12 seeds, 10 steps. 96 runs: about
         # 2.7 h on the 2-core machine at the credit grid's pace (99 min for 60 runs). No oracle:
         # the arms are compared by accuracy, and the credit grid has the oracle's recall
         "credit-ablations": Grid(methods=("grpo", "oar_g"), seeds=12, steps=10, eval_interval=2, taus=(),
                                  probes=(), floors=(), losses=(), corrections=(), loss_seeds=0,
                                  ablation_seeds=12, arms=_ablation_arms(), pass_k=4, pass_k_problems=50,
                                  oracle_trajectories=0, threshold=0.7, testbed="credit"),
         # the test suite's credit grid (tests/test_repro.py): tiny's main runs on the credit
         # testbed, no ablations (tiny has them), the oracle with the default probe only
         "tiny-credit": Grid(methods=("grpo", "oar_g"), seeds=2, steps=2, eval_interval=1, taus=(),
                             probes=(), floors=(), losses=(), corrections=(), pass_k=2,
                             pass_k_problems=4, oracle_trajectories=2, sft_steps=20, testbed="credit",
                             overrides=["data.synthetic.eval_n=48"])}


@dataclass(frozen=True)
class RunSpec:
    name: str
    group: str   # main | tau | probe | floor | loss
    label: str   # the method (main), the setting (ablations), or loss_label() (loss)
    method: str
    seed: int
    overrides: tuple[str, ...]


def grid(g: Grid) -> list[RunSpec]:
    runs = [RunSpec(f"{m}_s{s}", "main", m, m, s, ()) for s in range(g.seeds) for m in g.methods]
    for s in range(g.loss_seeds):
        for m in g.loss_methods:
            runs += [RunSpec(f"{m}_{loss}_s{s}", "loss", loss_label(m, loss), m, s,
                             (f"loss.policy_loss={loss}",)) for loss in g.losses]
            runs += [RunSpec(f"{m}_{c}_s{s}", "loss", loss_label(m, correction=c), m, s,
                             (f"loss.rollout_correction={c}",)) for c in g.corrections]
    m = g.ablation_method
    for s in range(g.ablation_seeds):
        runs += [RunSpec(f"{m}_tau{t}_s{s}", "tau", f"tau={t}", m, s, (f"shaping.tau={t}",))
                 for t in g.taus]
        runs += [RunSpec(f"{m}_probe_{p}_s{s}", "probe", p, m, s, (f"attribution.probe.kind={p}",))
                 for p in g.probes]
        runs += [RunSpec(f"{m}_floor{f}_s{s}", "floor", f"floor={f}", m, s, (f"shaping.floor={f}",))
                 for f in g.floors]
        runs += [RunSpec(f"{m}_{arm_slug(label)}_s{s}", "arm", label, m, s, tuple(o)) for label, o in g.arms]
    return runs


def select_arms(arms, wanted: str) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """The named arms (``Grid.arms``) whose labels are in ``wanted`` (comma-separated), in the
    grid's order; an unknown label or a grid without arms is an error naming the choices."""
    labels = [a.strip() for a in wanted.split(",") if a.strip()]
    known = [label for label, _ in arms]
    if not known:
        raise ValueError("this grid has no named arms (--grid credit-ablations has)")
    bad = [a for a in labels if a not in known]
    if bad or not labels:
        raise ValueError(f"unknown arm(s) {bad or [wanted]}; choose from {known}")
    return tuple((label, tuple(o)) for label, o in arms if label in labels)


def arm_slug(label: str) -> str:
    """A run directory's name for an arm's label (``tau=0 (boost-only)`` -> ``tau0_boost-only``)."""
    import re

    return re.sub(r"[^A-Za-z0-9.-]+", "_", label.replace("=", "")).strip("_")


def _baselines(runs: list[RunSpec], g: Grid) -> list[RunSpec]:
    """The main runs that double as the ablations' default setting (tau 0.4, answer_mean, floor 0)
    and as the loss axis's ``ppo_clip`` rows."""
    groups = [(group, label) for group, label, values in (
        ("tau", "tau=0.4", g.taus), ("probe", "answer_mean", g.probes), ("floor", "floor=0", g.floors),
        ("arm", PAPER_ARM, g.arms))
        if values]
    out = [RunSpec(r.name, group, label, r.method, r.seed, ()) for r in runs for group, label in groups
           if r.group == "main" and r.method == g.ablation_method and r.seed < g.ablation_seeds]
    if g.losses or g.corrections:
        out += [RunSpec(r.name, "loss", loss_label(r.method), r.method, r.seed, ()) for r in runs
                if r.group == "main" and r.method in g.loss_methods and r.seed < g.loss_seeds]
    return out


# ------------------------------------------------------------------------------ the work

def positions_for(cfg) -> int:
    """The position table a config's runs need: its prompt and response budget
    (``data.max_prompt_tokens + rollout.max_new_tokens``), rounded up to 32."""
    return -(-(cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens) // 32) * 32


def _start_seed(out: Path, seed: int) -> int | None:
    """The seed of the SFT start in ``out`` (None: none made yet); raises if it is not ``seed``."""
    stats = out / "sft" / "sft.json"
    if not stats.is_file():
        return None
    made = json.loads(stats.read_text()).get("seed", 0)  # starts made before it was recorded: seed 0
    if made != seed:
        raise ValueError(f"{out / 'sft'}: the SFT start there was made with --sft-seed {made}, not "
                         f"{seed}; use another --out for another start")
    return made


def sft_start(out: Path, config: Path, steps: int | None, carry_slip: float | None = None,
              seed: int = 0) -> Path:
    """The shared start (made once): the demo's tiny Qwen2 warmed up on the config's chain task
    (``demo_model.CHAIN_ARCH``, ``CHAIN_SFT``; ``steps`` and ``carry_slip`` override the warm-up's
    length and its teacher's slip rate; ``seed`` seeds its tokenizer's corpus, its initial weights
    and its warm-up data: another start of the same recipe). Its position table covers the
    config's prompt and response budget (``data.max_prompt_tokens + rollout.max_new_tokens``,
    rounded up to 32; the chain config's 112 fits CHAIN_ARCH's 160). The same seed on the same
    machine and thread count gives the same start; other CPUs' kernels may not."""
    from megatron_oar.config import load_config
    from megatron_oar.repro import demo_model

    hf = out / "sft"
    if _start_seed(out, seed) is not None:
        return hf
    cfg = load_config(config)
    task = cfg.data.synthetic
    arch = {**demo_model.CHAIN_ARCH,
            "max_position_embeddings": max(demo_model.CHAIN_ARCH["max_position_embeddings"], positions_for(cfg))}
    demo_model.make_demo_model(hf, task=task, seed=seed, **arch)
    sft = {**demo_model.CHAIN_SFT, **({"steps": steps} if steps else {}),
           **({"carry_slip": carry_slip} if carry_slip is not None else {})}
    stats = demo_model.sft_warmup(hf, task=task, seed=seed, **sft)
    atomic_write_text(hf / "sft.json", json.dumps({**stats, "seed": seed}))
    return hf


def sft_checkpoint(out: Path, sft: Path, config: Path, overrides: list[str], starter=None) -> Path:
    """The SFT start converted to a Megatron checkpoint once (``oar-convert hf-to-megatron`` in
    its own process), so that the runs start from it instead of each converting it again
    (``training/policy.py: init_checkpoint``, a process start-up and a conversion per run)."""
    from checkpoints_convert.cli import hf_to_megatron_command
    from megatron_oar.config import load_config
    from megatron_oar.models.model_checkpoint import META_FILE

    ckpt = out / "sft_megatron"
    if (ckpt / META_FILE).is_file():
        return ckpt
    dtype = load_config(config, overrides).model.dtype
    _run_one_process(hf_to_megatron_command(sft, ckpt, dtype), out / "sft_convert.log",
                     "converting the SFT start", starter)
    return ckpt


def pass_at_k(hf_dir: Path, task, *, k: int, n_problems: int, max_new_tokens: int, seed: int = 0) -> float:
    """Share of ``n_problems`` held-out problems with a correct answer among ``k`` samples at
    temperature 1 (HF sampling of the exported model, the reward verifier)."""
    from transformers.utils import logging as hf_logging

    from megatron_oar.repro import demo_model
    from megatron_oar.rewards import RewardConfig, score_batch

    hf_logging.disable_progress_bar()  # one bar per run's model load otherwise
    exs = demo_model.problems(4 * n_problems, 20_000 + seed, heldout=True, task=task,
                              distinct=True)[:n_problems]
    texts = demo_model.generate_responses(hf_dir, [ex.prompt for ex in exs], samples=k,
                                          temperature=1.0, max_new_tokens=max_new_tokens, seed=seed)
    refs = [ex.answer for ex, ts in zip(exs, texts) for _ in ts]
    acc = score_batch([t for ts in texts for t in ts], refs,
                      RewardConfig(extractors=["answer_tag"], num_workers=1)).accuracy
    return sum(bool(acc[i * k:(i + 1) * k].max() > 0) for i in range(len(exs))) / len(exs)


def run_overrides(spec: RunSpec, sft: Path, run_dir: Path, g: Grid) -> list[str]:
    """The testbed config's overrides for the run ``spec``."""
    return [f"model.path={sft}", f"run_dir={run_dir}", f"credit={spec.method}",
            "parallel.tp=1", "rollout.tp=1", f"train.steps={g.steps}",
            f"train.eval_interval={g.eval_interval}", f"train.seed={spec.seed}",
            f"rollout.seed={spec.seed}", f"attribution.seed={spec.seed}",
            f"checkpoint.interval={g.eval_interval}", "checkpoint.keep_last=1",
            "checkpoint.export_hf_at_end=true", "log.console=false", "log.tensorboard=false",
            *g.overrides, *spec.overrides]


def train_run(spec: RunSpec, out: Path, sft: Path, config: Path, g: Grid, starter=None) -> dict:
    """One run, resumable: training (one process, forked by ``starter`` when given) from ``sft``
    (the SFT start, an HF directory or its Megatron conversion), the HF export, pass@k;
    ``result.json``."""
    run_dir = out / "runs" / spec.name
    if (run_dir / "result.json").is_file():
        return json.loads((run_dir / "result.json").read_text())
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(run_dir / "spec.json", json.dumps(asdict(spec)))
    overrides = run_overrides(spec, sft, run_dir, g)
    cmd = [sys.executable, "-m", "megatron_oar.commands.train", "--config", str(config), *overrides]
    t0 = time.perf_counter()
    _run_one_process(cmd, run_dir / "train.log", f"run {spec.name}", starter)
    exported = sorted((run_dir / "hf").iterdir())[-1]
    from megatron_oar.config import load_config

    cfg = load_config(config, overrides)
    result = {"seconds": time.perf_counter() - t0, "hf": str(exported),
              "pass_at_k": pass_at_k(exported, cfg.data.synthetic, k=g.pass_k,
                                     n_problems=g.pass_k_problems,
                                     max_new_tokens=cfg.rollout.max_new_tokens, seed=spec.seed)
              if g.pass_k > 0 else None}
    atomic_write_text(run_dir / "result.json", json.dumps(result))
    return result


def oracle_run(probe: str, out: Path, sft: Path, config: Path, g: Grid, starter=None) -> Path:
    """The causal-token oracle on the SFT start with ``probe`` and the grid's overrides, as the
    runs see them; resumable (``recall.json``). ``sft`` is the start the runs use (its Megatron
    conversion: the oracle does not convert it again)."""
    dst = out / "oracle" / probe
    if (dst / "recall.json").is_file():
        return dst
    cmd = [sys.executable, "-m", "megatron_oar.eval.oracle", "--config", str(config),
           "--model", str(sft), "--trajectories", str(g.oracle_trajectories), "--out", str(dst),
           *(["--control"] if g.oracle_control else []),
           "parallel.tp=1", "rollout.tp=1", *g.overrides, f"attribution.probe.kind={probe}",
           f"run_dir={dst / 'run'}"]
    dst.mkdir(parents=True, exist_ok=True)
    _run_one_process(cmd, dst / "oracle.log", f"oracle ({probe})", starter)
    return dst


def _run_one_process(cmd: list[str], log: Path, what: str, starter=None) -> None:
    """``cmd`` (``python -m MODULE ...``) as a one-process torch.distributed world (its own port,
    one thread, so two run side by side on 2 cores), output appended to ``log``; raises naming
    ``what`` on failure. It runs in this process's directory, so relative paths (``--out``,
    ``--config``) mean the same there. With ``starter`` (a :class:`~megatron_oar.repro.warm_start.
    WarmStarter`) the process is forked from its warm interpreter instead of starting Python."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    if starter is not None:
        if cmd[:2] != [sys.executable, "-m"]:
            raise ValueError(f"{what}: not a `python -m MODULE` command: {cmd}")
        rc = starter.run(cmd[2], cmd[3:], env=env, log=log)
    else:
        with open(log, "a") as f:
            rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    if rc != 0:
        raise RuntimeError(f"{what} failed (exit {rc}); see {log}")


def _run_grid(out: Path, g: Grid, config: Path, jobs: int, starter, console, t_all: float) -> None:
    """The SFT start, its conversion, the runs and the oracle, ``jobs`` at a time (what is done
    is skipped)."""
    console.rule("[bold]oar repro: SFT start")
    sft = sft_start(out, config, g.sft_steps, g.sft_carry_slip, g.sft_seed)
    console.print(f"SFT start: {sft} ({json.loads((sft / 'sft.json').read_text())})")
    start = sft_checkpoint(out, sft, config, g.overrides, starter)
    specs = grid(g)
    # seed by seed (every method and arm of seed 0, then of seed 1, ...): a grid stopped early
    # has whole seeds, paired across its arms, and a later invocation goes on from there
    todo = sorted((s for s in specs if not (out / "runs" / s.name / "result.json").is_file()),
                  key=lambda s: s.seed)
    # the causal-token oracle on the SFT start, per probe (none where oracle_trajectories is 0)
    probes = ("answer_mean", *g.probes) if g.oracle_trajectories > 0 else ()
    oracle_words = f" and the oracle with {len(probes)} probes" if probes else ""
    console.rule(f"[bold]{len(specs)} runs ({len(specs) - len(todo)} done){oracle_words}, {jobs} at a time")
    done = [0]

    def one(spec: RunSpec) -> None:
        t = time.perf_counter()
        res = train_run(spec, out, start, config, g, starter)
        done[0] += 1
        elapsed = time.perf_counter() - t_all
        eta = elapsed / done[0] * (len(todo) - done[0])
        passk = "-" if res.get("pass_at_k") is None else f"{res['pass_at_k']:.1%}"
        console.print(f"[{done[0]}/{len(todo)}] {spec.name}: {time.perf_counter() - t:.0f}s, "
                      f"pass@{g.pass_k} {passk} · elapsed {elapsed / 60:.1f} min, "
                      f"ETA {eta / 60:.1f} min")

    def oracle(probe: str) -> None:
        t = time.perf_counter()
        oracle_run(probe, out, start, config, g, starter)
        console.print(f"oracle, probe {probe}: {time.perf_counter() - t:.0f}s")

    # the oracle runs need only the SFT start: they share the pool with the training runs
    work = [partial(oracle, p) for p in probes] + [partial(one, s) for s in todo]
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        list(pool.map(lambda job: job(), work))  # re-raises the first failure


def run(out: Path, g: Grid, *, config: Path | None = None, jobs: int = 2, report_only: bool = False) -> dict:
    """The grid ``g`` in ``out`` (with ``config``; default: the grid's testbed's), then its report."""
    from rich.console import Console

    from megatron_oar.repro import report
    from megatron_oar.repro.warm_start import WarmStarter

    console = Console()
    config = config or g.config()
    out.mkdir(parents=True, exist_ok=True)
    _start_seed(out, g.sft_seed)  # a report of another start's runs under this seed's name: refused
    before = json.loads((out / "settings.json").read_text()) if (out / "settings.json").is_file() else {}
    settings = {"config": str(config), "jobs": jobs, **asdict(g),
                "wall_seconds": before.get("wall_seconds", 0.0)}  # over every invocation
    atomic_write_text(out / "settings.json", json.dumps(settings, indent=1))
    t_all = time.perf_counter()
    if not report_only:
        # The runs' processes are forked from one warm interpreter, on CPU-only machines: a fork
        # of a process whose imports initialised CUDA's driver cannot use CUDA, so where a GPU is
        # present each run starts its own interpreter.
        import torch

        warm = contextlib.nullcontext() if torch.cuda.is_available() else WarmStarter()
        with warm as starter:
            _run_grid(out, g, config, jobs, starter, console, t_all)
        settings["wall_seconds"] += time.perf_counter() - t_all
        atomic_write_text(out / "settings.json", json.dumps(settings, indent=1))
    # the grid's own runs only: an out dir can hold runs of more seeds or arms (a grid run again
    # with fewer, or stopped while a later seed's runs had finished)
    rep = report.build(out, settings, aliases=[asdict(s) for s in _baselines(grid(g), g)],
                       names={s.name for s in grid(g)})
    atomic_write_text(out / "repro.md", report.render(rep))
    console.print(f"written: {out / 'repro.md'}, report.json, curves.png, recall.png "
                  f"({(time.perf_counter() - t_all) / 60:.1f} min; {settings['wall_seconds'] / 60:.1f} "
                  "min of runs in all)")
    return rep


def _axes(s: dict) -> str:
    """The publish header's words for the loss axis and the ablations a grid ran (none: '')."""
    out = ""
    if s.get("losses") or s.get("corrections"):
        what = [*(f"under {x}" for x in s.get("losses", [])), *(f"with {x}" for x in s.get("corrections", []))]
        out += f"; the loss axis: {', '.join(s['loss_methods'])} {', '.join(what)} x {s['loss_seeds']} seeds"
    if s.get("taus") or s.get("probes") or s.get("floors"):
        out += f"; ablations of {s['ablation_method']} with {s['ablation_seeds']} seed(s)"
    if s.get("arms"):
        out += (f"; {s['ablation_method']}'s arms {', '.join(a[0] for a in s['arms'])} x "
                f"{s['ablation_seeds']} seed(s)")
    return out


def _start(s: dict) -> str:
    """The publish header's words for a start made with another --sft-seed (seed 0: '')."""
    return f" (`--sft-seed {s['sft_seed']}`)" if s.get("sft_seed") else ""


PUBLISH_NAMES = {"credit-ablations": "repro-credit-ablations"}  # grids with a page of their own
KEEP = "<!-- oar repro --publish writes everything below this line -->"
TITLES = {"chain": "the paper in miniature on the chain testbed",
          "credit": "the credit testbed (few pivots among much filler)"}


def publish(out: Path, docs: Path, command: str, name: str = "repro") -> Path:
    """``docs/<name>.md`` (how it was made, then the tables) with the figures and report.json
    under ``docs/<name>/``; written to temp files and renamed. Where ``docs/<name>.md`` holds the
    line :data:`KEEP`, the text above it (written by hand: the design, the pilot) is kept."""
    import shutil

    rep = json.loads((out / "report.json").read_text())
    # the published copy names files relative to docs/, not where this machine kept them, and
    # the command's out dir by its own name; a --report-only rerun names the command that ran
    command = command.replace(f"--out {out}", f"--out {out.name}").replace(" --report-only", "")
    rep["figures"] = {k: f"{name}/{Path(v).name}" for k, v in rep.get("figures", {}).items()}
    rep["settings"]["config"] = Path(rep["settings"]["config"]).name
    assets = docs / name
    assets.mkdir(parents=True, exist_ok=True)
    for fig in ("curves.png", "recall.png"):
        if (out / fig).is_file():
            shutil.copyfile(out / fig, assets / f".{fig}.tmp")
            (assets / f".{fig}.tmp").replace(assets / fig)
    atomic_write_text(assets / "report.json", json.dumps(rep, indent=1))
    s = rep["settings"]
    doc = docs / f"{name}.md"
    kept = doc.read_text().split(KEEP)[0] + KEEP + "\n\n" if doc.is_file() and KEEP in doc.read_text() else ""
    title = TITLES.get(s.get("testbed", "chain"), s.get("testbed", ""))
    head = [f"# `oar repro`: {title}", ""] if not kept else []
    head += [f"Made by `{command}` in {s['wall_seconds'] / 60:.0f} min of wall time on a 2-core CPU "
             f"machine ({s['jobs']} runs at a time). {rep['runs']} runs of {s['steps']} RL steps from "
             f"one SFT start{_start(s)}: {', '.join(s['methods'])} x {s['seeds']} seeds{_axes(s)}. "
             f"Intervals are 95% Student-t intervals over seeds; with {s['seeds']} seeds they are wide, "
             "and a difference whose interval contains 0 is not a finding.", "",
             f"![curves]({name}/curves.png)", ""]
    if (assets / "recall.png").is_file():
        head += [f"![recall]({name}/recall.png)", ""]
    return atomic_write_text(doc, kept + "\n".join(head) + (out / "repro.md").read_text())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="oar repro", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("repro_out"))
    p.add_argument("--config", type=Path, help="the testbed config (default: the grid's testbed's)")
    p.add_argument("--grid", choices=sorted(GRIDS), default="default")
    p.add_argument("--testbed", choices=sorted(TESTBEDS),
                   help="the grid's runs on this testbed's config (default: the grid's: credit for "
                        "--grid credit and tiny-credit, chain for the others)")
    p.add_argument("--seeds", type=int, help="seeds per method, the loss axis's too, and at most this "
                                             "many for the ablations (default: the grid's)")
    p.add_argument("--arms", help="comma-separated: only these of the grid's named arms (the "
                                  "credit-ablations grid's: tau=0 (boost-only), sign_aware (ours), ...)")
    p.add_argument("--steps", type=int, help="RL steps per run (default: the grid's)")
    p.add_argument("--sft-seed", type=int, default=0,
                   help="seed of the SFT start (its init and warm-up data; default 0): the same grid "
                        "from another start of the same recipe, in its own --out")
    p.add_argument("--jobs", type=int, default=2, help="runs at a time (one process each)")
    p.add_argument("--pass-k", type=int, metavar="K",
                   help="pass@K of each run's export (HF sampling, the slow part of a short run); "
                        "0: none, the tables give held-out greedy accuracy only (default: the grid's)")
    p.add_argument("--report-only", action="store_true", help="tables and figures from what is there")
    p.add_argument("--publish", type=Path, metavar="DOCS",
                   help="also write DOCS/repro.md and DOCS/repro/ (figures, report.json); "
                        "DOCS/repro-credit.md and DOCS/repro-credit/ for the credit testbed")
    p.add_argument("overrides", nargs="*", help="key=value overrides for every run")
    args = p.parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the SFT start's save / load bars: instant, noise in a log
    g = GRIDS[args.grid]
    g = Grid(**{**asdict(g), **{k: v for k, v in (("seeds", args.seeds), ("loss_seeds", args.seeds),
                                                  ("steps", args.steps), ("testbed", args.testbed))
                            if v is not None},
                "overrides": list(args.overrides)})
    g.sft_seed = args.sft_seed
    if args.pass_k is not None:
        if args.pass_k < 0:
            p.error(f"--pass-k: must be >= 0, got {args.pass_k}")
        g.pass_k = args.pass_k
    if args.seeds is not None:
        g.ablation_seeds = min(g.ablation_seeds, args.seeds)
    if args.arms is not None:
        try:
            g.arms = select_arms(g.arms, args.arms)
        except ValueError as e:
            p.error(f"--arms: {e}")
    try:
        _start_seed(args.out, g.sft_seed)
    except ValueError as e:
        p.error(f"--sft-seed: {e}")
    run(args.out, g, config=args.config, jobs=args.jobs, report_only=args.report_only)
    if args.publish:
        publish(args.out, args.publish, "oar repro " + " ".join(argv if argv is not None else sys.argv[1:]),
                name=PUBLISH_NAMES.get(args.grid) or ("repro" if g.testbed == "chain" else f"repro-{g.testbed}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
