"""The recording's step-time model: whole steps measured on the recorded prompts, the
component model (``calibrate``'s forward costs on scratch KV) only for what differs.

``calibrate`` alone predicted a bs=1 S5K4N16 step at 21.8 ms where the engine took 27.5 on the
EPYC (its overheads come from random-token prompts, where almost nothing is accepted, and its
forward costs are minima); refitting the overheads as lines in the batch did not hold either
(the verify's cost grows faster than linearly from batch 4 to 16 here). So the model is
*anchored* on measured steps (:class:`AnchoredCostModel`): closed loops on the recorded
prompts at a few batch sizes, plain (``Never``, cold draft: what a policy's off stretch
costs) and speculative (``Always`` at the recorded shape), each the median step per (kind,
batch): a mean was swung by single preempted steps (19.5 ms of plain overhead at bs=1, load
7, beside 12.8 ms whole plain steps). Plain and speculative steps are measured in their own
loops, as the engine runs them under a policy: alternating them step by step made a bs=1
plain step 21-26 ms instead of 13 (load 7-9). Other shapes, accept lengths and contexts add
the component model's difference.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

import numpy as np

from workbench.engine.calibrate import calibrate
from workbench.errors import ConfigError
from workbench.policy.costmodel import CostModel
from workbench.policy.policies import Always, Never, RecordingPolicy, Shape

if TYPE_CHECKING:
    from workbench.engine.engine import Engine

BATCHES = (1, 4, 16)


def _steps(engine: Engine, prompts: Sequence[str], spec: Any, batch: int,
           tokens: int) -> list[tuple[int, float, float, Any, tuple[int, ...]]]:
    """(batch, context, ms, decision, accepted) of each pure decode step of ``batch`` prompts
    run together (the first decode step, which pays first-use costs, left out)."""
    import dataclasses

    from workbench.config import SamplingParams

    rec = RecordingPolicy(spec.policy)
    previous = engine.spec
    engine.set_spec(dataclasses.replace(spec, policy=rec))
    sp = SamplingParams(max_new_tokens=tokens, ignore_eos=True)
    rows = []
    rids: list[int] = []
    try:
        rids = [engine.add_request(prompts[i % len(prompts)], sp) for i in range(batch)]
        live = set(rids)
        while live:
            prefilling = any(engine.requests[r].in_prefill for r in live)
            n = len(rec.rows)
            t0 = time.perf_counter()
            outs = engine.step()
            ms = 1e3 * (time.perf_counter() - t0)
            live -= {o.rid for o in outs if o.finished}
            if not prefilling and len(rec.rows) > n:
                r = rec.rows[-1]
                rows.append((r.batch, float(r.context), ms, r.decision, r.accepted))
    finally:
        for rid in rids:
            engine.abort(rid)
        engine.set_spec(previous)
    return rows[1:]


@dataclass
class AnchoredCostModel(CostModel):
    """A CostModel whose plain and speculative step times at the recorded shape are the
    *measured* medians at the measured batch sizes (``anchors``; piecewise linear in the batch
    between them, the last segment's slope beyond), corrected by the component model only for
    what differs from the measured step: another shape, accept length or context. Policies
    (``threshold:auto``, Goodput) and the replay read it through ``plain_step_ms`` /
    ``spec_step_ms`` like any CostModel.

    ``anchors``: ``batches``, ``plain`` (ms of a cold plain step at each), ``plain_context``
    (mean KV length there), ``shapes``: per measured shape name (``S5K4N16``) its ``shape``,
    ``batches``, ``spec`` (ms), ``tau`` (tokens a speculating request committed per step
    there) and ``context``. A shape that was not measured is priced from the nearest measured
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
                   tokens: int = 48,
                   shapes: Sequence[Shape] | None = None) -> AnchoredCostModel:
    """The step-time model of the module doc: ``calibrate``'s components, and whole steps
    measured on ``prompts`` at ``batches`` as the anchors: plain steps, and speculative ones
    at every shape of ``shapes`` (default :func:`anchor_shapes`)."""
    from workbench.config import SpecConfig

    comp = calibrate(engine, shape=shape, contexts=contexts, steps=False)
    plain: dict[int, list[tuple[float, float]]] = {}
    spec: dict[tuple[int, ...], dict[int, list[tuple[float, float, float]]]] = {}
    s0, k0, n0 = shape
    for b in batches:
        if b > engine.config.max_batch_size:
            continue
        off = SpecConfig(num_steps=s0, topk=k0, num_draft_tokens=n0, policy=Never(),
                         draft_state="cold")
        for batch, ctx, ms, d, _ in _steps(engine, prompts, off, b, tokens):
            if batch == b and not d.speculate:  # (a request that finished early: not b)
                plain.setdefault(b, []).append((ms, ctx))
        for sh in shapes or anchor_shapes(shape):
            on = SpecConfig(num_steps=sh[0], topk=sh[1], num_draft_tokens=sh[2],
                            policy=Always(), draft_state="auto")
            for batch, ctx, ms, d, acc in _steps(engine, prompts, on, b, tokens):
                if batch == b and d.speculate and len(acc) == b:
                    spec.setdefault(tuple(sh), {}).setdefault(b, []).append(
                        (ms, sum(x + 1 for x in acc) / b, ctx))
    done = sorted(plain)
    if not done or not spec:
        raise ConfigError("fit_step_model: no plain or no speculative step measured (prompts "
                          "too short for the tokens asked?)")
    measured = {}
    for key_shape, by in spec.items():
        bs = sorted(by)
        measured["S{}K{}N{}".format(*key_shape)] = {
            "shape": list(key_shape), "batches": bs,
            **{key: [float(np.median([r[i] for r in by[b]])) for b in bs]
               for i, key in enumerate(("spec", "tau", "context"))},
            "samples": [len(by[b]) for b in bs]}
    anchors = {"batches": done, "plain": [float(np.median([r[0] for r in plain[b]]))
                                          for b in done],
               "plain_context": [float(np.median([r[1] for r in plain[b]])) for b in done],
               "plain_samples": [len(plain[b]) for b in done], "shapes": measured}
    return anchored(comp, anchors)
