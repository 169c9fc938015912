"""What both renderers of ``oar viz`` draw: per panel, each token as a :class:`Cell` (its text,
colours and tooltip), and the caption with each method's recall of oracle pivots.

A method's scores are normalised per sequence as OAR normalises importance (Eq. 14: ``log1p``,
then min-max over the scored tokens, negatives clamped to 0) and ranked among the scored tokens;
a token the probe does not rank, or whose score is not finite, is grey. The oracle panel colours
the causal pivots; the method panels underline them."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from megatron_oar.eval import recall
from megatron_oar.eval.records import TokenRecord
from megatron_oar.eval.viz.colors import (
    NON_PIVOT_RGB,
    PIVOT_RGB,
    RGB,
    UNSCORED_BG,
    UNSCORED_FG,
    score_rgb,
    text_rgb,
)

ORACLE = "oracle"
LABELS = {**recall.LABELS, ORACLE: "Oracle"}
TOP_PERCENT = 20  # the caption's recall of pivots: the paper's Figure 5 at K = 20%


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


def caption_text(record: TokenRecord, methods: list[str]) -> str:
    """The caption under a record's panels: each method's recall of oracle pivots in its top
    TOP_PERCENT% (or how many tokens were scored, without an oracle)."""
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
