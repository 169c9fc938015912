"""Answer equivalence with math-verify; runs inside the verifier worker processes only.

The main process never imports this module (only the pool's workers and the forkserver do), so
sympy's parsing and simplification of untrusted answers happen out of the trainer's process.

Answers are parsed with math-verify's LaTeX extraction only (ANTLR grammar -> sympy objects);
its plain-expression extraction is not used because it goes through ``sympy.parse_expr``, which
calls ``eval``. math-verify's own ``signal.alarm`` timeouts are disabled
(``parsing_timeout=None``, ``timeout_seconds=None``): the pool enforces the time limit by
killing the worker process.
"""

from __future__ import annotations

import logging
from functools import lru_cache

from math_verify import LatexExtractionConfig, parse, verify
from sympy import Basic, MatrixBase

from megatron_oar.rewards.extract import AnswerParseError

logging.getLogger("math_verify").setLevel(logging.ERROR)  # its "timeout disabled" warnings

_LATEX_ONLY = (LatexExtractionConfig(),)


@lru_cache(maxsize=4096)
def parse_answer(answer: str) -> tuple:
    """Parses a normalized answer (``1/2``, ``\\frac{1}{2}``, ``0.5``, ``x=3``, ...) with math-verify.

    Returns math-verify's list as a tuple: sympy objects first, then the matched string.
    """
    return tuple(parse("\\boxed{" + answer + "}", extraction_config=_LATEX_ONLY,
                       fallback_mode="first_match", parsing_timeout=None))


def _has_math(parsed: tuple) -> bool:
    return any(isinstance(p, (Basic, MatrixBase)) for p in parsed)


def math_verify_equal(pred: str, gold: str, *, float_rounding: int = 6,
                      numeric_precision: int = 15, strict: bool = True) -> bool:
    """True when ``pred`` and ``gold`` are mathematically equivalent (``1/2 == 0.5 == \\frac12``).

    Raises ``AnswerParseError`` when the prediction does not parse to math while the reference
    does; string-only answers on both sides (e.g. ``\\text{Evelyn}``) are compared as strings.
    """
    gold_parsed = parse_answer(gold)
    if not gold_parsed:
        raise ValueError(f"reference answer does not parse: {gold[:80]!r}")
    pred_parsed = parse_answer(pred)
    if not pred_parsed or (_has_math(gold_parsed) and not _has_math(pred_parsed)):
        raise AnswerParseError(f"cannot parse answer {pred[:80]!r}")
    return bool(verify(list(gold_parsed), list(pred_parsed), float_rounding=float_rounding,
                       numeric_precision=numeric_precision, strict=strict, timeout_seconds=None))
