"""The documentation's shape: README.md is a short entry page, and every relative link in
README.md and docs/*.md reaches a file that exists (and, for ``page.md#anchor``, a heading of
that page). Tests check no prose or tables here: tables that are program output live in docs/
under the command that prints them, and that program's own tests compare them."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 250

FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def prose(text: str) -> str:
    """The text without fenced code blocks and inline code, where brackets are not links."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation other than ``-``
    and ``_`` removed, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # [text](url) -> text
    text = text.replace("`", "").replace("*", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading's anchor; repeated headings get GitHub's -1, -2, ... suffixes."""
    seen: dict[str, int] = {}
    out = set()
    for heading in HEADING.findall(FENCE.sub("", page.read_text(encoding="utf-8"))):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def relative_links(page: Path) -> list[str]:
    return [t for t in LINK.findall(prose(page.read_text(encoding="utf-8")))
            if not re.match(r"^[a-z][a-z0-9+.-]*:", t, re.I)]  # http:, https:, mailto: ...


def test_readme_is_a_short_entry_page():
    readme = ROOT / "README.md"
    assert readme.is_file()
    lines = readme.read_text(encoding="utf-8").count("\n")
    assert lines < README_MAX_LINES, (
        f"README.md has {lines} lines; keep it under {README_MAX_LINES} and move depth into docs/")


def test_readme_points_into_docs():
    links = relative_links(ROOT / "README.md")
    assert any(t.startswith("docs/") for t in links)


def test_slug_follows_github():
    assert slug("The chain task (the OAR testbed)") == "the-chain-task-the-oar-testbed"
    assert slug("Planning: `oar plan`") == "planning-oar-plan"
    assert slug("Measured so far: does OAR work here?") == "measured-so-far-does-oar-work-here"
    assert slug("Rollouts, rewards and data") == "rollouts-rewards-and-data"


def test_link_pattern_skips_code():
    text = "see [a](a.md) and `[b](b.md)`\n```\n[c](c.md)\n```\n![d](img/d.png \"title\")\n"
    assert LINK.findall(prose(text)) == ["a.md", "img/d.png"]


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    broken = []
    for target in relative_links(page):
        path, _, anchor = target.partition("#")
        dest = Path(os.path.normpath(page.parent / path)) if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file or directory {dest}")
        elif anchor and dest.suffix == ".md" and anchor.lower() not in anchors(dest):
            broken.append(f"{target}: no heading with anchor #{anchor} in {dest}")
    assert not broken, f"{page.relative_to(ROOT)} has broken links:\n  " + "\n  ".join(broken)
