"""JupyterLab in headless Chromium: start ``jupyter lab`` on a free port with a token, then

* open 01_quickstart, Run All Cells, and see plotly figures rendered by Lab's own plotly
  renderer with no error output;
* open a two-cell notebook that displays the ``Explorer`` widget, press its **step** button in
  the browser, and see the draft tree drawn and the "press step" placeholder gone from the page
  (the widget's view, not only its Python state).

Notebooks run from a temporary folder so Lab's autosave never touches the repository."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from nb_browser import CHROMIUM, CHROMIUM_ARGS, REPO

pytest.importorskip("playwright")
pytest.importorskip("jupyterlab")

NOTEBOOK = "01_quickstart.ipynb"
EXPLORER_NOTEBOOK = "explorer.ipynb"


def write_explorer_notebook(path: Path) -> None:
    """Two cells: build the micro engine and display an Explorer; nothing stepped yet."""
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    nb.cells = [
        nbformat.v4.new_code_cell(
            "import workbench as wb\n"
            "from workbench.train.demo_models import demo_models\n"
            "from workbench.viz.widgets import Explorer\n"
            "models = demo_models(fast=True)\n"
            "engine = wb.Engine.from_pretrained(models.target, draft=models.draft)"),
        nbformat.v4.new_code_cell(
            "explorer = Explorer(engine, prompt=models.prompts[0], max_new_tokens=16)\n"
            "explorer"),
    ]
    nbformat.write(nb, path)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def lab(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """(base URL with token, root folder) of a running JupyterLab serving a copy of 01."""
    root = tmp_path / "lab"
    root.mkdir()
    shutil.copy(REPO / "notebooks" / NOTEBOOK, root / NOTEBOOK)
    write_explorer_notebook(root / EXPLORER_NOTEBOOK)
    port, token = free_port(), secrets.token_hex(16)
    env = {**os.environ, "WORKBENCH_FAST": "1", "JUPYTER_CONFIG_DIR": str(tmp_path / "cfg"),
           "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime")}
    log = (tmp_path / "lab.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--ip", "127.0.0.1", "--port", str(port),
         "--allow-root", "--no-browser", f"--IdentityProvider.token={token}",
         f"--ServerApp.root_dir={root}", "--LabApp.news_url=",
         "--ServerApp.disable_check_xsrf=True"],
        stdout=log, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=5):
                    break
            except (urllib.error.URLError, ConnectionError):
                if proc.poll() is not None or time.monotonic() > deadline:
                    log.flush()
                    pytest.fail("jupyter lab did not start:\n" +
                                (tmp_path / "lab.log").read_text()[-3000:])
                time.sleep(0.5)
        yield f"{base}/lab/tree/{{}}?token={token}", root
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@contextlib.contextmanager
def browser_page(height: int) -> Iterator[tuple[Any, list[str]]]:
    """A headless Chromium page 1400 px wide and the list its page errors are appended to."""
    from playwright.sync_api import sync_playwright

    errors: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": height})
            page.on("pageerror", lambda e: errors.append(str(e)))
            yield page, errors
        finally:
            browser.close()


def open_and_run_all(page: Any, url: str, shows: str | None = None) -> None:
    """Open a notebook in Lab, accept the kernel dialog if any, Run All Cells, wait until done.

    ``shows``: a selector that appears once the run is under way, waited for before the done
    check (a page where no cell has started yet would pass that check at once)."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeoutError

    page.goto(url, timeout=120_000)
    page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=120_000)
    # Lab may ask which kernel to start; the notebook's own (python3) is preselected
    try:
        page.click(".jp-Dialog .jp-mod-accept", timeout=15_000)
    except PlaywrightTimeoutError:
        pass  # no dialog: Lab started the notebook's kernel by itself
    # the kernel must be up before Run All (status shown in the toolbar)
    page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']",
                           timeout=120_000)
    page.click(".lm-MenuBar-itemLabel:text-is('Run')")
    page.click(".lm-Menu-itemLabel:text-is('Run All Cells')")
    if shows is not None:
        page.wait_for_selector(shows, timeout=300_000)
    # Run All is done when no prompt shows [*] and the kernel is idle again.
    page.wait_for_function(
        """() => !Array.from(document.querySelectorAll('.jp-InputArea-prompt'))
                .some(p => p.textContent.includes('*'))""", timeout=300_000)
    page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']",
                           timeout=60_000)


# Not marked slow: 31-48 s on 2 idle cores (Lab start, kernel start, the notebook, rendering).
# On a heavily loaded machine it took minutes; the waits below allow for that.


def test_lab_runs_quickstart_and_renders_figures(lab: tuple[str, Path], tmp_path: Path) -> None:
    url, _ = lab
    with browser_page(height=1000) as (page, errors):
        # jupyterlab-plotly draws into the output element itself (it gets .js-plotly-plot)
        open_and_run_all(page, url.format(NOTEBOOK), shows=".jp-Notebook .js-plotly-plot .main-svg")
        figures = page.locator(".jp-Notebook .js-plotly-plot").count()
        tracebacks = page.locator(".jp-OutputArea-output",
                                  has_text="Traceback (most recent call last)").count()
        lossless = page.locator(".jp-OutputArea-output",
                                has_text="lossless (greedy, token for token): True").count()
        shot = tmp_path / "lab_01_quickstart.png"
        page.screenshot(path=str(shot), full_page=False)
    assert tracebacks == 0
    assert lossless == 1
    assert figures >= 3  # coloured text, speedup bars, τ histogram
    assert shot.stat().st_size > 20_000
    assert not errors, errors


def test_lab_explorer_step_replaces_the_placeholder(lab: tuple[str, Path],
                                                    tmp_path: Path) -> None:
    url, _ = lab
    with browser_page(height=1100) as (page, errors):
        open_and_run_all(page, url.format(EXPLORER_NOTEBOOK))
        placeholder = ".jp-Notebook .wb-explorer-placeholder"
        page.wait_for_selector(placeholder, timeout=120_000)
        before = page.locator(placeholder).inner_text()
        page.click(".jp-Notebook .jupyter-widgets button:has-text('step')")
        # the tree FigureWidget is drawn by plotly.js in the browser
        page.wait_for_selector(".jp-Notebook .jupyter-widgets .js-plotly-plot .main-svg",
                               timeout=120_000)
        page.wait_for_function(
            "() => document.body.innerText.includes('this step τ =')", timeout=60_000)
        placeholders = page.locator(placeholder).count()
        svg_text = page.locator(".jp-Notebook .js-plotly-plot").first.inner_text()
        shot = tmp_path / "lab_explorer.png"
        page.screenshot(path=str(shot), full_page=False)
        keep = os.environ.get("WB_SCREENSHOTS")  # a folder to keep the screenshot in
        if keep:
            Path(keep).mkdir(parents=True, exist_ok=True)
            shutil.copy(shot, Path(keep) / shot.name)
    assert "press step" in before
    assert placeholders == 0, "the 'press step' placeholder is still on the page after a step"
    assert "press step" not in svg_text and "Draft tree" in svg_text
    assert not errors, errors
