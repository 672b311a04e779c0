"""Markdown for the model cards and the real-model report: tables and the cells in them.

The cards (``train/card.py``, ``train/moe_card.py``, ``train/real_head_card.py``) and
``bench/real_model.py``'s report render saved results (``workbench.data_io.load_json``) into
Markdown; every number goes through one of these, so a missing figure reads "—" everywhere and
an interval is written one way::

    table(["arm", "tok/s"], [["baseline", num(101.3, ".1f")]])
    interval(1.66, 0.75, 3.65, unit="×")          # '1.66× (0.75–3.65)'
    row_interval({"tok_s": 9.1, "tok_s_lo": 8.7, "tok_s_hi": 9.4}, "tok_s")

It imports nothing of the workbench: any layer may use it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

MISSING = "—"


def _absent(x: Any) -> bool:
    return x is None or (isinstance(x, float) and math.isnan(x))


def num(x: Any, fmt: str = ".2f", unit: str = "") -> str:
    """``x`` formatted with ``fmt`` (and ``unit``), or "—" when it is None or NaN."""
    return MISSING if _absent(x) else format(float(x), fmt) + unit


def interval(value: Any, lo: Any, hi: Any, fmt: str = ".2f", unit: str = "",
             style: str = "paren") -> str:
    """``value (lo–hi)`` (``style="paren"``) or ``value [lo, hi]`` (``"bracket"``); the value
    alone when either bound is missing, "—" when the value is."""
    v = num(value, fmt, unit)
    if _absent(lo) or _absent(hi) or _absent(value):
        return v
    if style == "paren":
        return f"{v} ({num(lo, fmt)}–{num(hi, fmt)})"
    if style == "bracket":
        return f"{v} [{num(lo, fmt)}, {num(hi, fmt)}]"
    raise ValueError(f"interval: style must be 'paren' or 'bracket', got {style!r}")


def row_interval(row: Mapping[str, Any], key: str, fmt: str = ".2f", unit: str = "",
                 style: str = "paren") -> str:
    """:func:`interval` of ``row[key]`` with ``row[key_lo]`` and ``row[key_hi]`` (the columns
    ``workbench.stats.ci_columns`` and the benches write)."""
    return interval(row.get(key), row.get(f"{key}_lo"), row.get(f"{key}_hi"), fmt, unit, style)


def table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A Markdown table (``|`` rows, one rule line), ending in a newline. Cells are written
    with ``str``; a row whose length differs from the header's is refused."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for i, r in enumerate(rows):
        cells = [str(c) for c in r]
        if len(cells) != len(header):
            raise ValueError(f"table: row {i} has {len(cells)} cells for {len(header)} columns")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
