"""The trainer's metrics: one record per step to JSONL, TensorBoard, wandb and the console.

.. code-block:: python

    logger = MetricsLogger(cfg.log, run_name="qwen-7b", total_steps=100, start_step=step,
                           enabled=rank == 0, hparams=asdict(cfg))
    with logger.phase("generate"):     # live status "step 3/100 · generate 12s · ETA 2m10s"
        ...                            # elapsed seconds -> time/generate of this step
    logger.log(step, {"reward/mean": 0.4, ...})
    logger.close()

Every rank builds one; only the one with ``enabled=True`` (rank 0) writes, the others still time
their phases, so callers need no ``if rank == 0``. ``step`` counts completed policy updates
(1 .. total_steps), the same number as the checkpoint's, so resuming from checkpoint ``k`` first
drops the JSONL records ``step > k`` that a crashed run wrote after its last checkpoint (and
TensorBoard hides its events past ``k``). A fresh run (``start_step=0``) appends to what is there.

``metrics.jsonl`` is the source of truth (``oar plot`` reads it): one JSON object per line,
``{"step": int, "wall_time": unix seconds, **metrics}``, floats only, NaN/inf written as null.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import statistics
import time
from collections import defaultdict, deque
from pathlib import Path
from typing import TYPE_CHECKING, Any

from megatron_oar.fileio import atomic_write

if TYPE_CHECKING:  # config imports megatron-core; `oar plot` only needs read_metrics
    from typing import Self  # Python 3.11+; annotations only

    from megatron_oar.config import LogConfig

log = logging.getLogger(__name__)

JSONL_NAME = "metrics.jsonl"
RESERVED_KEYS = ("step", "wall_time")

# The per-step console line: (metric key, short label, format); absent keys are left out.
# Adjust the keys here when the trainer's metric names change.
CONSOLE_METRICS: list[tuple[str, str, str]] = [
    ("reward/mean", "reward", "{:.3f}"),
    ("reward/accuracy", "acc", "{:.1%}"),
    ("response/length_mean", "len", "{:.0f}"),
    ("policy/entropy", "ent", "{:.3f}"),
    ("credit/ess_ratio", "ess", "{:.2f}"),
    ("loss/clip_frac", "clip", "{:.3f}"),
    ("loss/ref_kl", "kl", "{:.4f}"),
    ("loss/approx_kl", "kl_old", "{:.4f}"),
    ("eval/accuracy", "eval acc", "{:.1%}"),
    ("time/step", "time", "{:.1f}s"),
    ("perf/tokens_per_s", "tok/s", "{:,.0f}"),
]

# The step line's phase split: the step's top-level phases that took at least this share of it
# (every phase's seconds are in the metrics file as time/<phase>)
SPLIT_MIN_SHARE = 0.05
# A phase is slower than it should be when it took more than SLOW_FACTOR times its median over
# the run's last SLOW_HISTORY steps (at least SLOW_MIN_HISTORY of them) and more than SLOW_MIN_S
# seconds: a console line says so, once per phase name and run, at any log.level (phase lines
# themselves only at log.level=debug or with log.phase_lines). The floor keeps the jitter of
# phases of milliseconds (a CPU run's sleep, wake, sync) quiet; the median ignores the first
# step's warm-up once three steps are in.
SLOW_FACTOR = 3.0
SLOW_MIN_S = 1.0
SLOW_HISTORY = 20
SLOW_MIN_HISTORY = 3

_clock = time.perf_counter  # durations; a module attribute so tests can substitute a fake clock


def format_duration(seconds: float | None) -> str:
    """``130`` -> ``"2m10s"``; ``"?"`` when unknown."""
    if seconds is None or not math.isfinite(seconds):
        return "?"
    s = round(max(seconds, 0.0))
    d, s = divmod(s, 86400)
    h, s = divmod(s, 3600)
    m, s = divmod(s, 60)
    if d:
        return f"{d}d{h:02d}h"
    if h:
        return f"{h}h{m:02d}m"
    return f"{m}m{s:02d}s" if m else f"{s}s"


def flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    """Nested dicts -> dotted keys: ``{"optim": {"lr": 1}}`` -> ``{"optim.lr": 1}``."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _to_float(key: str, value: Any) -> float:
    """Python / numpy / 0-d torch scalars -> float, None -> NaN (written as null); anything else
    is the caller's bug."""
    if value is None:
        return math.nan
    try:
        return float(value)
    except (TypeError, ValueError, RuntimeError) as e:
        raise TypeError(f"metric {key!r}: expected a number or a scalar tensor, got "
                        f"{type(value).__name__} {value!r:.80}") from e


def _parse_lines(data: bytes) -> list[tuple[bytes, dict | None]]:
    """Each line of a metrics file with its record; ``None`` for a torn or unparseable line."""
    out = []
    for line in data.splitlines(keepends=True):
        rec = None
        if line.endswith(b"\n") and line.strip():
            try:
                rec = json.loads(line)
            except ValueError:
                pass
        if rec is not None and not (isinstance(rec, dict) and isinstance(rec.get("step"), int)):
            rec = None
        out.append((line, rec))
    return out


def truncate_after(path: Path, step: int | None) -> int:
    """Drops the records with ``step > step`` (none when ``step`` is None) and torn lines from
    ``path``, atomically.

    The kept lines stay byte for byte; the file is rewritten (temp file in the same dir, fsync,
    ``os.replace``) only when something is dropped. Returns how many lines were dropped.
    """
    path = Path(path)
    if not path.is_file():
        return 0
    lines = _parse_lines(path.read_bytes())
    keep = [line for line, rec in lines
            if rec is not None and (step is None or rec["step"] <= step)]
    dropped = len(lines) - len(keep)
    if dropped:
        atomic_write(path, lambda f: f.writelines(keep), "wb")
        log.warning("%s: dropped %d line(s): torn, or records after step %s (written after the "
                    "checkpoint this run resumes from)", path, dropped, step)
    return dropped


def read_metrics(run_dir_or_file: str | Path) -> list[dict]:
    """The records of a metrics file, in file order; non-finite values are ``None``.

    Accepts the file itself, a run dir (reads ``<run_dir>/logs/metrics.jsonl``) or a log dir
    holding ``metrics.jsonl``. A torn last line (a crash mid-write) is skipped; a bad line
    elsewhere is an error naming the file and line.
    """
    p = Path(run_dir_or_file)
    if p.is_dir():
        candidates = [p / "logs" / JSONL_NAME, p / JSONL_NAME]
        p = next((c for c in candidates if c.is_file()), candidates[0])
    if not p.exists():
        raise FileNotFoundError(f"no metrics file or run dir: {p}")
    if not p.is_file():
        raise FileNotFoundError(f"no metrics file: {p}")
    lines = _parse_lines(p.read_bytes())
    for i, (line, rec) in enumerate(lines[:-1]):
        if rec is None and line.strip():
            raise ValueError(f"{p}:{i + 1}: not a metrics record: {line[:80]!r}")
    return [rec for _, rec in lines if rec is not None]


class MetricsLogger:
    """Per-step metrics to JSONL / TensorBoard / wandb / console; phase timings; live status.

    See the module docstring. With ``enabled=False`` nothing is written or printed, but
    :meth:`phase` and :meth:`log` still time and return records.
    """

    def __init__(self, cfg: LogConfig, *, run_name: str, total_steps: int, start_step: int = 0,
                 enabled: bool = True, hparams: dict | None = None):
        self.cfg = cfg
        self.run_name = run_name
        self.total_steps = total_steps
        self.start_step = start_step
        self.enabled = enabled
        self.last_step = start_step
        self._times: dict[str, float] = defaultdict(float)
        self._phases: list[tuple[str, float]] = []  # open phases (name, start), outermost first
        self._top: list[str] = []  # this step's top-level phases, in the order they first ended
        self._history: dict[str, deque[float]] = {}  # a top-level phase's seconds per past step
        self._slow_shown: set[str] = set()  # phases already reported slow (once each)
        self._t0 = self._t_last = _clock()    # construction, previous log() call
        self._jsonl = self._tb = self._wandb = self._console = self._live = None
        self._closed = False
        if cfg.interval < 1:
            raise ValueError(f"log.interval must be >= 1, got {cfg.interval}")
        if not enabled:
            return
        if cfg.wandb:  # first: a missing package must fail before any file is touched
            try:
                import wandb
            except ImportError as e:
                raise ImportError("log.wandb=true needs the wandb package: pip install wandb "
                                  "(or set log.wandb=false)") from e
        if cfg.jsonl or cfg.tensorboard or cfg.wandb:
            if not cfg.dir:
                raise ValueError("log.dir is not set (Config sets it to {run_dir}/logs)")
            log_dir = Path(cfg.dir)
            log_dir.mkdir(parents=True, exist_ok=True)
        try:
            if cfg.jsonl:
                truncate_after(log_dir / JSONL_NAME, start_step if start_step > 0 else None)
                self._jsonl = open(log_dir / JSONL_NAME, "a", encoding="utf-8")  # noqa: SIM115
            if cfg.tensorboard:
                from torch.utils.tensorboard import SummaryWriter
                # purge_step hides the events a crashed run wrote after the checkpoint we resume.
                self._tb = SummaryWriter(str(log_dir / "tensorboard"),
                                         purge_step=start_step + 1 if start_step > 0 else None)
                if hparams:
                    self._tb.add_text("hparams", _markdown_table(flatten(hparams)), start_step)
            if cfg.wandb:
                self._wandb = wandb.init(project=cfg.wandb_project,
                                         name=cfg.wandb_name or run_name, config=hparams,
                                         id=_wandb_run_id(log_dir), dir=str(log_dir),
                                         resume="allow")
            if cfg.console:
                from rich.console import Console
                self._console = Console()
        except BaseException:
            self.close()
            raise

    # -- timing -------------------------------------------------------------------------------

    @contextlib.contextmanager
    def phase(self, name: str):
        """Adds the block's wall seconds to ``time/<name>`` of the step being logged (the step's
        console line shows the split of its top-level phases). With ``log.level=debug`` or
        ``log.phase_lines`` it prints one console line when the block ends; at any level, a
        top-level phase slower than it should be (:func:`slow_phase`) is shown once per run. On
        CUDA it also keeps the phase's peak GPU memory as ``mem/<name>_peak_gib`` (allocated by
        PyTorch) and ``mem/<name>_used_gib`` (the whole device, vLLM included: ``mem_get_info``)."""
        t = _clock()
        self._phases.append((name, t))
        if len(self._phases) == 1:
            self._start_live()
        cuda = len(self._phases) == 1 and _cuda_memory_stats()  # nested phases: the outer peak
        if cuda:
            import torch
            torch.cuda.reset_peak_memory_stats()
        try:
            yield
        finally:
            seconds = _clock() - t
            self._times[f"time/{name}"] += seconds
            top = len(self._phases) == 1
            if top:
                self._stop_live()
                if name not in self._top:
                    self._top.append(name)
            self._phases.pop()
            memory = _cuda_memory(name) if cuda else {}
            for key, gib in memory.items():
                self._times[key] = max(self._times.get(key, 0.0), gib)
            if self._console is not None and self.phase_lines:
                self._console.print(self._phase_line(name, seconds, memory), soft_wrap=True,
                                    highlight=False)
            if top and name not in self._slow_shown:
                self._report_slow(name)

    @property
    def phase_lines(self) -> bool:
        """One console line per phase: ``log.level=debug`` or ``log.phase_lines``."""
        return self.cfg.phase_lines or self.cfg.level == "debug"

    def _report_slow(self, name: str) -> None:
        seconds = self._times[f"time/{name}"]  # the step's total for the phase so far
        typical = slow_phase(seconds, self._history.get(name, ()))
        if typical is None:
            return
        self._slow_shown.add(name)
        if self._console is not None and not self.phase_lines:  # its phase line said it already
            from rich.text import Text
            line = Text()
            line.append(f"step {self.last_step + 1}/{self.total_steps}", style="dim")
            line.append(f" {name} took {seconds:.1f}s, {seconds / typical:.1f}x its median of "
                        f"{typical:.2f}s over the last {len(self._history[name])} steps "
                        "(shown once; every step's phase times: time/<phase> in metrics.jsonl)",
                        style="yellow")
            self._console.print(line, soft_wrap=True, highlight=False)

    def seconds(self, *names: str) -> float:
        """Wall seconds spent so far in this step in the phases ``names``."""
        return sum(self._times.get(f"time/{name}", 0.0) for name in names)

    def _phase_line(self, name: str, seconds: float, memory: dict[str, float]):
        from rich.text import Text
        line = Text()
        line.append(f"step {self.last_step + 1}/{self.total_steps}", style="dim")
        line.append(f" {'  ' * len(self._phases)}{name:<14}", style="bold")
        line.append(f" {seconds:8.2f}s")
        if memory:
            line.append(f" │ GPU peak {memory[f'mem/{name}_peak_gib']:.1f} GiB allocated, "
                        f"{memory[f'mem/{name}_used_gib']:.1f} GiB used", style="dim")
        return line

    def eta(self) -> float | None:
        """Seconds to ``total_steps`` from the mean step time since construction; None: unknown."""
        done = self.last_step - self.start_step
        if done <= 0:
            return None
        per_step = (self._t_last - self._t0) / done
        return max(0.0, per_step * (self.total_steps - self.last_step) - (_clock() - self._t_last))

    # -- records ------------------------------------------------------------------------------

    def log(self, step: int, metrics: dict[str, Any]) -> dict[str, float]:
        """Closes step ``step``: adds ``time/<phase>`` and ``time/step``, resets the timers and,
        every ``log.interval`` steps and at the last step, writes the record. Returns it."""
        bad = [k for k in RESERVED_KEYS if k in metrics]
        if bad:
            raise ValueError(f"metric names {bad} are reserved for the record itself")
        now = _clock()
        record = {"time/step": now - self._t_last, **self._times}
        record.update(metrics)
        record = {k: _to_float(k, v) for k, v in record.items()}
        split = [(name, self._times[f"time/{name}"]) for name in self._top]
        for name, seconds in split:
            self._history.setdefault(name, deque(maxlen=SLOW_HISTORY)).append(seconds)
        self._times.clear()
        self._top = []
        self._t_last, self.last_step = now, step
        if step == self.start_step:  # a record before the first update (the step-0 evaluation)
            self._t0 = now           # is set-up, not a step: the ETA starts counting here
        due = step % self.cfg.interval == 0 or step >= self.total_steps
        if self.enabled and due and not self._closed:
            self._write(step, record, split)
        return record

    def _write(self, step: int, record: dict[str, float], split: list[tuple[str, float]] = ()) -> None:
        if self._jsonl is not None:
            clean = {k: (v if math.isfinite(v) else None) for k, v in record.items()}
            line = json.dumps({"step": int(step), "wall_time": time.time(), **clean},
                              allow_nan=False)
            self._jsonl.write(line + "\n")
            self._jsonl.flush()
        if self._tb is not None:
            for k, v in record.items():
                self._tb.add_scalar(k, v, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(record, step=step)
        if self._console is not None:
            self._console.print(self._summary(step, record, split), soft_wrap=True, highlight=False)

    def _summary(self, step: int, record: dict[str, float], split: list[tuple[str, float]] = ()):
        """The step's one console line: CONSOLE_METRICS, the step time followed by the split of its
        top-level phases (those of at least SPLIT_MIN_SHARE of it), then the ETA."""
        from rich.text import Text
        line = Text()
        line.append(f"step {step}/{self.total_steps}", style="bold")
        fields = [(label, fmt.format(record[key])) for key, label, fmt in CONSOLE_METRICS
                  if key in record]
        total = record.get("time/step", 0.0)
        shown = [f"{name} {seconds:.2f}s" if seconds < 1 else f"{name} {seconds:.1f}s" for name, seconds in split
                 if total > 0 and seconds >= SPLIT_MIN_SHARE * total]
        if shown:
            fields = [(label, f"{value} ({', '.join(shown)})" if label == "time" else value)
                      for label, value in fields]
        for label, value in fields + [("ETA", format_duration(self.eta()))]:
            line.append(f" │ {label} ", style="dim")
            line.append(value)
        return line

    # -- live status (TTY only) ---------------------------------------------------------------

    def _start_live(self) -> None:
        if self._console is None or not self._console.is_terminal or self._closed:
            return
        from rich.errors import LiveError
        from rich.live import Live
        try:
            self._live = Live(_Status(self), console=self._console, transient=True,
                              refresh_per_second=4)
            self._live.start()
        except LiveError:  # another live display owns this console: go without
            self._live = None

    def _stop_live(self) -> None:
        if self._live is not None:
            live, self._live = self._live, None
            live.stop()

    def status_text(self) -> str:
        """``step 3/100 · train › forward 12s · ETA 2m10s``: the open phases, the innermost's
        elapsed time, and the ETA."""
        if self._phases:
            phase = " › ".join(n for n, _ in self._phases)
            phase += f" {format_duration(_clock() - self._phases[-1][1])}"
        else:
            phase = "idle"
        return (f"step {self.last_step + 1}/{self.total_steps} · {phase} · "
                f"ETA {format_duration(self.eta())}")

    # -- shutdown -----------------------------------------------------------------------------

    def close(self) -> None:
        """Flushes and closes every writer; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self._stop_live()
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Status:
    """The live line's renderable: re-rendered on every refresh, so the ETA counts down."""

    def __init__(self, logger: MetricsLogger):
        from rich.spinner import Spinner
        self.logger = logger
        self.spinner = Spinner("dots")

    def __rich__(self):
        self.spinner.update(text=self.logger.status_text())
        return self.spinner


def slow_phase(seconds: float, history) -> float | None:
    """The median of ``history`` (a phase's seconds in past steps) when ``seconds`` is slower than
    it should be (SLOW_FACTOR x that median and over SLOW_MIN_S; SLOW_MIN_HISTORY steps at
    least), else None."""
    past = list(history)[-SLOW_HISTORY:]
    if len(past) < SLOW_MIN_HISTORY or seconds <= SLOW_MIN_S:
        return None
    median = statistics.median(past)
    return median if seconds > SLOW_FACTOR * median else None


def _cuda_memory_stats() -> bool:
    try:
        import torch
    except ImportError:  # pragma: no cover - `oar plot` without torch
        return False
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def _cuda_memory(name: str) -> dict[str, float]:
    import torch
    free, total = torch.cuda.mem_get_info()
    return {f"mem/{name}_peak_gib": torch.cuda.max_memory_allocated() / 2**30,
            f"mem/{name}_used_gib": (total - free) / 2**30}


def _markdown_table(flat: dict[str, Any]) -> str:
    rows = "\n".join(f"| {k} | {str(v).replace('|', '/')} |" for k, v in sorted(flat.items()))
    return "| key | value |\n|---|---|\n" + rows


def _wandb_run_id(log_dir: Path) -> str:
    """The wandb run id kept in ``{log.dir}/wandb_run_id`` so a resumed run continues the same
    wandb run (``resume="allow"`` only resumes when the id is the same)."""
    path = log_dir / "wandb_run_id"
    if path.is_file() and path.read_text().strip():
        return path.read_text().strip()
    import wandb
    run_id = wandb.util.generate_id()
    path.write_text(run_id + "\n")
    return run_id
