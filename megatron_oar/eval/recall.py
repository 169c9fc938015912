"""Causal-token recall (paper Section 5.1, Figure 5a): how many of the oracle's causal pivots does
each importance signal rank within its top K% of tokens?

Per trajectory the scored tokens are ranked by score (ties: earlier token first) and the top
``ceil(K% x scored tokens)`` are kept. **Recall** pools over trajectories: pivots found in the top
K% / all pivots (``micro``); ``macro`` averages the per-trajectory recall over the trajectories that
have a pivot. A random ranking expects a recall of K%.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

from megatron_oar.eval.records import METHODS, TokenRecord
from megatron_oar.fileio import atomic_write_text
from megatron_oar.methods import LABELS as METHOD_LABELS

K_PERCENTS = (5, 10, 15, 20, 25, 30, 35, 40, 45, 50)
LABELS = {m: METHOD_LABELS[m] for m in METHODS}  # in the order of the tables


def top_mask(scores: Sequence[float], scored: Sequence[bool], percent: float) -> list[bool]:
    """True on the top ``percent``% of the scored tokens by score."""
    idx = [i for i, s in enumerate(scored) if s]
    keep = math.ceil(len(idx) * percent / 100.0)
    top = sorted(idx, key=lambda i: (-scores[i], i))[:keep]
    mask = [False] * len(scores)
    for i in top:
        mask[i] = True
    return mask


def recall_table(records: Sequence[TokenRecord], methods: Sequence[str],
                 k_percents: Sequence[float] = K_PERCENTS) -> dict:
    """``{"k_percents", "trajectories", "with_pivots", "pivots", "scored_tokens",
    "recall": {method: {"micro": [...], "macro": [...]}}}`` over records that carry oracle labels."""
    labelled = [r for r in records if r.oracle is not None]
    pivots_of = [[bool(o) and s for o, s in zip(r.oracle, r.scored_mask)] for r in labelled]
    total_pivots = sum(sum(p) for p in pivots_of)
    out = {"k_percents": list(k_percents), "trajectories": len(labelled),
           "with_pivots": sum(any(p) for p in pivots_of), "pivots": total_pivots,
           "scored_tokens": sum(sum(r.scored_mask) for r in labelled), "recall": {}}
    for m in methods:
        micro, macro = [], []
        for k in k_percents:
            hits, per_traj = 0, []
            for r, piv in zip(labelled, pivots_of):
                if m not in r.scores:
                    raise ValueError(f"record {r.id}: no scores for method {m!r}")
                top = top_mask(r.scores[m], r.scored_mask, k)
                found = sum(t and p for t, p in zip(top, piv))
                hits += found
                if any(piv):
                    per_traj.append(found / sum(piv))
            micro.append(hits / total_pivots if total_pivots else float("nan"))
            macro.append(sum(per_traj) / len(per_traj) if per_traj else float("nan"))
        out["recall"][m] = {"micro": micro, "macro": macro}
    return out


def render_markdown(table: dict) -> str:
    ks = table["k_percents"]
    lines = [f"Oracle causal-token recall within the top K% of scored tokens "
             f"({table['trajectories']} correct trajectories, {table['with_pivots']} with a pivot; "
             f"{table['pivots']} pivots among {table['scored_tokens']} scored tokens)", "",
             "| method | " + " | ".join(f"K={k:g}%" for k in ks) + " |",
             "|---|" + "---:|" * len(ks)]
    for m, r in table["recall"].items():
        lines.append(f"| {LABELS.get(m, m)} | " + " | ".join(_pct(v) for v in r["micro"]) + " |")
    lines += ["", "(micro recall: pivots found / all pivots; `recall.json` also has the "
                  "per-trajectory mean)"]
    return "\n".join(lines)


def _pct(v: float) -> str:
    return "-" if v != v else f"{100 * v:.1f}"


def plot_recall(table: dict, path: str | Path) -> Path:
    """Figure 5a: recall against K, one line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 4))
    ks = table["k_percents"]
    for m, r in table["recall"].items():
        ax.plot(ks, [100 * v for v in r["micro"]], marker="o", label=LABELS.get(m, m))
    ax.set_xlabel("top-K% tokens by importance")
    ax.set_ylabel("recall of oracle causal tokens (%)")
    ax.set_title(f"Causal-token recall ({table['trajectories']} trajectories)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_outputs(table: dict, out_dir: str | Path) -> dict[str, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "recall.json", "md": out / "recall.md", "png": out / "recall.png"}
    atomic_write_text(paths["json"], json.dumps(table, indent=2))
    atomic_write_text(paths["md"], render_markdown(table) + "\n")
    plot_recall(table, paths["png"])
    return paths


def main(argv: list[str] | None = None) -> int:
    """``oar analyze recall RECORDS.jsonl``: the table and plot again from saved records."""
    import argparse
    import sys

    from megatron_oar.eval.records import RecordError, read_records

    p = argparse.ArgumentParser(prog="oar analyze recall", description=main.__doc__)
    p.add_argument("records", type=Path, help="records.jsonl written by oar analyze oracle")
    p.add_argument("--methods", help="default: every method the records carry")
    p.add_argument("--k-percents", default=",".join(str(k) for k in K_PERCENTS))
    p.add_argument("--out", type=Path, help="default: the records' directory")
    args = p.parse_args(argv)
    try:
        records = list(read_records(args.records))
        methods = (args.methods.split(",") if args.methods
                   else sorted({m for r in records for m in r.scores}, key=_method_order))
        table = recall_table(records, methods, [float(k) for k in args.k_percents.split(",")])
    except (RecordError, ValueError) as e:
        print(f"oar analyze recall: {e}", file=sys.stderr)
        return 2
    write_outputs(table, args.out or args.records.parent)
    print(render_markdown(table))
    return 0


def _method_order(m: str) -> tuple[int, str]:
    order = list(LABELS)
    return (order.index(m) if m in order else len(order), m)
