"""``oar viz``'s HTML page: self-contained (inline CSS, no scripts), a legend, then a section per
record with a panel per method. Each token is a ``<span>`` in its cell's colours whose ``title``
tooltip gives the raw score, its rank and the normalised value (:func:`.cells.panel_cells`)."""

from __future__ import annotations

import html

from megatron_oar.eval.records import TokenRecord
from megatron_oar.eval.viz.cells import LABELS, Cell, caption_text, panel_cells
from megatron_oar.eval.viz.colors import PIVOT_RGB, UNSCORED_BG, UNSCORED_FG, hex_color, score_rgb
from megatron_oar.eval.viz.inputs import safe_name

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
