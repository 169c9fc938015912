"""Where a pass's time goes: device (kernel) time against host time, from one run under
``torch.profiler`` (``oar bench vs-hf --profile``).

A pass is *device-bound* when its kernels keep the GPU busy for most of its wall time, and
*host-bound* when the GPU idles between kernels while Python, the dispatcher and the launches
catch up (many small kernels, synchronisations, host-side copies). :func:`summarize` reports, for
one profiled run of ``wall_s`` seconds:

- ``busy_s``: the union of the device's kernel intervals (on a CPU: of the top-level operators,
  so the CPU-side summary is the same arithmetic over operators);
- ``idle_s`` = wall - busy, and ``busy_fraction``;
- ``kernels``: how many ran and their mean duration (a mean of a few microseconds means launch-bound);
- ``top``: the costliest kernels by total time (name, calls, seconds, share of all kernels' time);
- ``gaps``: the longest idle stretches between consecutive kernels, with the host operator that
  was running when the gap began (what the device waited for).
"""

from __future__ import annotations

import time
from collections import defaultdict
from pathlib import Path


def _intervals(prof, cuda: bool) -> list[tuple[str, float, float]]:
    """(name, start_us, end_us) of the device's kernels (CUDA) or of the top-level CPU operators."""
    from torch.autograd import DeviceType

    out = []
    for e in prof.events():
        if cuda and e.device_type != DeviceType.CUDA:
            continue
        if not cuda and (e.device_type != DeviceType.CPU or e.cpu_parent is not None):
            continue
        out.append((e.name, float(e.time_range.start), float(e.time_range.end)))
    return sorted(out, key=lambda x: x[1])


def _host_ops(prof) -> list[tuple[str, float, float]]:
    from torch.autograd import DeviceType

    return sorted(((e.name, float(e.time_range.start), float(e.time_range.end)) for e in prof.events()
                   if e.device_type == DeviceType.CPU and e.cpu_parent is None), key=lambda x: x[1])


def summarize_intervals(intervals: list[tuple[str, float, float]], wall_s: float, host=None, top: int = 10,
                        gaps: int = 5) -> dict:
    """The summary of ``intervals`` ((name, start_us, end_us), any order) over ``wall_s`` seconds
    of wall time; ``host``: the top-level host operators, to name what ran during each gap."""
    spans = sorted(intervals, key=lambda x: x[1])
    busy_us, end, holes = 0.0, None, []
    for name, s, e in spans:
        if end is None or s >= end:
            if end is not None and s > end:
                holes.append((s - end, end, name))
            busy_us += e - s
            end = e
        elif e > end:
            busy_us += e - end
            end = e
    totals: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for name, s, e in spans:
        totals[name][0] += 1
        totals[name][1] += e - s
    busy_s = busy_us / 1e6
    summed = sum(t for _, t in totals.values())  # >= busy where intervals overlap (streams)
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][1])[:top]
    gap_rows = []
    for length, at, next_name in sorted(holes, reverse=True)[:gaps]:
        during = None
        for name, s, e in host or []:
            if s <= at < e:
                during = name
                break
        gap_rows.append({"us": length, "before": next_name, "host_op": during})
    n = len(spans)
    return {"wall_s": wall_s, "busy_s": busy_s, "idle_s": max(wall_s - busy_s, 0.0),
            "busy_fraction": busy_s / wall_s if wall_s > 0 else None, "kernels": n,
            "mean_kernel_us": busy_us / n if n else None,
            "top": [{"name": k, "calls": c, "seconds": t / 1e6, "share": (t / summed) if summed else None}
                    for k, (c, t) in ranked],
            "gaps": gap_rows}


def profile_pass(fn, table_path: Path | None = None) -> dict:
    """Runs ``fn`` once under torch's profiler and returns its :func:`summarize_intervals`
    summary (``device``: cuda or cpu); with ``table_path``, also the 30 costliest operators as
    torch prints them."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t
    summary = summarize_intervals(_intervals(prof, cuda), wall, host=_host_ops(prof))
    summary["device"] = "cuda" if cuda else "cpu"
    if table_path is not None:
        table_path.parent.mkdir(parents=True, exist_ok=True)
        key = "cuda_time_total" if cuda else "cpu_time_total"
        table_path.write_text(prof.key_averages().table(sort_by=key, row_limit=30))
    return summary


def render(summaries: dict[str, dict]) -> str:
    """A Markdown table, one row per profiled pass (``summaries``: label -> summary)."""
    if not summaries:
        return ""
    device = next(iter(summaries.values())).get("device", "cuda")
    what = "kernel" if device == "cuda" else "top-level CPU operator"
    lines = [f"Profile (one more run of each pass under `torch.profiler`; busy = the union of the {what} "
             "intervals, idle = wall - busy):", "",
             "| pass | wall s | busy s | idle s | busy | kernels (mean us) | costliest | longest gap (host op) |",
             "|---|---:|---:|---:|---:|---|---|---|"]
    for label, s in summaries.items():
        top = s["top"][0] if s["top"] else None
        gap = s["gaps"][0] if s["gaps"] else None
        lines.append(
            f"| {label} | {s['wall_s']:.3f} | {s['busy_s']:.3f} | {s['idle_s']:.3f} | "
            f"{(s['busy_fraction'] or 0):.0%} | {s['kernels']} ({(s['mean_kernel_us'] or 0):.0f}) | "
            + (f"{top['name'][:40]} {top['share']:.0%}" if top and top["share"] is not None else "-") + " | "
            + (f"{gap['us'] / 1e3:.2f} ms ({gap['host_op'] or '?'})" if gap else "-") + " |")
    return "\n".join(lines)
