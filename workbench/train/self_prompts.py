"""Prompts the target writes itself, answered by the target: more self-distillation text than
the handwritten templates of ``workbench.train.real_prompts`` hold.

The target's chat template is opened at a user turn and given a category's first words (a
*steer*: ``"Translate the following sentence into German:\\n\\n"``, ``"Write a Python function
that"``, or nothing); the target samples the rest of the user turn until it closes it. This is
the Magpie recipe (Xu et al. 2024, arXiv:2406.08464): an instruction-tuned model's own template
draws user requests from the distribution it was tuned on. Each kept prompt is then answered
greedily with the chat template, exactly as ``distill`` answers the template prompts, and stored
in the same ``conversations.jsonl``.

A prompt is kept only if the target closed its turn (not cut by the token limit), it adds at
least ``MIN_CHARS`` to its steer, it is not a duplicate, and it names none of the held-out
prompts' sources (a topic or a standard-library name): the held-out set stays unseen.

    python -m workbench distill self --model M --conversations 3000
"""

from __future__ import annotations

import json
import random
import re
import time
from pathlib import Path
from typing import Any

from workbench.errors import ConfigError
from workbench.train.distill import ChatTokenizer, read_prompts
from workbench.train.turns import BACKENDS, open_turns

# the target languages of translation prompts (real_prompts.LANGS: the template prompts', kept
# equal by tests/train/test_self_prompts.py; not imported, since real_prompts' CLI imports this)
LANGS = ("French", "Spanish", "German", "Italian", "Portuguese")
# Sampled kinds and their steers. Translation and retrieval prompts are not sampled: asked to
# write a sentence to translate, a 135 M target writes broken foreign text, so they are built
# from kept prompts instead (derive()): an English question or request to translate, a passage
# written for summarising to answer a question from.
STEERS: dict[str, tuple[str, ...]] = {
    "chat": ("", "I", "Can you help me", "My", "I'm trying to", "Do you think"),
    "summarization": ("Summarize the following text in two or three sentences.\n\n",
                      "Summarize this paragraph:\n\n"),
    "qa": ("What is", "Why do", "How does", "Can you explain", "What are the main", "Who"),
    "math": ("Solve this problem step by step: ", "A math word problem:", "Calculate"),
    "code": ("Write a Python function that", "Write a Python program to", "How do I",
             "Write a Python class"),
}
SAMPLED = tuple(STEERS)
# the kinds whose prompt carries a passage the target writes: more tokens, a longer minimum
PASSAGE_KINDS = {"summarization": 200}
MIN_CHARS = 16
MAX_BARREN = 8  # batches in a row that keep nothing: the target cannot write prompts
TRANSLATABLE_CHARS = 240
QUESTIONS = ("What is the main point of the passage?", "According to the passage, who or what "
             "is it about?", "What does the passage say happens, and why?",
             "Answer in one sentence, using only the passage: what is its purpose?")


def banned_sources(heldout: Path) -> re.Pattern[str]:
    """One pattern matching any held-out source (a topic without its leading "the", a
    standard-library name, a sentence) as whole words, case-insensitively; generated math
    sources (``math12``) name nothing and are left out."""
    out = set()
    for r in read_prompts(heldout):
        s = str(r.get("source", "")).split(":")[0].strip()
        s = re.sub(r"^the ", "", s, flags=re.IGNORECASE)
        if s and not re.fullmatch(r"math\d+", s):
            out.add(s)
    if not out:
        raise ConfigError(f"{heldout}: no held-out sources to keep apart")
    alts = "|".join(re.escape(s) for s in sorted(out, key=len, reverse=True))
    return re.compile(rf"(?<!\w)(?:{alts})(?!\w)", re.IGNORECASE)


def keep(kind: str, steer: str, body: str, finished: bool, banned: re.Pattern[str],
         seen: set[str]) -> str | None:
    """The prompt text to keep for a sampled user turn, or None (see the module doc)."""
    if not finished:
        return None
    if len(body.strip()) < PASSAGE_KINDS.get(kind, MIN_CHARS):
        return None
    text = (steer + body).strip()  # body continues the steer's tokens, spaces included
    low = text.lower()
    if banned.search(text) or low in seen:
        return None
    seen.add(low)
    return text


def derive(kind: str, text: str, steer: str, rng: random.Random) -> tuple[str, str] | None:
    """(kind, prompt) built from a kept prompt: a translation of a short one-paragraph chat or
    QA prompt, a retrieval question on a summarisation passage; None for the other kinds."""
    if kind in ("chat", "qa") and len(text) <= TRANSLATABLE_CHARS and "\n" not in text:
        return "translation", (f"Translate the following sentence into {rng.choice(LANGS)}:"
                               f"\n\n{text}")
    if kind == "summarization":
        passage = text[len(steer):].strip() if text.startswith(steer.strip()) else text
        return "retrieval", ("Read the passage and answer the question using only the "
                             f"passage.\n\nPassage:\n{passage}\n\nQuestion: "
                             f"{rng.choice(QUESTIONS)}")
    return None


def self_distill(model: str, prompts: Path, out: Path, conversations: int,
                 max_new_tokens: int, prompt_tokens: int, batch: int, threads: int,
                 seed: int = 0, backend: str = "engine", device: str = "cpu",
                 time_limit: float | None = None) -> dict[str, Any]:
    """Append ``conversations`` self-prompted conversations (categories in turn) to
    ``out/conversations.jsonl`` and their prompt records to ``out/self_prompts.jsonl``;
    resumable (a rerun continues from the batches ``out/self_state.json`` records). The turns
    are written by ``backend`` on ``device`` (``workbench.train.turns``). With ``time_limit``
    (seconds), no batch starts after it has passed. Returns counts (``new`` includes the
    prompts built from kept ones), the share of sampled turns kept, and seconds."""
    from tqdm.auto import tqdm


    if conversations < 1 or batch < 1:
        raise ConfigError(f"conversations and batch must be >= 1, got {conversations}, {batch}")
    if backend not in BACKENDS:
        raise ConfigError(f"backend: expected one of {', '.join(BACKENDS)}, got {backend!r}")
    if time_limit is not None and not time_limit > 0:
        raise ConfigError(f"time_limit: expected seconds > 0, got {time_limit!r}")
    banned = banned_sources(prompts / "heldout.jsonl")
    out.mkdir(parents=True, exist_ok=True)
    conv, recs, state_f = (out / "conversations.jsonl", out / "self_prompts.jsonl",
                           out / "self_state.json")
    state = json.loads(state_f.read_text()) if state_f.is_file() else {"batches": 0}
    seen = set()
    have = 0
    # a run stopped between its two appends has answered prompts its records lack: the rerun
    # regenerates that batch (same seeds, same ids) and answers only the ids not yet answered
    answered = ({json.loads(x)["id"] for x in conv.read_text().splitlines() if x}
                if conv.is_file() else set())
    if recs.is_file() and recs.stat().st_size:  # (an emptied file: nothing kept yet)
        for r in read_prompts(recs):
            seen.add(r["prompt"].lower())
            have += 1
    ct = ChatTokenizer(model)
    tok = ct.tok
    opened = tok.apply_chat_template([{"role": "user", "content": "\x00"}],
                                     add_generation_prompt=False, tokenize=False)
    head, tail = opened.split("\x00")
    # the user turn closes with the template's end-of-turn token (ChatML's <|im_end|>) or, in
    # a plain-text template, its text (a newline): sampling stops there
    close = tail.strip() or tail
    end = tok.convert_tokens_to_ids(close) if close in tok.get_vocab() else None
    stop = {"stop_token_ids": (end,)} if end is not None else {"stop": (close,)}
    t0 = time.perf_counter()
    turns_gen = open_turns(backend, model, batch, threads, device, tok)
    sampled = kept = kept_turns = tokens = barren = 0
    bar = tqdm(total=conversations, initial=min(have, conversations), desc="self-distill",
               unit="conv")
    try:
        while have < conversations and (time_limit is None or
                                        time.perf_counter() - t0 < time_limit):
            b = state["batches"]
            rng = random.Random(f"{seed}:{b}")
            kinds = [SAMPLED[(b * batch + i) % len(SAMPLED)] for i in range(batch)]
            steers = [rng.choice(STEERS[k]) for k in kinds]
            ids = [tok(head + s, add_special_tokens=False)["input_ids"] for s in steers]
            limit = [prompt_tokens * (2 if k in PASSAGE_KINDS else 1) for k in kinds]
            turns = turns_gen.sample(ids, limit, seed * 1_000_003 + b, stop)
            rows = []
            for i, (k, s, (toks, finished)) in enumerate(zip(kinds, steers, turns,
                                                             strict=True)):
                sampled += 1
                body = tok.decode([t for t in toks if t != end],
                                  skip_special_tokens=True).removesuffix(close)
                text = keep(k, s, body, finished, banned, seen)
                if text is None:
                    continue
                rows.append({"id": f"self:{k}:{seed}:{b}:{i}", "kind": k, "prompt": text,
                             "source": "self"})
                d = derive(k, text, s, rng)
                if d is not None and d[1].lower() not in seen:
                    seen.add(d[1].lower())
                    rows.append({"id": f"self:{d[0]}:{seed}:{b}:{i}", "kind": d[0],
                                 "prompt": d[1], "source": "self"})
            rows = rows[: conversations - have]
            ask = [r for r in rows if r["id"] not in answered]
            if ask:
                msgs = [[{"role": "user", "content": r["prompt"]}] for r in ask]
                prompt_ids = [ct.ids(m) for m in msgs]
                answers = turns_gen.greedy(prompt_ids, max_new_tokens)
                with open(conv, "a") as f:
                    for r, m, p, a in zip(ask, msgs, prompt_ids, answers, strict=True):
                        m = m + [{"role": "assistant", "content": ct.decode(a)}]
                        f.write(json.dumps({"id": r["id"], "kind": r["kind"], "ids": p + a,
                                            "mask": [0] * len(p) + [1] * len(a),
                                            "messages": m}, ensure_ascii=False) + "\n")
                        tokens += len(p) + len(a)
                answered.update(r["id"] for r in ask)
            if rows:
                with open(recs, "a") as f:
                    f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
            kept += len(rows)
            kept_turns += sum(r["kind"] in STEERS for r in rows)
            barren = 0 if rows else barren + 1
            if barren == MAX_BARREN:
                raise ConfigError(
                    f"model {model!r}: {MAX_BARREN} batches in a row kept no prompt (the target "
                    f"does not close its user turn with {close!r} within {prompt_tokens} tokens, "
                    "or writes only duplicates or held-out sources)")
            have += len(rows)
            state["batches"] = b + 1
            state_f.write_text(json.dumps(state) + "\n")
            bar.update(len(rows))
    finally:
        bar.close()
        turns_gen.close()
    return {"conversations": have, "new": kept, "sampled_turns": sampled, "backend": backend,
            "device": device,
            "kept_share": round(kept_turns / sampled, 3) if sampled else None,
            "tokens": tokens,
            "seconds": round(time.perf_counter() - t0, 1)}
