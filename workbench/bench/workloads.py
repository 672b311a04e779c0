"""The held-out prompt set ``data/prompts/heldout.jsonl`` (``python -m workbench make-prompts``):
one JSON object per line (id, kind, prompt, source); reading it and every other prompt file is
``workbench.data_io``'s.

Code-completion prompts are cut from the target's held-out standard-library files (never
trained on), docstring-to-code prompts keep a function's signature and docstring, and a few
plain-English prompts show behaviour off the training distribution.
"""

from __future__ import annotations

import re
from pathlib import Path

# load_prompts: tests/lab/conftest.py still imports it from here (its owner moves it to data_io)
from workbench.data_io import Prompt, load_prompts  # noqa: F401

# the shipped demo models the CLI defaults to (repository-relative, as typed on a command line)
DEFAULT_TARGET = "data/models/wb-target"
DEFAULT_DRAFT = "data/models/wb-eagle3"

ENGLISH = (
    "The quick brown fox",
    "In this tutorial we will learn how to",
    "Speculative decoding is a technique that",
    # added so that every kind has at least MIN_PER_KIND prompts (appended: the first 67
    # prompts, which `bench --prompts N` takes in order, are unchanged)
    "The weather report for tomorrow says that",
    "Once upon a time, in a small village by the sea,",
    "The most important lesson I learned at my first job was",
    "To bake a loaf of bread you will need",
    "The history of the printing press begins",
    "Dear customer, thank you for your order. Unfortunately",
    "Here are three reasons why people enjoy hiking:",
    "The committee met on Tuesday to discuss",
    "A good night's sleep matters because",
)
MIN_PER_KIND = 12  # prompts per kind: a per-category table cell needs enough of them


def make_prompts(root: Path, heldout: list[str], per_file: int = 3,
                 max_chars: int = 600) -> list[Prompt]:
    """Deterministic prompts from held-out files (relative paths under ``root``)."""
    out: list[Prompt] = []
    def_re = re.compile(r"^(    )?def \w+\(.*\):\s*$")
    for rel in sorted(heldout):
        lines = (root / rel).read_text(encoding="utf-8", errors="replace").splitlines()
        defs = [i for i, line in enumerate(lines) if def_re.match(line) and i > 5]
        for j, i in enumerate(defs[:per_file]):
            body_start = i + 1
            # code: the context up to and including the def line
            ctx = "\n".join(lines[max(0, i - 25) : body_start]) + "\n"
            out.append(Prompt(f"{rel}:{i}:code", "code", ctx[-max_chars:], rel))
            if j == 0 and body_start < len(lines) and '"""' in lines[body_start]:
                end = body_start
                if lines[body_start].count('"""') < 2:
                    while end + 1 < len(lines) and '"""' not in lines[end + 1]:
                        end += 1
                    end += 1
                doc = "\n".join(lines[i : end + 1]) + "\n"
                out.append(Prompt(f"{rel}:{i}:docstring", "docstring", doc[-max_chars:], rel))
    for k, text in enumerate(ENGLISH):
        out.append(Prompt(f"english:{k}", "english", text, "handwritten"))
    # more docstring prompts (later defs, one file after the other in turn) until there are
    # MIN_PER_KIND, appended after everything above so the earlier prompts keep their order
    cands: list[list[Prompt]] = []
    for rel in sorted(heldout):
        lines = (root / rel).read_text(encoding="utf-8", errors="replace").splitlines()
        defs = [i for i, line in enumerate(lines) if def_re.match(line) and i > 5]
        docs = [(i, _docstring_prompt(lines, i)) for i in defs[1:]]
        cands.append([Prompt(f"{rel}:{i}:docstring", "docstring", d[-max_chars:], rel)
                      for i, d in docs if d is not None])
    need = MIN_PER_KIND - sum(p.kind == "docstring" for p in out)
    extra = [c[k] for k in range(max(map(len, cands), default=0)) for c in cands if k < len(c)]
    return out + extra[:max(need, 0)]


def _docstring_prompt(lines: list[str], i: int) -> str | None:
    """The def line at ``i`` and its docstring (None when it has none)."""
    start = i + 1
    if start >= len(lines) or '"""' not in lines[start]:
        return None
    end = start
    if lines[start].count('"""') < 2:
        while end + 1 < len(lines) and '"""' not in lines[end + 1]:
            end += 1
        end += 1
    return "\n".join(lines[i : end + 1]) + "\n"
