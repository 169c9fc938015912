"""``oar bench screening``: how close screened OAR-P comes to exact OAR-P, and at what cost.

Input: token records from ``oar analyze oracle`` (``records.jsonl``), which hold exact OAR-P and
OAR-G importance for the same correct trajectories. For each screen fraction q, the screened
importance is rebuilt with the trainer's own functions (``screen_positions``,
``merge_screened``: exact OAR-P on each row's top ceil(q n) tokens by OAR-G, the rest below them
in OAR-G's order), so no model run is needed. Reported per q, averaged over rows:

* Spearman rank correlation with exact OAR-P over the scored tokens;
* top-20% recall: the share of exact OAR-P's top 20% that screened ranks in its top 20%;
* cost: masked forwards (one per exactly scored token) plus OAR-G's accounted 2 forward-equivalents
  per sequence (noisy forward + input-gradient backward), relative to exact OAR-P's n per row.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from megatron_oar.attribution.importance_passes import merge_screened, screen_count, screen_positions
from megatron_oar.eval.recall import top_mask
from megatron_oar.eval.records import RecordError, read_records

HEADER = ("| screen fraction q | exact copies vs exact OAR-P | forward-equivalents vs exact OAR-P "
          "| Spearman vs exact | top-20% recall vs exact |\n|---:|---:|---:|---:|---:|")


def _ranks(x: torch.Tensor) -> torch.Tensor:
    """Average ranks (ties share their mean rank), as Spearman's rho needs."""
    order = torch.sort(x, stable=True).indices
    ranks = torch.empty_like(x, dtype=torch.float64)
    ranks[order] = torch.arange(len(x), dtype=torch.float64)
    for v in torch.unique(x):
        tie = x == v
        if tie.sum() > 1:
            ranks[tie] = ranks[tie].mean()
    return ranks


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    ra, rb = _ranks(a), _ranks(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    denom = ra.norm() * rb.norm()
    return float((ra * rb).sum() / denom) if denom > 0 else float("nan")


def evaluate(records, fractions: list[float]) -> list[dict]:
    rows = [r for r in records if "oar_p" in r.scores and "oar_g" in r.scores]
    if not rows:
        raise RecordError("no record carries both oar_p and oar_g scores (run oar analyze oracle "
                          "with --methods including oar_p,oar_g)")
    results = []
    for q in fractions:
        rho, recall, copies, exact_copies, fe = [], [], 0, 0, 0.0
        for r in rows:
            mask = torch.tensor(r.scored_mask).unsqueeze(0)
            n = int(mask.sum())
            if n < 2:
                continue
            p = torch.tensor(r.scores["oar_p"], dtype=torch.float32).unsqueeze(0)
            g = torch.tensor(r.scores["oar_g"], dtype=torch.float32).unsqueeze(0)
            selected = screen_positions(g, mask, [0], q)
            screened = merge_screened(p * selected, g, selected, mask)[0][mask[0]]
            exact = p[0][mask[0]]
            rho.append(spearman(screened, exact))
            top_s = top_mask(screened.tolist(), [True] * n, 20)
            top_p = top_mask(exact.tolist(), [True] * n, 20)
            recall.append(sum(a and b for a, b in zip(top_s, top_p)) / sum(top_p))
            copies += screen_count(n, q)
            exact_copies += n
            fe += screen_count(n, q) + 2.0
        results.append({"q": q, "rows": len(rho), "copies_ratio": copies / exact_copies,
                        "fe_ratio": fe / exact_copies,
                        "spearman": sum(x for x in rho if x == x) / max(1, sum(x == x for x in rho)),
                        "top20_recall": sum(recall) / len(recall),
                        "mean_scored_tokens": exact_copies / max(1, len(rho))})
    return results


def render(results: list[dict]) -> str:
    lines = [HEADER]
    for r in results:
        lines.append(f"| {r['q']:g} | {r['copies_ratio']:.0%} | {r['fe_ratio']:.0%} | "
                     f"{r['spearman']:.3f} | {r['top20_recall']:.3f} |")
    r = results[0]
    lines.append(f"\n{r['rows']} trajectories, {r['mean_scored_tokens']:.1f} scored tokens each "
                 "on average; exact OAR-P = 100% (one masked forward per scored token).")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="oar bench screening", description=__doc__.split("\n\n")[0])
    p.add_argument("records", type=Path, help="records.jsonl from oar analyze oracle")
    p.add_argument("--fractions", default="0.1,0.2,0.3,0.5", help="screen fractions q")
    p.add_argument("--update-benchmarks", action="store_true",
                   help="rewrite the screening section of BENCHMARKS.md with this table")
    args = p.parse_args(argv)
    try:
        fractions = [float(x) for x in args.fractions.split(",")]
        if not all(0 < q <= 1 for q in fractions):
            raise ValueError(f"--fractions {args.fractions!r}: each must be in (0, 1]")
        results = evaluate(list(read_records(args.records)), fractions)
    except (RecordError, ValueError) as e:
        print(f"oar bench screening: {e}", file=sys.stderr)
        return 2
    text = render(results)
    print(text)
    if args.update_benchmarks:
        from benchmarks import common

        section = (f"## Screened OAR-P against exact OAR-P (`oar bench screening`)\n\n"
                   f"Command: `{common.command_line('oar bench screening', argv or sys.argv[1:])}`\n"
                   f"{common.machine_line(common.machine_info())}\n\n"
                   f"The records (`oar analyze oracle` output) hold exact OAR-P and OAR-G importance "
                   f"of the same correct trajectories; screened importance is rebuilt from them with "
                   f"the trainer's `screen_positions` / `merge_screened`.\n\n{text}\n")
        print(f"updated {common.update_benchmarks('screening', section)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
