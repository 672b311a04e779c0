"""The incremental text-stop scan (engine/stops.py) against the whole-text rule it replaces.

* The Aho–Corasick automaton reports the earliest-ending (then longest) stop in a text fed in
  arbitrary pieces, and ``hold`` equals the longest suffix that is a proper prefix of a stop
  (the old quadratic ``hold_back_stops``), on random texts over a small alphabet.
* ``advance`` over a real byte-level tokenizer (the shipped target's, with multi-byte
  characters cut across tokens and bytes that are not UTF-8) fires at exactly the first token
  whose ``decode(output_ids)`` contains a stop.
* Cost: a token's scan decodes a bounded window and feeds each character once, however many and
  however long the stops (counted, not timed).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from workbench.engine.stops import (
    MAX_WINDOW,
    Hit,
    ScanState,
    StopStrings,
    advance,
    hold_back_stops,
    stop_strings,
)

ROOT = Path(__file__).resolve().parents[2]


def naive_first_hit(text: str, stops: tuple[str, ...]) -> Hit | None:
    """The stop whose first occurrence ends earliest in ``text`` (longest on a tie)."""
    best: Hit | None = None
    for s in stops:
        i = text.find(s)
        if i != -1:
            h = Hit(i + len(s), s)
            if best is None or h.end < best.end or (h.end == best.end and len(s) > len(best.stop)):
                best = h
    return best


def naive_hold(text: str, stops: tuple[str, ...]) -> int:
    return max((k for s in stops for k in range(1, min(len(s) - 1, len(text)) + 1)
                if text.endswith(s[:k])), default=0)


@pytest.mark.parametrize("seed", range(40))
def test_automaton_equals_the_whole_text_rule(seed: int) -> None:
    rng = random.Random(seed)
    alpha = "ab" if seed % 2 else "abc"
    stops = tuple({"".join(rng.choice(alpha) for _ in range(rng.randint(1, 6)))
                   for _ in range(rng.randint(1, 6))})
    text = "".join(rng.choice(alpha) for _ in range(rng.randint(0, 60)))
    auto = StopStrings(stops)
    want = naive_first_hit(text, stops)
    state, got, pos = auto.start(), None, 0
    while pos < len(text) and got is None:  # fed in random pieces
        k = rng.randint(1, 5)
        state, h = auto.feed(state, text[pos : pos + k])
        if h is not None:
            got = Hit(pos + h.end, h.stop)
        pos += k
    assert got == want
    for k in range(len(text) + 1):  # hold: on every prefix free of a complete stop
        if naive_first_hit(text[:k], stops) is None:
            assert auto.hold(text[:k]) == naive_hold(text[:k], stops)
            assert hold_back_stops(text[:k], stops) == text[: k - naive_hold(text[:k], stops)]


class CountingTokenizer:
    """The shipped target's tokenizer, counting the ids each decode reads."""

    def __init__(self) -> None:
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(ROOT / "data/models/wb-target")
        self.decoded = 0

    def decode(self, ids: list[int]) -> str:
        self.decoded += len(ids)
        return str(self.tok.decode(ids))


@pytest.fixture(scope="module")
def tok() -> CountingTokenizer:
    return CountingTokenizer()


def scan(tok: CountingTokenizer, ids: list[int], stops: tuple[str, ...]) -> int | None:
    """Index of the token at which the incremental scan fires, or None."""
    auto = (stop_strings(stops),)
    st = ScanState.start(auto)
    for i in range(len(ids)):
        st, hit = advance(tok, auto, st, lambda a, b: ids[a:b])
        if hit is not None:
            assert hit.stop in tok.decode(ids[: i + 1])
            return i
    return None


def first_stop(tok: CountingTokenizer, ids: list[int], stops: tuple[str, ...]) -> int | None:
    for i in range(len(ids)):
        text = tok.decode(ids[: i + 1])
        if any(s in text for s in stops):
            return i
    return None


TEXTS = ["héllo wörld 日本語 ok, déjà vu", "def parse(path):\n    return 1 + 2", "ééé日日日 a"]


@pytest.mark.parametrize("seed", range(30))
def test_advance_fires_at_the_first_token_whose_text_holds_a_stop(tok: CountingTokenizer,
                                                                   seed: int) -> None:
    rng = random.Random(seed)
    if seed % 3 == 2:  # arbitrary ids: bytes that are not UTF-8, cut characters, anything
        ids = [rng.randrange(len(tok.tok)) for _ in range(40)]
    else:
        ids = tok.tok.encode(rng.choice(TEXTS))
    text = tok.decode(ids)
    stops = tuple({text[i : i + rng.randint(1, 4)] for i in
                   (rng.randrange(len(text)) for _ in range(rng.randint(1, 3)))} - {""})
    assert scan(tok, ids, stops) == first_stop(tok, ids, stops)
    assert scan(tok, ids, ("\ufffd\ufffd",)) == first_stop(tok, ids, ("\ufffd\ufffd",))


def test_scan_cost_does_not_grow_with_the_stops_or_the_text(tok: CountingTokenizer) -> None:
    """800 stops of 2,000 characters that almost match (the hostile case) over 300 tokens:
    each token's scan decodes a window of at most MAX_WINDOW + 1 ids, twice."""
    ids = tok.tok.encode("a" * 300)
    stops = tuple("a" * 1999 + chr(0x4E00 + i) for i in range(800))
    auto: tuple[Any, ...] = (StopStrings(stops),)
    st = ScanState.start(auto)
    per_token = []
    for _ in ids:
        before = tok.decoded
        st, hit = advance(tok, auto, st, lambda a, b: ids[a:b])
        assert hit is None
        per_token.append(tok.decoded - before)
    assert max(per_token) <= 2 * (MAX_WINDOW + 1)
    assert sum(per_token) <= 4 * len(ids)  # a window of one or two tokens in ASCII text
    garbage = [122] * 300  # one byte that is never UTF-8: the window is capped
    st = ScanState.start(auto)
    for _ in garbage:
        before = tok.decoded
        st, _hit = advance(tok, auto, st, lambda a, b: garbage[a:b])
        assert tok.decoded - before <= 2 * (MAX_WINDOW + 1)
