"""``Goodput``: per step, the candidate (S, K, N) — or off — that maximises expected tokens/s
under a measured cost model (:mod:`workbench.policy.costmodel`) and online per-depth
acceptance estimates, with hysteresis, probing while off and exploring while on.

The other policies and the shared nouns (PolicyContext, Decision, shapes) are in
:mod:`workbench.policy.policies`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from workbench.errors import ConfigError
from workbench.policy.policies import (
    Decision,
    PolicyContext,
    Shape,
    check_shape,
    depth_rates,
    shape_name,
    spec_decision,
)

if TYPE_CHECKING:
    from workbench.policy.costmodel import CostModel


def tau_of(rates: Sequence[float]) -> float:
    """Accept length of per-depth acceptance rates a_1..a_d: τ = 1 + Σ_d Π_{j≤d} a_j."""
    tau, p = 1.0, 1.0
    for a in rates:
        p *= a
        tau += p
    return tau


PROBE_BACKOFF_MAX = 16
PROBE_CONFIRM_MAX = 8  # follow-up probes per off stretch (each asked for by the last probe)


class Goodput:
    """Per step, the candidate (S, K, N) — or off — that maximises expected tokens/s.

    Expected rate of a candidate at decode batch B: τ·B / spec_step_ms(B, S, K, N), where
    τ = 1 + Σ_{d≤D} Π_{j≤d} a_j, D = min(S, N−1), and a_d is the online (EMA) estimate of
    P(accept depth d | depth d−1 accepted). Off: B / plain_step_ms(B). Times come from
    ``cost_model`` (see ``workbench.policy.costmodel``), refreshed online from measured steps;
    with a cold draft plain steps are predicted without the draft extend (the one-off catch-up
    at switch-on is not charged: hysteresis keeps switches rare).

    Acceptance estimates are kept per top-K (tree width changes per-depth acceptance; depth
    does not). They start from ``accept_seed`` where given — per-depth rates measured on this
    engine and workload (``engine.calibrate.measure_tau(...).seed()``), each counting as
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
        return tau_of(self.acceptance(k, min(s, n - 1)))

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
        why = f"goodput {shape_name(choice)} {rates[choice][0]:.0f} tok/s (best {shape_name(best)})"
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
                f"{what} after {self.probe_gap} {shape_name(choice)} steps"
            self._probe_at = (ctx, rates[choice][0])
            return self._remember(spec_decision(shape, why, rates[shape][1]), ctx)
        if choice is None:
            return self._remember(Decision(False, reason=why, predicted_ms=rates[None][1]), ctx)
        return self._remember(spec_decision(choice, why, rates[choice][1]), ctx)

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
        tau = tau_of(depth_rates(accepted, min(shape[0], shape[2] - 1)))
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
