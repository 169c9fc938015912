"""``oar viz``'s PNG (matplotlib, Agg): the panels of one record drawn as wrapped monospace token
boxes in their cells' colours (:func:`.cells.panel_cells`, as the HTML draws them), PNG_WIDTH
(1200) px wide, growing in height with the text up to MAX_PNG_HEIGHT (longer panels are cut,
with a note pointing to the HTML page). Above the panels: the record's id and verdict, the
prompt, the caption and a legend."""

from __future__ import annotations

import unicodedata
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from megatron_oar.eval.records import TokenRecord
from megatron_oar.eval.viz.cells import LABELS, caption_text, panel_cells
from megatron_oar.eval.viz.colors import PIVOT_RGB, RGB, UNSCORED_BG, score_rgb
from megatron_oar.fileio import atomic_write

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
    """Draws :func:`png_figure` and writes it to ``out`` (atomically); returns the path."""
    fig, _ = png_figure(record, methods)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Glyph .* missing")  # CJK, emoji: tofu boxes
        return atomic_write(Path(out), lambda f: fig.savefig(f, format="png", dpi=DPI), "wb")
