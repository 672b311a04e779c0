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

:func:`report` reads a results folder (``scripts/bench_real_model.sh``'s ``$OUT``: the bs=1
``spec`` and ``peers`` results, the ``concurrency_policies`` sweep and the machine kind's
results file with each run's command) back into markdown tables, each naming the machine, the
load before and after, the command and the commit
(``python -m workbench.bench.real_model --report OUT``).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from workbench.bench.concurrency import summarize
from workbench.data_io import chat_messages_of, load_json, load_result_files, read_jsonl_records
from workbench.errors import ConfigError
from workbench.markdown import MISSING, num, row_interval, table
from workbench.models.loader import load_tokenizer, resolve_path


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
    records = read_jsonl_records(p, required=(), what="--src")
    if limit is not None and limit < 1:
        raise ConfigError(f"--limit: must be >= 1, got {limit}")
    if tokenizer is None:
        tokenizer = load_tokenizer(resolve_path(model))
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ConfigError(f"--model {model}: its tokenizer has no chat template (a chat model "
                          "is needed to render chat prompts)")
    items = []
    for i, where, obj in records:
        msgs = chat_messages_of(obj, where)
        text = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        if not isinstance(text, str) or not text:
            raise ConfigError(f"{where}: the chat template rendered no text")
        items.append({"prompt": text, "category": str(obj.get("category", obj.get("kind", ""))),
                      "id": str(obj.get("id", f"{p.name}:{i}"))})
    rows = interleave(items)[:limit]
    dst = Path(out)
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows),
                   encoding="utf-8")
    return dst


def _stamp(doc: dict[str, Any], run: dict[str, Any] | None) -> str:
    """One line: machine kind, cores, load before/after, flags, commit and command."""
    m = doc.get("machine") or {}
    load = doc.get("load") or {}
    before, after = load.get("before") or ["?"], load.get("after") or ["?"]
    flags = sorted({str(f.get("code", f)) if isinstance(f, dict) else str(f)
                    for f in doc.get("flags") or []})
    run = run or {}
    return (f"{m.get('cpu', '?')} (`{m.get('kind', '?')}`), {m.get('cores', '?')} cores, "
            f"torch threads {run.get('torch_threads', '?')}; load {before[0]} before, "
            f"{after[0]} after; flags: {', '.join(flags) or 'none'}; commit "
            f"`{run.get('commit', m.get('commit', '?'))}`; `{run.get('command', '?')}`")


def _yes(x: Any) -> str:
    return "yes" if x else "no"


def report(folder: str | Path) -> str:
    """Markdown tables of the results in ``folder`` (module docstring); a missing result is
    said so, never invented."""
    out = Path(folder)
    runs: dict[str, Any] = {}
    for doc in load_result_files(out).values():
        runs.update(doc["benchmarks"])
    lines: list[str] = []
    doc = load_json(out / "peers.json")
    if doc:
        rows = [[r["arm"], row_interval(r, "tok_s"), row_interval(r, "vs_hf_generate", unit="×"),
                 MISSING if r.get("vs_hf_paired") is None else
                 f"{row_interval(r, 'vs_hf_paired', unit='×')}, n = {int(r.get('pairs') or 0)}",
                 _yes(r.get("same_as_hf"))] for r in doc["summary"]]
        lines += ["bs=1, greedy, arms interleaved per prompt (`bench peers`): "
                  + _stamp(doc, runs.get("peers")), "",
                  table(["arm", "tok/s", "vs HF `generate` (totals)", "per prompt vs HF "
                         "`generate` (geometric mean, 95 %)", "same tokens as HF"], rows)]
    else:
        lines += [f"no `bench peers` result in {out}", ""]
    doc = load_json(out / "spec_bs1.json")
    if doc:
        rows = [[r["arm"], num(r.get("tau")), row_interval(r, "tok_s"),
                 row_interval(r, "speedup", unit="×"),
                 MISSING if r.get("verify_ratio") is None else
                 f"{num(r.get('verify_ratio'))} + {num(r.get('draft_ratio'))}",
                 num(r.get("ceiling"), unit="×"), num(r.get("of_ceiling_step")),
                 num(None if r.get("overhead") is None else 100 * r["overhead"], ".0f", " %"),
                 num(r.get("of_ceiling")), _yes(r.get("lossless"))] for r in doc["summary"]]
        lines += ["EAGLE-3 vs its own baseline, bs=1, greedy (`bench spec`): "
                  + _stamp(doc, runs.get("spec")), "",
                  table(["arm", "τ", "tok/s", "speedup", "verify + drafts (plain steps)",
                         "per-step ceiling", "step / ceiling", "overhead",
                         "speedup / ceiling", "lossless"], rows)]
    else:
        lines += [f"no `bench spec` result in {out}", ""]
    doc = load_json(out / "concurrency_policies.json")
    if doc:
        s = summarize(pd.DataFrame(doc["rows"]))
        never = s[s["arm"] == "never"].set_index("concurrency")["tok_s"]
        s["vs_never"] = s["tok_s"] / s["concurrency"].map(never)
        cfg = doc.get("config") or {}
        rows = [[r["arm"], r["concurrency"], row_interval(r, "tok_s"),
                 row_interval(r, "vs_baseline", unit="×"), num(r.get("vs_never"), unit="×"),
                 num(r.get("tau")), num(r.get("spec_share")),
                 _yes(r.get("lossless") in (True, None))] for r in s.to_dict(orient="records")]
        lines += ["closed-loop concurrency sweep, every named policy (`bench concurrency "
                  f"--policy`, {'interleaved' if cfg.get('interleaved') else 'sequential'}, "
                  f"{cfg.get('max_new_tokens', '?')} new tokens): "
                  + _stamp(doc, runs.get("concurrency_policies")), "",
                  table(["policy", "concurrency", "tok/s", "vs baseline", "vs never", "τ",
                         "share of steps speculating", "lossless"], rows)]
    else:
        lines += [f"no `bench concurrency --policy` result in {out}", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m workbench.bench.real_model",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="the chat target (folder, .gguf or pointer)")
    ap.add_argument("--src", help="held-out requests (JSONL)")
    ap.add_argument("--out", help="rendered prompts for --prompts-file (JSONL)")
    ap.add_argument("--limit", type=int, default=None, help="keep this many (categories "
                    "interleaved)")
    ap.add_argument("--report", default=None, metavar="FOLDER",
                    help="print the results in FOLDER as markdown tables instead")
    ns = ap.parse_args(argv)
    if ns.report is not None:
        print(report(ns.report))
        return 0
    missing = [f"--{k}" for k in ("model", "src", "out") if not getattr(ns, k)]
    if missing:
        print(f"error: {', '.join(missing)} required (or --report FOLDER)")
        return 1
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
