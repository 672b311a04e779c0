"""Self-distillation: the target answers prompt records (``workbench.train.real_prompts``) with
its chat template, greedily, batched through the ``Engine``; each conversation is stored as its
chat-templated token ids with a mask of the tokens the target generated.

Resumable: ``<out>/conversations.jsonl`` gains one line per finished conversation (train
prompts, categories interleaved, so a stopped run keeps a balanced share); a rerun skips the ids
already there. ``pack`` joins them into ``<out>/corpus.npz`` (train / heldout token arrays and
answer masks) for ``train-draft --corpus``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np

import workbench as wb
from workbench.config import SamplingParams
from workbench.data_io import read_jsonl_records
from workbench.errors import ConfigError
from workbench.models.loader import resolve_path


def read_prompts(path: str | Path) -> list[dict]:
    """Prompt records of a ``real_prompts`` file (``read_jsonl_records``: id, kind and a text
    prompt on every line); a bad line is refused naming the file and the line."""
    return [r.data for r in read_jsonl_records(path, ("id", "kind", "prompt"))]


def _interleave(rows: list[dict]) -> list[dict]:
    by: dict[str, list[dict]] = {}
    for r in rows:
        by.setdefault(r["kind"], []).append(r)
    out = []
    for i in range(max(len(v) for v in by.values())):
        out += [v[i] for v in by.values() if i < len(v)]
    return out


class ChatTokenizer:
    """The target folder's tokenizer and chat template: messages → token ids."""

    def __init__(self, model: str | Path) -> None:
        from transformers import AutoTokenizer


        # a pointer folder (the real model's stable name) resolves to the cache folder that
        # holds the tokenizer files
        folder = resolve_path(model)
        self.tok = AutoTokenizer.from_pretrained(str(folder if folder.is_dir() else
                                                     folder.parent))
        if not getattr(self.tok, "chat_template", None):
            raise ConfigError(f"model {str(model)!r}: its tokenizer has no chat template")

    def ids(self, messages: list[dict[str, str]]) -> list[int]:
        text = self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True).strip()


def _answer(engine: Any, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=max_new))
    return [list(o.token_ids) for o in outs]


def chat_messages(engine: Any, ct: ChatTokenizer, rows: list[dict], max_new: int
                  ) -> list[list[dict[str, str]]]:
    """Messages of each record up to its last user turn; earlier assistant turns are the
    target's own greedy answers."""
    msgs = [[{"role": "user", "content": r["turns"][0] if "turns" in r else r["prompt"]}]
            for r in rows]
    for t in range(1, max(len(r.get("turns", [1])) for r in rows)):
        idx = [i for i, r in enumerate(rows) if len(r.get("turns", [])) > t]
        if not idx:
            continue
        answers = _answer(engine, [ct.ids(msgs[i]) for i in idx], max_new)
        for i, a in zip(idx, answers, strict=True):
            msgs[i] += [{"role": "assistant", "content": ct.decode(a)},
                        {"role": "user", "content": rows[i]["turns"][t]}]
    return msgs


def distill(model: str, prompts: Path, out: Path, per_kind: int, max_new_tokens: int,
            second_turn_tokens: int, batch: int) -> dict[str, Any]:
    """Answer the train prompts (``per_kind`` > 0: at most that many per kind) into
    ``out/conversations.jsonl``; give the held-out chat records their first answer
    (``messages``) in ``prompts/heldout.jsonl``. Returns counts and seconds."""
    from tqdm.auto import tqdm  # here: a data tool, not one of the trainers quiet_progress mutes


    rows = read_prompts(prompts / "train.jsonl")
    if per_kind:
        seen: dict[str, int] = {}
        kept = []
        for r in rows:
            seen[r["kind"]] = seen.get(r["kind"], 0) + 1
            if seen[r["kind"]] <= per_kind:
                kept.append(r)
        rows = kept
    rows = _interleave(rows)
    out.mkdir(parents=True, exist_ok=True)
    conv = out / "conversations.jsonl"
    done = set()
    if conv.is_file():
        done = {json.loads(line)["id"] for line in conv.read_text().splitlines() if line}
    todo = [r for r in rows if r["id"] not in done]
    ct = ChatTokenizer(model)
    engine = wb.Engine.from_pretrained(model, config=wb.EngineConfig(
        max_batch_size=batch, kv_budget_tokens=batch * 1024, max_prefill_tokens=4096))
    t0 = time.perf_counter()
    tokens = 0
    try:
        held_path = prompts / "heldout.jsonl"
        held = read_prompts(held_path)
        need = [r for r in held if "turns" in r and "messages" not in r]
        if need:
            for r, m in zip(need, chat_messages(engine, ct, need, second_turn_tokens),
                            strict=True):
                r["messages"] = m
            held_path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n"
                                         for r in held))
        bar = tqdm(total=len(rows), initial=len(rows) - len(todo), desc="distill",
                   unit="conv")
        for lo in range(0, len(todo), batch):
            chunk = todo[lo : lo + batch]
            msgs = chat_messages(engine, ct, chunk, second_turn_tokens)
            prompt_ids = [ct.ids(m) for m in msgs]
            answers = _answer(engine, prompt_ids, max_new_tokens)
            with open(conv, "a") as f:
                for r, m, p, a in zip(chunk, msgs, prompt_ids, answers, strict=True):
                    # mask: the last answer (earlier assistant turns sit in the prompt ids)
                    mask = [0] * len(p) + [1] * len(a)
                    f.write(json.dumps({"id": r["id"], "kind": r["kind"], "ids": p + a,
                                        "mask": mask, "messages": m}) + "\n")
                    tokens += len(p) + len(a)
            bar.update(len(chunk))
        bar.close()
    finally:
        engine.close()
    return {"conversations": len(rows), "new": len(todo), "tokens": tokens,
            "seconds": time.perf_counter() - t0}


def pack(out: Path, heldout_share: float = 0.05) -> dict[str, Any]:
    """``out/conversations.jsonl`` → ``out/corpus.npz``: train / heldout token arrays (every
    ``1/heldout_share``-th conversation held out) and their answer masks; counts per kind."""
    lines = [json.loads(x) for x in (out / "conversations.jsonl").read_text().splitlines() if x]
    if not lines:
        raise ConfigError(f"{out}/conversations.jsonl: no conversations")
    every = max(2, round(1 / heldout_share))
    parts: dict[str, tuple[list[int], list[int]]] = {"train": ([], []), "heldout": ([], [])}
    stats: dict[str, dict[str, int]] = {}
    for i, c in enumerate(lines):
        ids, mask = parts["heldout" if i % every == every - 1 else "train"]
        ids += c["ids"]
        mask += c["mask"]
        s = stats.setdefault(c["kind"], {"conversations": 0, "tokens": 0, "answer_tokens": 0})
        s["conversations"] += 1
        s["tokens"] += len(c["ids"])
        s["answer_tokens"] += sum(c["mask"])
    arrays = {}
    for k, (ids, mask) in parts.items():
        arrays[k] = np.asarray(ids, dtype=np.uint16)
        arrays[f"{k}_mask"] = np.asarray(mask, dtype=np.uint8)
    np.savez(out / "corpus.npz", **arrays)
    summary = {"kinds": stats, "train_tokens": int(len(arrays["train"])),
               "heldout_tokens": int(len(arrays["heldout"]))}
    (out / "corpus.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary
