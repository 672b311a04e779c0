"""Request latency as the client sees it: from the moment the request's first bytes are read off
the socket to the moment each chunk of its answer is written.

:class:`~workbench.serve.limits.LimitsGuard` gives every HTTP request a :class:`RequestClock`
(in :data:`CLOCK`, so the route and :class:`~workbench.serve.frontend.ServeState` find it)
whose arrival is the time the connection read the request's first bytes
(:mod:`workbench.serve.connections`), and times every body write of the answer. A generation
route says, before it yields each streamed chunk, which choice the chunk carries and through
how many output tokens (:meth:`RequestClock.note`); the write then observes:

- ``sglang:time_to_first_token_seconds``: a streamed choice's first chunk with output tokens,
  written; a non-streamed choice's first token as the engine produced it (its answer is one
  write at the end, the end-to-end latency);
- ``sglang:inter_token_latency_seconds``: per later chunk that carried ``k`` new tokens, the
  time since the choice's previous written chunk divided by ``k``, observed ``k`` times (a
  non-streamed choice: the same over the engine's steps);
- ``sglang:e2e_request_latency_seconds``: arrival to the answer's last byte written (or to the
  moment the connection ended, for a client that left), per choice.

The histograms (:class:`~workbench.serve.sglang_metrics.ServeMetrics`) are observed on the
event loop and rendered on the engine loop, under their lock.
"""

from __future__ import annotations

import contextvars
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from workbench.serve.sglang_metrics import ServeMetrics

CLOCK: contextvars.ContextVar[RequestClock | None] = contextvars.ContextVar(
    "workbench_request_clock", default=None)


class RequestClock:
    """One HTTP request's latency observations (module doc); event loop only."""

    def __init__(self, arrival: float, metrics: ServeMetrics) -> None:
        self.arrival = arrival
        self.metrics = metrics
        self.stream = False
        self.choices: set[int] = set()  # admitted generation choices
        self._noted: dict[int, int] = {}  # choice → output tokens the next write carries through
        self._sent: dict[int, int] = {}  # choice → output tokens written so far
        self._last: dict[int, float] = {}  # choice → when its last tokens were written
        self._closed = False

    def admitted(self, index: int, stream: bool) -> None:
        """Choice ``index`` of this request went to the engine (its latencies count)."""
        self.choices.add(index)
        self.stream = stream

    def note(self, index: int, tokens: int) -> None:
        """The next body write carries choice ``index`` through ``tokens`` output tokens."""
        self._noted[index] = max(tokens, self._noted.get(index, 0))

    def engine_times(self, index: int, first_token: float | None,
                     token_times: list[float]) -> None:
        """A non-streamed choice: its first token and inter-token latencies as the engine
        produced them (``token_times``: one per output token; a step's tokens share one)."""
        if first_token is not None:
            self.metrics.observe_ttft(max(0.0, first_token - self.arrival), self.stream)
        self.metrics.observe_token_times(token_times)

    def written(self, now: float, final: bool) -> None:
        """A body write of the answer completed at ``now`` (``final``: its last)."""
        if self._closed:
            return
        noted, self._noted = self._noted, {}
        for index, tokens in noted.items():
            k = tokens - self._sent.get(index, 0)
            if k <= 0:
                continue
            if index not in self._last:
                self.metrics.observe_ttft(max(0.0, now - self.arrival), True)
            else:
                self.metrics.observe_itl((now - self._last[index]) / k, k)
            self._sent[index] = tokens
            self._last[index] = now
        if final:
            self.close(now)

    def close(self, now: float | None = None) -> None:
        """The answer is written or the connection ended: each choice's end-to-end latency,
        once."""
        if self._closed:
            return
        self._closed = True
        t = time.perf_counter() if now is None else now
        for _ in self.choices:
            self.metrics.observe_e2e(max(0.0, t - self.arrival), self.stream)
