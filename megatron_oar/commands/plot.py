"""``oar plot RUN_DIR``: a run's training curves as one PNG, from its ``logs/metrics.jsonl``.

.. code-block:: console

    $ oar plot runs/qwen-7b                      # -> runs/qwen-7b/plots/training_curves.png
    $ oar plot runs/qwen-7b --keys reward/mean 'time/*' --out curves.png

One panel per entry of :data:`PANELS` (or per ``--keys`` entry; glob patterns allowed); panels
whose metrics the run never logged are skipped. With many steps each curve is drawn faint with
its moving average on top. Matplotlib renders off-screen (Agg canvas, no pyplot), so this works
on a headless node and leaves the process's matplotlib backend alone.
"""

from __future__ import annotations

import argparse
import fnmatch
import math
import sys
from pathlib import Path

import numpy as np

from megatron_oar.fileio import atomic_write
from megatron_oar.training.logger import read_metrics

# (panel title, metric keys or glob patterns); adjust the keys when the trainer's names change.
PANELS: list[tuple[str, list[str]]] = [
    ("reward", ["reward/mean", "reward/accuracy", "reward/format"]),
    ("held-out evaluation", ["eval/accuracy", "eval/pass_at_n"]),
    ("response length (tokens)", ["response/length_mean", "response/length_max"]),
    ("entropy", ["policy/entropy"]),
    ("credit concentration", ["credit/ess_ratio", "credit/top10_mass"]),
    ("clip fraction", ["loss/clip_frac"]),
    ("KL", ["loss/ref_kl", "loss/approx_kl"]),
    ("grad norm", ["optim/grad_norm"]),
    ("rollout / train log-prob mismatch", ["rollout/logprob_mismatch"]),
    ("time per phase (s)", ["time/*"]),
]
SMOOTH_MIN_STEPS = 20  # from this many points on, a moving average is drawn over the raw curve
DEFAULT_OUT = Path("plots") / "training_curves.png"


def series(records: list[dict], key: str) -> tuple[np.ndarray, np.ndarray]:
    """``(steps, values)`` of the records that carry ``key``; null -> NaN."""
    pts = [(r["step"], math.nan if r[key] is None else r[key]) for r in records if key in r]
    arr = np.asarray(pts, dtype=float).reshape(-1, 2)
    return arr[:, 0], arr[:, 1]


def moving_average(y: np.ndarray, window: int) -> np.ndarray:
    """Trailing mean over the last ``window`` finite points (NaNs are skipped, not spread)."""
    ok = np.isfinite(y)
    csum = np.concatenate([[0.0], np.cumsum(np.where(ok, y, 0.0))])
    ccount = np.concatenate([[0], np.cumsum(ok)])
    lo = np.maximum(np.arange(1, len(y) + 1) - window, 0)
    hi = np.arange(1, len(y) + 1)
    count = ccount[hi] - ccount[lo]
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(count > 0, (csum[hi] - csum[lo]) / count, np.nan)


def expand(patterns: list[str], keys: list[str]) -> list[str]:
    """The metric keys matching each pattern, in pattern order, then key order, no repeats."""
    out: list[str] = []
    for pat in patterns:
        out += [k for k in keys if fnmatch.fnmatchcase(k, pat) and k not in out]
    return out


def plot_run(run_dir: str | Path, out: Path | None = None, keys: list[str] | None = None) -> Path:
    """Draws the run's curves to ``out`` (default ``<run_dir>/plots/training_curves.png``).

    ``keys``: one panel per entry (a metric key or a glob such as ``time/*``) instead of
    :data:`PANELS`. Raises ``FileNotFoundError`` without a metrics file and ``ValueError`` when it
    has no records or none of the requested metrics. Returns the path written.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    run_dir = Path(run_dir)
    records = read_metrics(run_dir)
    if not records:
        raise ValueError(f"{run_dir}: the metrics file has no records")
    if out is None:
        out = (run_dir if run_dir.is_dir() else run_dir.parent) / DEFAULT_OUT
    out = Path(out)

    present = sorted({k for r in records for k in r} - {"step", "wall_time"})
    panels = [(k, [k]) for k in keys] if keys else PANELS
    panels = [(title, expand(pats, present)) for title, pats in panels]
    panels = [(title, ks) for title, ks in panels if ks]
    if not panels:
        wanted = keys or [k for _, ks in PANELS for k in ks]
        raise ValueError(f"{run_dir}: none of the metrics {wanted} were logged "
                         f"(present: {present})")

    ncols = min(3, len(panels))
    nrows = math.ceil(len(panels) / ncols)
    fig = Figure(figsize=(5.0 * ncols, 3.2 * nrows), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    steps = [r["step"] for r in records]
    fig.suptitle(f"{run_dir.resolve().name}: steps {min(steps)}-{max(steps)}")
    for i, (title, ks) in enumerate(panels):
        ax = fig.add_subplot(nrows, ncols, i + 1)
        _draw(ax, records, ks)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)  # the exact keys (and averaging window): titles are loose

    return atomic_write(out, lambda f: fig.savefig(f, format="png"), "wb")


def _draw(ax, records: list[dict], keys: list[str]) -> None:
    """Each key's curve; faint raw + moving average when there are many points."""
    for j, key in enumerate(keys):
        x, y = series(records, key)
        color = f"C{j % 10}"
        if len(x) >= SMOOTH_MIN_STEPS:
            window = max(5, len(x) // 25)
            ax.plot(x, y, color=color, alpha=0.25, linewidth=0.8)
            ax.plot(x, moving_average(y, window), color=color, linewidth=1.5,
                    label=f"{key} (avg {window})")
        else:
            ax.plot(x, y, color=color, marker="o", markersize=3, linewidth=1.2, label=key)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="oar plot", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", metavar="RUN_DIR", type=Path,
                        help="a run dir (reads RUN_DIR/logs/metrics.jsonl) or a metrics.jsonl")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"PNG to write (default: RUN_DIR/{DEFAULT_OUT})")
    parser.add_argument("--keys", nargs="+", default=None, metavar="KEY",
                        help="one panel per metric key or glob (e.g. reward/mean 'time/*'); "
                             "commas also separate")
    args = parser.parse_args(argv)
    keys = [k for arg in args.keys for k in arg.split(",") if k] if args.keys else None
    if not args.run_dir.exists():
        print(f"oar plot: error: run dir not found: {args.run_dir}", file=sys.stderr)
        return 2
    try:
        path = plot_run(args.run_dir, args.out, keys)
    except (FileNotFoundError, ValueError) as e:
        print(f"oar plot: error: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
