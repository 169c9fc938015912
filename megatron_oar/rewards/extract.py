"""Final-answer extraction from model responses and reference answers.

Everything here is plain string scanning in linear time on bounded input: no regex that can
backtrack badly, no parsing of the answer itself (that happens in the verifier worker pool).
Model output is untrusted; it is only ever sliced and compared, never evaluated.

Extractors (selected and ordered by ``RewardConfig.extractors``; the first one that finds an
answer wins):

- ``answer_tag``:  the content of the last ``<answer>...</answer>`` block.
- ``boxed``:       the content of the last ``\\boxed{...}`` / ``\\fbox{...}`` (nested braces).
- ``gsm8k``:       the number after the last ``#### `` (thousands commas stripped).
- ``answer_line``: the rest of the last line starting ``Answer:`` or ``Final Answer:`` (DAPO-Math's
                   prompt asks for "The last line of your response should be of the form
                   Answer: $Answer").
"""

from __future__ import annotations

import re
from dataclasses import dataclass

ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"
_BOX_COMMANDS = ("\\boxed", "\\fbox")
# One whitespace run, then an optional "$" with its own run: no two adjacent optional runs, so no
# polynomial backtracking on "####" followed by thousands of spaces.
_GSM8K_RE = re.compile(r"####[ \t]*(?:\$[ \t]*)?([-+]?(?:[0-9][0-9,]*(?:\.[0-9]+)?|\.[0-9]+))")
_ANSWER_LINE_RE = re.compile(r"(?im)^[ \t*#]*(?:final[ \t]+)?answer[ \t*]*[:\uff1a][ \t*]*([^\n]*)$")


class AnswerParseError(ValueError):
    """Raised by a verifier when an answer cannot be parsed (the pool's status ``parse_error``)."""


@dataclass(frozen=True)
class Extraction:
    """An extracted answer: its text and its character span ``[start, end)`` in the response."""

    text: str
    start: int
    end: int
    extractor: str


def sanitize(text: str) -> str:
    """Returns ``text`` with lone surrogates and NUL bytes replaced by U+FFFD.

    Length-preserving (one code point in, one out), so spans found in the sanitized text are
    valid in the original. Anything non-string raises ``TypeError``.
    """
    if not isinstance(text, str):
        raise TypeError(f"expected str, got {type(text).__name__}")
    if "\x00" in text:
        text = text.replace("\x00", "\ufffd")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = "".join("\ufffd" if 0xD800 <= ord(c) <= 0xDFFF else c for c in text)
    return text


def extract_answer_tag(text: str) -> Extraction | None:
    """The content of the last complete ``<answer>...</answer>`` block.

    That is the last ``<answer>`` that some ``</answer>`` follows, up to the first such close.
    """
    last_close = text.rfind(ANSWER_CLOSE)
    if last_close == -1:
        return None
    start = text.rfind(ANSWER_OPEN, 0, last_close)
    if start == -1:
        return None
    s = start + len(ANSWER_OPEN)
    end = text.find(ANSWER_CLOSE, s)
    return Extraction(text[s:end], s, end, "answer_tag")


def _brace_pairs(text: str) -> dict[int, int]:
    """Maps each ``{`` index to its matching ``}`` index (``\\{``/``\\}`` do not count); one pass."""
    pairs, stack, i, n = {}, [], 0, len(text)
    while i < n:
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == "{":
            stack.append(i)
        elif c == "}" and stack:
            pairs[stack.pop()] = i
        i += 1
    return pairs


def extract_boxed(text: str) -> Extraction | None:
    """The content of the last well-formed ``\\boxed{...}`` or ``\\fbox{...}``.

    Nested braces are matched; ``\\boxed 5`` (argument without braces) is accepted. A last box
    whose braces never close is skipped in favour of the one before it.
    """
    hi, pairs = len(text), None
    while True:
        pos, cmd = max((text.rfind(c, 0, hi), c) for c in _BOX_COMMANDS)
        if pos == -1:
            return None
        i = pos + len(cmd)
        while i < len(text) and text[i] in " \t":
            i += 1
        if i < len(text) and text[i] == "{":
            if pairs is None:
                pairs = _brace_pairs(text)
            close = pairs.get(i, -1)
            if close != -1:
                return Extraction(text[i + 1:close], i + 1, close, "boxed")
        elif i > pos + len(cmd):  # "\\boxed 5": one token up to whitespace or "$"
            j = i
            while j < len(text) and not text[j].isspace() and text[j] != "$":
                j += 1
            if j > i:
                return Extraction(text[i:j], i, j, "boxed")
        hi = pos


def extract_gsm8k(text: str) -> Extraction | None:
    """The number after the last ``####`` (GSM8K's reference format), commas and spaces removed."""
    last = None
    for last in _GSM8K_RE.finditer(text):
        pass
    if last is None:
        return None
    number = last.group(1).replace(",", "")
    return Extraction(number, last.start(1), last.end(1), "gsm8k")


def extract_answer_line(text: str) -> Extraction | None:
    """The rest of the last line that starts with ``Answer:`` / ``Final Answer:`` (DAPO-Math's format)."""
    last = None
    for last in _ANSWER_LINE_RE.finditer(text):
        pass
    if last is None or not last.group(1).strip():
        return None
    return Extraction(last.group(1), last.start(1), last.end(1), "answer_line")


EXTRACTORS = {
    "answer_tag": extract_answer_tag,
    "boxed": extract_boxed,
    "gsm8k": extract_gsm8k,
    "answer_line": extract_answer_line,
}


def extract_answer(text: str, extractors=("answer_tag", "boxed", "gsm8k"), *,
                   tail_chars: int | None = None) -> Extraction | None:
    """Runs ``extractors`` in order on the last ``tail_chars`` characters of ``text``.

    Returns the first non-empty extraction (span relative to the full ``text``), else None.
    """
    offset = 0
    if tail_chars is not None and len(text) > tail_chars:
        offset = len(text) - tail_chars
        text = text[offset:]
    for name in extractors:
        try:
            fn = EXTRACTORS[name]
        except KeyError:
            raise ValueError(f"unknown answer extractor {name!r} in rewards.extractors; "
                             f"choose from {sorted(EXTRACTORS)}") from None
        found = fn(text)
        if found is not None and found.text.strip():
            return Extraction(found.text, found.start + offset, found.end + offset, name)
    return None


def _strip_math_delimiters(s: str) -> str:
    s = s.strip()
    for left, right in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if len(s) >= len(left) + len(right) and s.startswith(left) and s.endswith(right):
            s = s[len(left):len(s) - len(right)].strip()
    return s


def normalize_answer(s: str) -> str:
    """Cleans an extracted answer for the verifier.

    Takes the last ``\\boxed{}`` inside it if there is one, strips surrounding math delimiters
    (``$..$``, ``\\(..\\)``, ``\\[..\\]``), whitespace and a trailing full stop.
    """
    s = s.strip()
    inner = extract_boxed(s)
    if inner is not None:
        s = inner.text
    s = _strip_math_delimiters(s)
    if s.endswith(".") and not s.endswith(".."):
        s = s[:-1].rstrip()
    return s


def normalize_reference(ref: str) -> str:
    """A reference answer as the verifier wants it.

    Accepts plain answers (``0.5``, ``1/2``, ``\\frac{1}{2}``), ``$...$``, boxed strings, and GSM8K
    solutions ending in ``#### N``.
    """
    ref = sanitize(str(ref))
    if "####" in ref:
        found = extract_gsm8k(ref)
        if found is not None:
            return found.text
    return normalize_answer(ref)


def nesting_depth(s: str) -> int:
    """Maximum bracket nesting depth over ``()[]{}`` (unbalanced closers are ignored)."""
    depth = best = 0
    for c in s:
        if c in "([{":
            depth += 1
            best = max(best, depth)
        elif c in ")]}" and depth:
            depth -= 1
    return best
