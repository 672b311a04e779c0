"""``stop_regex`` (SGLang 0.5.23's sampling parameter): a request stops at the token after which
its output text contains a match of one of its patterns.

Bounded cost, whatever the pattern (a hostile pattern costs its own request a little, never the
server):

- **a linear-time engine**: patterns are compiled with RE2 (``google-re2``), which never
  backtracks: a search costs O(pattern × text) at worst, where Python's ``re`` can take
  exponential time (``(a+)+b``). RE2 refuses what it cannot do in linear time (backreferences,
  lookaround): such a pattern is a ``RequestError`` naming ``stop_regex`` (a 400 over HTTP);
- **bounded patterns**: at most :data:`MAX_PATTERNS` patterns of at most :data:`MAX_PATTERN_BYTES`
  UTF-8 bytes each (SGLang's own limits), compiled within :data:`MAX_PROGRAM_BYTES` of memory; a
  pattern that matches the empty string (it would stop every request at its first token) is
  refused too;
- **a bounded window**: each token searches only the last :data:`WINDOW_CHARS` characters of the
  output (plus the token's own text), so a token costs O(window) however long the output grows.
  A match must fit in that window (SGLang likewise searches a tail of the output).

This module holds the patterns' limits and their validation (``SamplingParams`` checks a request's
patterns with it, so it sits below the config). Matching is a
:class:`~workbench.engine.stops.TextStop` (``StopRegex``) fed each token's text by the incremental
scan of :mod:`workbench.engine.stops`: the state is the window itself (an immutable string), so a
block of accepted draft tokens stops exactly where plain decoding of the same tokens stops
(lossless, like stop strings). As upstream, the finish reason's ``matched`` is the pattern and
the text is not cut at the match: SGLang's detokenizer trims at ``text.find(matched)``, which
only a pattern that occurs literally in the text can hit; the same rule applies here
(``OutputProcessor.text_of``), and a stream holds back a suffix that may begin that literal.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any, Generic, TypeVar

from workbench.errors import RequestError

MAX_PATTERNS = 32
MAX_PATTERN_BYTES = 256
MAX_PROGRAM_BYTES = 1 << 20
WINDOW_CHARS = 512
CONTEXT_CHARS = 8  # characters before the window an assertion (\b, ^) may look at
# compiled programs kept for reuse, each charged its worst case (RE2's max_mem: the program
# and the DFA states a search may add): 32 programs; a server's memory stays flat whatever
# patterns its clients send (an entry count alone let 1,024 grow without a byte bound)
PROGRAM_CACHE_BYTES = 32 << 20

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class BudgetCache(Generic[K, V]):
    """A least-recently-used cache bounded by bytes, not entries: ``build(key)`` makes a value,
    ``cost(key)`` bounds the bytes it holds; entries are dropped oldest first while the total
    is over ``budget`` (a value costing more than the budget is built and not kept). Errors
    from ``build`` are raised, never cached. Thread-safe (the HTTP front end validates, the
    engine loop matches)."""

    def __init__(self, build: Callable[[K], V], cost: Callable[[K], int], budget: int) -> None:
        self._build, self._cost, self.budget = build, cost, budget
        self._entries: OrderedDict[K, tuple[V, int]] = OrderedDict()
        self.nbytes = 0
        self._lock = threading.Lock()

    def __call__(self, key: K) -> V:
        with self._lock:
            hit = self._entries.get(key)
            if hit is not None:
                self._entries.move_to_end(key)
                return hit[0]
        value = self._build(key)
        cost = self._cost(key)
        if cost > self.budget:
            return value
        with self._lock:
            if key not in self._entries:
                self._entries[key] = (value, cost)
                self.nbytes += cost
            while self.nbytes > self.budget:
                _, (_, c) = self._entries.popitem(last=False)
                self.nbytes -= c
        return value

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.nbytes = 0


def _re2() -> Any:
    try:
        import re2
    except ImportError:
        raise RequestError("stop_regex: needs the google-re2 package (pip install "
                           "google-re2)") from None
    return re2


def _compile(pattern: str) -> Any:
    """The RE2 program of one ``stop_regex`` pattern, or RequestError naming the field."""
    if not isinstance(pattern, str) or not pattern:
        raise RequestError(f"stop_regex: every pattern must be a non-empty string, got "
                           f"{pattern!r}")
    size = len(pattern.encode("utf-8", "surrogatepass"))
    if size > MAX_PATTERN_BYTES:
        raise RequestError(f"stop_regex: a pattern is {size} bytes, over the "
                           f"{MAX_PATTERN_BYTES}-byte limit")
    re2 = _re2()
    opts = re2.Options()
    opts.max_mem = MAX_PROGRAM_BYTES
    opts.log_errors = False
    opts.never_capture = True
    try:
        prog = re2.compile(pattern, options=opts)
    except re2.error as e:
        msg = e.args[0].decode() if e.args and isinstance(e.args[0], bytes) else str(e)
        raise RequestError(f"stop_regex: {pattern!r} is not a pattern RE2 accepts ({msg}); "
                           "RE2 runs in linear time: no backreferences or lookaround, "
                           f"repetitions up to 1000, compiled size up to {MAX_PROGRAM_BYTES} "
                           "bytes") from None
    if prog.search("") is not None:
        raise RequestError(f"stop_regex: {pattern!r} matches the empty string, so it would "
                           "stop every output at its first token")
    return prog


compile_pattern: BudgetCache[str, Any] = BudgetCache(_compile, lambda _: MAX_PROGRAM_BYTES,
                                                     PROGRAM_CACHE_BYTES)
compile_pattern.__doc__ = "The RE2 program of one pattern (cached within PROGRAM_CACHE_BYTES)."


def check_patterns(patterns: tuple[str, ...]) -> None:
    """Validate a request's patterns (count, size, syntax) or raise RequestError."""
    if len(patterns) > MAX_PATTERNS:
        raise RequestError(f"stop_regex: at most {MAX_PATTERNS} patterns, got {len(patterns)}")
    for p in patterns:
        compile_pattern(p)
