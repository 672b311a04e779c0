"""Replayed vs measured: a real ``bench concurrency --policy ... --json`` run beside a replay.

The measured ratio is each arm's tok/s over the ``never`` arm's at the same level and repeat,
its mean over repeats with a 95 % Student-t interval (``measured_lo``/``measured_hi``, n =
``measured_n``; none from one repeat); the replayed one ``vs_never``. ``ratio_error`` =
replayed ÷ measured − 1 with its interval (``error_lo``/``error_hi``: the replayed ratio over
the measured interval's ends), and ``within_10pct`` says whether the point is within ±10 %.
:func:`sign_test` asks whether the errors share a sign more often than chance (a systematic
bias a "within ±10 % in k of n" count hides).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from scipy import stats

from workbench.errors import ConfigError

TOLERANCE = 0.10


def read_bench_rows(path: str | Path) -> list[dict[str, Any]]:
    """The rows of ``bench concurrency``: its saved ``concurrency.json`` (``{"rows": [...]}``)
    or the JSON lines ``--json`` prints."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--against: no file at {p}")
    text = p.read_text()
    try:
        doc = json.loads(text)
        rows = doc["rows"] if isinstance(doc, dict) else doc
    except json.JSONDecodeError:
        try:
            rows = [json.loads(line) for line in text.splitlines() if line.strip()]
        except json.JSONDecodeError as e:
            raise ConfigError(f"--against: {p} is neither a bench JSON file nor JSON lines "
                              f"({e.msg})") from None
    except KeyError:
        raise ConfigError(f"--against: {p} has no 'rows'") from None
    if not isinstance(rows, list) or not all(isinstance(r, dict) and {"arm", "concurrency",
                                                                       "tok_s"} <= set(r)
                                             for r in rows):
        raise ConfigError(f"--against: {p}: expected rows with arm, concurrency, tok_s")
    return rows


def measured_ratios(rows: list[dict[str, Any]], conf: float = 0.95) -> pd.DataFrame:
    """(arm, concurrency) → tok/s over never's in the same repeat: the mean over repeats, its
    Student-t interval and n (one repeat: no interval)."""
    df = pd.DataFrame(rows)
    if "never" not in set(df["arm"]):
        raise ConfigError("--against: the bench run has no 'never' arm (the ratio's base)")
    if "repeat" not in df:
        df["repeat"] = 0
    cell = df.groupby(["arm", "concurrency", "repeat"], as_index=False)["tok_s"].mean()
    base = cell[cell["arm"] == "never"].set_index(["concurrency", "repeat"])["tok_s"]
    cell["ratio"] = [t / base.get((c, r), float("nan"))
                     for t, c, r in zip(cell["tok_s"], cell["concurrency"], cell["repeat"],
                                        strict=True)]
    out = []
    for (arm, c), g in cell.groupby(["arm", "concurrency"]):
        x = g["ratio"].dropna().to_numpy()
        n = len(x)
        mean = float(x.mean()) if n else float("nan")
        half = (float(stats.t.ppf(0.5 + conf / 2, n - 1) * x.std(ddof=1) / np.sqrt(n))
                if n > 1 else float("nan"))
        out.append({"policy": arm, "concurrency": c, "measured_tok_s": float(g["tok_s"].mean()),
                    "measured_vs_never": mean, "measured_lo": mean - half,
                    "measured_hi": mean + half, "measured_n": n})
    return pd.DataFrame(out)


def against(replayed: pd.DataFrame,
            measured: str | Path | list[dict[str, Any]] | pd.DataFrame) -> pd.DataFrame:
    """``replayed`` (lab replay's rows) with the measured ratios, ``ratio_error`` and
    ``within_10pct`` where the bench ran that policy at that level. ``measured``: a bench
    output file (:func:`read_bench_rows`) or its rows (``run_concurrency``'s frame)."""
    if isinstance(measured, pd.DataFrame):
        rows = measured.to_dict(orient="records")
    elif isinstance(measured, list):
        rows = measured
    else:
        rows = read_bench_rows(measured)
    m = measured_ratios(rows)
    out = replayed.merge(m, on=["policy", "concurrency"], how="left")
    out["ratio_error"] = out["vs_never"] / out["measured_vs_never"] - 1.0
    out["error_lo"] = out["vs_never"] / out["measured_hi"] - 1.0
    out["error_hi"] = out["vs_never"] / out["measured_lo"] - 1.0
    out["within_10pct"] = [None if pd.isna(e) else bool(abs(e) <= TOLERANCE)
                           for e in out["ratio_error"]]
    out.attrs.update(replayed.attrs)
    return out


def sign_test(check: pd.DataFrame, alpha: float = 0.05) -> dict[str, Any]:
    """Whether the replay's errors lean one way: the count of positive and negative
    ``ratio_error`` (zeros dropped) and the two-sided binomial p of so uneven a split;
    ``systematic`` when p < ``alpha``. With fewer than 6 cells no split is significant at 5 %:
    ``systematic`` is then False and ``note`` says why."""
    e = check["ratio_error"].dropna()
    pos, neg = int((e > 0).sum()), int((e < 0).sum())
    n = pos + neg
    p = float(stats.binomtest(pos, n, 0.5).pvalue) if n else float("nan")
    out = {"n": n, "positive": pos, "negative": neg, "p": p,
           "systematic": bool(n and p < alpha),
           "mean_error": float(e.mean()) if len(e) else float("nan")}
    if n < 6:
        out["note"] = f"{n} cells: too few for a sign test at {alpha:.0%}"
    return out


def sign_text(t: dict[str, Any]) -> str:
    """One sentence of the sign test for prose and the CLI."""
    if not t["n"]:
        return "no replayed cell has a measured ratio"
    lean = ("over" if t["positive"] > t["negative"] else "under")
    base = (f"{t['positive']} of {t['n']} errors positive, {t['negative']} negative "
            f"(sign test p = {t['p']:.3f})")
    if t["systematic"]:
        return (f"{base}: the replay {lean}-predicts systematically (mean error "
                f"{t['mean_error']:+.1%})")
    return base + (f"; {t['note']}" if t.get("note") else ": no systematic sign")
