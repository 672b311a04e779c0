"""Stop strings and stop token ids stay lossless under speculation.

Stops are applied token by token inside an accepted block, so:

* greedy: speculative output == baseline output (ids, trimmed text, finish reason, the matched
  stop), every config x batch 1/4/13;
* seeded sampling: every output stops exactly at its first stop (no token after it), and the
  baseline with stops is the baseline without stops cut at that point.

The stops are taken from each prompt's own unstopped continuation (a token id and a short
substring from its middle), so they fire mid-generation, usually inside a verified block.
"""

from __future__ import annotations

import dataclasses

import pytest
from helpers import id_prompts
from speculative.test_lossless import CONFIGS

import workbench as wb

N = 24
FAST = ("chain S3", "S5 K4 N16", "S6 K8 N32")


def unstopped(engine: wb.Engine, ps: list[list[int]], sp: wb.SamplingParams,
              ) -> list[tuple[list[int], str]]:
    """Per prompt: its own continuation under ``sp`` (``N`` tokens, EOS ignored) as token ids
    and text; the stop suites take their stops from its middle."""
    free = dataclasses.replace(sp, max_new_tokens=N, ignore_eos=True)
    outs = engine.generate(ps, [free] * len(ps))
    return [(o.token_ids, engine.tokenizer.decode(o.token_ids)) for o in outs]


def with_stops(engine: wb.Engine, ps: list[list[int]], sp: wb.SamplingParams,
               ) -> list[wb.SamplingParams]:
    """Per prompt: a stop token id and a stop string from the middle of its own baseline."""
    sps = []
    for i, (ids, text) in enumerate(unstopped(engine, ps, sp)):
        mid = len(text) // 2
        stop = text[mid : mid + 2].strip() or text[mid : mid + 2]
        kind = i % 3  # strings only, token ids only, both
        sps.append(dataclasses.replace(
            sp, max_new_tokens=N,
            stop=(stop,) if kind != 1 and stop else (),
            stop_token_ids=(ids[(2 * len(ids)) // 3],) if kind != 0 else ()))
    return sps


def first_stop(engine: wb.Engine, ids: list[int], sp: wb.SamplingParams) -> int | None:
    """Index of the first token at which ``sp``'s stops fire (the reference rule, applied to
    the whole output at once), or None."""
    stops = set(sp.stop_token_ids) | (set() if sp.ignore_eos else engine.eos_ids)
    for i, t in enumerate(ids):
        if t in stops:
            return i
        if sp.stop and any(s in engine.tokenizer.decode(ids[: i + 1]) for s in sp.stop):
            return i
    return None


def run(engine: wb.Engine, ps: list[list[int]], sps: list[wb.SamplingParams],
        spec: wb.SpecConfig | None, batch: int) -> list[wb.RequestOutput]:
    """run_staggered with per-request params; full outputs (text, reasons, matched)."""
    engine.set_spec(spec)
    try:
        queue = list(enumerate(zip(ps, sps, strict=True)))
        live: dict[int, int] = {}
        out: dict[int, wb.RequestOutput] = {}
        steps = 0
        while queue or live:
            while queue and len(live) < batch:
                i, (p, sp) = queue.pop(0)
                live[engine.add_request(p, sp)] = i
                if len(live) < batch:
                    engine.step()
            engine.step()
            steps += 1
            assert steps < 20 * len(ps) * N, f"requests never finish: {live}"
            for rid in [r for r in live if engine.requests[r].finished]:
                out[live.pop(rid)] = engine.release(rid)
        return [out[i] for i in range(len(ps))]
    finally:
        engine.set_spec(None)


def spec_equals_baseline(engine: wb.Engine, ps: list[list[int]], sps: list[wb.SamplingParams],
                         spec: wb.SpecConfig, batch: int,
                         ) -> tuple[list[wb.RequestOutput], list[wb.RequestOutput]]:
    """:func:`run` without then with ``spec``; asserts the outputs are the same (ids, trimmed
    text, finish reason, the matched stop) and returns both, baseline first."""
    base = run(engine, ps, sps, None, batch)
    out = run(engine, ps, sps, spec, batch)
    for b, s in zip(base, out, strict=True):
        assert (s.token_ids, s.text, s.finish_reason, s.matched_stop) == \
            (b.token_ids, b.text, b.finish_reason, b.matched_stop)
    return base, out


def check_exact_stop(engine: wb.Engine, o: wb.RequestOutput, sp: wb.SamplingParams) -> None:
    k = first_stop(engine, o.token_ids, sp)
    if k is None:
        assert o.finish_reason == "length" and len(o.token_ids) == sp.max_new_tokens
        assert o.matched_stop is None
        return
    assert len(o.token_ids) == k + 1, "output runs past its first stop"
    assert o.finish_reason == "stop"
    full = engine.tokenizer.decode(o.token_ids)
    if isinstance(o.matched_stop, int):
        assert o.token_ids[-1] == o.matched_stop
        assert o.text == engine.tokenizer.decode(o.token_ids[:-1])
    else:
        assert o.matched_stop in sp.stop and o.matched_stop in full
        assert o.text == full[: full.find(o.matched_stop)]


def sweep(name: str) -> list:
    return [pytest.param(name, marks=() if name in FAST else pytest.mark.slow)]


@pytest.mark.parametrize("name", [p for n in sorted(CONFIGS) for p in sweep(n)])
@pytest.mark.parametrize("batch", [1, 4, 13])
def test_greedy_stops_spec_equals_baseline(engine: wb.Engine, name: str, batch: int) -> None:
    ps = id_prompts(13 if batch > 1 else 4, seed=100 + batch, lo=2, hi=30)
    sps = with_stops(engine, ps, wb.SamplingParams())
    base, spec = spec_equals_baseline(engine, ps, sps, CONFIGS[name], batch)
    for b, sp in zip(base, sps, strict=True):
        check_exact_stop(engine, b, sp)
    assert any(o.finish_reason == "stop" and isinstance(o.matched_stop, str) for o in spec)
    assert any(o.finish_reason == "stop" and isinstance(o.matched_stop, int) for o in spec)
    assert any(sum(o.from_draft) for o in spec), "no draft token was accepted"
    assert engine.kv_usage()["used_blocks"] == 0


@pytest.mark.parametrize("name", [p for n in sorted(CONFIGS) for p in sweep(n)])
@pytest.mark.parametrize("batch", [1, 4, 13])
def test_seeded_sampling_stops_exactly(engine: wb.Engine, name: str, batch: int) -> None:
    ps = id_prompts(13 if batch > 1 else 4, seed=200 + batch, lo=2, hi=30)
    base_sp = wb.SamplingParams(temperature=0.7, top_p=0.95, ignore_eos=True)
    sps = [dataclasses.replace(sp, seed=1000 + i)
           for i, sp in enumerate(with_stops(engine, ps, base_sp))]
    for o, sp in zip(run(engine, ps, sps, CONFIGS[name], batch), sps, strict=True):
        check_exact_stop(engine, o, sp)
    # plain sampling: with stops = without stops, cut at the first stop (alone: batch 1)
    for p, sp in list(zip(ps, sps, strict=True))[:3]:
        o = engine.generate([p], sp)[0]
        free = engine.generate([p], dataclasses.replace(sp, stop=(), stop_token_ids=()))[0]
        assert o.token_ids == free.token_ids[: len(o.token_ids)]
        check_exact_stop(engine, o, sp)
    assert engine.kv_usage()["used_blocks"] == 0


def test_no_stop_trim_keeps_the_stop(engine: wb.Engine) -> None:
    p = id_prompts(1, seed=7, lo=2, hi=30)[0]
    sp = with_stops(engine, [p], wb.SamplingParams())[0]
    assert sp.stop
    trimmed = engine.generate([p], sp)[0]
    kept = engine.generate([p], dataclasses.replace(sp, no_stop_trim=True))[0]
    assert kept.token_ids == trimmed.token_ids and kept.finish_reason == "stop"
    # as SGLang: the text ends right after the stop string, not with the rest of its token
    assert kept.matched_stop in sp.stop
    assert kept.text == trimmed.text + kept.matched_stop
    assert engine.tokenizer.decode(kept.token_ids).startswith(kept.text)


def test_stream_never_shows_a_stop_string(engine: wb.Engine) -> None:
    p = id_prompts(1, seed=8, lo=2, hi=30)[0]
    sp = with_stops(engine, [p], wb.SamplingParams())[0]
    whole = engine.generate([p], sp, spec=CONFIGS["S5 K4 N16"])[0]
    streamed = "".join(engine.stream(p, sp, spec=CONFIGS["S5 K4 N16"]))
    assert streamed == whole.text


def test_stops_do_fire_inside_accepted_blocks(engine: wb.Engine) -> None:
    """Guard: the suite above exercises stops on an accepted draft token (mid-block), not only
    on a block's last (bonus) token."""
    ps = id_prompts(13, seed=113, lo=2, hi=30)
    sps = with_stops(engine, ps, wb.SamplingParams())
    outs = run(engine, ps, sps, CONFIGS["S5 K4 N16"], 13)
    assert any(o.finish_reason == "stop" and o.from_draft and o.from_draft[-1] for o in outs)
