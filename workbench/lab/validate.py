"""Replayed vs measured: a real ``bench concurrency --policy ... --json`` run beside a replay.

The measured ratio is each arm's tok/s over the ``never`` arm's at the same level (mean over
repeats), the replayed one ``vs_never``; ``ratio_error`` = replayed ÷ measured − 1 and
``within_10pct`` says whether it is within ±10 %.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd

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


def measured_ratios(rows: list[dict[str, Any]]) -> pd.DataFrame:
    """(arm, concurrency) → tok/s over never's, mean tok/s over repeats first."""
    df = pd.DataFrame(rows)
    if "never" not in set(df["arm"]):
        raise ConfigError("--against: the bench run has no 'never' arm (the ratio's base)")
    s = df.groupby(["arm", "concurrency"], as_index=False)["tok_s"].mean()
    base = s[s["arm"] == "never"].set_index("concurrency")["tok_s"]
    s["measured_vs_never"] = s["tok_s"] / s["concurrency"].map(base)
    return s.rename(columns={"arm": "policy", "tok_s": "measured_tok_s"})


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
    out["within_10pct"] = [None if pd.isna(e) else bool(abs(e) <= TOLERANCE)
                           for e in out["ratio_error"]]
    out.attrs.update(replayed.attrs)
    return out
