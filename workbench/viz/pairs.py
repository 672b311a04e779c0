"""The models a page runs, and its prompts: the real pair when it is here, else the demo pair.

Pages 01 and 03 run the real pair — SmolLM2-135M-Instruct (``data/models/smollm2-135m-instruct``,
fetched into the user cache by ``make real-model``) with its EAGLE-3 head
(``data/models/smollm2-eagle3``) — in full mode when both are present, and the notebooks' demo
pair otherwise (:func:`workbench.train.demo_models.demo_models`: the shipped ``wb-target`` pair,
or the micro pair under ``WORKBENCH_FAST=1``)::

    models = page_models(fast=FAST)
    engine = wb.Engine.from_pretrained(models.target, draft=models.draft)
    prompts = models.prompts_for(engine)            # text prompts, chat-rendered for the real pair
    cats = models.categories(engine, per_category=12)   # held-out prompts per category

The real pair's held-out prompts (``data/prompts/real/heldout.jsonl``) are chat requests, one
JSON object a line: ``kind`` (the category), and either ``messages`` (a list of
``{"role", "content"}``) or ``prompt`` (one user turn); each is rendered with the model's own
chat template, so the engine sees what a chat client would send.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import workbench as wb
from workbench.data_io import (
    DATA_DIR,
    PROMPTS_DIR,
    chat_messages_of,
    load_prompts,
    read_jsonl_records,
)
from workbench.errors import ConfigError
from workbench.models.fetch import POINTER, Pointer, is_fetched
from workbench.train.demo_models import demo_models

# ``WORKBENCH_REAL_TARGET`` / ``WORKBENCH_REAL_DRAFT`` / ``WORKBENCH_REAL_PROMPTS`` point the pages
# at another copy of the pair (an HF folder of the same model, a head checkpoint while it trains)
REAL_TARGET = Path(os.environ.get("WORKBENCH_REAL_TARGET",
                                  DATA_DIR / "models" / "smollm2-135m-instruct"))
REAL_DRAFT = Path(os.environ.get("WORKBENCH_REAL_DRAFT",
                                 DATA_DIR / "models" / "smollm2-eagle3"))
REAL_PROMPTS = Path(os.environ.get("WORKBENCH_REAL_PROMPTS",
                                   PROMPTS_DIR / "real" / "heldout.jsonl"))
DEMO_KINDS = ("code", "docstring", "english")  # the demo pair's held-out categories
REAL_KV_TOKENS = 16384  # the real pair's KV pool: ample for a page's prompts, 0.75 GB
QUICKSTART_PROMPTS = 4  # prompts of page 01 for the real pair: the first of each category


def real_missing() -> str | None:
    """Why the real pair cannot run here (None when it can)."""
    if not (REAL_DRAFT / "config.json").is_file():
        return f"no EAGLE-3 head for the real model ({REAL_DRAFT})"
    if not REAL_PROMPTS.is_file():
        return f"no held-out prompts for the real model ({REAL_PROMPTS})"
    if (REAL_TARGET / "config.json").is_file():
        return None

    if not (REAL_TARGET / POINTER).is_file():
        return f"{REAL_TARGET} is neither a model folder nor a pointer folder"
    if not is_fetched(Pointer.read(REAL_TARGET)):
        return "the real model is not in the user cache (`make real-model` fetches it)"
    return None


def read_chat_prompts(path: Path | None = None) -> list[tuple[str, list[dict[str, str]]]]:
    """``(category, messages)`` per line of a chat prompts file (default ``REAL_PROMPTS``, read
    by ``read_jsonl_records``); errors name the line and the field."""
    out = []
    for _, where, d in read_jsonl_records(REAL_PROMPTS if path is None else path, required=()):
        msgs = chat_messages_of(d, where)  # the bench's reading of a line: one rule
        kind = d.get("kind")
        if not isinstance(kind, str) or not kind:
            raise ConfigError(f"{where}: field 'kind' (the category) missing or not a string")
        out.append((kind, msgs))
    return out


def render(tokenizer: Any, messages: list[dict[str, str]]) -> str:
    """``messages`` as the model's chat template renders them, ready for the assistant's turn."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ConfigError("tokenizer: the real model's tokenizer has no chat template")
    return str(tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                             tokenize=False))


@dataclass(frozen=True)
class PagePair:
    """Where a page's models live, what they are, and where its prompts come from."""

    target: Path
    draft: Path
    kind: str  # "real" | "shipped" | "micro"
    summary: str
    demo_prompts: tuple[str, ...] = field(default=())  # the demo pair's text prompts

    def describe(self) -> str:
        """One line for a notebook: which models, from where."""
        return self.summary

    @property
    def real(self) -> bool:
        return self.kind == "real"

    @property
    def config(self) -> Any:
        """The page's ``EngineConfig``: the real target's KV pool held to 16,384 tokens (its
        30 layers x 3 KV heads x 64 dims cost 46 KB a token in float32), defaults otherwise."""
        return wb.EngineConfig(kv_budget_tokens=REAL_KV_TOKENS) if self.real \
            else wb.EngineConfig()

    def categories(self, engine: Any, per_category: int = 12,
                   chars: int = 400) -> dict[str, list[str]]:
        """Held-out prompts per category, at most ``per_category`` each, as text: the real
        pair's chat requests rendered with its template (in file order), or the demo pair's
        code / docstring / English prompts cut to their last ``chars`` characters."""
        if self.real:
            out: dict[str, list[str]] = {}
            for kind, msgs in read_chat_prompts():
                if len(out.setdefault(kind, [])) < per_category:
                    out[kind].append(render(engine.tokenizer, msgs))
            return out
        held = load_prompts("heldout")
        return {k: [p.prompt[-chars:] for p in held if p.kind == k][:per_category]
                for k in DEMO_KINDS}

    def held_out_counts(self) -> dict[str, int]:
        """How many held-out prompts each category has in all."""
        if self.real:
            counts: dict[str, int] = {}
            for kind, _ in read_chat_prompts():
                counts[kind] = counts.get(kind, 0) + 1
            return counts
        held = load_prompts("heldout")
        return {k: sum(p.kind == k for p in held) for k in DEMO_KINDS}

    def prompts_for(self, engine: Any) -> list[str]:
        """Page 01's prompts as text: the first held-out request of each category (up to
        ``QUICKSTART_PROMPTS``) for the real pair, else the demo pair's prompts."""
        if not self.real:
            return list(self.demo_prompts)
        firsts = [v[0] for v in self.categories(engine, per_category=1).values()]
        return firsts[:QUICKSTART_PROMPTS]


def page_models(fast: bool = False) -> PagePair:
    """The real pair unless ``fast`` or it is missing; then the demo pair (``demo_models``)."""
    if not fast and real_missing() is None:
        return PagePair(REAL_TARGET, REAL_DRAFT, "real",
                        f"real pair: {REAL_TARGET.name} (SmolLM2-135M-Instruct) + "
                        f"{REAL_DRAFT.name} (its EAGLE-3 head)")
    demo = demo_models(fast=fast)
    return PagePair(demo.target, demo.draft, demo.kind, demo.describe(), demo.prompts)


__all__ = ["PagePair", "REAL_DRAFT", "REAL_PROMPTS", "REAL_TARGET", "page_models",
           "read_chat_prompts", "real_missing", "render"]
