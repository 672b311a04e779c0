"""The recording's step-time model: whole steps measured on the recorded prompts, the
component model (``calibrate``'s forward costs on scratch KV) only for what differs.

What a replay prices is what a closed loop pays: every ``advance`` of ``bench concurrency``'s
loop (admission, ``engine.step()``, collecting finished requests), steps with prefill chunks
included. So the anchors (:class:`AnchoredCostModel`) are measured by the same loop: closed
loops on the recorded prompts at batch c = 1, 4, 16 (2c requests, the run's output length),
one arm per mode (``never``: plain steps, cold after 8; ``always`` at the recorded shape, its
chain and a 3-step chain; ``baseline`` beside them), and

* a plain / speculative step at batch b = the *mean* whole advance at the full batch without a
  prefill chunk (throughput is total time: a median left out the tail the runs pay; a sample
  over 5× the median, a preemption, is dropped and counted);
* a step with prefill chunks = its decode part (the anchors above, at its decode batch) + a
  line in the prefill tokens fitted to those steps' excess (``prefill``: a + b·tokens; one
  for steps whose decode part is plain or absent, one for speculative ones, where the chunks
  share the tree-masked verify: on the idle EPYC the bench's p99 gap between tokens at c=16
  was 424 ms for ``always``, 140 for ``never``; the draft's extend of the new prompts is in
  both).

With ``engines`` (one per arm, as ``bench concurrency`` gives every arm its own engine) the
arms run *interleaved*, one advance each per round in a seeded shuffled order — the bench's
arrangement, where a step finds the caches another engine's step left (the older model
measured each arm alone with medians: the bench's median steps were 3-24 % longer on the idle
2-core EPYC, and the replay underrated speculation at c=1, overrated it at c=16).
Without, the arms run one after another on ``engine``.

``calibrate`` alone predicted a bs=1 S5K4N16 step at 21.8 ms where the engine took 27.5 (its
overheads come from random-token prompts, where almost nothing is accepted, and its forward
costs are minima), and the verify's cost grows faster than linearly in the batch: measured
steps are the model, the components only correct another shape, accept length or context.
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

import numpy as np

from workbench.engine.calibrate import calibrate
from workbench.errors import ConfigError
from workbench.policy.costmodel import CostModel, LinearCost
from workbench.policy.policies import Always, Never, RecordingPolicy, Shape

if TYPE_CHECKING:
    from workbench.config import SpecConfig
    from workbench.engine.engine import Engine

BATCHES = (1, 4, 16)
OUTLIER = 5.0  # a step over 5x its group's median is a preemption, not the step's cost


@dataclass(frozen=True)
class StepSample:
    """One advance of a measuring loop: its arm, the loop's concurrency, the decode batch
    (requests past their prefill before the step), the mode (``plain``/``spec``/``prefill``
    when nothing decoded), the prompt tokens prefilled in it, the mean KV length of the decode
    requests, the accepted drafts of a speculative step, and the whole advance's ms."""

    arm: str
    concurrency: int
    index: int  # the advance's number in its loop
    batch: int
    mode: str
    prefill_tokens: int
    context: float
    accepted: tuple[int, ...]
    ms: float


class _Loop:
    """``bench concurrency``'s closed loop, one :meth:`advance` at a time, keeping a
    :class:`StepSample` per advance."""

    def __init__(self, arm: str, engine: Engine, spec: SpecConfig | None, prompts: Sequence[str],
                 concurrency: int, requests: int, tokens: int) -> None:
        from workbench.config import SamplingParams

        self.arm, self.engine, self.prompts = arm, engine, prompts
        self.c, self.n, self.nxt = concurrency, requests, 0
        self.sp = SamplingParams(max_new_tokens=tokens, ignore_eos=True)
        self.rec: RecordingPolicy | None = None
        self.spec = spec
        if spec is not None:
            self.rec = RecordingPolicy(spec.policy)
            self.spec = dataclasses.replace(spec, policy=self.rec)
        self.live: set[int] = set()
        self.samples: list[StepSample] = []
        self.started = False

    @property
    def done(self) -> bool:
        return self.nxt >= self.n and not self.live

    def advance(self) -> None:
        e = self.engine
        if not self.started:  # an engine runs one loop at a time
            e.set_spec(self.spec)
            self.started = True
        t0 = time.perf_counter()
        while self.nxt < self.n and len(self.live) < self.c:
            self.live.add(e.add_request(self.prompts[self.nxt % len(self.prompts)], self.sp))
            self.nxt += 1
        reqs = {rid: e.requests[rid] for rid in self.live}
        pre = {rid: (r.kv_len, r.prefill_target) for rid, r in reqs.items() if r.in_prefill}
        decode = [r for rid, r in reqs.items() if rid not in pre]
        ctx = float(np.mean([r.kv_len for r in decode])) if decode else 0.0
        n_rows = len(self.rec.rows) if self.rec is not None else 0
        outs = e.step()
        for o in outs:
            if o.finished and o.rid in self.live:
                self.live.discard(o.rid)
                e.output(o.rid, text=False)
        ms = 1e3 * (time.perf_counter() - t0)
        filled = sum(min(reqs[rid].kv_len, target) - kv for rid, (kv, target) in pre.items())
        mode = "plain" if decode else "prefill"
        acc: tuple[int, ...] = ()
        if self.rec is not None and len(self.rec.rows) > n_rows and decode:
            row = self.rec.rows[-1]
            mode = "spec" if row.decision.speculate and row.accepted else "plain"
            acc = tuple(row.accepted)
        self.samples.append(StepSample(self.arm, self.c, len(self.samples), len(decode), mode,
                                       int(filled), ctx, acc, ms))

    def close(self) -> None:
        for rid in self.live:
            self.engine.abort(rid)
        self.live.clear()


def measure_steps(arms: Mapping[str, SpecConfig | None], engines: Mapping[str, Engine],
                  prompts: Sequence[str], batches: Sequence[int], tokens: int,
                  seed: int = 0) -> list[StepSample]:
    """Closed loops of every arm at every concurrency of ``batches`` (``max(2c, prompts)``
    requests of ``tokens`` tokens), every advance a :class:`StepSample`, after the bench's
    warm-up (one request of 8 tokens per arm). Arms on distinct
    engines run interleaved (one advance each per round, shuffled with ``seed + c``), arms
    sharing an engine one after another."""
    out: list[StepSample] = []
    previous = {id(e): e.spec for e in engines.values()}
    try:  # bench concurrency's warm-up: allocator, rotary tables, first-call overheads
        for a, spec in arms.items():
            lp = _Loop(a, engines[a], spec, prompts[:1], 1, 1, min(8, tokens))
            try:
                while not lp.done:
                    lp.advance()
            finally:
                lp.close()
    finally:
        for e in engines.values():
            e.set_spec(previous[id(e)])
    for c in batches:
        loops = [_Loop(a, engines[a], spec, prompts, c, max(2 * c, len(prompts)), tokens)
                 for a, spec in arms.items()]
        groups: dict[int, list[_Loop]] = {}
        for lp in loops:
            groups.setdefault(id(lp.engine), []).append(lp)
        rng = random.Random(seed + c)
        previous = {id(e): e.spec for e in engines.values()}
        try:
            while any(groups.values()):
                # the first unfinished loop of every engine, one advance each, shuffled
                live = [g[0] for g in groups.values() if g]
                rng.shuffle(live)
                for lp in live:
                    lp.advance()
                for g in groups.values():
                    if g and g[0].done:
                        g.pop(0)
        finally:
            for lp in loops:
                lp.close()
            for e in engines.values():
                e.set_spec(previous[id(e)])
        out += [s for lp in loops for s in lp.samples]
    return out


def robust_mean(ms: Sequence[float]) -> tuple[float, int]:
    """The mean of ``ms`` without samples over OUTLIER x the median, and how many were left
    out."""
    a = np.asarray(ms, dtype=np.float64)
    keep = a[a <= OUTLIER * np.median(a)]
    return float(keep.mean()), int(a.size - keep.size)


@dataclass
class AnchoredCostModel(CostModel):
    """A CostModel whose plain and speculative step times at the recorded shape are the
    *measured* means at the measured batch sizes (``anchors``; piecewise linear in the batch
    between them, the last segment's slope beyond), corrected by the component model only for
    what differs from the measured step: another shape, accept length or context. Policies
    (``threshold:auto``, Goodput) and the replay read it through ``plain_step_ms`` /
    ``spec_step_ms`` like any CostModel.

    ``anchors``: ``batches``, ``plain`` (ms of a cold plain step at each), ``plain_context``
    (mean KV length there), ``shapes``: per measured shape name (``S5K4N16``) its ``shape``,
    ``batches``, ``spec`` (ms), ``tau`` (tokens a speculating request committed per step
    there) and ``context``; ``prefill`` (optional): ``a``, ``b`` of the prefill line
    (:meth:`prefill_ms`). A shape that was not measured is priced from the nearest measured
    one (same top-k first, then the closest S and N) plus the component difference."""

    anchors: dict[str, Any] = field(default_factory=dict)

    @staticmethod
    def _interp(xs: Sequence[float], ys: Sequence[float], batch: float) -> float:
        if len(xs) == 1:
            return float(ys[0])
        if batch >= xs[-1]:
            slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
            return float(ys[-1] + slope * (batch - xs[-1]))
        return float(np.interp(batch, xs, ys))

    def _components(self, batch: int, shape: Sequence[int], tau: float, ctx: float) -> float:
        s, k, n = shape
        return (self.target_ms(batch * n, ctx) + (s - 1) * self.draft_ms(batch * k, ctx)
                + self.draft_ms(batch * tau, ctx))

    def anchor_for(self, shape: Sequence[int]) -> dict[str, Any]:
        """The measured shape a speculative step of ``shape`` is priced from."""
        s, k, n = shape
        measured = list(self.anchors["shapes"].values())
        return min(measured, key=lambda a: (a["shape"] != list(shape), a["shape"][1] != k,
                                            abs(a["shape"][0] - s) + abs(a["shape"][2] - n)))

    def plain_step_ms(self, batch: int, context: float = 0.0, warm: bool = True,
                      scaled: bool = True) -> float:
        a = self.anchors
        ctx0 = self._interp(a["batches"], a["plain_context"], batch)
        ms = self._interp(a["batches"], a["plain"], batch) + self.target_ms(batch, context) \
            - self.target_ms(batch, ctx0)
        if warm:
            ms += self.draft_ms(batch, context)
        return max(ms, 1e-6) * (self.scale["plain"] if scaled else 1.0)

    def spec_step_ms(self, batch: int, num_steps: int, topk: int, num_draft_tokens: int,
                     tau: float = 1.0, context: float = 0.0, scaled: bool = True) -> float:
        a = self.anchor_for((num_steps, topk, num_draft_tokens))
        xs = a["batches"]
        ms = (self._interp(xs, a["spec"], batch)
              + self._components(batch, (num_steps, topk, num_draft_tokens), tau, context)
              - self._components(batch, a["shape"], self._interp(xs, a["tau"], batch),
                                 self._interp(xs, a["context"], batch)))
        return max(ms, 1e-6) * (self.scale["spec"] if scaled else 1.0)

    def prefill_ms(self, tokens: float, context: float = 0.0, spec: bool = False) -> float:
        """The prefill chunks of one step (``tokens`` in all) beside a plain or a speculative
        decode part: the measured line of such steps when the anchors have one (the draft's
        extend included; the other kind's line when only it was measured), else the target
        forward."""
        lines = self.anchors.get("prefill") or {}
        line = lines.get("spec" if spec else "plain") or lines.get("plain" if spec else "spec")
        if not line:
            return self.target_ms(tokens, context)
        return max(0.0, float(line["a"]) + float(line["b"]) * tokens)

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "anchors": self.anchors}


def cost_model_from_dict(d: dict[str, Any]) -> CostModel:
    """A saved cost model: anchored when it has ``anchors``."""
    base = CostModel.from_dict(d)
    if not d.get("anchors"):
        return base
    return anchored(base, dict(d["anchors"]))


def anchored(base: CostModel, anchors: dict[str, Any]) -> AnchoredCostModel:
    """``base`` (every field kept) with ``anchors``."""
    kw = {f.name: getattr(base, f.name) for f in fields(CostModel)}
    kw["scale"] = dict(base.scale)
    return AnchoredCostModel(**kw, anchors=anchors)


def anchor_shapes(shape: Shape) -> list[Shape]:
    """The shapes measured by default: the recorded one, its chain and a 3-step chain (the
    bench's goodput candidates; SGLang's and vLLM's arms run chains)."""
    s = shape[0]
    return list(dict.fromkeys([shape, (s, 1, s + 1), (min(3, s), 1, min(3, s) + 1)]))


def fit_step_model(engine: Engine, prompts: Sequence[str], shape: Shape,
                   contexts: Sequence[int] = (128, 384), batches: Sequence[int] = BATCHES,
                   tokens: int = 64, shapes: Sequence[Shape] | None = None,
                   engines: Sequence[Engine] = ()) -> AnchoredCostModel:
    """The step-time model of the module doc: ``calibrate``'s components, and whole advances
    measured on ``prompts`` at ``batches`` (:func:`measure_steps`) as the anchors: plain
    steps (``never``), speculative ones at every shape of ``shapes`` (default
    :func:`anchor_shapes`, ``always``) and the prefill line. ``engines``: more engines of the
    same models; with them the arms (and a ``baseline`` arm) run interleaved, arm i on
    ``[engine, *engines][i % n]``, as ``bench concurrency`` runs its arms."""
    from workbench.config import SpecConfig

    comp = calibrate(engine, shape=shape, contexts=contexts, steps=False)
    s0, k0, n0 = shape
    arms: dict[str, SpecConfig | None] = {"baseline": None} if engines else {}
    arms["never"] = SpecConfig(num_steps=s0, topk=k0, num_draft_tokens=n0, policy=Never(),
                               draft_state="auto")
    by_name: dict[str, Shape] = {}
    for sh in shapes or anchor_shapes(shape):
        name = "S{}K{}N{}".format(*sh)
        by_name[name] = tuple(sh)  # type: ignore[assignment]
        arms[name] = SpecConfig(num_steps=sh[0], topk=sh[1], num_draft_tokens=sh[2],
                                policy=Always(), draft_state="auto")
    pool = [engine, *engines]
    bs = [b for b in batches if b <= min(e.config.max_batch_size for e in pool)]
    samples = measure_steps({a: arms[a] for a in arms},
                            {a: pool[i % len(pool)] for i, a in enumerate(arms)},
                            prompts, bs, tokens)
    return anchored(comp, anchors_from(samples, by_name))


def anchors_from(samples: Sequence[StepSample], shapes: Mapping[str, Shape]) -> dict[str, Any]:
    """The anchors of :class:`AnchoredCostModel` from measured advances: per concurrency c,
    the robust mean of the steady steps (decode batch c, no prefill chunk; every loop's first
    advance and ``never``'s first 8 decode steps, warm, left out), and the prefill line
    fitted to the excess of every step with prefill chunks over its decode part (the anchors
    at its decode batch) on the speculative engines' arms, one line per kind of decode part."""
    from workbench.lab.sim import AUTO_WARM_STEPS

    samples = [x for x in samples if x.index > 0]  # the first advance pays first-use costs

    def steady(arm: str, mode: str) -> dict[int, list[StepSample]]:
        out: dict[int, list[StepSample]] = {}
        decoded: dict[int, int] = {}  # decode steps so far per loop
        for x in sorted(samples, key=lambda x: (x.arm, x.concurrency, x.index)):
            if x.arm != arm or not x.batch:
                continue
            decoded[x.concurrency] = k = decoded.get(x.concurrency, 0) + 1
            if (x.mode == mode and x.batch == x.concurrency and not x.prefill_tokens
                    and (arm != "never" or k > AUTO_WARM_STEPS)
                    and (mode == "plain" or len(x.accepted) == x.batch)):
                out.setdefault(x.concurrency, []).append(x)
        return out

    plain = steady("never", "plain")
    spec = {name: steady(name, "spec") for name in shapes}
    if not plain or not any(spec.values()):
        raise ConfigError("fit_step_model: no plain or no speculative step measured (prompts "
                          "too short for the tokens asked?)")
    dropped = 0

    def mean(xs: list[StepSample]) -> float:
        nonlocal dropped
        m, d = robust_mean([x.ms for x in xs])
        dropped += d
        return m

    measured = {}
    for name, by in spec.items():
        if not by:
            continue
        bs = sorted(by)
        measured[name] = {
            "shape": list(shapes[name]), "batches": bs,
            "spec": [mean(by[b]) for b in bs],
            "tau": [float(np.mean([sum(m + 1 for m in x.accepted) / x.batch for x in by[b]]))
                    for b in bs],
            "context": [float(np.mean([x.context for x in by[b]])) for b in bs],
            "samples": [len(by[b]) for b in bs]}
    done = sorted(plain)
    anchors: dict[str, Any] = {
        "batches": done, "plain": [mean(plain[b]) for b in done],
        "plain_context": [float(np.mean([x.context for x in plain[b]])) for b in done],
        "plain_samples": [len(plain[b]) for b in done], "shapes": measured}
    model = AnchoredCostModel(LinearCost(), anchors=anchors)  # the anchors as measured
    excess: dict[str, list[tuple[float, float]]] = {}
    for x in samples:
        if x.arm == "baseline" or not x.prefill_tokens:
            continue
        decode = 0.0
        if x.mode == "plain":
            decode = model.plain_step_ms(x.batch, warm=False)
        elif x.mode == "spec" and x.arm in measured:
            decode = model.spec_step_ms(x.batch, *shapes[x.arm])
        elif x.mode == "spec":
            continue
        kind = "spec" if x.mode == "spec" else "plain"
        excess.setdefault(kind, []).append((float(x.prefill_tokens), x.ms - decode))
    anchors["prefill"] = {}
    for kind, pts in excess.items():
        t, e = np.asarray(pts).T
        keep = e <= OUTLIER * max(float(np.median(e)), 1e-9)
        dropped += int((~keep).sum())
        t, e = t[keep], e[keep]
        a, b = -1.0, 0.0
        if np.ptp(t) > 0:
            b, a = (float(v) for v in np.polyfit(t, e, 1))
        if a < 0:  # a chunk costs no less than nothing: the line through 0 instead
            a, b = 0.0, float(np.dot(t, e) / np.dot(t, t))
        anchors["prefill"][kind] = {"a": a, "b": b, "samples": len(pts),
                                    "tokens": [float(t.min()), float(t.max())]}
    anchors["dropped"] = dropped
    return anchors
