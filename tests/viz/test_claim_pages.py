"""scripts/check_reports.py holds pages 08 and 09 to their computed claims: each must render at
least one, and every page as many as the exporter counted."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytest.importorskip("playwright")
REPO = Path(__file__).resolve().parents[2]


def _checker():
    spec = importlib.util.spec_from_file_location("check_reports",
                                                  REPO / "scripts" / "check_reports.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["check_reports"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_claim_pages_need_a_claim_and_every_page_its_count() -> None:
    cr = _checker()
    assert cr.claims_expected({"html": "08_policy_lab.html"}) == 1
    assert cr.claims_expected({"html": "09_moe_speculation.html",
                               "claims": {"claims": 0, "problems": []}}) == 1
    assert cr.claims_expected({"html": "09_moe_speculation.html",
                               "claims": {"claims": 5, "problems": []}}) == 5
    assert cr.claims_expected({"html": "02_draft_trees.html"}) == 0
    short = cr.PageCheck("09_moe_speculation.html", 0, claims=0, claims_expected=1)
    assert not short.ok
    assert cr.PageCheck("09_moe_speculation.html", 0, claims=2, claims_expected=1).ok
