"""Prompts for the real target's EAGLE-3 head across Spec-Bench-like categories, written or
derived offline, and the target's own answers to them (self-distillation).

Categories (``kind``): ``chat`` (multi-turn: a second user turn after the target's first
answer), ``translation``, ``summarization``, ``qa``, ``math``, ``retrieval`` (answer from a given
passage), ``code``. Passages come from the running interpreter's standard-library docstrings;
math problems are generated; the rest are templates over handwritten topic lists, kept as data
in ``data/prompts/real/templates.json`` (``distill prompts`` prepares the prompt files from them).

Held-out prompts are chosen by *source* (a topic, a docstring's object, a problem template's
numbers drawn from a separate generator): a held-out prompt never shares its source with a train
prompt, so neither its passage nor its topic was seen in training.

    python -m workbench distill prompts   # data/prompts/real/{train,heldout}.jsonl
    python -m workbench distill answers --model M   # data/work/real-distill/
    python -m workbench distill self --model M --conversations N  # more, self-prompted
    python -m workbench distill pack   # data/work/real-distill/corpus.npz

(``python -m workbench.train.real_prompts VERB`` runs the same verbs; ``distill`` and
``self-distill`` are aliases of ``answers`` and ``self``.)
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import inspect
import json
import random
import re
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from workbench.data_io import PROMPTS_DIR, load_json
from workbench.errors import ConfigError
from workbench.train.distill import distill, pack
from workbench.train.self_prompts import self_distill

KINDS = ("chat", "translation", "summarization", "qa", "math", "retrieval", "code")
OUT_DIR = PROMPTS_DIR / "real"
HELDOUT_SHARE = 0.15  # of the sources (a topic, passage or problem: across every category)
HELDOUT_PER_KIND = 16

# The templates and sources are data (data/prompts/real/templates.json); `distill prompts`
# builds the train / held-out prompt files from them.
TEMPLATES_FILE = OUT_DIR / "templates.json"
TEMPLATE_KEYS = ("topics", "qa_templates", "chat_first", "chat_second", "sentences", "langs",
                 "code_tasks", "code_templates", "modules")


def _templates(path: Path = TEMPLATES_FILE) -> dict[str, tuple[str, ...]]:
    """Each list of ``path`` as a tuple of strings; a missing list or a non-string entry is an
    error naming it."""
    if not path.is_file():
        raise ConfigError(f"no prompt templates at {path} (data/prompts/real/templates.json "
                          "ships with the repository)")
    doc = load_json(path)
    out = {}
    for key in TEMPLATE_KEYS:
        items = doc.get(key)
        if not isinstance(items, list) or not items or not all(isinstance(x, str) for x in items):
            raise ConfigError(f"{path}: {key!r} must be a non-empty list of strings")
        out[key] = tuple(items)
    return out


_T = _templates()
TOPICS = _T["topics"]
QA_TEMPLATES = _T["qa_templates"]
CHAT_FIRST = _T["chat_first"]
CHAT_SECOND = _T["chat_second"]
SENTENCES = _T["sentences"]
LANGS = _T["langs"]
CODE_TASKS = _T["code_tasks"]
CODE_TEMPLATES = _T["code_templates"]
MODULES = _T["modules"]


def _held(source: str) -> bool:
    """Held-out iff the source's hash falls in the held-out share (stable across runs)."""
    h = int(hashlib.sha1(source.encode()).hexdigest()[:8], 16)
    return h / 0xFFFFFFFF < HELDOUT_SHARE


def _passages(min_chars: int = 250, max_chars: int = 1400) -> list[tuple[str, str]]:
    """(qualified name, cleaned docstring) of stdlib objects with a mid-length docstring."""
    out: dict[str, str] = {}
    for mod_name in MODULES:
        try:
            mod = importlib.import_module(mod_name)
        except ImportError:  # a module this interpreter was built without (e.g. sqlite3)
            continue
        objs = [(mod_name, mod)] + [(f"{mod_name}.{n}", o) for n, o in vars(mod).items()
                                    if not n.startswith("_") and (inspect.isfunction(o)
                                                                  or inspect.isclass(o)
                                                                  or inspect.isbuiltin(o))]
        for name, o in objs:
            with warnings.catch_warnings():  # reading a deprecated alias's doc (typing.re)
                warnings.simplefilter("ignore", DeprecationWarning)
                doc = inspect.getdoc(o) or ""
            doc = re.sub(r"\n{3,}", "\n\n", doc).strip()
            if min_chars <= len(doc) <= max_chars and name not in out:
                out[name] = doc
    return sorted(out.items())


def _math_problem(rng: random.Random) -> str:
    a, b, c = rng.randint(3, 60), rng.randint(2, 25), rng.randint(2, 12)
    name = rng.choice(("Anna", "Ben", "Carlos", "Dana", "Emil", "Fatima", "George", "Hana"))
    item = rng.choice(("apples", "books", "marbles", "stickers", "cookies", "pencils", "coins"))
    forms = (
        f"{name} has {a} {item}. {name} buys {b} more and then gives away {c}. How many {item} "
        f"does {name} have now?",
        f"A box holds {b} {item}. How many {item} are there in {c} boxes, plus {a} loose ones?",
        f"{name} reads {b} pages a day. How many days does it take to read a book of {b * c} "
        "pages?",
        f"A shop sells {item} at {c} dollars each. {name} pays with {c * b + a} dollars for {b} "
        f"{item}. How much change does {name} get?",
        f"A train travels at {b * 5} km per hour for {c} hours. How far does it travel?",
        f"{name} saves {b} dollars every week. After {c} weeks, {name} spends {a} dollars. How "
        "much money is left?",
        f"What is {a} percent of {b * 20}? Show your reasoning step by step.",
        f"A rectangle is {a} cm long and {b} cm wide. What are its area and perimeter?",
        f"There are {a + b} students in a class and {a} of them are girls. What fraction of the "
        "class are boys?",
    )
    return rng.choice(forms) + " Solve it step by step."


def _rows(kind: str, rng: random.Random, passages: list[tuple[str, str]]
          ) -> Iterator[tuple[str, str, Any]]:
    """(source, id suffix, prompt or list of messages) of one category, deterministic order."""
    if kind == "qa":
        for t in TOPICS:
            for k in rng.sample(range(len(QA_TEMPLATES)), 2):
                yield t, f"{k}", QA_TEMPLATES[k].format(t=t)
        for name, _ in passages[::4]:
            yield name, "py", f"What does `{name}` in Python's standard library do?"
    elif kind == "chat":
        for t in TOPICS:
            for k in rng.sample(range(len(CHAT_FIRST)), 2):
                second = rng.choice(CHAT_SECOND)
                yield t, f"{k}", [CHAT_FIRST[k].format(t=t), second]
    elif kind == "translation":
        for s in SENTENCES:
            for lang in rng.sample(LANGS, 4):
                yield s, lang, f"Translate the following sentence into {lang}:\n\n{s}"
        for i, t in enumerate(TOPICS[:40]):
            lang = LANGS[i % len(LANGS)]
            yield t, lang, (f"Translate into {lang}: \"I am reading an article about {t}, and "
                            "it is very interesting.\"")
    elif kind == "summarization":
        for name, doc in passages:
            yield name, "sum", f"Summarize the following text in two or three sentences.\n\n{doc}"
    elif kind == "retrieval":
        qs = ("According to the passage, what does it do?", "What arguments or parameters does "
              "the passage mention?", "What does the passage say about errors or special cases?",
              "Answer in one sentence, using only the passage: what is its purpose?")
        for name, doc in passages:
            q = rng.choice(qs)
            yield name, "ret", (f"Read the passage and answer the question using only the "
                                f"passage.\n\nPassage ({name}):\n{doc}\n\nQuestion: {q}")
    elif kind == "math":
        for i in range(220):
            yield f"math{i}", "m", _math_problem(rng)
    elif kind == "code":
        for t in CODE_TASKS:
            for k in rng.sample(range(len(CODE_TEMPLATES)), 3):
                yield t, f"{k}", CODE_TEMPLATES[k].format(t=t)
        for name, doc in passages[1::5]:
            first = doc.split("\n")[0]
            yield name + ":code", "impl", (f"Write a small Python example that uses `{name}`. "
                                           f"Its documentation says: {first}")
    else:
        raise ConfigError(f"kind: {kind!r} not in {KINDS}")


def build_prompts(seed: int = 0, per_kind_train: int = 0) -> tuple[list[dict], list[dict]]:
    """(train, heldout) prompt records; ``per_kind_train`` > 0 caps train prompts per kind.

    Record: id, kind, prompt (text; the first user turn for chat), source, and for chat
    ``turns`` (the user turns in order)."""
    passages = _passages()
    train: list[dict] = []
    held: list[dict] = []
    for kind in KINDS:
        rng = random.Random(f"{seed}:{kind}")
        rows_t, rows_h = [], []
        for source, suffix, p in _rows(kind, rng, passages):
            turns = p if isinstance(p, list) else [p]
            rec = {"id": f"{kind}:{source}:{suffix}", "kind": kind, "prompt": turns[0],
                   "source": source}
            if len(turns) > 1:
                rec["turns"] = turns
            (rows_h if _held(source.split(":")[0]) else rows_t).append(rec)
        rng.shuffle(rows_t)
        if per_kind_train:
            rows_t = rows_t[:per_kind_train]
        train += rows_t
        held += rows_h[:HELDOUT_PER_KIND]
    return train, held


def write_prompts(out: Path = OUT_DIR, seed: int = 0) -> dict[str, dict[str, int]]:
    train, held = build_prompts(seed)
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train", train), ("heldout", held)):
        with open(out / f"{name}.jsonl", "w") as f:
            for r in rows:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
    return {name: {k: sum(r["kind"] == k for r in rows) for k in KINDS}
            for name, rows in (("train", train), ("heldout", held))}


def _add_verbs(sub: Any) -> None:
    """The four verbs, on ``sub`` (the module's own parser or ``workbench distill``'s)."""
    p = sub.add_parser("prompts", help="write train/heldout prompt files")
    p.add_argument("--out", default=str(OUT_DIR))
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(verb_fn=lambda ns: write_prompts(Path(ns.out), ns.seed))
    d = sub.add_parser("answers", aliases=["distill"],
                       help="the target answers the train (and held-out) prompts")
    d.add_argument("--model", required=True)
    d.add_argument("--prompts", default=str(OUT_DIR))
    d.add_argument("--out", default="data/work/real-distill")
    d.add_argument("--per-kind", type=int, default=0, help="train prompts per kind (0: all)")
    d.add_argument("--max-new-tokens", type=int, default=192)
    d.add_argument("--second-turn-tokens", type=int, default=128)
    d.add_argument("--batch", type=int, default=64)
    d.set_defaults(verb_fn=lambda ns: distill(ns.model, Path(ns.prompts), Path(ns.out), ns.per_kind,
                                         ns.max_new_tokens, ns.second_turn_tokens, ns.batch))
    s = sub.add_parser("self", aliases=["self-distill"],
                       help="the target writes user prompts per category (Magpie) and answers "
                            "them, into the same conversations.jsonl")
    s.add_argument("--model", required=True)
    s.add_argument("--prompts", default=str(OUT_DIR), help="folder of heldout.jsonl (kept apart)")
    s.add_argument("--out", default="data/work/real-distill")
    s.add_argument("--conversations", type=int, required=True, help="self-prompted total")
    s.add_argument("--max-new-tokens", type=int, default=160)
    s.add_argument("--prompt-tokens", type=int, default=128,
                   help="most tokens of a sampled user turn (twice that with a passage)")
    s.add_argument("--batch", type=int, default=32)
    s.add_argument("--threads", type=int, default=0)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--backend", default="engine", choices=("engine", "transformers"),
                   help="what writes the turns: the workbench engine, or transformers' generate")
    s.add_argument("--device", default="cpu", help="where the backend runs (cuda for a GPU)")
    s.add_argument("--time-limit", type=float, default=None,
                   help="seconds: no batch starts after them (the run stops short of the total)")
    s.set_defaults(verb_fn=lambda ns: self_distill(
        ns.model, Path(ns.prompts), Path(ns.out), ns.conversations, ns.max_new_tokens,
        ns.prompt_tokens, ns.batch, ns.threads, ns.seed, ns.backend, ns.device, ns.time_limit))
    k = sub.add_parser("pack", help="conversations.jsonl -> corpus.npz for train-draft")
    k.add_argument("--out", default="data/work/real-distill")
    k.set_defaults(verb_fn=lambda ns: pack(Path(ns.out)))


def run(ns: argparse.Namespace) -> int:
    """Run a parsed verb and print its summary as one JSON line."""
    print(json.dumps(ns.verb_fn(ns)))
    return 0


def add_parser(sub: Any) -> None:
    """``python -m workbench distill {prompts,answers,self,pack}`` on the main CLI."""
    g = sub.add_parser("distill", help="the real model's prompts, the target's answers to "
                                       "them (self-distillation) and the packed corpus")
    _add_verbs(g.add_subparsers(dest="verb", required=True))
    g.set_defaults(fn=run)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m workbench.train.real_prompts")
    _add_verbs(ap.add_subparsers(dest="cmd", required=True))
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
