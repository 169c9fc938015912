"""Find the answer span in a decoded response and map it back to token positions.

``answer_pattern`` is either a regular expression whose first group is the answer (default
``<answer>(.*?)</answer>``, matched with DOTALL; the last match wins) or the word ``boxed``
(the last ``\\boxed{...}`` or ``\\fbox{...}``, nested braces balanced). Characters are mapped to
tokens by decoding prefixes of the response, found by binary search, so any Hugging Face
tokenizer works (byte-level BPE, sentencepiece) with about ``2 log2(T)`` decodes per response.
"""

from __future__ import annotations

import re
from functools import lru_cache

BOXED = "boxed"
DEFAULT_PATTERN = r"<answer>(.*?)</answer>"


def _boxed_span(text: str) -> tuple[int, int] | None:
    starts = [m.end() for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text)]
    for start in reversed(starts):
        depth = 1
        for i in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                return start, i
    return None


@lru_cache(maxsize=32)
def _compile(pattern: str) -> re.Pattern:
    try:
        compiled = re.compile(pattern, re.DOTALL)
    except re.error as e:
        raise ValueError(f"probe.answer_pattern {pattern!r} is not a valid regular expression: {e}")
    if compiled.groups < 1:
        raise ValueError(f"probe.answer_pattern {pattern!r} needs a group around the answer")
    return compiled


def find_answer_chars(text: str, pattern: str = DEFAULT_PATTERN) -> tuple[int, int] | None:
    """``[start, end)`` character span of the answer (stripped of surrounding spaces), or None."""
    if pattern == BOXED:
        span = _boxed_span(text)
    else:
        matches = list(_compile(pattern).finditer(text))
        span = matches[-1].span(1) if matches else None
    if span is None:
        return None
    start, end = span
    while start < end and text[start].isspace():
        start += 1
    while end > start and text[end - 1].isspace():
        end -= 1
    return (start, end) if end > start else None


class SpanFinder:
    """``finder(response_ids) -> (k0, k1)``: the answer is response tokens ``[k0, k1)``, or None."""

    def __init__(self, tokenizer, pattern: str = DEFAULT_PATTERN):
        if pattern != BOXED:
            _compile(pattern)
        self.tokenizer = tokenizer
        self.pattern = pattern

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def _first_token_reaching(self, ids: list[int], chars: int) -> int:
        """Smallest k with ``len(decode(ids[:k])) >= chars``."""
        lo, hi = 0, len(ids)
        while lo < hi:
            mid = (lo + hi) // 2
            if len(self._decode(ids[:mid])) >= chars:
                hi = mid
            else:
                lo = mid + 1
        return lo

    def __call__(self, response_ids: list[int]) -> tuple[int, int] | None:
        span = find_answer_chars(self._decode(response_ids), self.pattern)
        if span is None:
            return None
        c0, c1 = span
        k0 = self._first_token_reaching(response_ids, c0 + 1) - 1  # the token holding char c0
        k1 = self._first_token_reaching(response_ids, c1)
        return (k0, k1) if 0 <= k0 < k1 else None
