"""Text stops matched incrementally: each token costs O(its own text), whatever the stops.

A request's output text is decoded a few tokens at a time (:func:`advance`: the incremental
detokenization of vLLM/SGLang, over the output ids only, so the text is what
``tokenizer.decode(output_ids)`` shows) and only the new characters are fed to each of the
request's :class:`TextStop` scanners. Stop strings share one Aho–Corasick automaton
(:class:`StopStrings`): a step costs O(new characters) amortized, not O(Σ len(stop) × text).

The state of a request's scan (:class:`ScanState`) is an immutable value, so
``OutputProcessor.cut`` can step it token by token through a block of accepted draft tokens
and keep the state after the token where it stops: a block ends exactly where plain decoding
of the same tokens ends (lossless stops).

Another kind of stop (``stop_regex``: :class:`StopRegex`, limits in :mod:`workbench.stop_regex`)
implements
:class:`TextStop` and is returned from :func:`text_stops` for the sampling parameters that ask
for it. Its ``feed`` sees the output text
as consecutive pieces (each piece: the characters a token made final) and reports the first
match that ends in the piece; ``hold`` says how many trailing characters of a text may still
begin a match (what a stream holds back).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

from workbench.config import SamplingParams
from workbench.stop_regex import (
    CONTEXT_CHARS,
    MAX_PROGRAM_BYTES,
    PROGRAM_CACHE_BYTES,
    WINDOW_CHARS,
    BudgetCache,
    check_patterns,
    compile_pattern,
)

# A decode window that has not ended on a complete character for this many tokens (bytes that
# are not UTF-8) is taken as final, U+FFFD and all: the scan's cost per token stays bounded.
MAX_WINDOW = 32


class Hit(NamedTuple):
    """A stop that matched: it ends at ``end`` in the piece just fed; ``stop`` is reported
    (``matched_stop``) and trimmed from the text."""

    end: int
    stop: str


class TextStop(Protocol):
    """One kind of text stop over a request's output text, fed incrementally (module doc)."""

    def start(self) -> Any:
        """The state before any text."""
        ...

    def feed(self, state: Any, piece: str) -> tuple[Any, Hit | None]:
        """Consume ``piece`` (the next characters of the text): the new state and the match
        ending earliest in ``piece``, if any. Must cost O(len(piece)) (amortized)."""
        ...

    def hold(self, text: str) -> int:
        """How many trailing characters of ``text`` may begin a match that is not complete
        (a stream does not show them yet). Bounded cost, independent of len(text)."""
        ...


class StopStrings:
    """An Aho–Corasick automaton over stop strings. State: a node (an int), the longest suffix
    of the text so far that is a prefix of some stop."""

    def __init__(self, stops: Sequence[str]) -> None:
        if not stops or not all(isinstance(s, str) and s for s in stops):
            raise ValueError(f"stops: expected non-empty strings, got {stops!r}")
        self.stops = tuple(stops)
        self.max_len = max(len(s) for s in stops)
        goto: list[dict[str, int]] = [{}]
        depth = [0]
        ends: list[str | None] = [None]  # the stop that is exactly this node's string
        for s in self.stops:
            node = 0
            for c in s:
                nxt = goto[node].get(c)
                if nxt is None:
                    nxt = len(goto)
                    goto[node][c] = nxt
                    goto.append({})
                    depth.append(depth[node] + 1)
                    ends.append(None)
                node = nxt
            if ends[node] is None:
                ends[node] = s
        fail = [0] * len(goto)
        # longest stop that is a suffix of this node's string (itself or via failure links)
        best: list[str | None] = list(ends)
        order = list(goto[0].values())  # depth 1: failure link to the root
        for node in order:  # breadth first: a node's failure target is shallower
            for c, child in goto[node].items():
                f = fail[node]
                while f and c not in goto[f]:
                    f = fail[f]
                fail[child] = goto[f].get(c, 0)
                if best[child] is None:
                    best[child] = best[fail[child]]
                order.append(child)
        self._goto, self._fail, self._depth, self._best = goto, fail, depth, best

    def start(self) -> int:
        return 0

    def feed(self, state: int, piece: str) -> tuple[int, Hit | None]:
        goto, fail, best = self._goto, self._fail, self._best
        node = state
        for i, c in enumerate(piece):
            while node and c not in goto[node]:
                node = fail[node]
            node = goto[node].get(c, 0)
            hit = best[node]
            if hit is not None:
                return node, Hit(i + 1, hit)
        return node, None

    def hold(self, text: str) -> int:
        # the automaton's node after the last max_len - 1 characters is the longest suffix of
        # ``text`` that a stop begins with (a proper prefix is shorter than max_len)
        node = 0
        goto, fail = self._goto, self._fail
        for c in text[max(0, len(text) - self.max_len + 1):] if self.max_len > 1 else "":
            while node and c not in goto[node]:
                node = fail[node]
            node = goto[node].get(c, 0)
        return self._depth[node]


# automata kept for reuse within a byte budget (~234 bytes per stop character measured: a
# request's 4,096-character bound is ~1 MB; 128 entries alone could hold 128 MB)
AUTOMATON_BYTES_PER_CHAR = 256
STOP_CACHE_BYTES = 16 << 20
stop_strings: BudgetCache[tuple[str, ...], StopStrings] = BudgetCache(
    StopStrings, lambda stops: 1024 + AUTOMATON_BYTES_PER_CHAR * sum(map(len, stops)),
    STOP_CACHE_BYTES)


def text_stops(sp: SamplingParams) -> tuple[TextStop, ...]:
    """The text stops ``sp`` asks for (empty: no text matching at all): its stop strings and
    its ``stop_regex`` patterns (:mod:`workbench.stop_regex`)."""
    found: tuple[TextStop, ...] = (stop_strings(sp.stop),) if sp.stop else ()
    if sp.stop_regex:
        found += (stop_regexes(sp.stop_regex),)
    return found


def hold_back(text: str, stops: tuple[TextStop, ...]) -> str:
    """``text`` without its longest suffix that may still begin a stop: what a stream may show
    before the request finishes (the rest may turn out to be a stop, trimmed at the end)."""
    cut = max((s.hold(text) for s in stops), default=0)
    return text[: len(text) - cut] if cut else text


def hold_back_stops(text: str, stops: tuple[str, ...]) -> str:
    """:func:`hold_back` for stop strings."""
    return hold_back(text, (stop_strings(stops),)) if stops else text


class ScanState(NamedTuple):
    """Where a request's text scan stands. Offsets count output tokens: ``n`` tokens were fed;
    the decode window is ``[prefix, n)``, the text of ``[prefix, read)`` is final, and the
    first ``fed`` characters of the window's text went to the stops."""

    n: int
    prefix: int
    read: int
    fed: int
    states: tuple[Any, ...]

    @staticmethod
    def start(stops: tuple[TextStop, ...]) -> ScanState:
        return ScanState(0, 0, 0, 0, tuple(s.start() for s in stops))


def advance(tokenizer: Any, stops: tuple[TextStop, ...], state: ScanState,
            ids: Callable[[int, int], list[int]]) -> tuple[ScanState, Hit | None]:
    """Feed output token ``state.n``; ``ids(a, b)`` gives output ids ``[a, b)`` (only the
    window is read). The text it makes final goes to every stop; a trailing run of U+FFFD (a
    multi-byte character cut by the token boundary, or bytes that are not UTF-8) is not final
    yet but is checked as the decoder shows it now, so a stop fires at the first token whose
    ``decode(output_ids)`` contains it. The hit is the one ending earliest (the longest of
    those ending there), or None."""
    n = state.n + 1
    prefix, read, fed, states = state.prefix, state.read, state.fed, state.states
    text = tokenizer.decode(ids(prefix, n))
    stable = len(text.rstrip("\ufffd"))
    final = stable == len(text) or n - prefix > MAX_WINDOW
    end = len(text) if final else stable
    hit = None
    if end > fed:
        states, hit = _feed(stops, states, text[fed:end])
        fed = end
    if hit is None and len(text) > max(fed, end):  # the tail as it reads now, not kept
        _, hit = _feed(stops, states, text[max(fed, end):])
    if final:  # the window's text is final: slide it (vLLM's prefix/read offsets)
        prefix, read = read, n
        fed = len(tokenizer.decode(ids(prefix, read)))
    return ScanState(n, prefix, read, fed, states), hit


def _feed(stops: tuple[TextStop, ...], states: tuple[Any, ...],
          piece: str) -> tuple[tuple[Any, ...], Hit | None]:
    """Every stop fed ``piece``: their new states and the earliest (then longest) hit."""
    new_states, hit = [], None
    for stop, st in zip(stops, states, strict=True):
        st, h = stop.feed(st, piece)
        new_states.append(st)
        if h is not None and (hit is None or h.end < hit.end or
                              (h.end == hit.end and len(h.stop) > len(hit.stop))):
            hit = h
    return tuple(new_states), hit


# -- stop_regex (the patterns' limits and validation: workbench/stop_regex.py) ----------------
class StopRegex:
    """The :class:`TextStop` of a request's ``stop_regex`` patterns.
    State: ``(window, total)``, the last :data:`WINDOW_CHARS` + :data:`CONTEXT_CHARS`
    characters of the text fed so far and how many were fed."""

    def __init__(self, patterns: tuple[str, ...]) -> None:
        check_patterns(patterns)
        self.patterns = patterns
        self.programs = [compile_pattern(p) for p in patterns]
        # upstream trims at text.find(pattern): what a stream holds back is what may begin it
        self._literal = stop_strings(patterns)

    def start(self) -> tuple[str, int]:
        return "", 0

    def feed(self, state: tuple[str, int], piece: str) -> tuple[tuple[str, int], Any]:
        window, total = state
        text = window + piece
        total += len(piece)
        # the window's first CONTEXT_CHARS characters are context only, unless the whole text
        # is in it (then ^ and \b at the start are the text's own)
        pos = 0 if total <= len(text) else min(CONTEXT_CHARS, len(window))
        hit = None
        base = len(text) - len(piece)
        for pattern, prog in zip(self.patterns, self.programs, strict=True):
            m = prog.search(text, pos)
            if m is not None:
                end = max(1, m.end() - base)
                if hit is None or end < hit.end:
                    hit = Hit(end, pattern)
        keep = WINDOW_CHARS + CONTEXT_CHARS
        return (text[-keep:] if len(text) > keep else text, total), hit

    def hold(self, text: str) -> int:
        return int(self._literal.hold(text))


# matchers kept for reuse, each charged its programs' worst case (they keep them alive)
stop_regexes: BudgetCache[tuple[str, ...], StopRegex] = BudgetCache(
    StopRegex, lambda patterns: len(patterns) * MAX_PROGRAM_BYTES, PROGRAM_CACHE_BYTES)
