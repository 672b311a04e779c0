"""What instrumentation costs: tok/s with tracing in three states, interleaved in one run.

* ``no_hooks`` — the reference, "a build without hooks": ``engine.trace`` is swapped for
  :class:`NoHooks`, whose ``enabled`` is a plain ``False`` class attribute and whose ``wants``
  returns False at once (the cheapest checks an ``if self.trace.enabled:`` /
  ``if self.trace.wants(Kind):`` guard can make);
* ``default`` — the engine as shipped with no tracer: its Dispatcher's ``enabled`` property and
  ``wants`` method (tracer disabled, no hooks);
* ``recording`` — every event recorded by ``wb.trace(engine)``.

Goals: ``default`` within 1% of ``no_hooks``, ``recording`` within 10%.
Columns, all against ``no_hooks``:

* ``overhead_pct`` — extra wall time of the summed runs; ``overhead_median_pct`` — median over
  repeats of the paired ratio (same repeat, arm, batch);
* ``cpu_overhead_pct`` — extra CPU time of this process (``time.process_time``): on a CPU-only
  run it is what tracing adds, and other processes on the machine barely move it;
* ``guard_est_pct`` (``default`` only) — noise-free estimate: per step, ``enabled`` and
  ``wants`` checks x the extra cost of each Dispatcher check over the ``NoHooks`` one (timed in
  isolation) / the CPU time of a ``no_hooks`` step.

On a shared or loaded machine wall-time noise can exceed the 1% goal many times over.

    python -m workbench.bench.trace_overhead TARGET [DRAFT]
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd

import workbench as wb
from workbench.config import SamplingParams, SpecConfig
from workbench.machine import machine_info
from workbench.trace.events import StepTiming
from workbench.trace.tracer import NullTracer, trace

if TYPE_CHECKING:
    from workbench.engine.engine import Engine

MODES = ("no_hooks", "default", "recording")
GOAL_PCT = {"default": 1.0, "recording": 10.0}
DEFAULT_ARMS: dict[str, SpecConfig | None] = {
    "baseline": None,
    "tree S5 K4 N16": SpecConfig(num_steps=5, topk=4, num_draft_tokens=16),
}


class NoHooks:
    """A tracer with nothing behind it: ``enabled`` is a class attribute, ``emit`` a no-op."""

    __slots__ = ()
    enabled = False

    def emit(self, event: object) -> None:
        """Drop ``event``."""

    def wants(self, *kinds: object) -> bool:
        return False


@contextmanager
def _mode(engine: Engine, mode: str) -> Iterator[Any]:
    """Put ``engine`` in one tracing state for the block; yields the recorder (or None)."""
    if mode == "default":
        yield None
    elif mode == "recording":
        with trace(engine) as rec:
            yield rec
    elif mode == "no_hooks":
        dispatcher = engine.trace
        setattr(engine, "trace", NoHooks())  # noqa: B010 (a stand-in, not a Dispatcher)
        try:
            yield None
        finally:
            engine.trace = dispatcher
    else:
        raise ValueError(f"mode {mode!r} unknown; valid: {', '.join(MODES)}")


class _CountingNoHooks:
    """``NoHooks`` that counts how often the engine reads ``enabled`` and calls ``wants``."""

    def __init__(self) -> None:
        self.checks = 0
        self.wants_checks = 0

    @property
    def enabled(self) -> bool:
        self.checks += 1
        return False

    def wants(self, *kinds: object) -> bool:
        self.wants_checks += 1
        return False

    def emit(self, event: object) -> None:
        """Drop ``event``."""


def _check_cost_ns(obj: Any, stmt: str = "o.enabled", number: int = 200_000) -> float:
    """Best-of-5 nanoseconds of one ``stmt`` (``o`` is ``obj``): a guard check."""
    import timeit


    t = timeit.Timer(stmt, globals={"o": obj, "Kind": StepTiming})
    return min(t.repeat(5, number)) / number * 1e9


def _checks_per_step(engine: Engine, batch: list[Any], sp: SamplingParams,
                     spec: SpecConfig | None) -> tuple[float, float]:
    """(``enabled`` reads, ``wants`` calls) per step."""
    dispatcher, counter = engine.trace, _CountingNoHooks()
    setattr(engine, "trace", counter)  # noqa: B010 (a stand-in, not a Dispatcher)
    try:
        s0 = engine.step_id
        engine.generate(batch, sp, spec=spec)
        steps = max(engine.step_id - s0, 1)
    finally:
        engine.trace = dispatcher
    return counter.checks / steps, counter.wants_checks / steps


def _check_untraced(engine: Engine) -> None:
    if not isinstance(engine.tracer, NullTracer) or engine.hooks:
        raise ValueError("run_trace_overhead: the engine must start with no tracer and no hooks "
                         f"(tracer {engine.tracer!r}, hooks {engine.hooks!r})")


def run_trace_overhead(engine: Engine, prompts: Sequence[Any], batch_sizes: Sequence[int] = (1, 16),
                       max_new_tokens: int = 32, repeats: int = 5,
                       arms: dict[str, SpecConfig | None] | None = None,
                       warmup: bool = True) -> pd.DataFrame:
    """One row per (arm, batch_size, mode): tokens, seconds, tok/s and overhead vs ``no_hooks``.

    Greedy, ``ignore_eos``; a batch of ``b`` takes the first ``b`` prompts (cycled), all added at
    once. Every (repeat, arm, batch) runs the three modes back to back, their order rotated each
    repeat. ``same_tokens`` says whether every mode produced the ``no_hooks`` tokens.
    ``df.attrs["machine"]`` holds the machine facts.
    """
    _check_untraced(engine)
    if arms is None:
        arms = {k: v for k, v in DEFAULT_ARMS.items()
                if v is None or engine.runner.draft is not None}
    sp = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    plist = list(prompts)
    batches = {b: [plist[i % len(plist)] for i in range(b)] for b in batch_sizes}

    def once(spec: SpecConfig | None, batch: list[Any], mode: str) -> dict[str, Any]:
        with _mode(engine, mode):
            s0 = engine.step_id
            c0, t0 = time.process_time(), time.perf_counter()
            outs = engine.generate(batch, sp, spec=spec)
            dt, cpu = time.perf_counter() - t0, time.process_time() - c0
        ids = [o.token_ids for o in outs]
        return {"seconds": dt, "cpu_seconds": cpu, "steps": engine.step_id - s0,
                "tokens": sum(map(len, ids)), "ids": ids}

    if warmup:  # allocator, rotary tables, first-call overheads
        for spec in arms.values():
            for batch in batches.values():
                for mode in MODES:
                    once(spec, batch, mode)
    runs = []
    for r in range(repeats):
        order = MODES[r % len(MODES):] + MODES[: r % len(MODES)]
        for arm, spec in arms.items():
            for b, batch in batches.items():
                for mode in order:
                    runs.append({"repeat": r, "arm": arm, "batch_size": b, "mode": mode,
                                 **once(spec, batch, mode)})
    df = pd.DataFrame(runs)
    # the guard's cost per read, in isolation: the Dispatcher property vs a class attribute
    check_ns = _check_cost_ns(engine.trace) - _check_cost_ns(NoHooks())
    wants_ns = (_check_cost_ns(engine.trace, "o.wants(Kind)")
                - _check_cost_ns(NoHooks(), "o.wants(Kind)"))
    rows = []
    for (arm, b), g in df.groupby(["arm", "batch_size"], sort=False):
        by_mode = {m: g[g["mode"] == m].sort_values("repeat") for m in MODES}
        ref = by_mode["no_hooks"]
        ref_tok_s = ref["tokens"].sum() / ref["seconds"].sum()
        ref_step_ns = ref["cpu_seconds"].sum() / ref["steps"].sum() * 1e9
        checks, wants_checks = _checks_per_step(engine, batches[b], sp, arms[arm])
        for mode in MODES:
            m = by_mode[mode]
            tok_s = m["tokens"].sum() / m["seconds"].sum()
            paired = [s / s0 for s, s0 in zip(m["seconds"], ref["seconds"], strict=True)]
            rows.append({
                "arm": arm, "batch_size": b, "mode": mode,
                "tokens": int(m["tokens"].sum()), "seconds": float(m["seconds"].sum()),
                "tok_s": tok_s,
                "overhead_pct": (ref_tok_s / tok_s - 1.0) * 100.0,
                "overhead_median_pct": (statistics.median(paired) - 1.0) * 100.0,
                "cpu_overhead_pct": (m["cpu_seconds"].sum() / ref["cpu_seconds"].sum() - 1.0)
                * 100.0,
                "guard_est_pct": (checks * check_ns + wants_checks * wants_ns)
                / ref_step_ns * 100.0
                if mode == "default" else float("nan"),
                "goal_pct": GOAL_PCT.get(mode, float("nan")),
                "same_tokens": all(a == b_ for a, b_ in zip(m["ids"], ref["ids"], strict=True)),
            })
    out = pd.DataFrame(rows)
    out.attrs.update(machine=machine_info(), max_new_tokens=max_new_tokens, prompts=len(plist),
                     repeats=repeats, check_ns=check_ns, wants_ns=wants_ns)
    return out


def format_table(df: pd.DataFrame) -> str:
    """The result as text: the table, then the machine and settings it was measured on."""
    m = df.attrs.get("machine", {})
    head = (f"machine: {m.get('cpu')} ({m.get('cores')} cores, torch threads "
            f"{m.get('torch_threads')}, cuda {m.get('cuda')}), torch {m.get('torch')}; "
            f"prompts {df.attrs.get('prompts')}, max_new_tokens {df.attrs.get('max_new_tokens')}, "
            f"repeats {df.attrs.get('repeats')}, greedy; overheads vs no_hooks; one Dispatcher "
            f"enabled / wants check costs {df.attrs.get('check_ns', float('nan')):.0f} / "
            f"{df.attrs.get('wants_ns', float('nan')):.0f} ns more than NoHooks'")
    body = df.to_string(index=False, float_format=lambda x: f"{x:.2f}")
    return f"{head}\n{body}"


MICRO_PROMPTS = ("def parse(path):\n", "import os\n\n", "class Config:\n    def __init__(self",
                 "for i in range(", "    return self.", "if __name__ == ")


def main(argv: Sequence[str]) -> int:
    """``TARGET [DRAFT]``: load the engine, run the default sweep, print the table."""
    if not 1 <= len(argv) <= 2:
        print("usage: python -m workbench.bench.trace_overhead TARGET [DRAFT]", file=sys.stderr)
        return 2
    target, draft = Path(argv[0]), Path(argv[1]) if len(argv) > 1 else None
    engine = wb.Engine.from_pretrained(target, draft=draft)
    try:
        df = run_trace_overhead(engine, MICRO_PROMPTS)
    finally:
        engine.close()
    print(format_table(df))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
