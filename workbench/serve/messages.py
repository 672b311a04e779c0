"""What the engine loop and its front ends say to each other (:mod:`workbench.serve.loop`):
the sink a request's answers go to, the loop's answers (:class:`Admitted`, :class:`Rejected`,
:class:`Chunk`), the loop's record of a submitted request (:class:`Ticket`) and the refusals
(:class:`LoopClosed`, :class:`QueueFull`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

from workbench.config import SamplingParams
from workbench.core import LogprobParams, RequestOutput


class Sink(Protocol):
    """Where the loop sends a request's messages; ``put`` must be thread-safe and never block.
    A sink may offer ``unread() -> int`` (messages not taken yet): backpressure reads it."""

    def put(self, item: object) -> None: ...


@dataclass(frozen=True)
class Admitted:
    """The engine queued the request as ``rid``; its prompt has ``prompt_tokens`` tokens."""

    rid: int
    prompt_tokens: int


@dataclass(frozen=True)
class Rejected:
    """The engine refused the request; ``message`` names the field ("prompt: ...")."""

    message: str
    status: int = 400


@dataclass(frozen=True)
class Chunk:
    """A request's cumulative output after a step. Final chunks carry the engine's output."""

    token_ids: list[int]
    text: str
    num_draft_tokens: int  # the engine's SpecConfig N when the chunk was made; 0: no spec
    finished: bool
    finish_reason: str | None = None
    error: str | None = None
    output: RequestOutput | None = None
    matched_stop: int | str | None = None  # finish_reason "stop": the token id or string
    internal: bool = False  # the error is an engine failure, not this request's own numbers


@dataclass(eq=False)
class Ticket:
    """One submitted request, as the loop tracks it. ``rid`` is set once admitted."""

    prompt: str | list[int]
    sampling: SamplingParams
    sink: Sink
    stream: bool
    rid: int | None = None
    done: bool = False
    submitted: float = field(default_factory=time.perf_counter)
    logprobs: LogprobParams | None = None
    share: str = "single"  # the queue share it counts against (EngineLoop.SHARES)
    group: object = None  # the HTTP request it is one choice of (None: a request of its own)


class LoopClosed(RuntimeError):
    """The loop is stopped or its engine failed; no new work is accepted."""


class QueueFull(RuntimeError):
    """``max_pending`` requests are already submitted and not finished; retry later."""
