"""What a speculative step costs beyond its forwards: the ceiling and the per-step overhead.

:class:`ForwardClock` times, per engine step, the model forwards themselves — the target's
forward and logits (a verify, a plain decode or a prefill) and every draft forward (the tree's
steps and the draft extend, with its feature GEMM) — by wrapping those methods on the engine's
own model instances for the duration of a ``with`` block (restored afterwards; outputs
untouched). Each step's row:
``step`` (the engine's step id), ``total_ms`` (the whole ``Engine.step``), ``target_ms``,
``draft_ms``. :func:`step_costs` joins them with the trace's step modes:

* ``verify_ratio`` / ``draft_ratio``: median target / draft forward ms of a speculative step
  over the median plain step ms (plain-step units, the same run);
* ``ceiling`` = τ / (verify_ratio + draft_ratio): the speedup if nothing but the forwards cost
  time (schedule, tree building, accept, commit, extend bookkeeping, Python all free);
* ``overhead``: median over speculative steps of (step − its forwards) / its forwards.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from workbench.config import SamplingParams, SpecConfig

if TYPE_CHECKING:
    from workbench.engine.engine import Engine


class ForwardClock:
    """Per-step forward times of ``engine`` inside a ``with`` block (module docstring)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.rows: list[dict[str, float]] = []
        self._cur = {"target_ms": 0.0, "draft_ms": 0.0}
        self._undo: list[tuple[Any, str]] = []

    def _wrap(self, obj: Any, name: str, key: str | None) -> None:
        fn: Callable[..., Any] = getattr(obj, name)
        cur = self._cur

        def timed(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                if key is not None:
                    cur[key] += 1e3 * (time.perf_counter() - t0)

        setattr(obj, name, timed)  # an instance attribute: the class is untouched
        self._undo.append((obj, name))

    def __enter__(self) -> ForwardClock:
        runner = self.engine.runner
        self._wrap(runner.target, "forward", "target_ms")
        self._wrap(runner.target, "logits", "target_ms")
        if runner.draft is not None:  # its forward and its feature GEMM (fc over the taps)
            self._wrap(runner.draft, "forward", "draft_ms")
            self._wrap(runner.draft, "features", "draft_ms")
        step = self.engine.step

        def timed_step() -> Any:
            self._cur.update(target_ms=0.0, draft_ms=0.0)
            t0 = time.perf_counter()
            out = step()
            self.rows.append({"step": self.engine.step_id,
                              "total_ms": 1e3 * (time.perf_counter() - t0), **self._cur})
            return out

        setattr(self.engine, "step", timed_step)  # noqa: B010 (instance wrapper, undone on exit)
        self._undo.append((self.engine, "step"))
        return self

    def __exit__(self, *exc: object) -> None:
        while self._undo:
            obj, name = self._undo.pop()
            delattr(obj, name)


def _run(engine: Engine, prompts: list[Any], sp: SamplingParams,
         spec: SpecConfig | None) -> list[dict[str, Any]]:
    """The steps of one pass over ``prompts``: forward times joined with each step's mode."""
    import workbench as wb

    with wb.trace(engine, events=["StepTiming"]) as tr, ForwardClock(engine) as clock:
        for p in prompts:
            engine.generate([p], sp, spec=spec)
    modes = dict(zip(tr.frame("timing")["step"], tr.frame("timing")["mode"], strict=True))
    return [{**r, "mode": modes[r["step"]]} for r in clock.rows if r["step"] in modes]


def step_costs(engine: Engine, prompts: list[Any], arms: dict[str, SpecConfig | None],
               sp: SamplingParams) -> dict[str, dict[str, float]]:
    """Per speculative arm, from a separate traced pass over ``prompts`` (tracing and the
    clock cost time of their own, so it is not the timed pass): ``verify_ratio``,
    ``draft_ratio`` and ``overhead`` (module docstring)."""
    plain = statistics.median(r["total_ms"] for r in _run(engine, prompts, sp, None)
                              if r["mode"] == "plain")
    out: dict[str, dict[str, float]] = {}
    for name, spec in arms.items():
        if spec is None:
            continue
        steps = [r for r in _run(engine, prompts, sp, spec) if r["mode"] == "spec"]
        if not steps:
            continue
        verify = statistics.median(r["target_ms"] for r in steps)
        draft = statistics.median(r["draft_ms"] for r in steps)
        over = statistics.median(r["total_ms"] / (r["target_ms"] + r["draft_ms"]) - 1.0
                                 for r in steps)
        out[name] = {"verify_ratio": verify / plain, "draft_ratio": draft / plain,
                     "overhead": over}
    return out
