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
* ``Goodput``: per step, the (S, K, N) or off that maximises expected tokens/s under a measured
  cost model and online per-depth acceptance estimates (with hysteresis and probing).
* ``RecordingPolicy``: wraps any of them and records every step (batch, decision, ms, accepted).
"""

from __future__ import annotations

import bisect
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

from workbench.config import max_draft_tokens
from workbench.errors import ConfigError

if TYPE_CHECKING:
    from workbench.speculative.costmodel import CostModel, Crossover

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


def check_shape(shape: Sequence[int], where: str) -> Shape:
    """Validate one (S, K, N) with SpecConfig's rules; errors name ``where``."""
    if len(shape) != 3 or not all(isinstance(v, int) and not isinstance(v, bool) for v in shape):
        raise ConfigError(f"{where}: expected (num_steps, topk, num_draft_tokens) integers, "
                          f"got {shape!r}")
    s, k, n = shape
    if s < 1 or k < 1 or n < 2:
        raise ConfigError(f"{where}: need num_steps >= 1, topk >= 1, num_draft_tokens >= 2, "
                          f"got {shape!r}")
    if k == 1 and n != s + 1:
        raise ConfigError(f"{where}: topk=1 (chain) forces num_draft_tokens = num_steps + 1 = "
                          f"{s + 1}, got {n}")
    if n > max_draft_tokens(s, k):
        raise ConfigError(f"{where}: num_draft_tokens {n} > topk·num_steps+1 = "
                          f"{max_draft_tokens(s, k)}")
    return (s, k, n)


def _spec(shape: Shape, reason: str, predicted_ms: float = float("nan")) -> Decision:
    return Decision(True, *shape, reason=reason, predicted_ms=predicted_ms)


def _name(shape: Shape | None) -> str:
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

    def lookup(self, decode_batch: int) -> Shape | None:
        """The tier's shape for this batch size (None = off)."""
        i = bisect.bisect_right([r[0] for r in self._rows], max(decode_batch, 1)) - 1
        return self._rows[i][2]

    def decide(self, ctx: PolicyContext) -> Decision:
        i = bisect.bisect_right([r[0] for r in self._rows], max(ctx.decode_batch, 1)) - 1
        lo, hi, shape = self._rows[i]
        why = f"decode batch {ctx.decode_batch} in tier {lo}..{_fmt(hi)}"
        return Decision(False, reason=why) if shape is None else _spec(shape, why)


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
        return _spec(shape, "random on")

    def observe(self, decision: Decision, measured_ms: float, accepted: list[int]) -> None:
        """Nothing to learn."""


PROBE_BACKOFF_MAX = 16
PROBE_CONFIRM_MAX = 8  # follow-up probes per off stretch (each asked for by the last probe)


class Goodput:
    """Per step, the candidate (S, K, N) — or off — that maximises expected tokens/s.

    Expected rate of a candidate at decode batch B: τ·B / spec_step_ms(B, S, K, N), where
    τ = 1 + Σ_{d≤D} Π_{j≤d} a_j, D = min(S, N−1), and a_d is the online (EMA) estimate of
    P(accept depth d | depth d−1 accepted). Off: B / plain_step_ms(B). Times come from
    ``cost_model`` (see ``workbench.speculative.costmodel``), refreshed online from measured steps;
    with a cold draft plain steps are predicted without the draft extend (the one-off catch-up
    at switch-on is not charged: hysteresis keeps switches rare).

    Acceptance estimates are kept per top-K (tree width changes per-depth acceptance; depth
    does not). They start from ``accept_seed`` where given — per-depth rates measured on this
    engine and workload (``costmodel.measure_acceptance(...).seed()``), each counting as
    ``seed_weight`` observations — and at ``prior_accept`` elsewhere (a guess: optimistic by
    default so unexplored shapes get tried). A
    speculating request that accepted m tokens counts a success at depths 1..m and a failure at
    depth m+1 when m < S. Each depth's estimate averages the prior (as one pseudo-observation)
    with the steps' batch rates — a running mean for the first 1/ema steps, then an EMA with
    weight ``ema`` — so a handful of steps overrides the prior and later drift is tracked.

    Hysteresis: the choice changes only after ``min_dwell`` steps in the current one and when
    the new one beats it by more than ``hysteresis`` (a fraction), so noisy timings do not
    thrash. Probing: while off nothing is observed, so after ``probe_every`` consecutive off
    steps one step speculates with the best-rated candidate (reason "probe"); its acceptance
    updates the estimates and, if it recovered, the policy switches back on. Probing bounds the
    cost of a stale "off" to one speculative step in ``probe_every + 1``; 0 disables it. A probe
    that leaves the policy off doubles the interval (up to ``PROBE_BACKOFF_MAX·probe_every``: a
    long busy period pays for few probes, each with a cold-draft catch-up); switching on resets
    it. A policy that starts off probes on its first step (it has measured nothing yet).

    Exploring while on: with several candidates, after ``probe_gap`` steps in one shape one
    step runs the best-rated other shape (reason "explore"), so a candidate whose estimate went
    stale (never run since a noisy dip) is measured again; the same backoff applies.

    Correcting a wrong start: a probe's (or explore's) own acceptance is judged alone (τ from
    that step's per-depth rates, priced by the cost model at its batch). When it says that shape
    beats the current choice (by more than ``hysteresis``) the next step probes it again at
    once instead of backing off — at most ``PROBE_CONFIRM_MAX`` such follow-ups until the choice
    next changes — so a pessimistic start whose probes keep finding high acceptance pulls its
    estimates up within a few steps (each probe averages in; the prior's weight shrinks as
    1/(probes+1)); a probe that finds no gain backs off as above. Worst case a wrong choice
    costs ``PROBE_CONFIRM_MAX`` extra steps per stretch on top of the backed-off probes.
    """

    def __init__(self, cost_model: CostModel | None = None,
                 candidates: Sequence[Sequence[int]] | None = None,
                 ema: float = 0.1, min_dwell: int = 4, hysteresis: float = 0.05,
                 prior_accept: float = 0.7, probe_every: int = 64,
                 accept_seed: Mapping[int, Sequence[float]] | None = None,
                 seed_weight: int = 4) -> None:
        if not 0.0 < ema <= 1.0:
            raise ConfigError(f"Goodput.ema: must be in (0, 1], got {ema!r}")
        if not isinstance(min_dwell, int) or min_dwell < 0:
            raise ConfigError(f"Goodput.min_dwell: must be an integer >= 0, got {min_dwell!r}")
        if not hysteresis >= 0.0:
            raise ConfigError(f"Goodput.hysteresis: must be >= 0, got {hysteresis!r}")
        if not 0.0 <= prior_accept <= 1.0:
            raise ConfigError(f"Goodput.prior_accept: must be in [0, 1], got {prior_accept!r}")
        if not isinstance(probe_every, int) or probe_every < 0:
            raise ConfigError(f"Goodput.probe_every: must be an integer >= 0, got "
                              f"{probe_every!r}")
        if not isinstance(seed_weight, int) or isinstance(seed_weight, bool) or seed_weight < 1:
            raise ConfigError(f"Goodput.seed_weight: must be an integer >= 1, got {seed_weight!r}")
        seed: dict[int, tuple[float, ...]] = {}
        for k, rates in (accept_seed or {}).items():
            if not isinstance(k, int) or isinstance(k, bool) or k < 1:
                raise ConfigError(f"Goodput.accept_seed: key {k!r} is not a top-K >= 1")
            vals = tuple(float(a) for a in rates)
            if not all(0.0 <= a <= 1.0 for a in vals):
                raise ConfigError(f"Goodput.accept_seed[{k}]: rates must be in [0, 1], got "
                                  f"{list(rates)!r}")
            seed[k] = vals
        self.accept_seed = seed
        self.seed_weight = seed_weight
        self.cost_model = cost_model
        self.candidates: tuple[Shape, ...] | None = None if candidates is None else tuple(
            check_shape(tuple(c), f"Goodput.candidates[{i}]") for i, c in enumerate(candidates))
        if self.candidates is not None and not self.candidates:
            raise ConfigError("Goodput.candidates: empty (use None for the SpecConfig's shape)")
        self.ema = ema
        self.min_dwell = min_dwell
        self.hysteresis = hysteresis
        self.prior_accept = prior_accept
        self.probe_every = probe_every
        self.reset()

    @property
    def needs_engine(self) -> bool:
        """True without a cost model: the engine gives it this machine's (and, unless
        ``accept_seed`` was given, the acceptance it measured) before the first step."""
        return self.cost_model is None

    def resolved(self, cost_model: CostModel,
                 accept_seed: Mapping[int, Sequence[float]] | None = None) -> Goodput:
        """A fresh Goodput with the same settings, ``cost_model`` and (where this one has
        none) ``accept_seed``."""
        return Goodput(cost_model, self.candidates, self.ema, self.min_dwell, self.hysteresis,
                       self.prior_accept, self.probe_every, self.accept_seed or accept_seed,
                       self.seed_weight)

    def __repr__(self) -> str:
        return (f"Goodput(candidates={self.candidates}, ema={self.ema}, min_dwell="
                f"{self.min_dwell}, hysteresis={self.hysteresis}, probe_every={self.probe_every})")

    def reset(self) -> None:
        """Forget acceptance estimates and the current choice (the cost model is kept)."""
        # topk → a_d for d = 1.. (index d−1); the measured seed where given
        self.accept: dict[int, list[float]] = {k: list(v) for k, v in self.accept_seed.items()}
        # topk → steps that reached depth d (the prior counts as one observation, so a seeded
        # depth that counts as seed_weight starts at seed_weight − 1)
        self.observed: dict[int, list[int]] = {k: [self.seed_weight - 1] * len(v)
                                               for k, v in self.accept_seed.items()}
        self.current: Shape | None = None
        self.started = False
        self.dwell = 0  # steps spent in the current choice
        self.off_run = self.probe_every  # off decisions since the last probe (start: probe)
        self.probe_gap = self.probe_every  # current probe interval (backs off, see decide)
        self._probed = False
        self._follow_up = False  # the last probe alone says speculating pays: probe again
        self.confirm_run = 0  # follow-up probes since speculation was last on
        self.switches = 0
        self.probes = 0
        self._probe_at: tuple[PolicyContext, float] | None = None  # a probe's ctx, off tok/s
        self._pending: tuple[Decision, float, str] | None = None  # decision, raw ms, kind

    # -- estimates -----------------------------------------------------------------------------
    def acceptance(self, topk: int, depth: int) -> list[float]:
        """Current a_1..a_depth for tree width ``topk`` (prior where never observed)."""
        a = self.accept.setdefault(topk, [])
        while len(a) < depth:
            a.append(self.prior_accept)
        return a[:depth]

    def expected_tau(self, shape: Sequence[int]) -> float:
        """τ = 1 + Σ_d Π_{j≤d} a_j over depths 1..min(S, N−1) (bonus token included)."""
        s, k, n = shape
        tau, p = 1.0, 1.0
        for a in self.acceptance(k, min(s, n - 1)):
            p *= a
            tau += p
        return tau

    def _model(self) -> CostModel:
        if self.cost_model is None:
            raise ConfigError("Goodput.cost_model: None is resolved by an engine (Engine."
                              "set_spec / generate); outside one pass a CostModel")
        return self.cost_model

    def rates(self, ctx: PolicyContext) -> dict[Shape | None, tuple[float, float]]:
        """Option → (expected tokens/s, predicted step ms); None is off."""
        b, c, cm = max(ctx.decode_batch, 1), ctx.context_tokens, self._model()
        out: dict[Shape | None, tuple[float, float]] = {
            None: cm.tok_s(b, None, context=c, warm=ctx.draft_state == "warm")}
        for shape in self.candidates or (ctx.shape,):
            out[shape] = cm.tok_s(b, shape, self.expected_tau(shape), context=c)
        return out

    # -- the policy ----------------------------------------------------------------------------
    def decide(self, ctx: PolicyContext) -> Decision:
        rates = self.rates(ctx)
        best = max(rates, key=lambda o: rates[o][0])  # ties keep the first: off
        cur = self.current
        if not self.started or cur not in rates:
            self._switch(best)
        elif best != cur and self.dwell >= self.min_dwell and \
                rates[best][0] > rates[cur][0] * (1.0 + self.hysteresis):
            self._switch(best)
        else:
            self.dwell += 1
        choice = self.current
        why = f"goodput {_name(choice)} {rates[choice][0]:.0f} tok/s (best {_name(best)})"
        others = [o for o in rates if o is not None and o != choice]
        follow, self._follow_up = self._follow_up, False
        if self._probed and not follow:
            # the last probe did not bring a switch: probe half as often
            self.probe_gap = min(2 * self.probe_gap, PROBE_BACKOFF_MAX * self.probe_every)
        self._probed = False
        self.confirm_run += int(follow)
        self.off_run += 1
        if self.probe_every and others and (follow or self.off_run > self.probe_gap):
            self.off_run = 0
            self.probes += 1
            self._probed = True
            shape = max(others, key=lambda o: rates[o][0])
            what = "probe" if choice is None else "explore"
            why = f"{what}: the last {what}'s acceptance says it pays" if follow else \
                f"{what} after {self.probe_gap} {_name(choice)} steps"
            self._probe_at = (ctx, rates[choice][0])
            return self._remember(_spec(shape, why, rates[shape][1]), ctx)
        if choice is None:
            return self._remember(Decision(False, reason=why, predicted_ms=rates[None][1]), ctx)
        return self._remember(_spec(choice, why, rates[choice][1]), ctx)

    def _switch(self, choice: Shape | None) -> None:
        if self.started and choice != self.current:
            self.switches += 1
            self._follow_up, self.confirm_run = False, 0
        if self.started or choice is not None:
            self.off_run = 0  # a policy that starts off probes at once; one that starts on not
        if choice is not None:
            self.probe_gap, self._probed = self.probe_every, False
        self.started = True
        self.current = choice
        self.dwell = 1

    def _remember(self, d: Decision, ctx: PolicyContext) -> Decision:
        """Keep the unscaled prediction so observe() can refresh the cost model's step scale."""
        kind = "spec" if d.speculate else "plain"
        scale = self._model().scale[kind]
        self._pending = (d, d.predicted_ms / scale if scale > 0 else d.predicted_ms, kind)
        return d

    def observe(self, decision: Decision, measured_ms: float, accepted: list[int]) -> None:
        if self._pending is not None and self._pending[0] is decision:
            _, raw, kind = self._pending
            self._model().observe_step(kind, raw, measured_ms)
        self._pending = None
        probe, self._probe_at = self._probe_at, None
        if decision.speculate and accepted:
            self.update_acceptance(decision.num_steps, decision.topk, accepted)
            if probe is not None and decision.reason.startswith(("probe", "explore")):
                self._judge_probe(decision, accepted, *probe)

    def _judge_probe(self, decision: Decision, accepted: Sequence[int], ctx: PolicyContext,
                     current_tok_s: float) -> None:
        """The probe's own acceptance alone: does its shape beat the current choice?"""
        shape = (decision.num_steps, decision.topk, decision.num_draft_tokens)
        tau, p = 1.0, 1.0
        for rate in depth_rates(accepted, min(shape[0], shape[2] - 1)):
            p *= rate
            tau += p
        spec = self._model().tok_s(max(ctx.decode_batch, 1), shape, tau,
                                     context=ctx.context_tokens)[0]
        self._follow_up = spec > current_tok_s * (1.0 + self.hysteresis) and \
            self.confirm_run < PROBE_CONFIRM_MAX

    def update_acceptance(self, num_steps: int, topk: int, accepted: Sequence[int]) -> None:
        """One step's batch: depth d has reached = #(m >= d−1), successes = #(m >= d)."""
        self.acceptance(topk, num_steps)
        a = self.accept[topk]
        seen = self.observed.setdefault(topk, [])
        while len(seen) < num_steps:
            seen.append(0)
        for d, rate in enumerate(depth_rates(accepted, num_steps), start=1):
            seen[d - 1] += 1
            w = max(self.ema, 1.0 / (seen[d - 1] + 1))  # the prior counts as one observation
            a[d - 1] = (1.0 - w) * a[d - 1] + w * rate


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
