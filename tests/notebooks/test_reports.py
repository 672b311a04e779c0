"""Export one fast notebook to HTML and check it in headless Chromium, offline: every plotly
figure drawn, widget views rendered by the vendored html-manager, no console errors, no
network requests, a screenshot written."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from nb_browser import REPO

pytest.importorskip("playwright")
pytest.importorskip("nbclient")

NOTEBOOK = REPO / "notebooks" / "01_quickstart.ipynb"


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("reports")
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "export_reports.py"), "--fast",
                           "--out", str(out), str(NOTEBOOK)], capture_output=True, text=True,
                          env=env, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


def test_export_writes_page_and_manifest(exported: Path) -> None:
    manifest = json.loads((exported / "manifest.json").read_text())
    (page,) = manifest["pages"]
    assert page["html"] == "01_quickstart.html" and page["error"] is None
    assert page["plotly_figures"] >= 3  # coloured text, speedup bars, τ histogram
    html = (exported / page["html"]).read_text()
    assert not re.search(r'<script[^>]*src="https?://', html), "a script still loads from the web"
    assert html.count('class="plotly-graph-div"') == page["plotly_static"]
    if manifest["widgets"]["renderer"] == "offline":  # npm reached the registry
        assert (exported / "vendor" / "embed-amd.js").is_file()
        assert 'src="vendor/require.js"' in html
        # the widget renderer is loaded only by pages that hold widget views
        assert ("'vendor/embed-amd.js'" in html) == (page["widget_views"] > 0)
    # plotly.js lives once in vendor/, not inside the page
    assert (exported / "vendor" / "plotly.min.js").stat().st_size > 1_000_000
    assert 'src="vendor/plotly.min.js"' in html and len(html) < 1_500_000
    assert "NBVAL_" not in html  # pytest-nbval's markers are not part of the page
    # the stamp and the index carry date, commit, machine, load, run time and sanity status
    assert 'class="wb-stamp"' in html and "load (1-min" in html
    assert page["commit"] and page["machine"] and page["load_before"] and page["sanity"]
    # the stamp names the engine's measured choices and the page's computed claims, all of
    # which follow from their own intervals
    assert "conditions (measured choices): " in html and "gemm=" in html
    assert page["conditions"] and page["claims"]["claims"] >= 3
    assert page["claims"]["problems"] == [] and "computed claim(s)" in html
    index = (exported / "index.html").read_text()
    assert 'href="01_quickstart.html"' in index and page["sanity"]["status"] in index


def test_check_reports_fails_a_page_whose_claim_its_interval_denies(exported: Path,
                                                                   tmp_path: Path) -> None:
    """A page edited to word a claim against its interval fails the browser check."""
    bad = tmp_path / "bad"
    shutil.copytree(exported, bad)
    page = bad / "01_quickstart.html"
    html = page.read_text()
    lie = re.sub(r'data-verdict="(below|above|unresolved)"',
                 lambda m: 'data-verdict="' + {"below": "above", "above": "below",
                                               "unresolved": "above"}[m.group(1)] + '"',
                 html, count=1)
    assert lie != html
    page.write_text(lie)
    out = bad / "check.json"
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "check_reports.py"),
                           "--reports", str(bad), "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    (res,) = json.loads(out.read_text())
    assert proc.returncode == 1 and not res["ok"] and res["claim_problems"]


def test_stale_pages_removed_and_index_lists_the_rest(exported: Path) -> None:
    sys.path.insert(0, str(REPO / "scripts"))
    import export_reports as er

    (exported / "quickstart.html").write_text("<html>an old page</html>")
    assert er.remove_stale(exported, {"01_quickstart.html"}) == ["quickstart.html"]
    assert (exported / "01_quickstart.html").is_file()


def test_page_without_vendor_says_why_in_place(exported: Path, tmp_path: Path) -> None:
    """A page copied without its vendor/ folder shows a message, not a silent gap."""
    from nb_browser import CHROMIUM, CHROMIUM_ARGS
    from playwright.sync_api import sync_playwright

    alone = tmp_path / "alone"
    alone.mkdir()
    (alone / "01_quickstart.html").write_bytes((exported / "01_quickstart.html").read_bytes())
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            page.goto((alone / "01_quickstart.html").as_uri(), wait_until="load")
            page.wait_for_selector(".wb-missing", timeout=60_000)
            text = page.locator(".wb-missing").first.inner_text()
            n = page.locator(".wb-missing").count()
        finally:
            browser.close()
    assert "copy the whole reports/ folder" in text and n >= 3  # one per figure


def test_page_renders_offline_in_chromium(exported: Path) -> None:
    out = exported / "check.json"
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "check_reports.py"),
                           "--reports", str(exported), "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    (res,) = json.loads(out.read_text())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert res["ok"] and res["plotly_rendered"] == res["plotly_expected"] >= 3
    assert res["console_errors"] == [] and res["failed_requests"] == []
    assert res["claims"] >= 3 and res["claim_problems"] == []
    shot = exported / res["screenshot"]
    assert shot.is_file() and shot.stat().st_size > 20_000
