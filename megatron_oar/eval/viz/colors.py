"""The colours of ``oar viz``: the importance ramp, the pivot and unscored colours, and a text
colour that keeps contrast on each background."""

from __future__ import annotations

import math

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
