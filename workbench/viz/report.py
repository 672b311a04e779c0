"""What a notebook page says about the trust of its own numbers: the sanity flags of
:mod:`workbench.bench.sanity` rendered as a visible block, and tables with flagged rows marked.

``sanity_block(flags, what)`` returns an HTML block (``IPython.display.HTML``) with the class
``wb-sanity`` and ``data-flags`` = the number of flags; ``scripts/export_reports.py`` counts
these blocks to give every page its sanity status in ``reports/index.html``. A notebook shows one
block under every table or figure whose numbers were checked.
"""

from __future__ import annotations

import html
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from workbench.data_io import DATA_DIR, load_result_files
from workbench.engine.autotune import conditions_line
from workbench.stats import mean_ci

if TYPE_CHECKING:
    import pandas as pd


class Flag(Protocol):
    """What a page shows of a sanity flag (``workbench.bench.sanity.Flag`` has these)."""

    code: str
    message: str

SANITY_CLASS = "wb-sanity"
RESULTS_ENV = "WORKBENCH_RESULTS"


def results_dir() -> Path:
    """Where a page reads saved results: ``$WORKBENCH_RESULTS`` when set (the prose test runs
    a page on other result sets this way), else the repository's ``data/results``."""
    env = os.environ.get(RESULTS_ENV)
    return Path(env) if env else DATA_DIR / "results"

MAX_MESSAGES = 3  # messages shown per flag code


def sanity_html(flags: Sequence[Flag], what: str) -> str:
    """The HTML of :func:`sanity_block` (plain string, for tests and the exporter)."""
    n = len(flags)
    codes = sorted({f.code for f in flags})
    if n == 0:
        body = (f"<b>sanity: no flags</b> — {html.escape(what)}: every check of "
                "<code>workbench.bench.sanity</code> passed.")
        color, bg = "#1b5e20", "#e8f5e9"
    else:
        # grouped by code, a few messages each: 80 "loaded" rows would bury the rest
        items = ""
        for code in codes:
            msgs = [f.message for f in flags if f.code == code]
            shown = "; ".join(html.escape(m) for m in msgs[:MAX_MESSAGES])
            more = f" … and {len(msgs) - MAX_MESSAGES} more" if len(msgs) > MAX_MESSAGES else ""
            items += f"<li><code>{html.escape(code)}</code> ×{len(msgs)}: {shown}{more}</li>"
        body = (f"<b>⚠ sanity: {n} flag{'s' if n != 1 else ''}</b> — {html.escape(what)}: "
                "treat the flagged numbers as noise, not as findings (rerun on an idle "
                f"machine).<ul style='margin:4px 0 0 0'>{items}</ul>")
        color, bg = "#8a4b00", "#fff4e5"
    return (f'<div class="{SANITY_CLASS}" data-flags="{n}" data-codes="{",".join(codes)}" '
            f'style="font:13px sans-serif;color:{color};background:{bg};padding:6px 10px;'
            f'border-left:4px solid {color};margin:4px 0">{body}</div>')


CONDITIONS_CLASS = "wb-conditions"
def conditions_html(choices: dict[str, Any], what: str,
                    machine: dict[str, Any] | None = None,
                    load: dict[str, Any] | None = None) -> str:
    """The conditions a result ran under, as an HTML block (class ``wb-conditions``,
    ``data-conditions`` = the choices in one line): the engine's measured choices (GEMM path,
    attention, threads, compile, policy …, each with how and where it was decided), the
    machine and the load. ``scripts/export_reports.py`` copies the page's blocks into its
    stamp."""
    # what, how, where and at what load each choice was measured (PROVISIONAL when measured
    # under contention): the engine's own stamp line
    chosen = {k: v for k, v in choices.items() if not isinstance(v, dict) or "choice" in v}
    short = conditions_line(chosen) or "none recorded"
    notes = [f"{k}: {v['note']}" for k, v in chosen.items()
             if isinstance(v, dict) and v.get("note")]
    bits = [f"<b>conditions</b> — {html.escape(what)}: measured choices: {html.escape(short)}"]
    if notes:
        bits.append("<small>" + html.escape("; ".join(notes)) + "</small>")
    if machine:
        m = machine
        bits.append("machine: " + html.escape(
            f"{m.get('cpu', '?')}, {m.get('cores', '?')} cores, torch {m.get('torch', '?')}"
            + (f", commit {m['commit']}" if m.get("commit") else "")
            + (f", {m['time']}" if m.get("time") else "")))
    if load:
        lb, la = load.get("before"), load.get("after")
        if lb and la:
            bits.append(f"load (1-min) {lb[0]:.2f} → {la[0]:.2f} on {load.get('cores', '?')} "
                        "cores")
    return (f'<div class="{CONDITIONS_CLASS}" data-conditions="{html.escape(short)}" '
            'style="font:12px sans-serif;color:#333;background:#f4f6fa;padding:5px 10px;'
            f'border-left:4px solid #5b7db1;margin:4px 0">{"<br>".join(bits)}</div>')


def conditions_block(choices: dict[str, Any], what: str,
                     machine: dict[str, Any] | None = None,
                     load: dict[str, Any] | None = None) -> Any:
    """``IPython.display.HTML`` of :func:`conditions_html`."""
    from IPython.display import HTML

    return HTML(conditions_html(choices, what, machine, load))


def sanity_block(flags: Sequence[Flag], what: str) -> Any:
    """``IPython.display.HTML`` of the flags raised on ``what`` (a visible 'no flags' block
    when there are none: a page must say that it checked)."""
    from IPython.display import HTML

    return HTML(sanity_html(flags, what))


def highlight_flagged(df: pd.DataFrame, column: str = "flags") -> Any:
    """A pandas ``Styler`` that paints rows with a non-empty ``column`` amber (the numbers of
    a flagged row are shown, marked, not hidden)."""
    if column not in df.columns:
        raise ValueError(f"highlight_flagged: no column {column!r}; got {list(df.columns)}")

    def paint(row: Any) -> list[str]:
        bad = bool(str(row[column]))
        return ["background-color:#fff4e5" if bad else "" for _ in row]

    return df.style.apply(paint, axis=1).format(precision=2)


def ratio_ci(df: pd.DataFrame, by: Sequence[str], value: str,
             conf: float = 0.95) -> pd.DataFrame:
    """Per group of ``by``: the geometric mean of a ratio column ``value`` (speedups) and its
    confidence interval, computed on log(value) with :func:`workbench.stats.mean_ci`
    and mapped back — a ratio's interval stays positive and symmetric in log space (a
    Student-t interval on the raw ratios can reach below 0× with few noisy repeats). Columns:
    ``by``..., ``value``, ``<value>_lo``, ``<value>_hi``, ``n``."""
    import math

    import pandas as pd

    if (df[value] <= 0).any():
        raise ValueError(f"ratio_ci: {value} must be > 0")
    rows = []
    for key, g in df.groupby(list(by), sort=False):
        keys = key if isinstance(key, tuple) else (key,)
        m, lo, hi = mean_ci([math.log(v) for v in g[value]], conf)
        rows.append({**dict(zip(by, keys, strict=True)), value: math.exp(m),
                     f"{value}_lo": math.exp(lo), f"{value}_hi": math.exp(hi), "n": len(g)})
    return pd.DataFrame(rows, columns=[*by, value, f"{value}_lo", f"{value}_hi", "n"])


def paired_ratio(results: pd.DataFrame, value: str = "tok_s", baseline: str = "baseline",
                 by: Sequence[str] = ("concurrency",), pair: str = "repeat",
                 conf: float = 0.95) -> pd.DataFrame:
    """Each arm's ``value`` over the baseline's *in the same run* (same ``by`` and ``pair``,
    e.g. the same level and repeat), summarised per (arm, ``by``) with :func:`ratio_ci`:
    columns arm, ``by``…, ``ratio``, ``ratio_lo``, ``ratio_hi``, ``n``. The one ratio a
    page's table, figure and prose should all show (a ratio of means is another number)."""
    keys = [*by, pair] if pair in results.columns else list(by)
    base = results[results["arm"] == baseline][[*keys, value]].rename(
        columns={value: "_base"})
    paired = results[results["arm"] != baseline].merge(base, on=keys)
    paired = paired.assign(ratio=paired[value] / paired["_base"])
    return ratio_ci(paired, ["arm", *by], "ratio", conf)


# the result-config keys that are a ``bench`` flag, in the CLI's spelling
_RERUN_FLAGS = {"levels": "--levels", "max_new_tokens": "--max-new-tokens", "prompts": "--prompts",
                "repeats": "--repeats"}


def runnable_command(command: str) -> bool:
    """Whether a recorded command can be pasted and run: ``python -m workbench ...`` that splits
    as a shell line, with at most one trailing parenthesised note (``(one repeat)``) and no
    note spliced into its arguments (a ``(from DIR)`` written into an ``--out`` path)."""
    import shlex

    body = re.sub(r"\s+\([^()]*\)\s*$", "", command.strip())
    if "(" in body or ")" in body or not body.startswith("python -m workbench "):
        return False
    try:
        shlex.split(body)
    except ValueError:
        return False
    return True


def rerun_command(bench: str, config: dict[str, Any]) -> str:
    """The ``bench`` command that reruns a result, from the config it saved."""
    parts = [f"python -m workbench bench {bench}"]
    for key, flag in _RERUN_FLAGS.items():
        value = config.get(key)
        if value is None:
            continue
        parts.append(f"{flag} {','.join(map(str, value)) if isinstance(value, list) else value}")
    return " ".join(parts)


def saved_run_line(folder: str | Path, bench: str, doc: dict[str, Any]) -> str:
    """Who made a saved result and on what: the exact command (from the per-machine file
    ``<kind>.json`` of :mod:`workbench.bench.results`, matched by time), the models it ran
    (its ``--model``/``--draft``, else the command's defaults: the shipped pair), the machine
    and when. ``doc`` is the result's own JSON (``machine``, ``config``)."""
    import shlex

    m = doc.get("machine") or {}
    command = None
    for kdoc in load_result_files(folder).values():
        entry = kdoc.get("benchmarks", {}).get(bench)
        if entry and (not m.get("time") or entry.get("time") == m.get("time")):
            command = entry.get("command")
            break
    models = "the shipped pair (data/models/wb-target + wb-eagle3, the command's defaults)"
    recorded = None
    if command and not runnable_command(command):
        recorded, command = command, rerun_command(bench, doc.get("config") or {})
    if command:
        args = shlex.split(command.split(" (from ")[0])
        if "--model" in args or "--url" in args:
            flag = "--model" if "--model" in args else "--url"
            i = args.index(flag)
            models = f"{flag} {args[i + 1]}" if i + 1 < len(args) else models
    note = (f" (the recorded command `{recorded}` cannot run: this one is rebuilt from the "
            "result's config)" if recorded else "" if command else " (command not recorded)")
    return (f"saved by `{command or f'python -m workbench bench {bench}'}`"
            f"{note} · models: {models} · "
            f"{m.get('cpu', '?')}, {m.get('cores', '?')} cores · {m.get('time', 'time ?')}"
            + (f" · commit {m['commit']}" if m.get("commit") else ""))
