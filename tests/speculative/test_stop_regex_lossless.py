"""``stop_regex`` stays lossless under speculation, like stop strings: the patterns are fed each
token's text by the same incremental scan, so a block of accepted draft tokens ends exactly where
plain decoding of the same tokens ends.

* greedy: speculative output == baseline output (ids, text, finish reason, the matched pattern),
  configs x batch 1/4/13; every output stops at the first token after which its text contains a
  match (the reference rule: RE2 over ``decode(output_ids[:i + 1])``);
* seeded sampling: every output stops exactly at its first match;
* patterns come from each prompt's own unstopped continuation (two characters from its middle,
  joined by a character class or an optional gap), so they fire mid-generation.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
from helpers import id_prompts
from speculative.test_lossless import CONFIGS
from speculative.test_stop_lossless import (
    FAST,
    N,
    run,
    spec_equals_baseline,
    sweep,
    unstopped,
)

import workbench as wb
from workbench.stop_regex import WINDOW_CHARS, compile_pattern


def with_regex(engine: wb.Engine, ps: list[list[int]], sp: wb.SamplingParams,
               ) -> list[wb.SamplingParams]:
    """Per prompt: a pattern built from two characters in the middle of its own baseline."""
    sps = []
    for i, (_, text) in enumerate(unstopped(engine, ps, sp)):
        mid = len(text) // 2
        a, b = (text[mid : mid + 2] + "xy")[:2]
        kind = i % 3
        pattern = [f"{re.escape(a)}.?{re.escape(b)}",  # an optional gap
                   f"[{re.escape(a)}][{re.escape(b)}]",  # character classes
                   f"(?:{re.escape(a)}{re.escape(b)}|qqqq)"][kind]  # an alternation
        sps.append(dataclasses.replace(sp, max_new_tokens=N, stop_regex=(pattern,),
                                       ignore_eos=True))
    return sps


def first_match(engine: wb.Engine, ids: list[int], sp: wb.SamplingParams) -> int | None:
    """Index of the first token after which the decoded output contains a match, or None."""
    progs = [compile_pattern(p) for p in sp.stop_regex]
    for i in range(len(ids)):
        text = engine.tokenizer.decode(ids[: i + 1])[-WINDOW_CHARS:]
        if any(p.search(text) for p in progs):
            return i
    return None


def check_exact_stop(engine: wb.Engine, o: wb.RequestOutput, sp: wb.SamplingParams) -> None:
    k = first_match(engine, o.token_ids, sp)
    if k is None:
        assert o.finish_reason == "length" and len(o.token_ids) == sp.max_new_tokens
        return
    assert len(o.token_ids) == k + 1, "output runs past its first match"
    assert o.finish_reason == "stop" and o.matched_stop in sp.stop_regex
    full = engine.tokenizer.decode(o.token_ids)
    cut = full.find(o.matched_stop)  # SGLang trims at text.find(pattern), so rarely at all
    assert o.text == (full if cut == -1 else full[:cut])


@pytest.mark.parametrize("name", [p for n in sorted(CONFIGS) for p in sweep(n)])
@pytest.mark.parametrize("batch", [1, 4, 13])
def test_greedy_stop_regex_spec_equals_baseline(engine: wb.Engine, name: str,
                                                batch: int) -> None:
    ps = id_prompts(13 if batch > 1 else 4, seed=300 + batch, lo=2, hi=30)
    sps = with_regex(engine, ps, wb.SamplingParams())
    base, spec = spec_equals_baseline(engine, ps, sps, CONFIGS[name], batch)
    for b, sp in zip(base, sps, strict=True):
        check_exact_stop(engine, b, sp)
    assert any(o.finish_reason == "stop" for o in spec)
    assert any(sum(o.from_draft) for o in spec), "no draft token was accepted"
    assert engine.kv_usage()["used_blocks"] == 0


@pytest.mark.parametrize("name", FAST)
def test_seeded_sampling_stop_regex_stops_exactly(engine: wb.Engine, name: str) -> None:
    ps = id_prompts(13, seed=400, lo=2, hi=30)
    base_sp = wb.SamplingParams(temperature=0.7, top_p=0.95)
    sps = [dataclasses.replace(sp, seed=2000 + i)
           for i, sp in enumerate(with_regex(engine, ps, base_sp))]
    for o, sp in zip(run(engine, ps, sps, CONFIGS[name], 13), sps, strict=True):
        check_exact_stop(engine, o, sp)
    # plain sampling: with the pattern = without it, cut at its first match
    for p, sp in list(zip(ps, sps, strict=True))[:3]:
        o = engine.generate([p], sp)[0]
        free = engine.generate([p], dataclasses.replace(sp, stop_regex=()))[0]
        assert o.token_ids == free.token_ids[: len(o.token_ids)]


def test_stop_regex_fires_inside_accepted_blocks(engine: wb.Engine) -> None:
    """Guard: the suite above stops on an accepted draft token (mid-block), not only on a
    block's last (bonus) token."""
    ps = id_prompts(13, seed=313, lo=2, hi=30)
    sps = with_regex(engine, ps, wb.SamplingParams())
    outs = run(engine, ps, sps, CONFIGS["S5 K4 N16"], 13)
    assert any(o.finish_reason == "stop" and o.from_draft and o.from_draft[-1] for o in outs)


def test_stream_equals_the_whole_text(engine: wb.Engine) -> None:
    p = id_prompts(1, seed=9, lo=2, hi=30)[0]
    sp = with_regex(engine, [p], wb.SamplingParams())[0]
    whole = engine.generate([p], sp, spec=CONFIGS["S5 K4 N16"])[0]
    streamed = "".join(engine.stream(p, sp, spec=CONFIGS["S5 K4 N16"]))
    assert streamed == whole.text


def test_pathological_pattern_costs_linear_time(engine: wb.Engine) -> None:
    """(a+)+@ backtracks exponentially in Python's re; RE2 runs it in linear time over the
    bounded window, so a long output under it finishes (by length: it never matches)."""
    p = id_prompts(1, seed=10, lo=2, hi=30)[0]
    sp = wb.SamplingParams(max_new_tokens=48, ignore_eos=True,
                           stop_regex=("(a+)+@@@@", "(.*.*)*QQQ@@", "(x|x|x|x)*@@@@y"))
    o = engine.generate([p], sp, spec=CONFIGS["S5 K4 N16"])[0]
    assert o.finish_reason == "length" and len(o.token_ids) == 48
