"""Find the answer span in a decoded response and map it back to token positions.

``answer_pattern`` is either a regular expression whose first group is the answer (default
``<answer>(.*?)</answer>``, matched with DOTALL; the last match wins) or the word ``boxed``
(the last ``\\boxed{...}`` or ``\\fbox{...}``, nested braces balanced). Characters are mapped to
tokens by decoding prefixes of the response, found by binary search, so any Hugging Face
tokenizer works (byte-level BPE, sentencepiece) with about ``2 log2(T)`` decodes per response.

The whole match's start is the answer's opening tag (``<answer>``, ``\\boxed{``, the literal text
of a custom pattern before its group): the reasoning that attribution scores is the response
before it (:meth:`SpanFinder.locate`).
"""

from __future__ import annotations

import re
from functools import lru_cache

BOXED = "boxed"
DEFAULT_PATTERN = r"<answer>(.*?)</answer>"


def _boxed_match(text: str) -> tuple[int, int, int] | None:
    """``(m0, c0, c1)``: ``\\boxed{`` starts at ``m0``, the braces hold ``[c0, c1)``."""
    opens = [(m.start(), m.end()) for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text)]
    for m0, start in reversed(opens):
        depth = 1
        for i in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                return m0, start, i
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


def find_answer_match(text: str, pattern: str = DEFAULT_PATTERN) -> tuple[int, int, int] | None:
    """``(m0, start, end)``: the whole match (the opening tag, e.g. ``<answer>`` or ``\\boxed{``)
    starts at character ``m0``; ``[start, end)`` is the answer, stripped of surrounding spaces.
    None when there is no (non-blank) answer."""
    if pattern == BOXED:
        found = _boxed_match(text)
    else:
        matches = list(_compile(pattern).finditer(text))
        found = (matches[-1].start(), *matches[-1].span(1)) if matches else None
    if found is None:
        return None
    m0, start, end = found
    while start < end and text[start].isspace():
        start += 1
    while end > start and text[end - 1].isspace():
        end -= 1
    return (m0, start, end) if end > start else None


def find_answer_chars(text: str, pattern: str = DEFAULT_PATTERN) -> tuple[int, int] | None:
    """``[start, end)`` character span of the answer (stripped of surrounding spaces), or None."""
    found = find_answer_match(text, pattern)
    return None if found is None else found[1:]


class SpanFinder:
    """``finder(response_ids) -> (k0, k1)``: the answer is response tokens ``[k0, k1)``, or None;
    ``finder.locate(response_ids) -> (t0, k0, k1)`` adds ``t0``, the token where the opening tag
    starts."""

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

    def locate(self, response_ids: list[int]) -> tuple[int, int, int] | None:
        """``(t0, k0, k1)``: the answer is response tokens ``[k0, k1)`` and its opening tag (the
        start of the whole match) lies in token ``t0``, so ``[0, t0)`` is the reasoning before
        the answer (a token that holds both reasoning text and the tag's first character counts
        as tag). ``t0 <= k0``. None without an answer."""
        found = find_answer_match(self._decode(response_ids), self.pattern)
        if found is None:
            return None
        m0, c0, c1 = found
        k0 = self._first_token_reaching(response_ids, c0 + 1) - 1  # the token holding char c0
        k1 = self._first_token_reaching(response_ids, c1)
        if not 0 <= k0 < k1:
            return None
        t0 = max(0, min(k0, self._first_token_reaching(response_ids, m0 + 1) - 1))  # holds char m0
        return t0, k0, k1

    def __call__(self, response_ids: list[int]) -> tuple[int, int] | None:
        found = self.locate(response_ids)
        return None if found is None else found[1:]
