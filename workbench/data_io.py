"""Reading and writing the project's data files: one repository root, JSONL prompt files, JSON
results. Every reader refuses bad input with a ConfigError naming the file, the line and the
field.

* :data:`REPO_ROOT` — the checkout (``data/``, ``docs/``...), the one place it is derived;
* :func:`read_jsonl_records` — the one reader of JSONL prompt files (every ``--prompts-file``,
  the held-out sets, the distilled corpora), with :func:`read_prompts_file`,
  :func:`load_prompt_records` and :func:`chat_messages_of` on top;
* :class:`Prompt`, :func:`load_prompts` / :func:`save_prompts` — ``data/prompts/<name>.jsonl``;
* :func:`load_json` — a result or summary file ({} when it is absent);
* :func:`load_result_files` — every per-machine results file of a folder.

It imports nothing of the workbench but its errors: any layer may use it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NamedTuple

from workbench.errors import ConfigError

REPO_ROOT = Path(__file__).resolve().parents[1]
DATA_DIR = REPO_ROOT / "data"
PROMPTS_DIR = DATA_DIR / "prompts"


@dataclass(frozen=True)
class Prompt:
    id: str
    kind: str  # "code" | "docstring" | "english"
    prompt: str
    source: str


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
                              "(python -m workbench distill answers writes them)")
        elif chat:
            r = {**r, "prompt": [{"role": "user", "content": r["prompt"]}]}
        out.append(r)
    return out


def chat_messages_of(obj: dict[str, Any], where: str) -> list[dict[str, str]]:
    """One record of ``read_jsonl_records`` → chat messages (errors start with ``where``: the
    file and the line)."""
    if "messages" in obj:
        msgs = obj["messages"]
        if not is_chat_messages(msgs):
            raise ConfigError(f"{where}: 'messages' must be a non-empty list of objects with "
                              "string 'role' and 'content'")
        return [{"role": m["role"], "content": m["content"]} for m in msgs]
    text = obj.get("prompt")
    if not isinstance(text, str) or not text:
        raise ConfigError(f"{where}: expected 'messages' or a non-empty string 'prompt'")
    return [{"role": "user", "content": text}]


def load_json(path: str | Path) -> dict[str, Any]:
    """The JSON object in ``path``; {} when there is no such file (a result not measured yet).
    A file that is not JSON, or not an object, is refused naming the file."""
    p = Path(path)
    if not p.is_file():
        return {}
    try:
        doc = json.loads(p.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ConfigError(f"{p}: not JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"{p}: expected a JSON object, got {_json_kind(doc)}")
    return doc


def load_result_files(folder: str | Path) -> dict[str, dict[str, Any]]:
    """kind → document, for every per-machine file in ``folder``."""
    out: dict[str, dict[str, Any]] = {}
    for p in sorted(Path(folder).glob("*.json")):
        try:
            doc = json.loads(p.read_text())
        except json.JSONDecodeError:
            continue
        if isinstance(doc, dict) and "benchmarks" in doc and "machine" in doc:
            out[p.stem] = doc
    return out
