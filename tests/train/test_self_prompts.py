"""Self-written prompts (``workbench.train.self_prompts``): what is kept, what is built from a
kept prompt, the held-out sources kept apart, and a whole resumable run on the toy target."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch

from workbench.errors import ConfigError
from workbench.train.distill import read_prompts
from workbench.train.self_prompts import (
    QUESTIONS,
    STEERS,
    banned_sources,
    derive,
    keep,
    self_distill,
)

REPO = Path(__file__).resolve().parents[2]
HELDOUT = REPO / "data" / "prompts" / "real" / "heldout.jsonl"
TOY = REPO / "data" / "models" / "wb-target"


def _banned(tmp_path: Path, *sources: str):
    f = tmp_path / "heldout.jsonl"
    f.write_text("".join(json.dumps({"id": f"h{i}", "kind": "qa", "prompt": "p", "source": s})
                         + "\n" for i, s in enumerate(sources)))
    return banned_sources(f)


def test_a_kept_prompt_is_the_steer_and_the_targets_whole_turn(tmp_path: Path) -> None:
    banned = _banned(tmp_path, "tea", "the French Revolution", "json.dumps", "math12")
    seen: set[str] = set()
    assert keep("qa", "What is", " the capital of Peru?", True, banned, seen) == \
        "What is the capital of Peru?"
    # cut by the token limit, too short, a duplicate (any case): not kept
    assert keep("qa", "What is", " a long question that never", False, banned, seen) is None
    assert keep("qa", "What is", " it?", True, banned, seen) is None
    assert keep("qa", "What IS", " THE capital of Peru?", True, banned, seen) is None
    # a passage kind needs a passage
    steer = STEERS["summarization"][0]
    assert keep("summarization", steer, "Short text.", True, banned, seen) is None
    assert keep("summarization", steer, "A passage. " * 30, True, banned, seen).startswith(steer)


def test_held_out_sources_are_refused_as_whole_words_only(tmp_path: Path) -> None:
    banned = _banned(tmp_path, "tea", "the French Revolution", "json.dumps", "math12")
    seen: set[str] = set()
    for body in (" the French Revolution about?", " green TEA good for you?",
                 " json.dumps used for in Python?"):
        assert keep("qa", "What is", body, True, banned, seen) is None, body
    # a word that merely contains a source, and a generated math source, are not refused
    assert keep("qa", "Why do", " teachers give homework?", True, banned, seen)
    assert keep("qa", "What is", " math12 plus one?", True, banned, seen)


def test_the_shipped_held_out_set_bans_its_own_sources() -> None:
    banned = banned_sources(HELDOUT)
    rows = read_prompts(HELDOUT)
    topics = [r["source"] for r in rows if r["kind"] in ("qa", "chat")]
    assert topics and all(banned.search(f"Tell me about {t}.") for t in topics)
    assert not banned.search("Tell me about nothing in particular.")


def test_an_empty_or_sourceless_held_out_file_is_refused(tmp_path: Path) -> None:
    f = tmp_path / "heldout.jsonl"
    f.write_text(json.dumps({"id": "m", "kind": "math", "prompt": "p", "source": "math3"}) + "\n")
    with pytest.raises(ConfigError, match="no held-out sources"):
        banned_sources(f)
    f.write_text("")
    with pytest.raises(ConfigError, match="heldout.jsonl"):
        banned_sources(f)


def test_translation_and_retrieval_prompts_are_built_from_kept_ones() -> None:
    rng = random.Random(0)
    kind, p = derive("chat", "Can you help me plan a trip?", "Can you help me", rng)
    assert kind == "translation" and p.endswith("\n\nCan you help me plan a trip?")
    assert p.startswith("Translate the following sentence into ")
    steer = STEERS["summarization"][0]
    kind, p = derive("summarization", steer.strip() + "\n\nThe passage text.", steer, rng)
    assert kind == "retrieval" and "Passage:\nThe passage text.\n\nQuestion: " in p
    assert any(p.endswith(q) for q in QUESTIONS)
    assert derive("code", "Write a Python function that adds.", "Write", rng) is None
    assert derive("qa", "Two\nlines?", "", rng) is None  # not one sentence to translate
    assert derive("qa", "x" * 300, "", rng) is None


def test_a_run_appends_conversations_and_resumes_where_it_stopped(tmp_path: Path) -> None:
    prompts = tmp_path / "prompts"
    prompts.mkdir()
    shutil.copy(HELDOUT, prompts / "heldout.jsonl")
    out = tmp_path / "out"
    r = self_distill(str(TOY), prompts, out, conversations=5, max_new_tokens=6,
                     prompt_tokens=24, batch=8, threads=1)
    assert r["conversations"] == 5 and r["new"] == 5 and 0 < r["kept_share"] <= 1
    recs = read_prompts(out / "self_prompts.jsonl")
    convs = [json.loads(x) for x in (out / "conversations.jsonl").read_text().splitlines()]
    assert [c["id"] for c in convs] == [x["id"] for x in recs]
    banned = banned_sources(prompts / "heldout.jsonl")
    for rec, c in zip(recs, convs, strict=True):
        assert rec["source"] == "self" and not banned.search(rec["prompt"])
        assert len(c["ids"]) == len(c["mask"]) and 1 <= sum(c["mask"]) <= 6
        assert c["mask"] == sorted(c["mask"])  # the answer is the tail
        assert c["messages"][0] == {"role": "user", "content": rec["prompt"]}
    assert len({x["prompt"].lower() for x in recs}) == len(recs)
    # a rerun to the same total adds nothing; a larger total continues with new batches
    assert self_distill(str(TOY), prompts, out, 5, 6, 24, 8, 1)["new"] == 0
    r = self_distill(str(TOY), prompts, out, 9, 6, 24, 8, 1)
    assert r["conversations"] == 9 and r["new"] == 4
    recs2 = read_prompts(out / "self_prompts.jsonl")
    assert [x["id"] for x in recs2[:5]] == [x["id"] for x in recs]
    assert len({x["id"] for x in recs2}) == 9


def test_a_run_stopped_between_its_two_appends_answers_nothing_twice(tmp_path: Path) -> None:
    prompts = tmp_path / "prompts"
    prompts.mkdir()
    shutil.copy(HELDOUT, prompts / "heldout.jsonl")
    out = tmp_path / "out"
    self_distill(str(TOY), prompts, out, 5, 6, 24, 8, 1)
    # as if stopped after answering the last batch, before its records and state were written
    state = json.loads((out / "self_state.json").read_text())
    last = state["batches"] - 1
    recs = (out / "self_prompts.jsonl").read_text().splitlines()
    kept = [x for x in recs if f":0:{last}:" not in json.loads(x)["id"]]
    assert len(kept) < len(recs)
    (out / "self_prompts.jsonl").write_text("".join(x + "\n" for x in kept))
    (out / "self_state.json").write_text(json.dumps({"batches": last}))
    self_distill(str(TOY), prompts, out, 5, 6, 24, 8, 1)
    ids = [json.loads(x)["id"] for x in (out / "conversations.jsonl").read_text().splitlines()]
    assert len(ids) == len(set(ids)) == 5
    assert [x["id"] for x in read_prompts(out / "self_prompts.jsonl")] == ids


def test_a_target_that_never_closes_its_turn_is_refused_loudly(tmp_path: Path) -> None:
    prompts = tmp_path / "prompts"
    prompts.mkdir()
    shutil.copy(HELDOUT, prompts / "heldout.jsonl")
    # one token per turn: never a closed turn with a body
    with pytest.raises(ConfigError, match="kept no prompt"):
        self_distill(str(TOY), prompts, tmp_path / "out", 3, 4, 1, 4, 1)
    with pytest.raises(ConfigError, match="conversations"):
        self_distill(str(TOY), prompts, tmp_path / "out", 0, 4, 8, 4, 1)


def test_translation_languages_are_the_template_prompts_languages() -> None:
    from workbench.train import real_prompts, self_prompts

    assert self_prompts.LANGS == real_prompts.LANGS


def test_transformers_backend_writes_the_same_records_and_the_engines_greedy_answers(
        tmp_path: Path) -> None:
    """The transformers backend (the GPU path, here on the CPU) keeps prompts by the same rules
    and answers each with the target's greedy answer: the engine's, token for token."""
    import workbench as wb

    prompts = tmp_path / "prompts"
    prompts.mkdir()
    shutil.copy(HELDOUT, prompts / "heldout.jsonl")
    out = tmp_path / "out"
    tf32 = torch.backends.cuda.matmul.allow_tf32
    r = self_distill(str(TOY), prompts, out, 6, 8, 24, 8, 1, backend="transformers")
    assert r["conversations"] == 6 and r["backend"] == "transformers"
    assert torch.backends.cuda.matmul.allow_tf32 == tf32  # switched off only while it ran
    recs = read_prompts(out / "self_prompts.jsonl")
    convs = [json.loads(x) for x in (out / "conversations.jsonl").read_text().splitlines()]
    assert [c["id"] for c in convs] == [x["id"] for x in recs]
    banned = banned_sources(prompts / "heldout.jsonl")
    assert not any(banned.search(x["prompt"]) for x in recs)
    engine = wb.Engine.from_pretrained(str(TOY), config=wb.EngineConfig(threads=1))
    try:
        for c in convs:
            p = [t for t, m in zip(c["ids"], c["mask"], strict=True) if m == 0]
            a = [t for t, m in zip(c["ids"], c["mask"], strict=True) if m == 1]
            want = engine.generate([p], wb.SamplingParams(max_new_tokens=8))[0].token_ids
            assert a == list(want), c["id"]
    finally:
        engine.close()


def test_a_bad_backend_device_or_time_limit_is_refused_naming_the_field(tmp_path: Path) -> None:
    prompts = tmp_path / "prompts"
    prompts.mkdir()
    shutil.copy(HELDOUT, prompts / "heldout.jsonl")
    with pytest.raises(ConfigError, match="backend"):
        self_distill(str(TOY), prompts, tmp_path / "o", 2, 4, 8, 4, 1, backend="vllm")
    with pytest.raises(ConfigError, match="time_limit"):
        self_distill(str(TOY), prompts, tmp_path / "o", 2, 4, 8, 4, 1, time_limit=0)
    with pytest.raises(ConfigError, match="device"):
        self_distill(str(TOY), prompts, tmp_path / "o", 2, 4, 8, 4, 1, backend="transformers",
                     device="tpu:9")


def test_a_time_limit_stops_starting_batches(tmp_path: Path) -> None:
    prompts = tmp_path / "prompts"
    prompts.mkdir()
    shutil.copy(HELDOUT, prompts / "heldout.jsonl")
    r = self_distill(str(TOY), prompts, tmp_path / "o", 1000, 4, 24, 8, 1, time_limit=1e-9)
    # the clock starts before the target loads: no batch starts, and the state says so
    assert r["conversations"] == 0 and r["sampled_turns"] == 0
