"""``oar viz RECORDS.jsonl``: token-importance maps like the paper's Figures 4 and 8 (HTML, PNG).

.. code-block:: console

    $ oar viz runs/oracle/records.jsonl --id 'math500/17#3'
    # -> runs/oracle/viz/math500_17_3.html and .png
    $ oar viz records.jsonl --index 0 --methods oar_g,oracle,entropy --out figs/
    $ oar viz records.jsonl --max-records 10     # one page, a section per record; a PNG each

What the maps show: :mod:`megatron_oar.eval.viz`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from megatron_oar.eval.records import RecordError
from megatron_oar.eval.viz.html_page import render_html
from megatron_oar.eval.viz.inputs import (
    DEFAULT_MAX_RECORDS,
    VizError,
    parse_methods,
    resolve_methods,
    safe_name,
    select_records,
)
from megatron_oar.eval.viz.png_figure import render_png
from megatron_oar.fileio import atomic_write


def visualize(path: str | Path, out_dir: str | Path | None = None, *, id: str | None = None,
              index: int | None = None, methods: list[str] | None = None,
              max_records: int = DEFAULT_MAX_RECORDS, png: bool = True) -> list[Path]:
    """Writes ``OUT/<id>.html`` and ``OUT/<id>.png`` (several records: ``OUT/<file stem>.html``,
    one section each, and one PNG per record). Returns the paths written."""
    path = Path(path)
    records = select_records(path, id=id, index=index, max_records=max_records)
    items = [(r, resolve_methods(r, methods, path)) for r in records]
    out_dir = Path(out_dir) if out_dir is not None else path.parent / "viz"
    names: list[str] = []
    for r in records:
        name = safe_name(r.id)
        names.append(name if name not in names else f"{name}_{len(names)}")
    page = out_dir / f"{names[0] if len(records) == 1 else safe_name(path.stem)}.html"
    written = [atomic_write(page, lambda f: f.write(render_html(items, str(path))))]
    if png:
        written += [render_png(r, m, out_dir / f"{n}.png") for (r, m), n in zip(items, names)]
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="oar viz",
                                     description=__doc__.splitlines()[0].replace("``", ""))
    parser.add_argument("records", metavar="RECORDS.jsonl", type=Path,
                        help="token records (oar analyze oracle)")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--id", default=None, help="the record with this id")
    which.add_argument("--index", type=int, default=None, metavar="I",
                       help="the I-th record of the file (0-based)")
    parser.add_argument("--methods", default=None,
                        help="comma-separated panels, in order: oar_p, oar_g, entropy, random, "
                             "oracle (default: the oar_p/oar_g/entropy scores present, then "
                             "oracle)")
    parser.add_argument("--out", type=Path, default=None, metavar="DIR",
                        help="output directory (default: viz/ next to RECORDS.jsonl)")
    parser.add_argument("--max-records", type=int, default=DEFAULT_MAX_RECORDS, metavar="N",
                        help=f"without --id/--index: the first N records on one page "
                             f"(default {DEFAULT_MAX_RECORDS})")
    parser.add_argument("--no-png", action="store_true", help="write the HTML only")
    args = parser.parse_args(argv)
    try:
        paths = visualize(args.records, args.out, id=args.id, index=args.index,
                          methods=parse_methods(args.methods), max_records=args.max_records,
                          png=not args.no_png)
    except (VizError, RecordError) as e:
        print(f"oar viz: error: {e}", file=sys.stderr)
        return 2
    for p in paths:
        print(p)
    return 0
