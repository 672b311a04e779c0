"""``bench load``: bs=1 speed alone and beside one competing CPU-bound process pinned to a core.

A researcher's machine is rarely idle. This benchmark makes the contention itself: it starts a
busy loop pinned (``sched_setaffinity``) to the last core this process may use, runs the
baseline and EAGLE-3 at bs=1 (interleaved per prompt, the first of the two alternating, outputs
compared token for token), stops the competitor (whatever happens: a ``finally``, terminate
then kill), and alternates phases
``alone, competing`` ``repeats`` times, so both conditions share the machine's drift.

Goals (issue 26), each printed with its figure:

* bs=1 tok/s competing ≥ :data:`MIN_KEPT` × alone, for the baseline and for EAGLE-3;
* the EAGLE-3/baseline ratio competing within :data:`MAX_RATIO_CHANGE` of the ratio alone.

"Alone" means without *our* competitor: on a shared machine other work may still run, and each
phase's conditions (other processes' CPU use, steal, load: ``workbench.engine.contention``)
are measured and saved beside its figures. The engine adapts as it would anywhere (its
contention monitor re-measures the thread count); ``--engine contention=off`` shows the same
run without that.
"""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pandas as pd

from workbench.bench.spec import timed_arms
from workbench.config import SamplingParams, SpecConfig
from workbench.engine import affinity, contention
from workbench.errors import ConfigError

if TYPE_CHECKING:
    from workbench.engine.engine import Engine

MIN_KEPT = 0.7  # competing tok/s over alone tok/s, each arm
MAX_RATIO_CHANGE = 0.15  # |EAGLE-3/baseline competing over alone - 1|
SETTLE_S = 0.3  # after starting or stopping the competitor, before timing
_SPIN = "import os, sys\nos.sched_setaffinity(0, {int(sys.argv[1])})\nwhile True:\n    pass\n"


class Competitor:
    """One CPU-bound process pinned to ``core`` (default: the last core this process may
    use), for the duration of a ``with`` block; stopped even when the block raises. The
    cores are the process's as it started (``affinity.HOME``), not its mask now: an engine
    that started on a busy machine may have pinned its threads to fewer."""

    def __init__(self, core: int | None = None) -> None:
        cpus = sorted(affinity.HOME) if affinity.HOME is not None else []
        if len(cpus) < 2:
            have = len(cpus) or "an unknown number of"
            raise ConfigError(f"bench load: needs at least 2 cores to pin a competitor beside "
                              f"the engine; this process may use {have} core(s)")
        self.core = cpus[-1] if core is None else core
        if self.core not in cpus:
            raise ConfigError(f"bench load: core {self.core} is not one of this process's "
                              f"cores {cpus}")
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Competitor:
        self.proc = subprocess.Popen([sys.executable, "-c", _SPIN, str(self.core)],
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE)
        time.sleep(SETTLE_S)
        if self.proc.poll() is not None:
            err = self.proc.stderr.read().decode() if self.proc.stderr else ""
            raise RuntimeError(f"bench load: the competitor exited at once: {err.strip()}")
        return self

    def stop(self) -> None:
        p, self.proc = self.proc, None
        if p is None:
            return
        p.terminate()
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=5)
        if p.stderr is not None:
            p.stderr.close()
        time.sleep(SETTLE_S)

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def __enter__(self) -> Competitor:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass(frozen=True)
class LoadBenchResult:
    """``rows`` (phase, condition, prompt, arm, tokens, seconds, tok_s, lossless), ``summary``
    (per condition and arm), ``goals`` (one row per goal: figure, bound, met) and
    ``phases`` (each phase's measured conditions)."""

    rows: pd.DataFrame
    summary: pd.DataFrame
    goals: pd.DataFrame
    phases: list[dict[str, Any]]


def run_load_bench(engine: Engine, prompts: list[Any], spec: SpecConfig,
                   max_new_tokens: int = 64, repeats: int = 1, core: int | None = None,
                   progress: bool = True) -> LoadBenchResult:
    """Alternate ``alone`` and ``competing`` phases ``repeats`` times (see the module
    docstring); every phase runs every prompt with the baseline and EAGLE-3, the first of the
    two alternating (``_phase``)."""
    if repeats < 1:
        raise ConfigError(f"bench load: repeats must be >= 1, got {repeats}")
    competitor = Competitor(core)
    sp = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    arms: dict[str, SpecConfig | None] = {"baseline": None, "eagle3": spec}
    for s in arms.values():  # warm-up
        engine.generate([prompts[0]], sp, spec=s)
    rows: list[dict[str, Any]] = []
    phases: list[dict[str, Any]] = []
    for r in range(repeats):
        for condition in ("alone", "competing"):
            if condition == "competing":
                competitor.start()
            try:
                a = contention.cpu_sample()
                t0 = time.perf_counter()
                rows += _phase(engine, prompts, arms, sp, len(phases), condition, r)
                cond = contention.between(a, contention.cpu_sample())
            finally:
                competitor.stop()
            threads = getattr(engine, "contention", None)
            phases.append({"phase": len(phases), "repeat": r, "condition": condition,
                           "seconds": time.perf_counter() - t0, "conditions": cond.to_dict(),
                           "adaptations": len(threads.log) if threads is not None else None})
            if progress:
                print(f"phase {len(phases) - 1} {condition}: {cond.describe()}")
    df = pd.DataFrame(rows)
    summary, goals = summarize(df)
    busy = [p for p in phases if p["condition"] == "alone" and p["conditions"]["contended"]]
    # the goals compare against an idle machine: an "alone" phase that other work contended
    # cannot decide them, whatever the figures say
    goals["assessable"] = not busy
    return LoadBenchResult(df, summary, goals, phases)


def verdict(res: LoadBenchResult) -> str:
    """One line: every goal met, which missed, or why the run cannot decide them."""
    if not bool(res.goals["assessable"].all()):
        busy = [p["conditions"].get("others") for p in res.phases if p["condition"] == "alone"]
        return ("goals not assessable: the alone phases were themselves contended (other "
                f"processes used {', '.join(str(b) for b in busy)} cores); the goals compare "
                "with an idle machine — rerun on a quiet one")
    missed = res.goals[~res.goals["met"]]["goal"].tolist()
    return "every goal met" if not missed else "missed: " + "; ".join(missed)


def _phase(engine: Engine, prompts: list[Any], arms: dict[str, SpecConfig | None],
           sp: SamplingParams, phase: int, condition: str, repeat: int = 0
           ) -> list[dict[str, Any]]:
    """Every prompt once per arm. Which arm goes first alternates by prompt and by repeat:
    whatever the start of a phase costs (the engine noticing the competitor arrive or leave,
    and re-placing its threads) falls on each arm alike, not always on the baseline."""
    rows = []
    order = list(arms.items())
    for i, p in enumerate(prompts):
        turn = dict(order if (i + repeat) % 2 == 0 else order[::-1])
        # every arm's tokens against the baseline's, whichever ran first
        timed = {arm: (out, dt) for arm, out, dt, _ in timed_arms(engine, p, turn, sp)}
        base = next(timed[a][0].token_ids for a, s in arms.items() if s is None)
        for arm in arms:
            out, dt = timed[arm]
            rows.append({"phase": phase, "condition": condition, "prompt": i, "arm": arm,
                         "tokens": len(out.token_ids), "seconds": dt,
                         "tok_s": len(out.token_ids) / dt,
                         "lossless": out.token_ids == base})
    return rows


def summarize(df: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Per (condition, arm): summed tokens / seconds → ``tok_s``, ``lossless``; and the goal
    rows: each arm's competing/alone tok/s (≥ MIN_KEPT) and the change of the EAGLE-3/baseline
    ratio (≤ MAX_RATIO_CHANGE)."""
    g = df.groupby(["condition", "arm"], sort=False).agg(
        tokens=("tokens", "sum"), seconds=("seconds", "sum"), lossless=("lossless", "all"))
    g["tok_s"] = g["tokens"] / g["seconds"]
    summary = g.reset_index()
    t = summary.pivot(index="arm", columns="condition", values="tok_s")
    goals = []
    for arm in ("baseline", "eagle3"):
        kept = float(t.loc[arm, "competing"] / t.loc[arm, "alone"])
        goals.append({"goal": f"{arm} tok/s competing / alone", "figure": kept,
                      "bound": f">= {MIN_KEPT}", "met": kept >= MIN_KEPT})
    alone = float(t.loc["eagle3", "alone"] / t.loc["baseline", "alone"])
    busy = float(t.loc["eagle3", "competing"] / t.loc["baseline", "competing"])
    change = busy / alone - 1.0
    goals.append({"goal": f"EAGLE-3/baseline competing {busy:.2f}x vs alone {alone:.2f}x",
                  "figure": change, "bound": f"|change| <= {MAX_RATIO_CHANGE}",
                  "met": abs(change) <= MAX_RATIO_CHANGE})
    summary["speedup"] = [float(r.tok_s / t.loc["baseline", r.condition])
                          for r in summary.itertuples()]
    return summary, pd.DataFrame(goals)
