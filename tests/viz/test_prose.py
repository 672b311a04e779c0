"""Computed prose: a claim's words come from its interval, and a page whose claim does not
follow from its numbers is caught (``check_claims``)."""

from __future__ import annotations

import math

import pytest

from workbench.viz import prose as P


def test_words_follow_the_interval_not_the_point() -> None:
    win = P.ratio("tree", 1.3, 1.1, 1.5, n=8)
    assert win.verdict == P.ABOVE and str(win).startswith("tree is faster than the baseline")
    assert "1.30× [1.10–1.50], n = 8" in str(win)
    lose = P.ratio("tree", 0.8, 0.7, 0.9, n=8)
    assert lose.verdict == P.BELOW and "is slower than" in str(lose)
    # 1.66× [0.75–3.65]: the highest point, but the interval straddles 1×
    unsure = P.ratio("tree", 1.66, 0.75, 3.65, n=4)
    assert unsure.verdict == P.UNRESOLVED
    assert str(unsure) == ("tree vs the baseline: 1.66× [0.75–3.65], n = 4 — "
                           "not resolved at this noise")
    assert "faster" not in str(unsure) and "slower" not in str(unsure)
    # no interval (one sample) is no claim
    assert P.ratio("tree", 2.0, None, None).verdict == P.UNRESOLVED
    assert P.ratio("tree", 2.0, math.nan, math.nan).verdict == P.UNRESOLVED
    assert P.choose(win, "pays", "costs") == "pays"
    assert P.choose(unsure, "pays", "costs") == P.NOT_RESOLVED


def test_compare_two_samples() -> None:
    plain = [27.9, 28.1, 28.0, 27.8, 28.2] * 4
    head = [23.9, 24.1, 23.8, 24.0, 24.2] * 4
    c = P.compare("the plain step", plain, head, "the head's step")
    assert c.verdict == P.ABOVE and c.value == pytest.approx(28.0 / 24.0, rel=1e-3)
    assert "costs more than the head's step: 1.17×" in str(c) and "n = 20/20" in str(c)
    noisy = P.compare("a", [10, 30, 5, 40], [20, 25, 8, 30], "b")
    assert noisy.verdict == P.UNRESOLVED and P.NOT_RESOLVED in str(noisy)


def test_trend_decays_only_when_the_slope_is_resolved() -> None:
    depth = [1] * 50 + [2] * 50 + [3] * 50
    accepted = [1] * 40 + [0] * 10 + [1] * 25 + [0] * 25 + [1] * 10 + [0] * 40
    t = P.trend("acceptance", depth, accepted, falls="decays with depth")
    assert t.verdict == P.BELOW and str(t).startswith("acceptance decays with depth: slope -0.3")
    # node rates 0.26 / 0.11 / 0.15 / 0.19 / 0.23: no monotone decay
    d, a = [], []
    for k, rate in enumerate((0.26, 0.11, 0.15, 0.19, 0.23), start=1):
        d += [k] * 100
        a += [1] * round(100 * rate) + [0] * (100 - round(100 * rate))
    flat = P.trend("acceptance", d, a, falls="decays with depth")
    assert flat.verdict == P.UNRESOLVED and "decays" not in str(flat)


def test_ratio_of_per_item_ratios() -> None:
    m, lo, hi, n = P.ratio_of([1.2, 1.3, 1.25, 1.22])
    assert n == 4 and lo < m < hi and lo > 1.0
    m, lo, hi, n = P.ratio_of([1.2])
    assert n == 1 and math.isnan(lo)
    with pytest.raises(ValueError, match="ratios must be > 0"):
        P.ratio_of([1.0, 0.0])


def test_check_claims_catches_a_claim_its_interval_denies() -> None:
    good = P.prose_html("Fastest: ", P.ratio("tree", 1.3, 1.1, 1.5, n=8), "; ",
                        P.ratio("chain", 1.66, 0.75, 3.65, n=4), ".")
    assert P.check_claims(good) == []
    assert len(P.parse_claims(good)) == 2
    # a page that colours its words by the point estimate: "faster" over a straddling interval
    lie = good.replace('data-verdict="unresolved"', 'data-verdict="above"')
    assert any("gives 'unresolved'" in p for p in P.check_claims(lie))
    # right verdict, wrong words
    words = good.replace("is faster than", "is slower than")
    assert any("does not use its word" in p for p in P.check_claims(words))
    dropped = good.replace(" — not resolved at this noise", "")
    assert any("does not say" in p for p in P.check_claims(dropped))


def test_say_renders_markdown_bits_and_escapes() -> None:
    html = P.prose_html("**bold** `code` <script>", P.ratio("x", 1.2, 1.1, 1.3), P.BR)
    assert "<b>bold</b>" in html and "<code>code</code>" in html and "&lt;script&gt;" in html
    assert html.count("<br>") == 1  # Raw passes through
    assert 'class="wb-prose"' in html and 'class="wb-claim"' in html


def test_a_resolved_bound_never_prints_as_the_reference() -> None:
    c = P.ratio("chain", 0.507, 0.258, 0.997, n=4)
    assert c.verdict == P.BELOW and "[0.258–0.997]" in str(c)
