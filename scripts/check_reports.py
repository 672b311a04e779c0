"""Open every exported report in headless Chromium and check that it rendered, offline.

    python scripts/check_reports.py                  # reports/manifest.json → all pages
    python scripts/check_reports.py --reports /tmp/r --json /tmp/r/check.json

Per page (``file://``, Debian's ``/usr/bin/chromium`` driven by playwright-python; never
``playwright install``): wait for ``.js-plotly-plot .main-svg``, count plotly figures drawn
(``.js-plotly-plot`` holding a ``.main-svg``) against those the manifest expects, count widget
views rendered by the html-manager against the widget outputs, collect console errors, page
errors and failed requests (the pages must need no network), any "could not load" note the
exporter's fallback put in place of a widget or figure, and save a full-page screenshot to
``reports/screenshots/<page>.png``. Also checks that ``index.html`` links every page, and that
every computed claim on a page (``workbench.viz.prose``: a ``wb-claim`` span) says what its
own interval gives (``check_claims``), and that a page shows every claim the exporter counted
in it (``manifest.json``'s ``claims``) — pages 08 and 09 (``CLAIM_PAGES``) at least one each,
since their conclusions are checked claims. Exit status 1 if any page falls short, logged an
error or carries a claim its interval denies.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from playwright.sync_api import TimeoutError as PlaywrightTimeoutError

REPO = Path(__file__).resolve().parents[1]
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
PLOTS_JS = """() => Array.from(document.querySelectorAll('.js-plotly-plot'))
                     .filter(p => p.querySelector('.main-svg')).length"""
# html-manager renders each widget-view <script> into a new element beside it (same parent)
VIEW_ROOTS_JS = """() => Array.from(document.querySelectorAll(
    'script[type="application/vnd.jupyter.widget-view+json"]'))
    .filter(s => s.parentElement && s.parentElement.querySelector('.jupyter-widgets, .widget-box,'
        + ' .lm-Widget')).length"""


# Without the vendored renderer (no npm) pages load it from these CDNs: offline those requests
# fail by design (widgets show as text); they are reported as expected, not as errors.
WIDGET_CDNS = ("cdn.jsdelivr.net", "unpkg.com", "cdnjs.cloudflare.com")


# anywidget (plotly's FigureWidget) rejects an unobserved promise when a model takes over 2 s
# to initialise (a busy machine, the 5 MB plotly bundle); the figure still renders. Reported as
# benign when every expected figure rendered, as an error otherwise.
BENIGN = ("[anywidget] Failed to initialize model.",)

# pages whose conclusions are computed claims (the replay against the real run, the dense vs MoE
# verify cost): each must render at least one, whatever the manifest says
CLAIM_PAGES = ("08_policy_lab", "09_moe_speculation")


def claims_expected(entry: dict[str, Any]) -> int:
    """How many computed claims a page must render: the exporter's count, at least 1 on a
    page of ``CLAIM_PAGES``."""
    counted = int((entry.get("claims") or {}).get("claims", 0))
    return max(counted, 1) if Path(entry["html"]).stem in CLAIM_PAGES else counted


@dataclass
class PageCheck:
    page: str
    plotly_expected: int
    plotly_rendered: int = 0
    widgets_expected: int = 0
    widgets_rendered: int = 0
    console_errors: list[str] = field(default_factory=list)
    failed_requests: list[str] = field(default_factory=list)
    expected_failures: list[str] = field(default_factory=list)
    benign: list[str] = field(default_factory=list)
    claims: int = 0
    claims_expected: int = 0
    claim_problems: list[str] = field(default_factory=list)
    screenshot: str = ""
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return (self.plotly_rendered >= self.plotly_expected and
                self.widgets_rendered >= self.widgets_expected and
                not self.console_errors and not self.failed_requests and
                self.claims >= self.claims_expected and not self.claim_problems)


def load_manifest(reports: Path) -> list[dict[str, Any]]:
    """Pages from ``manifest.json``; without one, every ``*.html`` with expectations read
    from the page itself (plotly divs and widget-view scripts)."""
    path = reports / "manifest.json"
    if path.is_file():
        return json.loads(path.read_text())["pages"]
    pages = []
    for html in sorted(reports.glob("*.html")):
        text = html.read_text(encoding="utf-8", errors="replace")
        pages.append({"html": html.name, "plotly_figures": text.count('class="plotly-graph-div"'),
                      "widget_views": text.count("application/vnd.jupyter.widget-view+json")})
    return pages


def check_page(browser: Any, html: Path, expected_plots: int, expected_widgets: int,
               shots: Path, timeout_ms: int, widgets_offline: bool,
               expected_claims: int = 0) -> PageCheck:
    """Open one page, wait for it to render, count, screenshot."""
    res = PageCheck(html.name, expected_plots, widgets_expected=expected_widgets
                    if widgets_offline else 0, claims_expected=expected_claims)
    sys.path.insert(0, str(REPO))
    from workbench.viz.prose import check_claims, parse_claims

    source = html.read_text(encoding="utf-8", errors="replace")
    res.claims = len(parse_claims(source))
    res.claim_problems = check_claims(source)
    if res.claims < res.claims_expected:
        res.claim_problems.append(f"{res.claims} computed claim(s) on the page, "
                                  f"{res.claims_expected} expected")
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.on("console", lambda m: res.console_errors.append(m.text[:300])
            if m.type == "error" else None)
    page.on("pageerror", lambda e: res.console_errors.append(f"pageerror: {str(e)[:300]}"))

    def failed(request: Any) -> None:
        msg = f"{request.url[:200]} ({request.failure})"
        cdn = any(host in request.url for host in WIDGET_CDNS)
        (res.expected_failures if cdn and not widgets_offline else res.failed_requests).append(msg)

    page.on("requestfailed", failed)
    t0 = time.perf_counter()
    deadline = t0 + timeout_ms / 1e3
    try:
        # big pages (plotly.js inline, widget state) parse slowly: do not wait for "load"
        page.goto(html.resolve().as_uri(), wait_until="domcontentloaded", timeout=timeout_ms)
        if expected_plots:
            page.wait_for_selector(".js-plotly-plot .main-svg", timeout=timeout_ms)
    except PlaywrightTimeoutError as e:
        res.console_errors.append(f"timeout: {str(e).splitlines()[0]}")
    # Figures and widgets render asynchronously: poll until every expected one is there.
    while True:
        res.plotly_rendered = page.evaluate(PLOTS_JS)
        res.widgets_rendered = page.evaluate(VIEW_ROOTS_JS)
        done = res.plotly_rendered >= expected_plots and \
            res.widgets_rendered >= res.widgets_expected
        if done or time.perf_counter() > deadline:
            break
        page.wait_for_timeout(250)
    page.wait_for_timeout(500)  # let late console errors arrive
    missing = page.locator(".wb-missing").count()  # export_reports' "could not load" notes
    if missing:
        res.console_errors.append(f"{missing} output(s) show the 'could not load' message")
    if res.plotly_rendered >= expected_plots:
        res.benign = [e for e in res.console_errors if any(b in e for b in BENIGN)]
        res.console_errors = [e for e in res.console_errors if e not in res.benign]
    if not widgets_offline:  # the console echoes each expected CDN failure
        res.expected_failures += [e for e in res.console_errors if "ERR_" in e]
        res.console_errors = [e for e in res.console_errors if "ERR_" not in e]
    res.seconds = round(time.perf_counter() - t0, 1)
    shots.mkdir(parents=True, exist_ok=True)
    shot = shots / f"{html.stem}.png"
    page.screenshot(path=str(shot), full_page=True)
    res.screenshot = str(shot.relative_to(html.parent)) if shot.is_relative_to(html.parent) \
        else str(shot)
    page.close()
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reports", type=Path, default=REPO / "reports")
    ap.add_argument("--timeout", type=float, default=180.0, help="seconds per page")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    ns = ap.parse_args(argv)
    if not Path(CHROMIUM).exists():
        print(f"{CHROMIUM} not found: apt-get install -y chromium", file=sys.stderr)
        return 2
    from playwright.sync_api import sync_playwright

    pages = load_manifest(ns.reports)
    if not pages:
        print(f"no pages in {ns.reports}", file=sys.stderr)
        return 1
    manifest = ns.reports / "manifest.json"
    offline = True
    if manifest.is_file():
        offline = json.loads(manifest.read_text())["widgets"].get("renderer") == "offline"
    index = ns.reports / "index.html"
    unlisted = [e["html"] for e in pages if not index.is_file() or
                f'href="{e["html"]}"' not in index.read_text(encoding="utf-8")]
    if unlisted:
        print(f"index.html does not list: {', '.join(unlisted)}", file=sys.stderr)
    results: list[PageCheck] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            for entry in pages:
                results.append(check_page(browser, ns.reports / entry["html"],
                                          int(entry.get("plotly_figures", 0)),
                                          int(entry.get("widget_views", 0)),
                                          ns.reports / "screenshots", int(ns.timeout * 1e3),
                                          offline, claims_expected(entry)))
        finally:
            browser.close()
    print(f"{'page':45s} {'plotly':>9s} {'widgets':>9s} {'errors':>6s} {'failed':>6s} "
          f"{'claims':>6s}  screenshot")
    for r in results:
        print(f"{r.page:45s} {r.plotly_rendered:>4d}/{r.plotly_expected:<4d} "
              f"{r.widgets_rendered:>4d}/{r.widgets_expected:<4d} {len(r.console_errors):>6d} "
              f"{len(r.failed_requests):>6d} {r.claims:>3d}/{r.claims_expected:<2d} "
              f"{r.screenshot}  "
              f"{'ok' if r.ok else 'FAIL'}")
        for e in r.console_errors + r.failed_requests + r.claim_problems:
            print(f"    {e}")
        for e in r.expected_failures:
            print(f"    (expected without the vendored renderer) {e}")
        for e in r.benign:
            print(f"    (benign) {e}")
    if not offline:
        print("note: widgets were exported with CDN URLs (no npm); widget views not counted")
    if ns.json is not None:
        ns.json.write_text(json.dumps([{**asdict(r), "ok": r.ok} for r in results], indent=2)
                           + "\n")
    return 0 if all(r.ok for r in results) and not unlisted else 1


if __name__ == "__main__":
    sys.exit(main())
