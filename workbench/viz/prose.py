"""Computed prose: the sentences of a notebook page rendered from its own results and their
intervals, so a page cannot say what its data deny.

A claim is a point estimate with its interval and a reference (1.0 for a ratio, 0 for a
slope). Its words come from the interval, never from the point: an interval wholly above the
reference takes the ``above`` word ("faster than"), wholly below the ``below`` word ("slower
than"), and an interval that contains the reference (or no interval at all) is rendered as
"… — not resolved at this noise"::

    from workbench.viz import prose as P

    c = P.ratio("tree S5 K4 N16", 1.66, 0.75, 3.65, n=4)
    str(c)
    # 'tree S5 K4 N16 vs the baseline: 1.66× [0.75–3.65], n = 4 — not resolved at this noise'
    P.say("The fastest arm: ", c, ".")          # an HTML paragraph for a notebook cell

Every claim renders as ``<span class="wb-claim" data-…>`` carrying its value, interval,
reference and the words it chose; :func:`check_claims` re-derives each verdict from those
numbers, so a test (or ``scripts/check_reports.py``) can read an executed page and fail when a
claim does not follow from its data. Helpers for the usual shapes of a claim:

* :func:`ratio` — a ratio against 1× (speedups, tok/s ÷ baseline's) with its interval;
* :func:`compare` — two samples (e.g. step times): the ratio of their means with a
  delta-method interval, rendered "costs 1.17× [1.05–1.30] as much as";
* :func:`trend` — the least-squares slope of y on x with its interval ("decays with depth");
* :func:`ratio_of` — a ratio interval from per-item ratios (geometric mean, t on the log).

The statistics (``ratio_of``, ``mean_ratio``, the slope's interval) are ``workbench.stats``'s;
this module turns their numbers into words.
"""

from __future__ import annotations

import html
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from workbench.stats import NoTrend, mean_ratio, ratio_of, slope_ci  # noqa: F401  (P.ratio_of)

NOT_RESOLVED = "not resolved at this noise"
CLAIM_CLASS = "wb-claim"
PROSE_CLASS = "wb-prose"
ABOVE, BELOW, UNRESOLVED = "above", "below", "unresolved"


def verdict(lo: float | None, hi: float | None, ref: float = 1.0) -> str:
    """``above`` when the whole interval lies above ``ref``, ``below`` when below, else
    ``unresolved`` (the interval contains ``ref``, or there is none: one sample is no claim)."""
    if lo is None or hi is None or _nan(lo) or _nan(hi) or lo == hi:
        return UNRESOLVED
    if lo > ref:
        return ABOVE
    if hi < ref:
        return BELOW
    return UNRESOLVED


def _nan(x: float) -> bool:
    return isinstance(x, float) and math.isnan(x)


def fmt(x: float | None, digits: int = 2) -> str:
    """A number for prose: fixed decimals up to 1000, thousands separators above, n/a for
    None/NaN."""
    if x is None or _nan(float(x)):
        return "n/a"
    x = float(x)
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    return f"{x:.{digits}f}"


@dataclass(frozen=True)
class Claim:
    """One computed claim. ``text`` is the whole sentence fragment (plain text);
    ``verdict`` one of above / below / unresolved, derived from ``lo``/``hi`` against ``ref``;
    ``word`` the words it used for that verdict (checked by :func:`check_claims`)."""

    text: str
    value: float
    lo: float | None
    hi: float | None
    ref: float
    n: int | None
    verdict: str
    word: str
    other: str = ""  # the word of the opposite verdict (must not appear)

    def __str__(self) -> str:
        return self.text

    @property
    def resolved(self) -> bool:
        return self.verdict != UNRESOLVED

    def html(self) -> str:
        """The claim as a ``wb-claim`` span (its numbers in data attributes)."""
        def a(x: float | None) -> str:
            return "" if x is None or _nan(float(x)) else repr(float(x))

        color = "#555555" if self.verdict == UNRESOLVED else "#111111"
        return (f'<span class="{CLAIM_CLASS}" data-value="{a(self.value)}" data-lo="{a(self.lo)}"'
                f' data-hi="{a(self.hi)}" data-ref="{a(self.ref)}" data-n="{self.n or ""}"'
                f' data-verdict="{self.verdict}" data-word="{html.escape(self.word)}"'
                f' data-other="{html.escape(self.other)}"'
                f' style="color:{color}">{html.escape(self.text)}</span>')

    def _repr_html_(self) -> str:
        return self.html()


def interval(value: float, lo: float | None, hi: float | None, unit: str = "",
             digits: int = 2) -> str:
    """``1.66× [0.75–3.65]`` (``1.66×`` when there is no interval: no bounds, NaN bounds, or a
    zero-width one such as a single sample's, which would read as certainty)."""
    core = f"{fmt(value, digits)}{unit}"
    if lo is None or hi is None or _nan(float(lo)) or _nan(float(hi)) or float(lo) == float(hi):
        return core
    return f"{core} [{fmt(lo, digits)}–{fmt(hi, digits)}]"


def _claim(subject: str, value: float, lo: float | None, hi: float | None, n: int | None,
           ref: float, above: str, below: str, against: str, unit: str,
           digits: int) -> Claim:
    v = verdict(lo, hi, ref)
    # enough decimals that a resolved bound never prints as the reference (0.997 → "1.00")
    while digits < 6 and ((v == BELOW and hi is not None and float(fmt(hi, digits)) >= ref) or
                          (v == ABOVE and lo is not None and float(fmt(lo, digits)) <= ref)):
        digits += 1
    nums = interval(value, lo, hi, unit, digits) + (f", n = {n}" if n is not None else "")
    if v == ABOVE:
        word = above
        text = f"{subject} {above} {against}: {nums}".replace("  ", " ")
    elif v == BELOW:
        word = below
        text = f"{subject} {below} {against}: {nums}".replace("  ", " ")
    else:
        word = NOT_RESOLVED
        text = f"{subject} vs {against}: {nums} — {NOT_RESOLVED}"
    other = {ABOVE: below, BELOW: above}.get(v, "")
    return Claim(text.strip(), float(value), _opt(lo), _opt(hi), float(ref), n, v, word, other)


def _opt(x: float | None) -> float | None:
    return None if x is None or _nan(float(x)) else float(x)


def ratio(subject: str, value: float, lo: float | None, hi: float | None,
          n: int | None = None, ref: float = 1.0, above: str = "is faster than",
          below: str = "is slower than", against: str = "the baseline", unit: str = "×",
          digits: int = 2) -> Claim:
    """A ratio against ``ref`` (1×): e.g. a speedup with its 95 % interval over ``n``
    prompts or repeats."""
    return _claim(subject, value, lo, hi, n, ref, above, below, against, unit, digits)


def compare(subject: str, a: Sequence[float], b: Sequence[float], against: str,
            above: str = "costs more than", below: str = "costs less than",
            unit: str = "×", digits: int = 2) -> Claim:
    """Two samples (e.g. ms per step of two kinds): the ratio of their means with its
    interval — "the plain step costs more than the head's step: 1.17× [1.05–1.30], n = 40/38"
    or "… — not resolved at this noise"."""
    r, lo, hi = mean_ratio(a, b)
    c = _claim(subject, r, lo, hi, None, 1.0, above, below, against, unit, digits)
    text = c.text.replace(interval(r, lo, hi, unit, digits),
                          interval(r, lo, hi, unit, digits) + f", n = {len(a)}/{len(b)}", 1)
    return Claim(text, c.value, c.lo, c.hi, c.ref, len(a) + len(b), c.verdict, c.word, c.other)


def trend(subject: str, x: Sequence[float], y: Sequence[float], rises: str = "rises",
          falls: str = "decays", per: str = "", conf: float = 0.95, digits: int = 3) -> Claim:
    """The least-squares slope of ``y`` on ``x`` (e.g. accepted-or-not per drafted node
    against its depth) with its Student-t interval: "acceptance decays with depth: slope
    −0.041 [−0.06–−0.02] per level, n = 1,200" — or not resolved at this noise."""
    try:
        slope, lo, hi, se, n = slope_ci(x, y, conf)
    except NoTrend as e:  # too few points, or x does not vary: no trend to claim
        return Claim(f"{subject}: {e} — {NOT_RESOLVED}", math.nan, None, None, 0.0, len(x),
                     UNRESOLVED, NOT_RESOLVED)
    v = verdict(lo, hi, 0.0) if se > 0 else (ABOVE if slope > 0 else BELOW if slope < 0
                                              else UNRESOLVED)
    nums = f"slope {slope:+.{digits}f} [{lo:+.{digits}f} to {hi:+.{digits}f}]{per}, " \
        f"n = {n:,}"
    if v == ABOVE:
        word, text = rises, f"{subject} {rises}: {nums}"
    elif v == BELOW:
        word, text = falls, f"{subject} {falls}: {nums}"
    else:
        word, text = NOT_RESOLVED, f"{subject}: {nums} — {NOT_RESOLVED}"
    other = {ABOVE: falls, BELOW: rises}.get(v, "")
    return Claim(text, slope, lo, hi, 0.0, n, v, word, other)


def choose(claim: Claim, above: str, below: str, unresolved: str = NOT_RESOLVED) -> str:
    """The phrase that goes with ``claim``'s verdict (for a conclusion drawn from it)."""
    return {ABOVE: above, BELOW: below}.get(claim.verdict, unresolved)


class Raw(str):
    """A string :func:`say` passes through unescaped (trusted markup: ``BR``, a table)."""


BR = Raw("<br>")


def say(*parts: Any) -> Any:
    """``IPython.display.HTML`` of one paragraph (class ``wb-prose``): strings are escaped
    (``**bold**`` and ```code``` are kept, :class:`Raw` parts such as ``BR`` pass through),
    claims render as their ``wb-claim`` spans."""
    from IPython.display import HTML

    return HTML(prose_html(*parts))


def prose_html(*parts: Any) -> str:
    out = []
    for p in parts:
        if isinstance(p, Claim):
            out.append(p.html())
        elif isinstance(p, Raw):
            out.append(str(p))
        else:
            s = html.escape(str(p))
            s = re.sub(r"\*\*(.+?)\*\*", r"<b>\1</b>", s)
            s = re.sub(r"`(.+?)`", r"<code>\1</code>", s)
            out.append(s)
    return (f'<div class="{PROSE_CLASS}" style="font:14px sans-serif;line-height:1.5;'
            f'margin:4px 0">{"".join(out)}</div>')


CLAIM_RE = re.compile(r'<span class="wb-claim"([^>]*)>(.*?)</span>', re.S)
ATTR_RE = re.compile(r'data-([a-z]+)="([^"]*)"')


def parse_claims(text: str) -> list[dict[str, Any]]:
    """Every ``wb-claim`` span in an HTML text: its data attributes and inner text."""
    out = []
    for m in CLAIM_RE.finditer(text):
        attrs = {k: html.unescape(v) for k, v in ATTR_RE.findall(m.group(1))}
        attrs["text"] = html.unescape(m.group(2))
        out.append(attrs)
    return out


def check_claims(text: str) -> list[str]:
    """Problems with the claims in an HTML text (an executed page): a verdict that its own
    interval does not give, or words that do not match the verdict. Empty when every claim
    follows from its data."""
    problems = []
    for c in parse_claims(text):
        lo, hi, ref = (float(c[k]) if c.get(k) else None for k in ("lo", "hi", "ref"))
        want = verdict(lo, hi, 0.0 if ref is None else ref)
        said = c.get("verdict", "")
        where = c["text"][:120]
        if said != want:
            problems.append(f"claim says {said!r} but its interval [{lo}, {hi}] against {ref} "
                            f"gives {want!r}: {where}")
        word = c.get("word", "")
        if want == UNRESOLVED and NOT_RESOLVED not in c["text"]:
            problems.append(f"unresolved claim does not say '{NOT_RESOLVED}': {where}")
        other = c.get("other", "")
        if want != UNRESOLVED and (NOT_RESOLVED in c["text"] or not word or
                                   word not in c["text"] or (other and other in c["text"])):
            problems.append(f"resolved claim does not use its word {word!r} (alone): {where}")
    return problems
