"""Chat prompts for benchmarking a pretrained chat model (e.g. SmolLM2-135M-Instruct and its
EAGLE-3 head): held-out requests rendered with the target's own chat template.

A chat model answers what its template frames; a bench that fed it the bare request would time
text no user sends. :func:`render_chat_prompts` turns a JSONL of requests — one object a line,
``{"messages": [{"role": ..., "content": ...}, ...]}`` or ``{"prompt": "<one user turn>"}``,
optionally with ``category`` (or ``kind``) and ``id`` — into the file every ``bench`` command
reads with ``--prompts-file``: ``{"prompt": <rendered text, generation prompt appended>,
"category": ..., "id": ...}``. The categories are interleaved (round-robin in file order), so
the first N lines of the output cover every category; ``limit`` keeps that many.

Rendered text is encoded without added special tokens by the engine and by the transformers
peers alike (``tokenizer.encode(text, add_special_tokens=False)``), so every arm sees the same
ids, the template's own special tokens included.

``python -m workbench.bench.real_model --model M --src heldout.jsonl --out F.jsonl [--limit N]``
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from workbench.errors import ConfigError


def _messages(obj: Any, where: str) -> list[dict[str, str]]:
    """One input line → chat messages (errors name the file, the line and the field)."""
    if not isinstance(obj, dict):
        raise ConfigError(f"{where}: expected a JSON object")
    if "messages" in obj:
        msgs = obj["messages"]
        if not isinstance(msgs, list) or not msgs or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str) for m in msgs):
            raise ConfigError(f"{where}: 'messages' must be a non-empty list of objects with "
                              "string 'role' and 'content'")
        return [{"role": m["role"], "content": m["content"]} for m in msgs]
    text = obj.get("prompt")
    if not isinstance(text, str) or not text:
        raise ConfigError(f"{where}: expected 'messages' or a non-empty string 'prompt'")
    return [{"role": "user", "content": text}]


def interleave(items: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Round-robin over the items' ``category`` (first-seen order), each category's items in
    file order."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for it in items:
        groups.setdefault(str(it.get("category", "")), []).append(it)
    out: list[dict[str, Any]] = []
    for k in range(max((len(g) for g in groups.values()), default=0)):
        out += [g[k] for g in groups.values() if k < len(g)]
    return out


def render_chat_prompts(src: str | Path, model: str | Path, out: str | Path,
                        limit: int | None = None, tokenizer: Any = None) -> Path:
    """``src`` (module docstring) rendered with ``model``'s chat template → ``out`` (JSONL,
    categories interleaved, at most ``limit`` lines). ``tokenizer`` overrides the model's
    (``workbench.models.loader.load_tokenizer``: a folder's tokenizer files or a GGUF's own).
    Errors name the field: a missing file, a malformed line, a model without a chat template."""
    p = Path(src)
    if not p.is_file():
        raise ConfigError(f"--src: no file at {p}")
    if limit is not None and limit < 1:
        raise ConfigError(f"--limit: must be >= 1, got {limit}")
    if tokenizer is None:
        from workbench.models.loader import load_tokenizer, resolve_path

        tokenizer = load_tokenizer(resolve_path(model))
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ConfigError(f"--model {model}: its tokenizer has no chat template (a chat model "
                          "is needed to render chat prompts)")
    items = []
    for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        where = f"--src {p}:{i}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{where}: not JSON ({e.msg})") from None
        msgs = _messages(obj, where)
        text = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        if not isinstance(text, str) or not text:
            raise ConfigError(f"{where}: the chat template rendered no text")
        items.append({"prompt": text, "category": str(obj.get("category", obj.get("kind", ""))),
                      "id": str(obj.get("id", f"{p.name}:{i}"))})
    if not items:
        raise ConfigError(f"--src: {p} holds no prompts (empty prompts file)")
    rows = interleave(items)[:limit]
    dst = Path(out)
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows),
                   encoding="utf-8")
    return dst


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m workbench.bench.real_model",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="the chat target (folder, .gguf or pointer)")
    ap.add_argument("--src", required=True, help="held-out requests (JSONL)")
    ap.add_argument("--out", required=True, help="rendered prompts for --prompts-file (JSONL)")
    ap.add_argument("--limit", type=int, default=None, help="keep this many (categories "
                    "interleaved)")
    ns = ap.parse_args(argv)
    try:
        path = render_chat_prompts(ns.src, ns.model, ns.out, ns.limit)
    except ConfigError as e:
        print(f"error: {e}")
        return 1
    n = sum(1 for line in path.read_text(encoding="utf-8").splitlines() if line)
    print(f"{n} chat prompts rendered with {ns.model}'s template: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
