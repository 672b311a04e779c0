"""What a speculative step costs beyond its forwards: the ceiling and the per-step overhead.

:class:`ForwardClock` times, per engine step, the model forwards themselves — the target's
forward and logits (a verify, a plain decode or a prefill) and every draft forward (the tree's
steps and the draft extend, with its feature GEMM) — by wrapping those methods on the engine's
own model instances for the duration of a ``with`` block (restored afterwards; outputs
untouched; a few µs per step). Each step's row: ``step`` (the engine's step id), ``total_ms``
(the whole ``Engine.step``), ``target_ms``, ``draft_ms``, and the tree builds, extends and
prompt passes (``prefill``) with the forwards inside them (``tree_ms``/``tree_fwd_ms``, ...).

``bench spec`` runs its timed arms inside the clock, so the speedup and its ceiling come from
the same steps (:func:`decode_costs`, :func:`forwards_ms`):

* ``verify_ratio`` / ``draft_ratio``: median target / draft forward ms of an arm's decode steps
  over the baseline's median decode step (plain-step units);
* ``ceiling`` = τ / (verify_ratio + draft_ratio): the per-step speedup if nothing but the
  forwards cost time (schedule, tree building, accept, commit, extend bookkeeping, Python all
  free);
* ``overhead``: median over the arm's decode steps of (step − its forwards) / its forwards;
* over whole prompts, the baseline's time over the arm's forwards' time: the end-to-end
  speedup with everything but the forwards free (the prefill, which no speculation shortens,
  included as it is in the speedup).

:func:`phase_costs` says where the overhead sits, median ms per speculative step by phase, from a
separate traced pass (the trace's ``StepTiming`` phases less the forwards run inside them):
``schedule``, ``tree`` (building the trees around the draft forwards), ``verify`` (the verify
batch around the target forward), ``accept``, ``commit``, ``extend`` (the draft extends'
bookkeeping, the cold catch-up's included) and ``other`` (the rest of the step: accounting,
tracing, Python).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import workbench as wb
from workbench.config import SamplingParams, SpecConfig

if TYPE_CHECKING:
    from workbench.engine.engine import Engine


# ForwardClock's per-step keys: all forwards, and the tree builds / extends / prompt passes with
# theirs
KEYS = ("target_ms", "draft_ms", "tree_ms", "tree_fwd_ms", "extend_ms", "extend_fwd_ms",
        "prompt_ms", "prompt_fwd_ms")
PHASES = ("schedule", "tree", "verify", "accept", "commit", "extend", "other")


class ForwardClock:
    """Per-step forward times of ``engine`` inside a ``with`` block (module docstring)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.rows: list[dict[str, float]] = []
        # per arm, each generate call's rows (``bench.spec.timed_arms`` fills it)
        self.by_arm: dict[str, list[list[dict[str, float]]]] = {}
        self._cur = dict.fromkeys(KEYS, 0.0)
        self._undo: list[tuple[Any, str]] = []
        self._where: list[str] = []  # "tree" / "extend" while the worker builds / extends

    def _wrap(self, obj: Any, name: str, key: str | None, where: str | None = None) -> None:
        """``key``: a forward's ms (also added to ``<where>_fwd_ms`` inside a tree build or an
        extend); ``where``: a worker phase whose whole ms goes to ``<where>_ms``."""
        fn: Callable[..., Any] = getattr(obj, name)
        cur, inside = self._cur, self._where

        def timed(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            if where is not None:
                inside.append(where)
            try:
                return fn(*a, **k)
            finally:
                ms = 1e3 * (time.perf_counter() - t0)
                if where is not None:
                    inside.pop()
                    cur[f"{where}_ms"] += ms
                if key is not None:
                    cur[key] += ms
                    if inside:
                        cur[f"{inside[-1]}_fwd_ms"] += ms

        setattr(obj, name, timed)  # an instance attribute: the class is untouched
        self._undo.append((obj, name))

    def __enter__(self) -> ForwardClock:
        runner = self.engine.runner
        self._wrap(runner.target, "forward", "target_ms")
        self._wrap(runner.target, "logits", "target_ms")
        if runner.draft is not None:  # its forward and its feature GEMM (fc over the taps)
            self._wrap(runner.draft, "forward", "draft_ms")
            self._wrap(runner.draft, "features", "draft_ms")
        worker = self.engine.worker
        self._wrap(worker, "_draft", None, "tree")
        self._wrap(worker, "extend", None, "extend")
        self._wrap(worker, "prefill", None, "prompt")  # a step with prompt_ms > 0 prefilled
        step = self.engine.step

        def timed_step() -> Any:
            self._cur.update(dict.fromkeys(KEYS, 0.0))
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
    with wb.trace(engine, events=["StepTiming"]) as tr, ForwardClock(engine) as clock:
        for p in prompts:
            engine.generate([p], sp, spec=spec)
    timing = tr.frame("timing").set_index("step")
    cols = ["mode", "schedule_ms", "verify_ms", "accept_ms", "commit_ms"]
    steps = {int(k): v for k, v in timing[cols].to_dict(orient="index").items()}
    # a step with no decode work (a prompt's prefill alone) emits no StepTiming: left out
    return [{**r, **steps[int(r["step"])]} for r in clock.rows if int(r["step"]) in steps]


def overhead_ms(r: dict[str, Any]) -> dict[str, float]:
    """One speculative step's overhead by phase (module docstring), in ms."""
    out = {"schedule": r["schedule_ms"], "tree": r["tree_ms"] - r["tree_fwd_ms"],
           "verify": r["verify_ms"] - r["target_ms"], "accept": r["accept_ms"],
           "commit": r["commit_ms"], "extend": r["extend_ms"] - r["extend_fwd_ms"]}
    out["other"] = r["total_ms"] - r["target_ms"] - r["draft_ms"] - sum(out.values())
    return out


def phase_costs(engine: Engine, prompts: list[Any], arms: dict[str, SpecConfig | None],
                sp: SamplingParams) -> dict[str, dict[str, float]]:
    """Per speculative arm, where its decode steps' overhead sits (``overhead_<phase>_ms``,
    module docstring), from a separate traced pass over ``prompts``: the phases come from the
    trace's ``StepTiming`` events, which cost time of their own, so this is not the timed pass.
    The arms take turns per prompt (they share the machine's drift)."""
    named = {k: v for k, v in arms.items() if v is not None}
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in named}
    for p in prompts:
        for name, spec in named.items():
            runs[name] += _run(engine, [p], sp, spec)
    out: dict[str, dict[str, float]] = {}
    for name, rows in runs.items():
        by_phase = [overhead_ms(r) for r in rows if r["mode"] == "spec"]
        if by_phase:
            out[name] = {f"overhead_{k}_ms": statistics.median(p[k] for p in by_phase)
                         for k in PHASES}
    return out


def decode_costs(base: list[dict[str, float]], rows: list[dict[str, float]]
                 ) -> dict[str, float]:
    """One speculative arm's decode steps against the baseline's, from ForwardClock rows of the
    same timed pass (every prompt and repeat; a row with ``prompt_ms`` > 0 prefilled and is left
    out): ``verify_ratio``, ``draft_ratio`` (median forwards ms of the arm's decode steps over
    the baseline's median decode step), ``overhead`` (median over the arm's decode steps of
    (step − its forwards) / its forwards) and ``prefill_ratio`` (the baseline's median prefill
    step in the same unit). NaN where a kind of step is missing."""
    plain = _median([r["total_ms"] for r in base if not r["prompt_ms"]])
    steps = [r for r in rows if not r["prompt_ms"] and r["target_ms"] + r["draft_ms"] > 0]
    return {"verify_ratio": _median([r["target_ms"] for r in steps]) / plain,
            "draft_ratio": _median([r["draft_ms"] for r in steps]) / plain,
            "overhead": _median([r["total_ms"] / (r["target_ms"] + r["draft_ms"]) - 1.0
                                 for r in steps]),
            "prefill_ratio": _median([r["total_ms"] for r in base if r["prompt_ms"]]) / plain}


def forwards_ms(rows: list[dict[str, float]]) -> float:
    """The model forwards' ms in ``rows`` (the target's and the draft's, every step)."""
    return sum(r["target_ms"] + r["draft_ms"] for r in rows)


def _median(xs: list[float]) -> float:
    """The median; NaN for none (a pass whose prompts prefilled inside mixed steps)."""
    return statistics.median(xs) if xs else float("nan")
