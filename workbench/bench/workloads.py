"""Prompt sets in ``data/prompts/*.jsonl`` (one JSON object per line: id, kind, prompt, source).

Code-completion prompts are cut from the target's held-out standard-library files (never
trained on), docstring-to-code prompts keep a function's signature and docstring, and a few
plain-English prompts show behaviour off the training distribution.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NamedTuple

from workbench.errors import ConfigError

PROMPTS_DIR = Path(__file__).resolve().parents[2] / "data" / "prompts"
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


@dataclass(frozen=True)
class Prompt:
    id: str
    kind: str  # "code" | "docstring" | "english"
    prompt: str
    source: str


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


def save_prompts(prompts: list[Prompt], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(asdict(p)) + "\n" for p in prompts))


def load_prompts(name: str = "heldout", kinds: tuple[str, ...] | None = None,
                 limit: int | None = None, folder: Path | None = None) -> list[Prompt]:
    """Load ``<folder>/<name>.jsonl`` (default ``data/prompts``), optionally filtered."""
    path = (folder or PROMPTS_DIR) / f"{name}.jsonl"
    if not path.is_file():
        raise ConfigError(f"prompts: {path} does not exist (see data/prompts/README.md)")
    items = [Prompt(**json.loads(line)) for line in path.read_text().splitlines() if line]
    if kinds:
        items = [p for p in items if p.kind in kinds]
    return items[:limit] if limit else items


class JsonlRecord(NamedTuple):
    """One record of a JSONL file: its line number, ``FILE:LINE`` (prefixed with the label
    errors name) for the caller's own errors, and the object."""

    line: int
    where: str
    data: dict[str, Any]


def is_chat_messages(x: Any) -> bool:
    """``x`` is a non-empty list of objects with string ``role`` and ``content``."""
    return isinstance(x, list) and bool(x) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str)
        and isinstance(m.get("content"), str) for m in x)


def _json_kind(x: Any) -> str:
    """What a parsed JSON value is, in JSON's words."""
    if isinstance(x, dict):
        return "an object"
    if isinstance(x, list):
        return "an array"
    if isinstance(x, str):
        return "a string" if x else "an empty string"
    if isinstance(x, bool) or x is None:
        return json.dumps(x)
    return "a number"


def read_jsonl_records(path: str | Path, required: tuple[str, ...] = ("prompt",),
                       what: str = "prompts file", allow_messages: bool = False
                       ) -> list[JsonlRecord]:
    """The records of a JSONL prompts file (UTF-8, one JSON object a line, blank lines
    skipped). Refused with a ConfigError naming ``what``, the file and the line: a missing
    file, bytes that are not UTF-8, a line that is not JSON or not an object, a ``required``
    field missing, a ``prompt`` that is not a non-empty string (or, with ``allow_messages``, a
    list of chat messages), a file with no records."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{what}: no file at {p}")
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise ConfigError(f"{what}: cannot read {p} ({e.strerror})") from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        at = raw.count(b"\n", 0, e.start) + 1
        raise ConfigError(f"{what}: {p}:{at}: not UTF-8 ({e.reason})") from None
    out: list[JsonlRecord] = []
    # split on "\n" only: str.splitlines would also cut at U+2028 and others inside strings
    for i, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        where = f"{what}: {p}:{i}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{where}: not JSON ({e.msg} at column {e.colno})") from None
        except RecursionError:
            raise ConfigError(f"{where}: not JSON (nested too deeply)") from None
        if not isinstance(obj, dict):
            raise ConfigError(f"{where}: expected a JSON object, got {_json_kind(obj)}")
        for f in required:
            if f not in obj:
                raise ConfigError(f"{where}: no field {f!r}")
        if "prompt" in obj:
            v = obj["prompt"]
            if not (isinstance(v, str) and v) and not (allow_messages and is_chat_messages(v)):
                want = "a non-empty string" + (" or a list of chat messages ({role, content})"
                                               if allow_messages else "")
                raise ConfigError(f"{where}: 'prompt' must be {want}, got {_json_kind(v)}")
        out.append(JsonlRecord(i, where, obj))
    if not out:
        raise ConfigError(f"{what}: {p} has no records (empty prompts file)")
    return out


def read_prompts_file(path: str | Path, flag: str = "--prompts-file") -> list[str]:
    """``F.jsonl``: one ``{"prompt": "..."}`` per line (other keys are kept out), read by
    :func:`read_jsonl_records`; errors name ``flag``, the file and the line."""
    return [r.data["prompt"] for r in read_jsonl_records(path, ("prompt",), what=flag)]


def load_prompt_records(path: str | Path, chat: bool = False) -> list[dict]:
    """Records of a jsonl prompt file (id, kind, prompt, source; optional ``messages``: a chat
    conversation ending in a user turn), read by :func:`read_jsonl_records`. A record with
    ``messages`` (or a ``prompt`` that is a list of messages) is sent as those messages; with
    ``chat``, a text prompt is sent as one user turn (the model's chat template applies).
    The returned records' ``prompt`` is what the engine receives."""
    out = []
    for _, where, r in read_jsonl_records(path, ("id", "kind", "prompt"), allow_messages=True):
        msgs = r["messages"] if "messages" in r else r["prompt"]
        if isinstance(msgs, list) or "messages" in r:
            if not is_chat_messages(msgs) or msgs[-1]["role"] != "user":
                raise ConfigError(f"{where}: messages must be a non-empty list of "
                                  "{role, content} objects that ends with a user turn")
            r = {**r, "prompt": msgs}
        elif "turns" in r:
            raise ConfigError(f"{where}: a multi-turn record needs its 'messages' "
                              "(python -m workbench.train.real_prompts distill writes them)")
        elif chat:
            r = {**r, "prompt": [{"role": "user", "content": r["prompt"]}]}
        out.append(r)
    return out
