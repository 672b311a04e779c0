"""Benchmarks that flag their own noise: load, self-consistency checks, confidence intervals.

A speed figure is only worth quoting if the run it came from was quiet and its numbers agree
with each other. This module gives every ``bench`` result (and a notebook) the means to say so:

* :class:`LoadSampler` / :func:`load_before` / :func:`load_after` — the 1/5/15-min load
  average before and after a run (``os.getloadavg``);
* :func:`sanity_flags` — checks a table of result rows and returns :class:`Flag` s:

  ==================== =====================================================================
  code                 raised when
  ==================== =====================================================================
  ``loaded``           the 1-min load before or after the run exceeds the cores (other work
                       competed for the CPU: absolute figures are low, ratios noisier)
  ``tok_s_vs_itl``     at concurrency 1, tok/s and ``tokens per step × 1000 / ITL p50`` differ
                       by more than 20 % (the clock, the ITL or the token count is off); with
                       ``ttft_p50_ms``, ``tokens`` and ``requests`` the expectation includes
                       each request's TTFT: n / (TTFT + (n − 1) · ITL / tokens per step)
  ``never_vs_baseline`` arm ``never`` (speculative engine, drafting off) and ``baseline``
                       differ in tok/s by more than 5 % at the same level (noise, or a real
                       K=0 tax above 5 %)
  ``speedup_above_tau`` a speedup over baseline larger than τ (a speculative step never costs
                       less than a plain one, so speedup ≤ τ: a larger figure is noise)
  ``contended``        other processes used the CPU when the run started
                       (:func:`contention_flags`, ``workbench.engine.contention``): every
                       figure of the run is provisional
  ``provisional_choice`` the engine ran on a choice measured under contention
                       (:func:`choice_flags`; ``workbench.engine.autotune``): ``--strict``
                       refuses the result
  ==================== =====================================================================

* :func:`mark` — adds a ``flags`` column (comma-separated codes, "" when clean) to a table;
* :func:`report` — the ``{"machine", "load", "flags"}`` block every result file carries;
* :func:`mean_ci` / :func:`ci_columns` — mean and Student-t confidence interval over repeats
  (``workbench.stats``, imported here for the pages that read them from this module).

Use from a notebook::

    from workbench.bench import sanity
    with sanity.LoadSampler() as load:
        df = run_concurrency(engine, prompts, levels=(1, 4))
    flags = sanity.sanity_flags(df, load=load.as_dict())
    df = sanity.mark(df, flags)           # df["flags"]: "loaded,never_vs_baseline" / ""
    for f in flags:
        print(f.code, f.message)
    m, lo, hi = sanity.mean_ci([101.0, 97.5, 99.2])

Rows are mappings (or a DataFrame) with any of the columns ``arm``, ``concurrency``, ``repeat``,
``tok_s``, ``itl_p50_ms``, ``tau``, ``spec_share``, ``speedup`` / ``vs_baseline``,
``load_before`` / ``load_after``; checks whose columns are missing are skipped.
"""

from __future__ import annotations

import math
import os
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import pandas as pd

from workbench.engine.autotune import choice_records
from workbench.engine.contention import Conditions
from workbench.machine import loadavg, machine_info
from workbench.stats import ci_columns, mean_ci  # noqa: F401  (pages: sanity.mean_ci)

LOADED = "loaded"
TOK_S_VS_ITL = "tok_s_vs_itl"
NEVER_VS_BASELINE = "never_vs_baseline"
SPEEDUP_ABOVE_TAU = "speedup_above_tau"
CONTENDED = "contended"
PROVISIONAL_CHOICE = "provisional_choice"
CODES = (LOADED, TOK_S_VS_ITL, NEVER_VS_BASELINE, SPEEDUP_ABOVE_TAU, CONTENDED,
         PROVISIONAL_CHOICE)

ITL_TOLERANCE = 0.20  # tok/s vs tokens-per-step × 1000 / ITL p50 at c=1
NEVER_TOLERANCE = 0.05  # never vs baseline tok/s at the same level


@dataclass(frozen=True)
class Flag:
    """One reason not to trust a result. ``code`` is one of :data:`CODES`; ``message`` says
    what was seen, with the numbers; ``row`` is the offending row (None: the whole run)."""

    code: str
    message: str
    row: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (the row's values as plain Python types)."""
        d = asdict(self)
        if self.row is not None:
            d["row"] = {k: _plain(v) for k, v in self.row.items()}
        return d


def _plain(v: Any) -> Any:
    if hasattr(v, "item") and callable(v.item):
        return v.item()
    return v


def load_before() -> list[float] | None:
    """The load average ``[1, 5, 15 min]`` now: call right before a run."""
    return loadavg()


def load_after() -> list[float] | None:
    """The load average ``[1, 5, 15 min]`` now: call right after a run."""
    return loadavg()


class LoadSampler:
    """Load average before and after a block::

        with LoadSampler() as load:
            ...                       # the benchmark
        load.before, load.after       # [1, 5, 15-min] each (None where the OS has none)
        load.as_dict()                # {"before": [...], "after": [...], "cores": n}
    """

    def __init__(self, cores: int | None = None) -> None:
        self.cores = cores if cores is not None else os.cpu_count()
        self.before: list[float] | None = None
        self.after: list[float] | None = None

    def start(self) -> LoadSampler:
        self.before = load_before()
        return self

    def stop(self) -> LoadSampler:
        self.after = load_after()
        return self

    def __enter__(self) -> LoadSampler:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def as_dict(self) -> dict[str, Any]:
        return {"before": self.before, "after": self.after, "cores": self.cores}


def _rows(rows: Iterable[Mapping[str, Any]] | pd.DataFrame) -> list[dict[str, Any]]:
    if isinstance(rows, pd.DataFrame):
        return [dict(r) for r in rows.to_dict(orient="records")]
    return [dict(r) for r in rows]


def _get(row: Mapping[str, Any], key: str) -> float | None:
    v = row.get(key)
    if v is None or isinstance(v, str):
        return None
    try:
        x = float(v)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(x) else x


def _load1(load: Any) -> float | None:
    if load is None:
        return None
    if isinstance(load, int | float):
        return float(load)
    seq = list(load)
    return float(seq[0]) if seq else None


def sanity_flags(rows: Iterable[Mapping[str, Any]] | pd.DataFrame, *, cores: int | None = None,
                 load: Mapping[str, Any] | None = None) -> list[Flag]:
    """Check result rows (see the module docstring for the codes and columns).

    ``cores`` defaults to ``load["cores"]`` or ``os.cpu_count()``; ``load`` is a
    :meth:`LoadSampler.as_dict` for the whole run (rows may also carry their own
    ``load_before`` / ``load_after``). Rows without ``concurrency`` count as concurrency 1.
    Returns the flags in check order; empty when the run looks clean.
    """
    table = _rows(rows)
    cores = cores or (load or {}).get("cores") or os.cpu_count() or 1
    flags: list[Flag] = []
    # 1. load above the cores, for the run and for any row that carries its own
    if load is not None:
        for when in ("before", "after"):
            x = _load1(load.get(when))
            if x is not None and x > cores:
                flags.append(Flag(LOADED, f"load {x:.2f} {when} the run > {cores} cores: other "
                                          "work competed for the CPU", None))
    for r in table:
        for when in ("before", "after"):
            x = _load1(r.get(f"load_{when}"))
            if x is not None and x > cores:
                flags.append(Flag(LOADED, f"load {x:.2f} {when} this row > {cores} cores", r))
                break
    # 2. tok/s vs tokens per step × 1000 / ITL p50, at concurrency 1, uniform arms only
    for r in table:
        c, tok_s, itl = _get(r, "concurrency"), _get(r, "tok_s"), _get(r, "itl_p50_ms")
        if (c if c is not None else 1.0) != 1.0 or tok_s is None or itl is None or itl <= 0:
            continue
        share = _get(r, "spec_share")
        tau = _get(r, "tau") or 1.0
        if share is None:
            per_step = tau
        elif share <= 0.01:
            per_step = 1.0
        elif share >= 0.99:
            per_step = tau
        else:
            continue  # a mix of plain and speculative steps: ITL p50 is one of the two
        expect = per_step * 1000.0 / itl
        formula = f"{per_step:.2f} × 1000 / ITL p50 {itl:.2f} ms"
        ttft, tokens, requests = _get(r, "ttft_p50_ms"), _get(r, "tokens"), _get(r, "requests")
        if ttft is not None and tokens and requests:
            # at c=1 a request's time is its TTFT plus its remaining tokens' steps: with short
            # outputs the TTFT is a sizeable share, so the plain 1000/ITL would flag every run
            n = tokens / requests
            expect = 1000.0 * n / (ttft + (n - 1) * itl / per_step)
            formula = (f"{n:.0f} tokens / (TTFT p50 {ttft:.1f} ms + {n - 1:.0f} × ITL p50 "
                       f"{itl:.2f} ms / {per_step:.2f})")
        if abs(tok_s / expect - 1.0) > ITL_TOLERANCE:
            flags.append(Flag(TOK_S_VS_ITL, f"{r.get('arm', 'row')} at c=1: {tok_s:.1f} tok/s "
                              f"vs {formula} = {expect:.1f} (off by "
                              f"{100 * (tok_s / expect - 1):+.0f} %, > "
                              f"{100 * ITL_TOLERANCE:.0f} %)", r))
    # 3. never vs baseline at the same level (mean over repeats)
    by: dict[float, dict[str, list[float]]] = {}
    for r in table:
        arm, tok_s = r.get("arm"), _get(r, "tok_s")
        if arm in ("never", "baseline") and tok_s is not None:
            c = _get(r, "concurrency") or 1.0
            by.setdefault(c, {}).setdefault(str(arm), []).append(tok_s)
    for c, arms in sorted(by.items()):
        if "never" in arms and "baseline" in arms:
            nv, bl = statistics.fmean(arms["never"]), statistics.fmean(arms["baseline"])
            ratio = nv / bl
            if abs(ratio - 1.0) > NEVER_TOLERANCE:
                flags.append(Flag(NEVER_VS_BASELINE, f"c={c:g}: never {nv:.1f} vs baseline "
                                  f"{bl:.1f} tok/s ({ratio:.3f}×, off by > "
                                  f"{100 * NEVER_TOLERANCE:.0f} %)",
                                  {"arm": "never", "concurrency": c, "tok_s": nv,
                                   "baseline_tok_s": bl}))
    # 4. speedup above tau, for rows that speculated
    for r in table:
        speed: float | None = _get(r, "speedup")
        if speed is None:
            speed = _get(r, "vs_baseline")
        accept, share = _get(r, "tau"), _get(r, "spec_share")
        if speed is None or accept is None or (share is not None and share <= 0.0):
            continue
        if r.get("arm") in ("baseline", "never") or accept <= 1.0 and share is None:
            continue
        if speed > accept:
            flags.append(Flag(SPEEDUP_ABOVE_TAU, f"{r.get('arm', 'row')}"
                              f"{_at(r)}: speedup {speed:.2f}× > τ {accept:.2f} (impossible "
                              "without noise)", r))
    return flags


def choice_flags(choices: Mapping[str, Any] | None) -> list[Flag]:
    """One run-wide ``provisional_choice`` flag naming the engine choices (``Engine.choices``)
    that were measured under contention, with where and at what load; [] when none were."""
    recs = [r for r in choice_records(choices or {}) if r["provisional"]]
    if not recs:
        return []
    named = "; ".join(f"{r['name']}={r['choice']} measured {r['measured_at']} at load "
                      f"{r['load1']}, others {r['others']} of {r['cores']} cores" for r in recs)
    return [Flag(PROVISIONAL_CHOICE, f"ran on provisional choices (measured under contention, "
                                     f"re-measured at the next quiet start): {named}", None)]


def contention_flags(conditions: Mapping[str, Any] | None) -> list[Flag]:
    """A run-wide ``contended`` flag when the run-start conditions
    (``workbench.engine.contention.Conditions.to_dict()``) were contended."""
    if not conditions or not conditions.get("contended"):
        return []

    c = Conditions(**{k: v for k, v in conditions.items()
                      if k in Conditions.__dataclass_fields__})
    return [Flag(CONTENDED, f"the machine was {c.describe()} when the run started: every "
                            "figure is provisional", None)]


def _at(r: Mapping[str, Any]) -> str:
    c = _get(r, "concurrency")
    return "" if c is None else f" at c={c:g}"


def _matches(flag_row: Mapping[str, Any], row: Mapping[str, Any]) -> bool:
    keys = [k for k in ("arm", "concurrency", "repeat", "prompt", "shape") if k in flag_row]
    if not keys:
        return False
    for k in keys:
        a, b = flag_row.get(k), row.get(k)
        if k == "concurrency" and a is not None and b is not None:
            if float(a) != float(b):
                return False
        elif k in row and a != b:
            return False
        elif k not in row:
            return False
    return True


def mark(df: pd.DataFrame, flags: Sequence[Flag]) -> pd.DataFrame:
    """A copy of ``df`` with a ``flags`` column: the codes of the flags about each row
    (matched on arm / concurrency / repeat / prompt / shape), plus run-wide flags (row None)
    on every row; "" for a clean row."""
    out = df.copy()
    run_wide = sorted({f.code for f in flags if f.row is None})
    col = []
    for r in out.to_dict(orient="records"):
        codes = list(run_wide)
        for f in flags:
            if f.row is not None and f.code not in codes and _matches(f.row, r):
                codes.append(f.code)
        col.append(",".join(codes))
    out["flags"] = col
    return out


def report(flags: Sequence[Flag], load: Mapping[str, Any] | None,
           machine: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The block a result file carries: ``{"machine": ..., "load": {"before", "after",
    "cores"}, "flags": [{"code", "message", "row"}...], "flagged": bool}``."""
    return {"machine": dict(machine) if machine is not None else machine_info(),
            "load": dict(load) if load is not None else None,
            "flags": [f.to_dict() for f in flags], "flagged": bool(flags)}


def print_flags(flags: Sequence[Flag], limit: int = 12) -> None:
    """Print the flags (or that the run looks clean) under a result table: run-wide ones and
    row flags other than per-row load first, at most ``limit``, then counts of the rest."""
    if not flags:
        print("\nsanity: clean (load ≤ cores, numbers self-consistent)")
        return
    print(f"\nsanity: {len(flags)} flag(s) — figures from this run are marked in the table")
    shown = [f for f in flags if f.row is None or f.code != LOADED][:limit]
    for f in shown:
        print(f"  [{f.code}] {f.message}")
    rest = len(flags) - len(shown)
    if rest:
        counts: dict[str, int] = {}
        for f in flags:
            if f not in shown:
                counts[f.code] = counts.get(f.code, 0) + 1
        print("  ... and " + ", ".join(f"{n} more [{c}]" for c, n in counts.items())
              + " (all in the saved JSON)")


def exit_code(ok: bool, flags: Sequence[Flag], strict: bool) -> int:
    """A bench command's exit status: 1 when the run failed (``ok`` False, e.g. not lossless),
    2 when ``strict`` and any flag was raised, else 0."""
    if not ok:
        return 1
    return 2 if strict and flags else 0
