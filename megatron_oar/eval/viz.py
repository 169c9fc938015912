"""``oar viz RECORDS.jsonl``: token-importance maps like the paper's Figures 4 and 8 (HTML, PNG).

.. code-block:: console

    $ oar viz runs/oracle/records.jsonl --id 'math500/17#3'
    # -> runs/oracle/viz/math500_17_3.html and .png
    $ oar viz records.jsonl --index 0 --methods oar_g,oracle,entropy --out figs/
    $ oar viz records.jsonl --max-records 10     # one page, a section per record; a PNG each

One row ("panel") per method, in the order given: ``oar_p`` (OAR-P), ``oar_g`` (OAR-G),
``entropy``, ``random`` or any other score in the record, and ``oracle`` (the counterfactual
causal mask). By default: the OAR-P, OAR-G and entropy scores the record has, then the oracle
when it was run. Each token is drawn on a background whose colour encodes its score normalised
per sequence and method the way OAR normalises importance (Eq. 14: ``log1p``, then min-max over
the scored tokens; negatives are clamped to 0), so the panels share one scale: white = the
sequence's least important token, dark red = its most important. Oracle pivots are blue; in the
method rows they are underlined in blue too, so alignment can be read off one row. Tokens the
probe does not rank (``scored`` false, e.g. the answer span) and non-finite scores are grey.

The HTML is self-contained (inline CSS, no scripts): each token is a ``<span>`` whose ``title``
tooltip gives the raw score, its rank and the normalised value. The PNG (matplotlib, Agg) draws
the same panels with the same colours (:func:`cell_colors` is shared) as wrapped monospace token
boxes, 1200 px wide, growing in height with the text. The caption of both gives, per method,
the recall of oracle pivots among the top 20% of scored tokens (the paper's Figure 5 at K=20%).
"""

from __future__ import annotations

import argparse
import html
import math
import re
import sys
import unicodedata
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import numpy as np

from megatron_oar.eval import recall
from megatron_oar.eval.records import METHODS, RecordError, TokenRecord, read_records
from megatron_oar.fileio import atomic_write

ORACLE = "oracle"
LABELS = {**recall.LABELS, ORACLE: "Oracle"}
DEFAULT_METHODS = ("oar_p", "oar_g", "entropy")  # + oracle when present; random only on request
TOP_PERCENT = 20  # the caption's recall of pivots: the paper's Figure 5 at K = 20%
DEFAULT_MAX_RECORDS = 20

RGB = tuple[int, int, int]
# White -> yellow -> orange -> dark red (YlOrRd-like). Every channel is non-increasing along the
# ramp, so luminance falls strictly with the score: a higher score is always a darker colour.
_STOPS: tuple[tuple[float, RGB], ...] = (
    (0.0, (255, 255, 255)), (0.25, (255, 237, 160)), (0.5, (254, 178, 76)),
    (0.75, (240, 59, 32)), (1.0, (158, 0, 30)))
PIVOT_RGB: RGB = (33, 102, 172)      # oracle causal pivot (blue: a hue the ramp never takes)
NON_PIVOT_RGB: RGB = (255, 255, 255)
UNSCORED_BG: RGB = (236, 236, 236)   # not ranked by the probe, or a non-finite score
UNSCORED_FG: RGB = (150, 150, 150)
DARK_FG: RGB = (17, 17, 17)
LIGHT_FG: RGB = (255, 255, 255)


class VizError(ValueError):
    """A bad input or flag; the message names the file or flag."""


# ----------------------------------------------------------------------------- scores and colours

def score_rgb(v: float) -> RGB:
    """The colormap: normalised importance in [0, 1] -> background colour (clamped outside)."""
    v = min(max(float(v), 0.0), 1.0) if math.isfinite(v) else 0.0
    for (lo, c_lo), (hi, c_hi) in zip(_STOPS, _STOPS[1:]):
        if v <= hi:
            t = (v - lo) / (hi - lo)
            r, g, b = (round(x + (y - x) * t) for x, y in zip(c_lo, c_hi))
            return r, g, b
    return _STOPS[-1][1]


def luminance(rgb: RGB) -> float:
    """WCAG relative luminance in [0, 1]."""
    def lin(c: int) -> float:
        c = c / 255
        return c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4
    r, g, b = (lin(c) for c in rgb)
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


def text_rgb(bg: RGB) -> RGB:
    """Black or white text, whichever contrasts more with ``bg``."""
    lum = luminance(bg)
    return LIGHT_FG if 1.05 / (lum + 0.05) > (lum + 0.05) / 0.05 else DARK_FG


def hex_color(rgb: RGB) -> str:
    return "#{:02x}{:02x}{:02x}".format(*rgb)


def normalize(scores: list[float], mask: list[bool]) -> np.ndarray:
    """OAR's Eq. 14 per sequence (:func:`~megatron_oar.algorithms.oar.normalize_importance`:
    ``log1p``, then min-max) over the masked finite tokens, negatives clamped to 0, in [0, 1);
    NaN where a token is not ranked."""
    import torch

    from megatron_oar.algorithms.oar import normalize_importance

    x = np.asarray(scores, dtype=np.float64)
    ok = np.asarray(mask, dtype=bool) & np.isfinite(x)
    safe = np.where(ok, np.clip(np.nan_to_num(x), 0.0, None), 0.0)
    norm = normalize_importance(torch.from_numpy(safe)[None], torch.from_numpy(ok)[None])[0].numpy()
    return np.where(ok, norm, np.nan)


def ranks(scores: list[float], mask: list[bool]) -> np.ndarray:
    """1 = the highest score among the masked finite tokens (ties: the earlier token first);
    0 = not ranked."""
    x = np.asarray(scores, dtype=np.float64)
    idx = np.flatnonzero(np.asarray(mask, dtype=bool) & np.isfinite(x))
    out = np.zeros(x.shape, dtype=np.int64)
    out[idx[np.argsort(-x[idx], kind="stable")]] = np.arange(1, len(idx) + 1)
    return out


def top_recall(record: TokenRecord, method: str) -> tuple[int, int, int] | None:
    """``(pivots among the top TOP_PERCENT%, pivots, k)`` over the scored tokens (ranked as
    ``oar analyze recall`` ranks them); None without an oracle."""
    if record.oracle is None:
        return None
    scores = record.scores[method]
    ranked = [bool(m) and math.isfinite(v) for m, v in zip(record.scored_mask, scores)]
    top = recall.top_mask(scores, ranked, TOP_PERCENT)
    pivots = [i for i, o in enumerate(record.oracle) if o and ranked[i]]
    return sum(top[i] for i in pivots), len(pivots), sum(top)


@dataclass
class Cell:
    """One token as drawn in one panel (shared by the HTML and the PNG)."""
    text: str      # display text (control characters escaped)
    bg: RGB
    fg: RGB
    title: str     # tooltip
    pivot: bool    # underline: an oracle pivot in a method row
    newline: bool  # whitespace-only token with a line break: drawn with a visible marker


def display_text(tok: str) -> str:
    """The token as shown: control characters other than newline and tab become ``\\xNN``, lone
    surrogates U+FFFD; everything else (leading spaces, ``<``, byte-fallback pieces) is kept."""
    out = []
    for ch in tok:
        o = ord(ch)
        if ch in "\n\t":
            out.append(ch)
        elif o < 0x20 or 0x7F <= o < 0xA0:
            out.append(f"\\x{o:02x}")
        elif 0xD800 <= o <= 0xDFFF:
            out.append("\ufffd")
        else:
            out.append(ch)
    return "".join(out)


def panel_cells(record: TokenRecord, method: str) -> list[Cell]:
    """The cells of one panel; ``method`` is a score name or ``"oracle"``."""
    label = LABELS.get(method, method)
    mask = record.scored_mask
    oracle = record.oracle or [0] * len(record.tokens)
    cells = []
    if method == ORACLE:
        for tok, o, s in zip(record.tokens, oracle, mask):
            bg = PIVOT_RGB if o else NON_PIVOT_RGB
            fg = text_rgb(bg) if (o or s) else UNSCORED_FG
            title = f"{tok!r} | oracle: " + ("causal pivot (1)" if o else "not a pivot (0)")
            cells.append(Cell(display_text(tok), bg, fg, title + ("" if s else " | not scored"),
                              False, _is_newline(tok)))
        return cells
    scores = record.scores[method]
    norm, rank = normalize(scores, mask), ranks(scores, mask)
    n = int((rank > 0).sum())
    for i, tok in enumerate(record.tokens):
        raw = scores[i]
        if rank[i]:
            bg = score_rgb(norm[i])
            fg = text_rgb(bg)
            title = f"{tok!r} | {label}: {raw:.4g} | rank {rank[i]}/{n} | normalised {norm[i]:.2f}"
        else:
            bg, fg = UNSCORED_BG, UNSCORED_FG
            why = "not scored" if not mask[i] else "non-finite score"
            title = f"{tok!r} | {label}: {raw:.4g} | {why}"
        pivot = bool(record.oracle is not None and oracle[i])
        cells.append(Cell(display_text(tok), bg, fg, title + (" | oracle pivot" if pivot else ""),
                          pivot, _is_newline(tok)))
    return cells


def cell_colors(record: TokenRecord, method: str) -> list[tuple[RGB, RGB]]:
    """``(background, text)`` colour per token: what both renderers draw."""
    return [(c.bg, c.fg) for c in panel_cells(record, method)]


def _is_newline(tok: str) -> bool:
    return "\n" in tok and not tok.strip()


# ----------------------------------------------------------------------------- inputs

def resolve_methods(record: TokenRecord, methods: list[str] | None, path: Path) -> list[str]:
    """The panels for ``record``; every requested method must be in it (VizError otherwise)."""
    if methods is None:
        out = [m for m in DEFAULT_METHODS if m in record.scores]
        if not out:
            out = [m for m in (*METHODS, *record.scores) if m in record.scores]
            out = list(dict.fromkeys(out))
        if record.oracle is not None:
            out.append(ORACLE)
        if not out:
            raise VizError(f"{path}: record {record.id!r} has no scores and no oracle to draw")
        return out
    for m in methods:
        if m == ORACLE and record.oracle is None:
            raise VizError(f"--methods: record {record.id!r} in {path} has no oracle labels "
                           f"(oracle is null: run `oar analyze oracle` first)")
        if m != ORACLE and m not in record.scores:
            have = ", ".join([*record.scores, *([ORACLE] if record.oracle is not None else [])])
            raise VizError(f"--methods: record {record.id!r} in {path} has no {m!r} scores "
                           f"(it has: {have or 'none'})")
    return methods


def parse_methods(arg: str | None) -> list[str] | None:
    if arg is None:
        return None
    names = [m.strip().lower().replace("-", "_") for m in re.split(r"[,\s]+", arg) if m.strip()]
    if not names:
        raise VizError("--methods: no method named (e.g. --methods oar_p,oar_g,entropy,oracle)")
    return list(dict.fromkeys(names))


def select_records(path: Path, *, id: str | None = None, index: int | None = None,
                   max_records: int = DEFAULT_MAX_RECORDS) -> list[TokenRecord]:
    """The record with ``id``, the one at ``index`` (0-based), or the first ``max_records``."""
    if not path.is_file():
        raise VizError(f"{path}: no such records file")
    if index is not None and index < 0:
        raise VizError(f"--index {index}: must be >= 0")
    if max_records < 1:
        raise VizError(f"--max-records {max_records}: must be >= 1")
    chosen: list[TokenRecord] = []
    first_ids: list[str] = []
    count = 0
    for i, rec in enumerate(read_records(path)):
        count = i + 1
        if id is None and index is None:
            chosen.append(rec)
            if len(chosen) == max_records:
                break
        elif (id is not None and rec.id == id) or index == i:
            return [rec]
        elif len(first_ids) < 5:
            first_ids.append(rec.id)
    if id is None and index is None:
        if not chosen:
            raise VizError(f"{path}: no records in the file")
        return chosen
    if id is not None:
        raise VizError(f"--id {id!r}: no record with that id in {path} ({count} records; "
                       f"first ids: {', '.join(map(repr, first_ids)) or 'none'})")
    raise VizError(f"--index {index}: {path} has only {count} records")


def safe_name(rid: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", rid).strip("._") or "record"


# ----------------------------------------------------------------------------- HTML

_CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:24px auto;
 max-width:1200px;padding:0 16px;color:#111;background:#fff}
h1{font-size:20px}h2{font-size:16px;margin:0 0 4px}
section.record{border-top:2px solid #ccc;padding-top:12px;margin-top:20px}
.meta,.caption,.legend{font-size:13px;color:#333}
.legend{display:flex;flex-wrap:wrap;gap:14px;align-items:center;margin:8px 0}
.bar{display:inline-block;width:240px;height:12px;border:1px solid #999;vertical-align:middle}
.sw{display:inline-block;padding:0 5px;border:1px solid #bbb;border-radius:2px}
details.prompt{font-size:13px;margin:6px 0}details.prompt summary{cursor:pointer;color:#444}
pre.prompt{white-space:pre-wrap;background:#f6f6f6;padding:8px;max-height:260px;overflow:auto}
.panel{margin:10px 0}.label{font-weight:600;font-size:14px;margin-bottom:2px}
.tokens{font-family:"DejaVu Sans Mono",Menlo,Consolas,monospace;font-size:13px;line-height:1.7;
 white-space:pre-wrap;overflow-wrap:anywhere;border:1px solid #ddd;border-radius:4px;padding:8px}
.t{border-radius:2px}.pv{box-shadow:inset 0 -2px 0 %(pivot)s}
.nl::before{content:"\\21B5";opacity:.55}
""" % {"pivot": hex_color(PIVOT_RGB)}  # noqa: UP031 (CSS braces stay literal with %)


def _span(c: Cell) -> str:
    cls = "t" + (" pv" if c.pivot else "") + (" nl" if c.newline else "")
    return (f'<span class="{cls}" style="background:{hex_color(c.bg)};color:{hex_color(c.fg)}" '
            f'title="{html.escape(c.title)}">{html.escape(c.text)}</span>')


def _legend_html() -> str:
    stops = ",".join(hex_color(score_rgb(i / 10)) for i in range(11))
    pv, un = hex_color(PIVOT_RGB), hex_color(UNSCORED_BG)
    return (
        '<div class="legend"><span>importance: low <span class="bar" style="background:'
        f'linear-gradient(to right,{stops})"></span> high '
        '<small>(log1p + min-max per sequence and method)</small></span>'
        f'<span><span class="sw" style="background:{pv};color:#fff">tok</span> oracle causal pivot'
        '</span><span><span class="sw pv">tok</span> pivot, in a method row</span>'
        f'<span><span class="sw" style="background:{un};color:{hex_color(UNSCORED_FG)}">tok</span>'
        ' not scored</span></div>')


def caption_text(record: TokenRecord, methods: list[str]) -> str:
    scored = [m for m in methods if m != ORACLE]
    n = sum(record.scored_mask)
    if record.oracle is None or not scored:
        return f"{n} of {len(record.tokens)} tokens scored; oracle not run."
    parts, head = [], ""
    for m in scored:
        hits, pivots, k = top_recall(record, m)  # type: ignore[misc]
        head = f"top {TOP_PERCENT}% = {k} of {n} scored tokens, {pivots} pivots"
        ratio = f" = {hits / pivots:.2f}" if pivots else ""
        parts.append(f"{LABELS.get(m, m)} {hits}/{pivots}{ratio}")
    return f"Recall of oracle pivots in the {head}: " + " · ".join(parts)


def _record_html(record: TokenRecord, methods: list[str]) -> str:
    prompt = record.prompt or ""
    snippet = " ".join(prompt.split())
    snippet = snippet[:120] + ("…" if len(snippet) > 120 else "")
    verdict = "✓ correct" if record.correct else "✗ incorrect"
    panels = []
    for m in methods:
        spans = "".join(_span(c) for c in panel_cells(record, m))
        panels.append(f'<div class="panel" data-method="{html.escape(m)}"><div class="label">'
                      f'{html.escape(LABELS.get(m, m))}</div>'
                      f'<div class="tokens">{spans}</div></div>')
    return (f'<section class="record" id="{html.escape(safe_name(record.id))}">'
            f'<h2>{html.escape(record.id)}</h2>'
            f'<div class="meta">{verdict} · reference: <code>{html.escape(str(record.reference))}'
            f'</code> · {len(record.tokens)} response tokens</div>'
            f'<details class="prompt"><summary>Prompt: {html.escape(snippet)}</summary>'
            f'<pre class="prompt">{html.escape(prompt)}</pre></details>'
            + "".join(panels)
            + f'<p class="caption">{html.escape(caption_text(record, methods))}</p></section>')


def render_html(items: list[tuple[TokenRecord, list[str]]], source: str = "") -> str:
    """A self-contained page: legend, then one section per ``(record, methods)``."""
    title = "Token importance: " + (items[0][0].id if len(items) == 1 else source)
    body = "\n".join(_record_html(r, m) for r, m in items)
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>'
            f'{html.escape(title)}</title><style>{_CSS}</style></head><body>'
            f'<h1>{html.escape(title)}</h1>'
            + (f'<div class="meta">from {html.escape(source)}</div>' if source else "")
            + _legend_html() + body + "</body></html>\n")


# ----------------------------------------------------------------------------- PNG

PNG_WIDTH, DPI, MARGIN = 1200, 100, 24
FONT_PT, LINE_PX = 10, 20
MAX_PNG_HEIGHT = 30000


class Box(NamedTuple):
    """A drawn token box in PNG pixels (origin top left)."""
    method: str
    token: int
    x0: float
    y0: float
    x1: float
    y1: float
    rgb: RGB


def _char_cols(ch: str) -> int:
    if unicodedata.combining(ch) or unicodedata.category(ch) in ("Mn", "Me", "Cf"):
        return 0
    return 2 if unicodedata.east_asian_width(ch) in ("W", "F") else 1


def wrap(texts: list[str], cols: int) -> tuple[list[list[tuple[int, int, int, str]]], int]:
    """Lays tokens out on lines of ``cols`` columns: per token its segments ``(line, col, width,
    text)``, and the number of lines. Newlines break lines; a token that does not fit on the rest
    of a line starts the next one, and one wider than a line is broken."""
    out, line, col = [], 0, 0
    for text in texts:
        segs = []
        for j, part in enumerate(text.replace("\t", "    ").split("\n")):
            if j:
                line, col = line + 1, 0
            width = sum(map(_char_cols, part))
            if col and col + width > cols >= width:
                line, col = line + 1, 0
            start, buf = col, []
            for ch in part:
                w = _char_cols(ch)
                if col + w > cols and col > 0:
                    if buf:
                        segs.append((line, start, col - start, "".join(buf)))
                    line, col, start, buf = line + 1, 0, 0, []
                buf.append(ch)
                col += w
            if buf:
                segs.append((line, start, col - start, "".join(buf)))
        out.append(segs)
    return out, line + 1


def png_figure(record: TokenRecord, methods: list[str]):
    """``(figure, boxes)``: the record's panels drawn on an Agg figure PNG_WIDTH px wide."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.collections import PatchCollection
    from matplotlib.figure import Figure

    fig = Figure(figsize=(PNG_WIDTH / DPI, 1.0), dpi=DPI)
    canvas = FigureCanvasAgg(fig)
    probe = fig.text(0, 0, "M" * 100, **_MONO)
    adv = probe.get_window_extent(canvas.get_renderer()).width / 100  # hinted advance, px
    probe.remove()
    cols = int((PNG_WIDTH - 2 * MARGIN) // adv)

    panels = []
    for m in methods:
        cells = panel_cells(record, m)
        segs, nlines = wrap([("↵" if c.newline else "") + c.text for c in cells], cols)
        panels.append((m, cells, segs, nlines))
    header_px, panel_extra = 4 * LINE_PX + 16, LINE_PX + 14  # as drawn below
    budget = (MAX_PNG_HEIGHT - 2 * MARGIN - header_px) // LINE_PX - len(panels) * 3
    keep = max(5, budget // max(1, len(panels)))
    height = 2 * MARGIN + header_px + sum(
        panel_extra + min(n, keep) * LINE_PX + (LINE_PX if n > keep else 0) for *_, n in panels)
    fig.set_size_inches(PNG_WIDTH / DPI, height / DPI)
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, PNG_WIDTH)
    ax.set_ylim(height, 0)
    ax.axis("off")

    sheet = _Sheet(ax, canvas, adv)
    y = _png_header(sheet, record, methods, MARGIN)
    for m, cells, segs, nlines in panels:
        y = _png_panel(sheet, m, cells, segs, nlines, keep, y)
    ax.add_collection(PatchCollection(sheet.rects, facecolors=sheet.colors, edgecolors="none",
                                      linewidths=0, antialiased=False, zorder=0))
    for x0, x1, yy in sheet.underlines:
        ax.plot([x0, x1], [yy, yy], color=_rgbf(PIVOT_RGB), linewidth=1.5, solid_capstyle="butt",
                zorder=1)
    return fig, sheet.boxes


_MONO = {"family": "DejaVu Sans Mono", "size": FONT_PT}
_SANS = {"family": "DejaVu Sans", "parse_math": False, "va": "center"}


def _rgbf(c: RGB) -> tuple[float, float, float]:
    return (c[0] / 255, c[1] / 255, c[2] / 255)


@dataclass
class _Sheet:
    """The PNG being drawn: its axes, the character advance, and what is collected for the
    end (background rectangles and their colours, the token boxes, pivot underlines)."""

    ax: object
    canvas: object
    adv: float
    rects: list = field(default_factory=list)
    colors: list = field(default_factory=list)
    boxes: list[Box] = field(default_factory=list)
    underlines: list[tuple[float, float, float]] = field(default_factory=list)

    def rect(self, x: float, y: float, w: float, h: float, rgb: RGB) -> None:
        from matplotlib.patches import Rectangle

        self.rects.append(Rectangle((x, y), w, h))
        self.colors.append(_rgbf(rgb))


def _png_header(sheet: _Sheet, record: TokenRecord, methods: list[str], y: float) -> float:
    """The title, prompt, caption and legend lines; returns the y below them."""
    ax, canvas = sheet.ax, sheet.canvas
    verdict = "correct" if record.correct else "incorrect"
    head = (f"{record.id}  ({verdict}; reference: {record.reference}; "
            f"{len(record.tokens)} response tokens)")
    _fit(ax.text(MARGIN, y + LINE_PX / 2, head, size=12, weight="bold", **_SANS), canvas)
    y += LINE_PX + 4
    prompt = " ".join((record.prompt or "").split())
    _fit(ax.text(MARGIN, y + LINE_PX / 2, "prompt: " + prompt, size=9, color="#555", **_SANS),
         canvas)
    y += LINE_PX
    _fit(ax.text(MARGIN, y + LINE_PX / 2, caption_text(record, methods), size=9, color="#333",
                 **_SANS), canvas)
    y += LINE_PX + 4
    # legend: colour bar, pivot and unscored swatches
    x = MARGIN + 118
    for i in range(48):
        sheet.rect(x + i * 5, y + 4, 5, LINE_PX - 8, score_rgb(i / 47))
    ax.text(MARGIN, y + LINE_PX / 2, "importance: low", size=9, **_SANS)
    ax.text(x + 248, y + LINE_PX / 2, "high (log1p + min-max per sequence)", size=9, **_SANS)
    x = MARGIN + 620
    for rgb, label in ((PIVOT_RGB, "oracle causal pivot (underline in method rows)"),
                       (UNSCORED_BG, "not scored")):
        sheet.rect(x, y + 4, 22, LINE_PX - 8, rgb)
        ax.text(x + 28, y + LINE_PX / 2, label, size=9, **_SANS)
        x += 340
    return y + LINE_PX + 8


def _png_panel(sheet: _Sheet, m: str, cells, segs, nlines: int, keep: int, y: float) -> float:
    """One method's panel: its label, then the tokens on their coloured boxes (at most ``keep``
    lines); returns the y below it."""
    ax, adv = sheet.ax, sheet.adv
    ax.text(MARGIN, y + LINE_PX / 2, LABELS.get(m, m), size=11, weight="bold", **_SANS)
    y += LINE_PX + 4
    runs: dict[int, list[tuple[int, str, RGB]]] = {}
    for i, (cell, tsegs) in enumerate(zip(cells, segs)):
        for line, col, width, text in tsegs:
            if line >= keep:
                continue
            x0, y0 = MARGIN + col * adv, y + line * LINE_PX + 1
            box = Box(m, i, x0, y0, x0 + width * adv, y0 + LINE_PX - 2, cell.bg)
            sheet.boxes.append(box)
            sheet.rect(box.x0, box.y0, box.x1 - box.x0, box.y1 - box.y0, cell.bg)
            if cell.pivot:
                sheet.underlines.append((box.x0, box.x1, box.y1 - 1))
            runs.setdefault(line, []).append((col, text, cell.fg))
    for line, items in runs.items():  # one text artist per run of same-coloured text
        run_col, run_text, run_fg = items[0]
        for col, text, fg in [*items[1:], (-1, "", None)]:
            if fg == run_fg and col == run_col + sum(map(_char_cols, run_text)):
                run_text += text
                continue
            if run_text.strip():
                ax.text(MARGIN + run_col * adv, y + line * LINE_PX + LINE_PX / 2, run_text,
                        color=_rgbf(run_fg), parse_math=False, va="center", **_MONO)
            run_col, run_text, run_fg = col, text, fg
    y += min(nlines, keep) * LINE_PX
    if nlines > keep:
        ax.text(MARGIN, y + LINE_PX / 2, f"… {nlines - keep} more lines (see the HTML page)",
                size=9, color="#a00", **_SANS)
        y += LINE_PX
    return y + 10


def _fit(text, canvas, width: float = PNG_WIDTH - 2 * MARGIN) -> None:
    """Shortens a one-line header text artist (with an ellipsis) until it fits ``width`` px."""
    s = text.get_text()
    for _ in range(20):
        w = text.get_window_extent(canvas.get_renderer()).width
        if w <= width or len(s) < 8:
            return
        s = s[:max(4, int(len(s) * width / w) - 2)]
        text.set_text(s + "…")


def render_png(record: TokenRecord, methods: list[str], out: str | Path) -> Path:
    fig, _ = png_figure(record, methods)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Glyph .* missing")  # CJK, emoji: tofu boxes
        return atomic_write(Path(out), lambda f: fig.savefig(f, format="png", dpi=DPI), "wb")


# ----------------------------------------------------------------------------- CLI

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


if __name__ == "__main__":
    raise SystemExit(main())
