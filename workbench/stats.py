"""The statistics behind every interval the workbench prints, on ``scipy.stats``.

One module for the project's numbers about numbers, so a benchmark, a card, a figure and a
page's prose all compute an interval the same way:

* :func:`t_quantile` / :func:`mean_ci` — a mean over repeats and its Student-t interval;
* :func:`ci_columns` — the same per group of a table (``<value>``, ``_lo``, ``_hi``, ``n``);
* :func:`bootstrap_ratio` — a ratio of sums over prompts with its percentile bootstrap interval;
* :func:`ratio_of` — a ratio from per-item ratios (geometric mean, Student-t on the logs);
* :func:`mean_ratio` — the ratio of two samples' means (delta method on the log, Welch df);
* :func:`slope_ci` — a least-squares slope with its Student-t interval;
* :func:`percentile` — the linear-interpolation percentile latency tables quote (p50, p99).

It imports nothing of the workbench: any layer may use it.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

import numpy as np
import pandas as pd
from scipy import stats as _st


def _finite(values: Sequence[float | None]) -> list[float]:
    return [float(v) for v in values if v is not None and not math.isnan(float(v))]


def t_quantile(p: float, df: float) -> float:
    """The Student-t quantile: ``t`` with ``P(T_df <= t) = p``, ``0 < p < 1``, ``df >= 1``."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"t_quantile: p must be in (0, 1), got {p}")
    if df < 1:
        raise ValueError(f"t_quantile: df must be >= 1, got {df}")
    return float(_st.t.ppf(p, df))


def mean_ci(values: Sequence[float | None], conf: float = 0.95) -> tuple[float, float, float]:
    """``(mean, lo, hi)``: the mean of ``values`` and its two-sided Student-t confidence
    interval at level ``conf`` (the repeats of one measurement). One value: lo = hi = mean
    (no spread measured, not a claim of none). None and NaN are dropped; none left: NaNs."""
    if not 0.0 < conf < 1.0:
        raise ValueError(f"mean_ci: conf must be in (0, 1), got {conf}")
    xs = _finite(values)
    if not xs:
        return (math.nan, math.nan, math.nan)
    m = statistics.fmean(xs)
    if len(xs) < 2:
        return (m, m, m)
    half = t_quantile(0.5 + conf / 2.0, len(xs) - 1) * statistics.stdev(xs) / math.sqrt(len(xs))
    return (m, m - half, m + half)


def ci_columns(df: pd.DataFrame, by: Sequence[str], value: str,
               conf: float = 0.95) -> pd.DataFrame:
    """Per group of ``by``: ``<value>`` (mean), ``<value>_lo``, ``<value>_hi`` and ``n``
    over the rows (repeats) of ``df``."""
    rows = []
    for key, g in df.groupby(list(by), sort=False):
        keys = key if isinstance(key, tuple) else (key,)
        m, lo, hi = mean_ci(g[value].tolist(), conf)
        rows.append({**dict(zip(by, keys, strict=True)), value: m, f"{value}_lo": lo,
                     f"{value}_hi": hi, "n": len(g)})
    return pd.DataFrame(rows)


def bootstrap_ratio(num: Sequence[float], den: Sequence[float], n_boot: int = 2000,
                    seed: int = 0, conf: float = 0.95) -> tuple[float, float, float]:
    """``(sum(num) / sum(den), lo, hi)``: a ratio of sums over items (prompts) and its
    percentile bootstrap interval, items resampled with replacement (``seed``: reproducible)."""
    a, b = np.asarray(num, dtype=float), np.asarray(den, dtype=float)
    if len(a) == 0 or len(a) != len(b):
        raise ValueError(f"bootstrap_ratio: need equal non-empty lists, got {len(a)}/{len(b)}")
    point = float(a.sum() / b.sum())
    idx = np.random.default_rng(seed).integers(0, len(a), (n_boot, len(a)))
    ratios = a[idx].sum(1) / np.maximum(b[idx].sum(1), 1e-12)
    q = (1 - conf) / 2
    return point, float(np.quantile(ratios, q)), float(np.quantile(ratios, 1 - q))


def ratio_of(ratios: Sequence[float], conf: float = 0.95) -> tuple[float, float, float, int]:
    """(geometric mean, lo, hi, n) of per-item ratios, the interval Student-t on the logs
    (NaN bounds for a single item)."""
    xs = _finite(ratios)
    if any(r <= 0 for r in xs):
        raise ValueError("ratio_of: ratios must be > 0")
    if not xs:
        raise ValueError("ratio_of: no ratios")
    m, lo, hi = mean_ci([math.log(r) for r in xs], conf)
    if len(xs) < 2:
        return math.exp(m), math.nan, math.nan, len(xs)
    return math.exp(m), math.exp(lo), math.exp(hi), len(xs)


def mean_ratio(a: Sequence[float], b: Sequence[float],
               conf: float = 0.95) -> tuple[float, float, float]:
    """mean(a) / mean(b) with a delta-method interval on the log ratio (Welch degrees of
    freedom, rounded down); NaN bounds when either side has fewer than two samples."""
    xa, xb = _finite(a), _finite(b)
    if not xa or not xb:
        raise ValueError("mean_ratio: both samples need values")
    ma, mb = statistics.fmean(xa), statistics.fmean(xb)
    if ma <= 0 or mb <= 0:
        raise ValueError("mean_ratio: means must be > 0")
    r = ma / mb
    if len(xa) < 2 or len(xb) < 2:
        return r, math.nan, math.nan
    va = statistics.variance(xa) / (len(xa) * ma * ma)
    vb = statistics.variance(xb) / (len(xb) * mb * mb)
    se = math.sqrt(va + vb)
    if se == 0:
        return r, r, r
    df = (va + vb) ** 2 / ((va * va / (len(xa) - 1) if va else 0) +
                           (vb * vb / (len(xb) - 1) if vb else 0))
    t = t_quantile(0.5 + conf / 2.0, max(1, int(df)))
    return r, r * math.exp(-t * se), r * math.exp(t * se)


class NoTrend(ValueError):
    """:func:`slope_ci` on data that has no slope to estimate (too few points, x constant)."""


def slope_ci(x: Sequence[float], y: Sequence[float],
             conf: float = 0.95) -> tuple[float, float, float, float, int]:
    """``(slope, lo, hi, se, n)``: the least-squares slope of ``y`` on ``x`` and its Student-t
    interval (n − 2 degrees of freedom). Fewer than 3 points, or an ``x`` that does not vary:
    :class:`NoTrend` saying which (its message reads in a sentence)."""
    pts = [(float(a), float(b)) for a, b in zip(x, y, strict=True)]
    n = len(pts)
    if n < 3:
        raise NoTrend(f"too few points for a trend (n = {n})")
    mx = statistics.fmean(p[0] for p in pts)
    my = statistics.fmean(p[1] for p in pts)
    sxx = sum((p[0] - mx) ** 2 for p in pts)
    if sxx == 0:
        raise NoTrend("x does not vary")
    slope = sum((p[0] - mx) * (p[1] - my) for p in pts) / sxx
    resid = sum((p[1] - my - slope * (p[0] - mx)) ** 2 for p in pts)
    se = math.sqrt(resid / (n - 2) / sxx)
    half = t_quantile(0.5 + conf / 2.0, n - 2) * se
    return slope, slope - half, slope + half, se, n


def percentile(xs: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0–100) of ``xs``, linear interpolation between order
    statistics (numpy's default, as SGLang's bench_serving reports); NaN for no values."""
    return float(np.percentile(xs, q)) if len(xs) else math.nan
