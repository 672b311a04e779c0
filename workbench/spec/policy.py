"""Speculation policies: per step, speculate (and how much) or decode plainly.

A policy only chooses *whether/how much* to draft; verification keeps outputs identical to
plain decoding either way, so flipping policies never changes greedy outputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class PolicyContext:
    step: int
    decode_batch: int  # running requests in decode (prefilling requests do not count)
    num_steps: int
    topk: int
    num_draft_tokens: int


@dataclass(frozen=True)
class Decision:
    speculate: bool
    num_steps: int = 0
    topk: int = 0
    num_draft_tokens: int = 0
    reason: str = ""
    predicted_ms: float = float("nan")


class Policy(Protocol):
    def decide(self, ctx: PolicyContext) -> Decision: ...

    def observe(self, decision: Decision, measured_ms: float, accepted: list[int]) -> None: ...


class _Stateless:
    def observe(self, decision: Decision, measured_ms: float, accepted: list[int]) -> None:
        """Stateless policies learn nothing."""


@dataclass(frozen=True)
class Always(_Stateless):
    """Speculate every step with the SpecConfig's (S, K, N)."""

    def decide(self, ctx: PolicyContext) -> Decision:
        return Decision(True, ctx.num_steps, ctx.topk, ctx.num_draft_tokens, "always")


@dataclass(frozen=True)
class Never(_Stateless):
    """Never speculate (the K=0 arm: measures what an idle speculative engine costs)."""

    def decide(self, ctx: PolicyContext) -> Decision:
        return Decision(False, reason="never")


@dataclass(frozen=True)
class BatchThreshold(_Stateless):
    """No drafting when the running decode batch is > n (``spec_disable_batch_threshold``)."""

    n: int

    def __post_init__(self) -> None:
        if not isinstance(self.n, int) or self.n < 0:
            raise ValueError(f"BatchThreshold.n: must be an integer >= 0, got {self.n!r}")

    def decide(self, ctx: PolicyContext) -> Decision:
        if ctx.decode_batch > self.n:
            return Decision(False, reason=f"decode batch {ctx.decode_batch} > {self.n}")
        return Decision(True, ctx.num_steps, ctx.topk, ctx.num_draft_tokens,
                        f"decode batch {ctx.decode_batch} <= {self.n}")
