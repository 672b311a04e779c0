"""Speculation policies: per step, speculate (and how much) or decode plainly.

A policy only chooses *whether/how much* to draft; verification keeps outputs identical to
plain decoding either way, so flipping policies never changes greedy outputs.

Each step the engine calls ``decide(PolicyContext)`` once for the running decode batch (requests
still in prefill do not count), runs the step, then calls ``observe(decision, measured_ms,
accepted)`` with the whole step's wall time and, per speculating request, the number of draft
tokens it accepted (bonus excluded; empty on plain steps).

* ``Always`` / ``Never``: the EAGLE-3 and K=0 arms.
* ``BatchThreshold(n)``: SGLang's ``speculative_disable_batch_threshold`` style cut-off;
  ``BatchThreshold.from_cost_model`` puts n where this machine's cost model crosses over.
* ``StepTable``: SGLang/vLLM-style tiers, one (S, K, N) or off per decode-batch range.
* ``RandomFlip``: on/off at random every step (losslessness and stress tests).
* ``Goodput`` (in :mod:`workbench.policy.goodput`): per step, the (S, K, N) or off that
  maximises expected tokens/s under a measured cost model and online per-depth acceptance
  estimates (with hysteresis and probing).
* ``RecordingPolicy``: wraps any of them and records every step (batch, decision, ms, accepted).
"""

from __future__ import annotations

import bisect
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

from workbench.errors import ConfigError

if TYPE_CHECKING:
    from workbench.policy.costmodel import CostModel, Crossover

Shape = tuple[int, int, int]  # (S draft steps, K top-k, N verified nodes incl. the root)


@dataclass(frozen=True)
class PolicyContext:
    """What a policy sees each step. ``num_steps/topk/num_draft_tokens`` are the SpecConfig's.

    ``context_tokens`` is the mean KV length of the decode requests and ``draft_state`` the
    SpecConfig's warm/cold setting; both have defaults so an engine that does not pass them
    still works (cost predictions then ignore context length and assume a warm draft).
    """

    step: int
    decode_batch: int  # running requests in decode (prefilling requests do not count)
    num_steps: int
    topk: int
    num_draft_tokens: int
    context_tokens: int = 0
    draft_state: str = "warm"

    @property
    def shape(self) -> Shape:
        return (self.num_steps, self.topk, self.num_draft_tokens)


@dataclass(frozen=True)
class Decision:
    """speculate=False is one plain decode step; otherwise draft a tree of (S, K, N)."""

    speculate: bool
    num_steps: int = 0
    topk: int = 0
    num_draft_tokens: int = 0
    reason: str = ""
    predicted_ms: float = float("nan")

    @property
    def shape(self) -> Shape | None:
        return (self.num_steps, self.topk, self.num_draft_tokens) if self.speculate else None


class Policy(Protocol):
    def decide(self, ctx: PolicyContext) -> Decision: ...

    def observe(self, decision: Decision, measured_ms: float, accepted: list[int]) -> None: ...


@dataclass(frozen=True)
class StepRecord:
    """One observed step: the decode batch (and mean context) it was decided for, the decision
    as observed (a "ran plain" one when the engine decoded plainly), its measured wall ms and
    the draft tokens each speculating request accepted (bonus excluded)."""

    batch: int
    decision: Decision
    ms: float
    accepted: tuple[int, ...]
    context: int = 0


class RecordingPolicy:
    """Wraps a policy: decides and learns exactly as ``inner`` does, and keeps one
    :class:`StepRecord` per observed step in ``rows`` (cost-model calibration and the
    concurrency bench read their steps from it)."""

    def __init__(self, inner: Policy) -> None:
        self.inner = inner
        self.rows: list[StepRecord] = []
        self._ctx: PolicyContext | None = None

    def __repr__(self) -> str:
        return f"RecordingPolicy({self.inner!r})"

    def decide(self, ctx: PolicyContext) -> Decision:
        self._ctx = ctx
        return self.inner.decide(ctx)

    def observe(self, decision: Decision, measured_ms: float, accepted: list[int]) -> None:
        ctx = self._ctx
        self.rows.append(StepRecord(ctx.decode_batch if ctx else 0, decision, measured_ms,
                                    tuple(accepted), ctx.context_tokens if ctx else 0))
        self.inner.observe(decision, measured_ms, accepted)


def max_draft_tokens(num_steps: int, topk: int) -> int:
    """The most tree nodes a draft of ``num_steps`` expansions of the top-``topk`` frontier can
    offer, root included: k children per step, k·s + 1 (SpecConfig and policy shapes)."""
    return topk * num_steps + 1


def tree_shape_problem(num_steps: int, topk: int, num_draft_tokens: int,
                       n_name: str = "") -> str | None:
    """The tree-shape rule an (S, K, N) breaks, in words (``None`` when it breaks none): a
    chain (topk=1) verifies exactly S+1 nodes; a tree at most :func:`max_draft_tokens`.
    SpecConfig and the policies' candidate shapes both check it; ``n_name`` names N in the
    budget message when the caller's field does not."""
    s, k, n = num_steps, topk, num_draft_tokens
    if k == 1 and n != s + 1:
        return f"topk=1 (chain) forces num_draft_tokens = num_steps + 1 = {s + 1}, got {n}"
    if n > max_draft_tokens(s, k):
        return f"{n_name}{n} > topk·num_steps+1 = {max_draft_tokens(s, k)}"
    return None


def check_shape(shape: Sequence[int], where: str) -> Shape:
    """Validate one (S, K, N) with SpecConfig's rules; errors name ``where``."""
    if len(shape) != 3 or not all(isinstance(v, int) and not isinstance(v, bool) for v in shape):
        raise ConfigError(f"{where}: expected (num_steps, topk, num_draft_tokens) integers, "
                          f"got {shape!r}")
    s, k, n = shape
    if s < 1 or k < 1 or n < 2:
        raise ConfigError(f"{where}: need num_steps >= 1, topk >= 1, num_draft_tokens >= 2, "
                          f"got {shape!r}")
    problem = tree_shape_problem(s, k, n, n_name="num_draft_tokens ")
    if problem:
        raise ConfigError(f"{where}: {problem}")
    return (s, k, n)


def spec_decision(shape: Shape, reason: str, predicted_ms: float = float("nan")) -> Decision:
    return Decision(True, *shape, reason=reason, predicted_ms=predicted_ms)


def shape_name(shape: Shape | None) -> str:
    return "off" if shape is None else "S{}K{}N{}".format(*shape)


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
    """No drafting when the running decode batch is > n (``spec_disable_batch_threshold``).

    ``n = 0`` never speculates (a decode batch is at least 1). Where speculation stops paying
    depends on the machine: :meth:`from_cost_model` takes n from a cost model calibrated on it
    (``basis`` then says why; it is not part of the policy's identity). ``n="auto"`` leaves it
    to the engine: ``Engine.set_spec`` (so ``generate``/``stream``) replaces it by
    ``from_cost_model`` on this machine's cached cost model and a measured τ
    (``workbench.engine.policy_init``; stage ``policy_costmodel``, ``Engine.choices["policy"]``).
    """

    n: int | Literal["auto"]
    basis: Crossover | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.n == "auto":
            return
        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 0:
            raise ConfigError(f"BatchThreshold.n: must be an integer >= 0 or 'auto', got "
                              f"{self.n!r}")

    @property
    def needs_engine(self) -> bool:
        """True for ``n="auto"``: the engine resolves it before the first step."""
        return self.n == "auto"

    @classmethod
    def from_cost_model(cls, cost_model: CostModel, shape: Sequence[int], tau: float, *,
                        context: float = 0.0, draft_state: str = "auto",
                        max_batch: int = 1024) -> BatchThreshold:
        """n = the crossover the cost model predicts, less one (``CostModel.crossover``): the
        largest decode batch up to which speculating at ``shape`` with accept length ``tau``
        beats plain decoding at every batch. Plain steps are priced without the draft extend
        unless ``draft_state`` is "warm" (auto and cold drafts go cold in long off stretches,
        which is where a threshold leaves them). Deterministic given the cost model."""
        if draft_state not in ("warm", "cold", "auto"):
            raise ConfigError(f"BatchThreshold.from_cost_model: draft_state {draft_state!r} "
                              "not warm/cold/auto")
        cross = cost_model.crossover(check_shape(tuple(shape), "BatchThreshold.from_cost_model"),
                                     tau, context=context, warm=draft_state == "warm",
                                     max_batch=max_batch)
        return cls(cross.n, basis=cross)

    def decide(self, ctx: PolicyContext) -> Decision:
        if self.n == "auto":
            raise ConfigError("BatchThreshold.n: 'auto' is resolved by an engine (Engine.set_spec"
                              " / generate); outside one use BatchThreshold.from_cost_model")
        if ctx.decode_batch > self.n:
            return Decision(False, reason=f"decode batch {ctx.decode_batch} > {self.n}")
        return Decision(True, ctx.num_steps, ctx.topk, ctx.num_draft_tokens,
                        f"decode batch {ctx.decode_batch} <= {self.n}")


@dataclass(frozen=True)
class StepTable(_Stateless):
    """Tiers by decode batch size (SGLang/vLLM style): ``{(lo, hi): (S, K, N) or None}``.

    Ranges are inclusive; ``hi`` may be ``None`` or ``math.inf`` (open-ended). The tiers must
    not overlap and must cover 1..inf (a gap raises ConfigError naming it); None = off.
    Example: ``StepTable({(1, 4): (5, 4, 16), (5, 16): (3, 1, 4), (17, None): None})``.
    """

    tiers: Mapping[Any, Sequence[int] | None]  # (lo, hi) → shape; hi None or inf: open
    _rows: tuple[tuple[int, float, Shape | None], ...] = field(init=False, repr=False,
                                                                compare=False)
    _los: tuple[int, ...] = field(init=False, repr=False, compare=False)  # each tier's lo

    def __post_init__(self) -> None:
        if not isinstance(self.tiers, Mapping) or not self.tiers:
            raise ConfigError("StepTable.tiers: expected a non-empty {(lo, hi): shape} mapping")
        rows: list[tuple[int, float, Shape | None]] = []
        for key, val in self.tiers.items():
            if not isinstance(key, tuple) or len(key) != 2:
                raise ConfigError(f"StepTable.tiers: key {key!r} is not a (lo, hi) pair")
            lo, hi = key
            hi_f = math.inf if hi is None else hi
            if not isinstance(lo, int) or isinstance(lo, bool) or lo < 1:
                raise ConfigError(f"StepTable.tiers: tier {key!r}: lo must be an integer >= 1")
            if not (hi_f == math.inf or (isinstance(hi_f, int) and not isinstance(hi_f, bool))) \
                    or hi_f < lo:
                raise ConfigError(f"StepTable.tiers: tier {key!r}: hi must be an integer >= lo, "
                                  "None or math.inf")
            shape = None if val is None else check_shape(tuple(val), f"StepTable tier {key!r}")
            rows.append((lo, hi_f, shape))
        rows.sort(key=lambda r: r[0])
        if rows[0][0] > 1:
            raise ConfigError(f"StepTable.tiers: gap: decode batch 1..{rows[0][0] - 1} is not "
                              "covered")
        for (lo0, hi0, _), (lo1, hi1, _) in zip(rows, rows[1:], strict=False):
            if lo1 <= hi0:
                raise ConfigError(f"StepTable.tiers: overlap: ({lo0}, {_fmt(hi0)}) and "
                                  f"({lo1}, {_fmt(hi1)})")
            if lo1 > hi0 + 1:
                raise ConfigError(f"StepTable.tiers: gap: decode batch {int(hi0) + 1}..{lo1 - 1} "
                                  "is not covered")
        if rows[-1][1] != math.inf:
            raise ConfigError(f"StepTable.tiers: gap: decode batch {int(rows[-1][1]) + 1}..inf is "
                              "not covered (use hi=None for the last tier)")
        object.__setattr__(self, "_rows", tuple(rows))
        object.__setattr__(self, "_los", tuple(r[0] for r in rows))

    def _tier(self, decode_batch: int) -> tuple[int, float, Shape | None]:
        return self._rows[bisect.bisect_right(self._los, max(decode_batch, 1)) - 1]

    def lookup(self, decode_batch: int) -> Shape | None:
        """The tier's shape for this batch size (None = off)."""
        return self._tier(decode_batch)[2]

    def decide(self, ctx: PolicyContext) -> Decision:
        lo, hi, shape = self._tier(ctx.decode_batch)
        why = f"decode batch {ctx.decode_batch} in tier {lo}..{_fmt(hi)}"
        return Decision(False, reason=why) if shape is None else spec_decision(shape, why)


def _fmt(hi: float) -> str:
    return "inf" if hi == math.inf else str(int(hi))


class RandomFlip:
    """Speculate with probability ``p`` each step, independently (seeded).

    For losslessness tests and stress: every step is a potential on/off switch, which
    exercises warm/cold draft catch-up. With ``shapes`` the speculative steps also pick a random
    (S, K, N) from them (varying tree shapes step to step); otherwise the SpecConfig's.
    """

    def __init__(self, p: float = 0.5, seed: int = 0, shapes: Sequence[Sequence[int]] = ()) -> None:
        if not isinstance(p, (int, float)) or not 0.0 <= p <= 1.0:
            raise ConfigError(f"RandomFlip.p: must be in [0, 1], got {p!r}")
        self.p = float(p)
        self.seed = seed
        self.shapes = tuple(check_shape(tuple(s), "RandomFlip.shapes") for s in shapes)
        self.rng = random.Random(seed)
        self.steps = self.spec_steps = self.flips = 0
        self._last: bool | None = None

    def __repr__(self) -> str:
        return f"RandomFlip(p={self.p}, seed={self.seed}, shapes={self.shapes})"

    def reset(self) -> None:
        """Reseed and zero the counters (same sequence of decisions again)."""
        self.rng = random.Random(self.seed)
        self.steps = self.spec_steps = self.flips = 0
        self._last = None

    def decide(self, ctx: PolicyContext) -> Decision:
        on = self.rng.random() < self.p
        self.steps += 1
        self.flips += int(self._last is not None and on != self._last)
        self._last = on
        if not on:
            return Decision(False, reason="random off")
        self.spec_steps += 1
        shape = self.rng.choice(self.shapes) if self.shapes else ctx.shape
        return spec_decision(shape, "random on")

    def observe(self, decision: Decision, measured_ms: float, accepted: list[int]) -> None:
        """Nothing to learn."""


def depth_rates(accepted: Sequence[int], depth: int) -> list[float]:
    """Per-depth acceptance of one batch of speculating requests (draft tokens each accepted):
    a_d = #(m >= d) / #(m >= d−1) for d = 1..``depth``, stopping at the first depth no request
    reached."""
    out: list[float] = []
    for d in range(1, depth + 1):
        reached = sum(1 for m in accepted if m >= d - 1)
        if not reached:
            break
        out.append(sum(1 for m in accepted if m >= d) / reached)
    return out
