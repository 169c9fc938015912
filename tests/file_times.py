"""Per-file test times from a pytest JUnit report, as the Markdown table docs/testing.md keeps:

    .venv/bin/python -m pytest tests --junitxml=report.xml && python tests/file_times.py report.xml [N]

Each test's time is pytest's total (setup + call + teardown), so a module-scoped fixture counts
in the file that first used it."""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from collections import defaultdict


def file_times(report: str) -> list[tuple[str, float, int]]:
    """(file, seconds, tests) per test file, slowest first."""
    seconds: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for case in ET.parse(report).getroot().iter("testcase"):
        name = case.get("classname", "").split(".")
        path = "/".join(p for p in name if not p[:1].isupper()) + ".py"  # drop a class name
        seconds[path] += float(case.get("time", 0.0))
        count[path] += 1
    return sorted(((f, seconds[f], count[f]) for f in seconds), key=lambda r: -r[1])


def main(argv: list[str]) -> int:
    rows = file_times(argv[0])
    top = int(argv[1]) if len(argv) > 1 else 15
    total = sum(s for _, s, _ in rows)
    print("| file | tests | seconds | share |\n|---|---:|---:|---:|")
    for f, s, n in rows[:top]:
        print(f"| `{f}` | {n} | {s:.0f} | {100 * s / total:.0f}% |")
    print(f"| all {len(rows)} files | {sum(n for *_, n in rows)} | {total:.0f} | 100% |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
