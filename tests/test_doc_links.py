"""Every relative link in README.md and docs/ reaches a file, and every ``#anchor`` a heading of
it (GitHub's slugs), so moving a section cannot leave a dangling link."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.MULTILINE | re.DOTALL)


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text())
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*$", text, re.MULTILINE)}


def broken(path: Path) -> list[str]:
    out = []
    for target in LINK.findall(FENCE.sub("", path.read_text())):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            out.append(f"{target} (no file {dest.relative_to(ROOT)})")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            out.append(f"{target} (no heading #{anchor})")
    return out


@pytest.mark.parametrize("path", pages(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_links_resolve(path: Path) -> None:
    bad = broken(path)
    assert not bad, f"{path.relative_to(ROOT)}: broken links: {bad}"


def test_slugs_follow_github() -> None:
    assert slug("Speed on the real pair (bs=1, ceiling, concurrency)") == (
        "speed-on-the-real-pair-bs1-ceiling-concurrency")
    assert slug("llama.cpp's numerics: the same weights") == "llamacpps-numerics-the-same-weights"
    assert slug("The EAGLE-3 head's held-out τ") == "the-eagle-3-heads-held-out-τ"
