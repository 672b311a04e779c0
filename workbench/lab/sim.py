"""Replay a recorded run at one concurrency: continuous batching under the engine's rules,
real ``Policy`` objects deciding and observing, accepted counts from the recording, step times
from the recorded cost model.

The loop is ``bench concurrency``'s closed loop: ``c`` requests in flight, request i runs
recorded request i mod R (the prompts' order), a new one joins as soon as one finishes
(``max(2c, R)`` requests by default). Each step follows ``Engine._step``:

1. admit waiting requests; prefill chunks within ``max_prefill_tokens`` in running order
   (a request that finishes its prefill emits its first token this step and decodes from the
   next);
2. if any request decodes: ``policy.decide(PolicyContext(step, batch, S, K, N, mean KV
   length, warm/cold))``; speculating requests are the decode requests with more than one
   token left, the others ride in the verify (or the step is plain);
3. a speculating request emits min(m + 1, tokens left), m from :func:`trees.accepted` for the
   decision's shape at its position; ``policy.observe(decision, ms, [m...])`` with the step's
   time less prefill and catch-up, as the engine does; a decision to speculate that nobody
   could follow is observed as a plain one ("; ran plain").

The draft's extend rule is the worker's: ``warm`` extends on every plain step, ``cold`` never,
``auto`` in the first 8 plain steps of an off stretch and only drafts at most
``catchup_window`` behind; a cold draft keeps the last ``catchup_window`` rows, which the next
speculative step catches up. Step times (modelled): prefill = an anchored model's measured
prefill line (of plain or of speculative steps, as the step runs) over the step's chunks
(else target(T, context) + the extends); plain =
``plain_step_ms(B)`` (cold) + draft(rows extended); spec = ``spec_step_ms(n, S, K, N, τ)``
at the n speculating requests' own accept length + the riders' extra target rows + any warm
extend, plus a catch-up draft(rows) — the run's cost model (an anchored one for recordings:
:mod:`workbench.lab.stepfit`), per step with its real counts.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from workbench.policy.costmodel import CostModel
from workbench.policy.policies import Decision, PolicyContext, Shape, shape_name
from workbench.viz.figures.style import MIN_P99_SAMPLES

AUTO_WARM_STEPS = 8  # engine/worker.py: an off stretch keeps the draft warm this many steps
AUTO_CATCHUP_ROWS = 32  # engine/worker.py: auto's cap when catchup_window is None


class Oracle:
    """Hindsight: per step, the candidate shape (or off) that emits the most tokens per
    modelled ms given the acceptance that actually happens there. The simulator asks it with
    every option's (tokens, ms) for the step (:meth:`choose`); it is the upper bound policies
    are scored against. ``candidates`` default to every recorded shape the run can replay."""

    def __init__(self, candidates: Sequence[Shape]) -> None:
        if not candidates:
            raise ValueError("Oracle.candidates: empty")
        self.candidates = tuple(candidates)

    def __repr__(self) -> str:
        return f"Oracle({len(self.candidates)} shapes)"

    def choose(self, evaluate: Callable[[Shape | None], tuple[int, float]]) -> Decision:
        best: Shape | None = None
        t0, ms0 = evaluate(None)
        best_rate = t0 / ms0
        for shape in self.candidates:
            t, ms = evaluate(shape)
            if t / ms > best_rate:
                best, best_rate = shape, t / ms
        if best is None:
            return Decision(False, reason="oracle: off")
        return Decision(True, *best, reason=f"oracle: {shape_name(best)}")

    def observe(self, decision: Decision, measured_ms: float, accepted: list[int]) -> None:
        """Hindsight needs no learning."""


@dataclass
class _Req:
    n: int  # request number
    r: int  # recorded request it replays
    prompt_len: int
    length: int  # output tokens
    off: int  # first tree row
    arrival: float
    prefilled: int = 0
    j: int = -1  # last emitted output token (−1: none yet)
    lag: int = 0  # draft rows behind (features kept, not yet extended)
    first: float = math.nan
    times: list[float] = field(default_factory=list)

    @property
    def kv_len(self) -> int:
        return self.prompt_len + max(self.j, 0)

    @property
    def left(self) -> int:
        return self.length - 1 - self.j


@dataclass
class LevelResult:
    """One policy at one concurrency: the row (tok/s, τ, latencies, spec fraction, ...) and
    the steps (batch, decision shape name, ms, tokens)."""

    row: dict[str, Any]
    steps: list[tuple[int, str, float, int]]
    accepted: list[tuple[float, list[int]]]  # per speculative step: (mean context, m each)


class Simulator:
    """See the module doc. ``run``: a :class:`~workbench.lab.record.RecordedRun` (exact
    acceptance) or a :class:`~workbench.lab.boxreplay.BoxRun` (modelled): ``prompt_lens``,
    ``output_lens``, ``row_offsets()`` and ``accept_table(shape)``. ``cost`` prices steps (a
    copy: policies keep their own); ``spec_shape`` is the SpecConfig's (S, K, N) the context
    reports."""

    def __init__(self, run: Any, cost: CostModel, spec_shape: Shape,
                 draft_state: str = "auto", catchup_window: int | None = 32,
                 max_prefill_tokens: int = 1024, max_batch: int = 64) -> None:
        self.run, self.cost = run, cost.copy()
        self.shape = spec_shape
        self.draft_state, self.window = draft_state, catchup_window
        self.max_prefill, self.max_batch = max_prefill_tokens, max_batch
        self.offsets = run.row_offsets()
        # a measured prefill line (an anchored model's): a step's chunks priced together
        has_line = bool(getattr(cost, "anchors", {}).get("prefill"))
        self.line: Callable[..., float] | None = \
            self.cost.prefill_ms if has_line else None  # type: ignore[attr-defined]

    # -- the extend rule --------------------------------------------------------------------
    def _warm(self, streak: int) -> bool:
        if self.draft_state == "auto":
            return streak < AUTO_WARM_STEPS
        return self.draft_state == "warm"

    def _extendable(self, q: _Req, streak: int) -> bool:
        """Does a step that does not speculate extend this draft now?"""
        if not self._warm(streak):
            return False
        return self.draft_state != "auto" or q.lag <= (self.window or AUTO_CATCHUP_ROWS)

    # -- one level --------------------------------------------------------------------------
    def run_level(self, policy: Any, concurrency: int,
                  num_requests: int | None = None, spec: bool = True) -> LevelResult:
        """Replay ``policy`` at ``concurrency`` (``spec=False``: a baseline engine, no draft)."""
        run, cm = self.run, self.cost
        n_total = num_requests or max(2 * concurrency, len(run.prompt_lens))
        s0, k0, n0 = self.shape
        live: list[_Req] = []
        done: list[_Req] = []
        clock = 0.0
        nxt = step_id = streak = 0
        steps: list[tuple[int, str, float, int]] = []
        emitted: list[int] = []  # tokens per speculating request-step
        acc_log: list[tuple[float, list[int]]] = []
        while nxt < n_total or live:
            while nxt < n_total and len(live) < min(concurrency, self.max_batch):
                r = nxt % len(run.prompt_lens)
                live.append(_Req(nxt, r, run.prompt_lens[r], run.output_lens[r],
                                 self.offsets[r], clock))
                nxt += 1
            step_id += 1
            decode = [q for q in live if q.j >= 0]
            ms_prefill, budget, fresh = 0.0, self.max_prefill, []
            for q in live:
                if q.j < 0 and budget > 0:
                    t = min(q.prompt_len - q.prefilled, budget)
                    if self.line is None:
                        ms_prefill += cm.target_ms(t, q.prefilled + t / 2)
                    q.prefilled += t
                    budget -= t
                    if q.prefilled == q.prompt_len:
                        fresh.append(q)
            for q in fresh:  # first token; the prefill's extend per the rule
                q.j, q.lag = 0, q.prompt_len
                if spec and self._extendable(q, streak):
                    if self.line is None:
                        ms_prefill += cm.draft_ms(q.lag, q.prompt_len / 2)
                    q.lag = 0
            ms, tokens, mode = 0.0, len(fresh), "prefill"
            catchup = 0.0
            if decode:
                b = len(decode)
                ctx = sum(q.kv_len for q in decode) / b
                warm = self._warm(streak)
                pctx = PolicyContext(step_id, b, s0, k0, n0, context_tokens=int(ctx),
                                     draft_state="warm" if warm else "cold")
                if not spec:
                    d = Decision(False, reason="no spec")
                elif isinstance(policy, Oracle):
                    d = policy.choose(functools.partial(self._option, decode, ctx, streak))
                else:
                    d = policy.decide(pctx)
                specs = [q for q in decode if q.left > 1] if d.speculate else []
                if specs:
                    m = run.accept_table(d.shape)
                    ms_steps = [int(m[q.off + q.j]) for q in specs]
                    catchup = cm.draft_ms(sum(q.lag for q in specs), ctx) \
                        if any(q.lag for q in specs) else 0.0
                    step_tokens, ms = self._price(decode, d.shape, ctx, streak)[:2]
                    ms -= catchup  # priced apart: the policy does not observe it
                    ride = [q for q in decode if q.left <= 1]
                    for q, mm in zip(specs, ms_steps, strict=True):
                        e = min(mm + 1, q.left)
                        emitted.append(e)
                        q.j += e
                        q.lag = 0
                    self._plain_rows(ride, streak, spec)
                    streak, mode, tokens = 0, "spec", tokens + step_tokens
                    acc_log.append((ctx, ms_steps))
                    policy.observe(d, ms, ms_steps)
                else:
                    if d.speculate:
                        d = Decision(False, reason=f"{d.reason}; ran plain")
                    ms = self._price(decode, None, ctx, streak)[1] if spec else \
                        cm.plain_step_ms(b, ctx, warm=False)
                    self._plain_rows(decode, streak, spec)
                    streak, mode, tokens = streak + 1, "plain", tokens + b
                    if spec:
                        policy.observe(d, ms, [])
                steps.append((b, shape_name(d.shape) if mode == "spec" else "off",
                              ms + catchup, tokens))
            if self.line is not None and budget < self.max_prefill:  # the extends included
                ms_prefill = self.line(self.max_prefill - budget, spec=mode == "spec")
            clock += ms_prefill + ms + catchup
            for q in fresh:
                q.first = clock
                q.times.append(clock)
            for q in decode:
                q.times.append(clock)
            for q in [q for q in live if q.j >= q.length - 1]:
                live.remove(q)
                done.append(q)
        return LevelResult(self._row(concurrency, done, clock, steps, emitted), steps, acc_log)

    def _plain_rows(self, reqs: list[_Req], streak: int, spec: bool) -> None:
        """Each plain row emits one token; its draft extends per the rule (cost in _price)."""
        for q in reqs:
            q.j += 1
            if not spec:
                continue
            q.lag += 1
            if self._extendable(q, streak):
                q.lag = 0
            elif self.window is not None:
                q.lag = min(q.lag, self.window)  # older features become holes

    def _option(self, decode: list[_Req], ctx: float, streak: int,
                shape: Shape | None) -> tuple[int, float]:
        """(tokens, ms) of one option for the oracle."""
        return self._price(decode, shape, ctx, streak)[:2]

    def _price(self, decode: list[_Req], shape: Shape | None, ctx: float,
               streak: int) -> tuple[int, float, float]:
        """(tokens emitted, step ms incl. catch-up, catch-up ms) of running ``shape`` (None:
        plain) on ``decode`` now; the acceptance is the recorded one. The step is the cost
        model's plain / speculative step (at the speculating requests' own accept length),
        plus the riders' rows in the verify and any warm extend, plus a cold catch-up."""
        cm, b = self.cost, len(decode)
        specs = [q for q in decode if q.left > 1] if shape is not None else []
        ride = [q for q in decode if q not in specs] if specs else decode
        ext = sum(q.lag + 1 for q in ride if self._extendable(q, streak))
        extend = cm.draft_ms(ext, ctx) if ext else 0.0
        if not specs:
            return b, cm.plain_step_ms(b, ctx, warm=False) + extend, 0.0
        s, k, n = shape  # type: ignore[misc]
        m = self.run.accept_table(shape)
        em = [min(int(m[q.off + q.j]) + 1, q.left) for q in specs]
        lag = sum(q.lag for q in specs)
        catchup = cm.draft_ms(lag, ctx) if lag else 0.0
        rows = len(specs) * n
        ms = (cm.spec_step_ms(len(specs), s, k, n, tau=sum(em) / len(specs), context=ctx)
              + (cm.target_ms(rows + len(ride), ctx) - cm.target_ms(rows, ctx) if ride
                 else 0.0) + extend)
        return sum(em) + len(ride), ms + catchup, catchup

    @staticmethod
    def _row(c: int, done: list[_Req], clock: float,
             steps: list[tuple[int, str, float, int]], emitted: list[int]) -> dict[str, Any]:
        tokens = sum(q.length for q in done)
        tpot = [(q.times[-1] - q.first) / (q.length - 1) for q in done if q.length > 1]
        itl = [float(g) for q in done for g in np.diff(q.times) if g > 0]
        spec_steps = sum(1 for st in steps if st[1] != "off")
        return {"concurrency": c, "requests": len(done), "tokens": tokens,
                "seconds": clock / 1e3, "tok_s": 1e3 * tokens / clock if clock else math.nan,
                "tau": float(np.mean(emitted)) if emitted else 1.0,
                "spec_fraction": spec_steps / max(1, len(steps)),
                "decode_steps": len(steps),
                "tpot_n": len(tpot), "itl_n": len(itl),
                "tpot_p50_ms": float(np.percentile(tpot, 50)) if tpot else math.nan,
                "tpot_p99_ms": _p99(tpot), "itl_p50_ms":
                    float(np.percentile(itl, 50)) if itl else math.nan,
                "itl_p99_ms": _p99(itl)}


def _p99(xs: list[float]) -> float:
    """A p99, or NaN from fewer than the project's minimum of samples (below it a p99 is the
    sample's maximum, not a tail estimate)."""
    return float(np.percentile(xs, 99)) if len(xs) >= MIN_P99_SAMPLES else math.nan
