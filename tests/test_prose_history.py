"""The project's prose says what is true now and how to measure it: no development history.

Scanned: every tracked Markdown file (README, docs/, model cards, data/ and notebook READMEs) and
the markdown cells of every notebook. Only prose counts: fenced code blocks, inline code spans,
HTML comments and link targets are left out, so an identifier (a ``session_id`` field, a
``helpers.py`` path) never trips the test. History lives in data/results (every run carries its
command, commit, machine and load) and in git.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Words and phrases that narrate how the project was written rather than what it is.
HISTORY_WORDS = (
    "session", "sessions", "last time", "this morning", "this afternoon", "tonight",
    "yesterday", "today", "earlier today", "this week", "helper", "helpers", "we fixed",
    "we changed", "previously", "used to", "since the refactor", "before the fix",
    "after the fix", "was fixed", "is now", "are now", "now does", "for now",
)
# A commit hash in prose (7-12 hex digits with at least one digit and one letter).
COMMIT = re.compile(r"(?<![\w#/.-])(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,12}(?![\w-])")
# Exact technical terms that contain a listed word and are not history (matched
# case-sensitively, removed before the scan).
ALLOWED = (
    "aiohttp.ClientSession", "requests.Session", "ClientSession",
)
PATTERN = re.compile(r"\b(" + "|".join(re.escape(w) for w in HISTORY_WORDS) + r")\b",
                     re.IGNORECASE)


def prose_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "*.md", "*.ipynb"], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout.split()
    found = {ROOT / p for p in out}
    # files not yet tracked under the prose folders count too
    for pattern in ("*.md", "docs/*.md", "notebooks/*.ipynb", "notebooks/*.md",
                    "data/models/*/README.md"):
        found |= set(ROOT.glob(pattern))
    return sorted(p for p in found if p.is_file() and ".venv" not in p.parts)


def markdown_of(path: Path) -> str:
    if path.suffix != ".ipynb":
        return path.read_text()
    cells = json.loads(path.read_text())["cells"]
    return "\n\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")


def prose(text: str) -> str:
    """``text`` without code blocks, inline code, HTML comments, link targets, bare URLs and
    the allowed terms; line breaks kept, so a hit's line number is the file's."""
    def blank(m: re.Match[str]) -> str:
        return "\n" * m.group(0).count("\n")

    text = re.sub(r"^(```|~~~).*?^\1[^\n]*$", blank, text, flags=re.MULTILINE | re.DOTALL)
    text = re.sub(r"<!--.*?-->", blank, text, flags=re.DOTALL)
    text = re.sub(r"(`+)(?:(?!\1).)+?\1", " ", text)
    text = re.sub(r"\]\([^)]*\)", "]", text)
    text = re.sub(r"https?://\S+", " ", text)
    for term in ALLOWED:
        text = text.replace(term, " ")
    return text


def history(text: str) -> list[tuple[int, str]]:
    """(line number, the word or hash) for every history word in ``text``'s prose."""
    hits = []
    for i, line in enumerate(prose(text).splitlines(), 1):
        hits += [(i, m.group(0)) for m in PATTERN.finditer(line)]
        hits += [(i, m.group(0)) for m in COMMIT.finditer(line)]
    return hits


@pytest.mark.parametrize("path", prose_files(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_development_history_in_prose(path: Path) -> None:
    hits = history(markdown_of(path))
    where = "markdown cells" if path.suffix == ".ipynb" else "lines"
    assert not hits, (f"{path.relative_to(ROOT)}: development history in prose ({where}; say "
                      f"what is true now, history lives in data/results and git): {hits}")


def test_the_scan_reads_prose_only() -> None:
    text = ("A `session_id` field, [x](helpers.py) and\n```\nlast time = 3\n```\n"
            "an aiohttp.ClientSession <!-- previously -->\n")
    assert history(text) == []
    assert history("Measured this session at 8651f06.\nIt used to sleep.") == [
        (1, "session"), (1, "8651f06"), (2, "used to")]
    assert history("colour #1f77b4, 1234567 tokens, the decade") == []
