"""Format reward: does a response have the shape the prompt asked for?

A separate signal from accuracy (1.0 well-formed, 0.0 not). Styles (``RewardConfig.format_style``):

- ``answer_tag`` (default; the paper's format): non-empty reasoning, then exactly one
  ``<answer>...</answer>`` block with non-empty content, and nothing after it.
- ``think_answer``: ``<think>reasoning</think>`` (the opening tag may sit in the prompt), then one
  ``<answer>...</answer>`` block at the end, as above.
- ``boxed``: non-empty reasoning and exactly one ``\\boxed{...}`` with non-empty content.

``RewardConfig.format_pattern`` (a regex, matched with ``re.fullmatch`` and ``re.DOTALL`` against
the response with trailing whitespace and end-of-turn markers removed) replaces the style.
The built-in styles are linear-time string checks, safe on megabyte responses; a custom pattern
runs on the whole response, so keep it free of nested quantifiers.
"""

from __future__ import annotations

import re
from functools import lru_cache

from megatron_oar.rewards.extract import ANSWER_CLOSE, ANSWER_OPEN, extract_boxed

FORMAT_STYLES = ("answer_tag", "think_answer", "boxed")
END_MARKERS = ("<|im_end|>", "<|endoftext|>", "</s>", "<|eot_id|>")


def _strip_end(text: str) -> str:
    text = text.rstrip()
    changed = True
    while changed:
        changed = False
        for marker in END_MARKERS:
            if text.endswith(marker):
                text = text[:-len(marker)].rstrip()
                changed = True
    return text


def _answer_block_at_end(text: str) -> bool:
    """Reasoning, then exactly one non-empty ``<answer>`` block that ends the text."""
    if text.count(ANSWER_OPEN) != 1 or text.count(ANSWER_CLOSE) != 1:
        return False
    if not text.endswith(ANSWER_CLOSE):
        return False
    start = text.find(ANSWER_OPEN)
    inner = text[start + len(ANSWER_OPEN):-len(ANSWER_CLOSE)]
    return bool(text[:start].strip()) and bool(inner.strip())


def _think_answer(text: str) -> bool:
    if text.count("</think>") != 1 or text.count("<think>") > 1:
        return False
    close = text.find("</think>")
    open_ = text.find("<think>")
    if open_ > close or (open_ != -1 and text[:open_].strip()):
        return False
    thought = text[(open_ + len("<think>")) if open_ != -1 else 0:close]
    rest = text[close + len("</think>"):].strip()
    if not thought.strip() or not rest.startswith(ANSWER_OPEN):
        return False
    return _answer_block_at_end(thought + rest)  # reasoning = the thought


def _boxed(text: str) -> bool:
    """Reasoning, then exactly one non-empty ``\\boxed{}`` (or ``\\fbox{}``)."""
    if text.count("\\boxed") + text.count("\\fbox") != 1:
        return False
    box = extract_boxed(text)
    if box is None or not box.text.strip():
        return False
    command = max(text.find("\\boxed"), text.find("\\fbox"))
    return bool(text[:command].strip(" \t\n$([\\"))


@lru_cache(maxsize=16)
def _compiled(pattern: str) -> re.Pattern:
    try:
        return re.compile(pattern, re.DOTALL)
    except re.error as e:
        raise ValueError(f"rewards.format_pattern is not a valid regex ({e}): {pattern!r}") from None


def format_score(response: str, style: str = "answer_tag", pattern: str | None = None) -> float:
    """1.0 if ``response`` has the requested shape, else 0.0."""
    text = _strip_end(response)
    if pattern:
        return 1.0 if _compiled(pattern).fullmatch(text) else 0.0
    if style == "answer_tag":
        ok = _answer_block_at_end(text)
    elif style == "think_answer":
        ok = _think_answer(text)
    elif style == "boxed":
        ok = _boxed(text)
    else:
        raise ValueError(f"unknown rewards.format_style {style!r}; choose from {FORMAT_STYLES} "
                         "or set rewards.format_pattern")
    return 1.0 if ok else 0.0
