"""The project's prose says what is true now and how to measure it: no development history.

Scanned: every tracked Markdown file (README, docs/, model cards, data/ and notebook READMEs) and
the markdown cells of every notebook. Only prose counts: fenced code blocks, inline code spans,
HTML comments and link targets are left out, so an identifier (a ``session_id`` field, a
``helpers.py`` path) never trips the test. History lives in data/results (every run carries its
command, commit, machine and load) and in git.

Code comments under workbench/ follow the same rule for machine figures: a comment block that
names a machine (a 2-core EPYC, an H100) beside a measured figure (ms, µs, tok/s, %, ×) goes
stale with the machine; the figure lives in docs/MEASUREMENTS.md and the comment points there.
"""

from __future__ import annotations

import io
import json
import re
import subprocess
import tokenize
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
    for pattern in ("*.md", "docs/*.md", "docs/*/*.md", "notebooks/*.ipynb", "notebooks/*.md",
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


# A machine named in a code comment, and a measured figure (a number with a time, rate, share or
# ratio unit).
MACHINE = re.compile(r"\b(EPYC|Xeon|Ryzen|Graviton|\d+-core|[HAL]\d{2,3}|RTX ?\d+|this machine)\b",
                     re.IGNORECASE)
FIGURE = re.compile(r"(?<![\w.])\d+(?:\.\d+)?\s?(?:ms|µs|us|ns|s|tok/s|%|×|x)(?![\w/])")
# Folders whose owners move their comments' figures themselves (docs/MEASUREMENTS.md), and one
# file of a folder outside this change; every other module is held to the rule.
COMMENTS_PENDING = ("workbench/engine/", "workbench/models/", "workbench/attention/paged.py")


def comment_blocks(source: str) -> list[list[tuple[int, str]]]:
    """Runs of comments on consecutive lines: [(line number, comment text)]."""
    blocks: list[list[tuple[int, str]]] = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type != tokenize.COMMENT:
            continue
        if blocks and blocks[-1][-1][0] == tok.start[0] - 1:
            blocks[-1].append((tok.start[0], tok.string))
        else:
            blocks.append([(tok.start[0], tok.string)])
    return blocks


def machine_figures(source: str) -> list[int]:
    """Line numbers of figure-carrying lines in comment blocks that name a machine."""
    hits = []
    for block in comment_blocks(source):
        if MACHINE.search(" ".join(text for _, text in block)):
            hits += [line for line, text in block if FIGURE.search(text)]
    return hits


def code_files() -> list[Path]:
    return sorted(p for p in (ROOT / "workbench").rglob("*.py")
                  if not p.relative_to(ROOT).as_posix().startswith(COMMENTS_PENDING))


@pytest.mark.parametrize("path", code_files(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_machine_figures_in_code_comments(path: Path) -> None:
    hits = machine_figures(path.read_text())
    assert not hits, (f"{path.relative_to(ROOT)}: machine figures in comments (lines {hits}); "
                      "move them into docs/MEASUREMENTS.md and point the comment there")


def test_the_comment_scan_needs_a_machine_and_a_figure() -> None:
    src = ("x = 1  # ~3 µs per layer\nz = 0\n"
           "# blocks win (measured on the 2-core EPYC:\n# 110 -> 30 µs at 16 rows)\n"
           "y = 2\n# on a 2-core EPYC the order matters\n"
           "s = '# 5 ms on an H100'\n")
    assert machine_figures(src) == [4]
    assert machine_figures("# 1.6 vs 2.7 ms at T=1 on the H100\n") == [1]
