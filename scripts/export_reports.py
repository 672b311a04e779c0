"""Execute the notebooks and export each as a self-contained HTML page under ``reports/``.

    python scripts/export_reports.py                 # every notebooks/*.ipynb
    python scripts/export_reports.py --fast notebooks/01_quickstart.ipynb --out /tmp/r

What makes the pages work offline (ECOSYSTEM-NOTES.md, "Plotly/ipywidgets in exported HTML"):

1. The kernel runs with ``PLOTLY_RENDERER=notebook``: each page inlines plotly.js once and every
   figure renders without a CDN. (Committed notebooks keep the default mimetype renderer, which
   nbconvert drops.)
2. Widget state is stored at execution and rendered by ``@jupyter-widgets/html-manager@1``
   installed with npm into ``data/work/npm-widgets`` and copied, with ``require.js``, to
   ``reports/vendor``; pages load ``vendor/require.js`` and ``vendor/embed-amd.js``. Plotly's
   ``FigureWidget`` is an anywidget: its AMD build (the ``anywidget`` Python package's
   nbextension) is copied to ``vendor/anywidget.js``; ``require.config`` maps it and the
   html-manager's modules into ``vendor/`` (so the widgets' icon fonts load from there).
   Without npm the pages fall back to nbconvert's CDN URLs: offline, widgets show as text
   (figures are unaffected); the manifest says which happened.
3. MathJax and Mermaid (CDN scripts the notebooks do not use) are left out of the template,
   and the MathJax ``<script src=...cdnjs...>`` that plotly's HTML renderer adds to every
   figure is removed from the outputs (no figure uses LaTeX).

Writes ``reports/<notebook>.html`` and ``reports/manifest.json`` (per page: seconds, figures
and widget views expected, errors), which ``scripts/check_reports.py`` reads. Exit status 1 if
any notebook failed to execute.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = REPO / "notebooks"
NPM_DIR = REPO / "data" / "work" / "npm-widgets"
NPM_PACKAGES = ("@jupyter-widgets/html-manager@1", "requirejs")
PLOTLY_MIME = "application/vnd.plotly.v1+json"
CDN_MATHJAX = re.compile(r'<script[^>]*src="https://cdnjs\.cloudflare\.com/ajax/libs/mathjax/'
                         r'[^"]*"[^>]*>\s*</script>')
WIDGET_VIEW_MIME = "application/vnd.jupyter.widget-view+json"

# The lab template minus the CDN scripts the notebooks do not need, plus requirejs paths.
TEMPLATE = r"""
{%- extends 'lab/index.html.j2' -%}
{%- block html_head_js_requirejs -%}
<script src="{{ resources.require_js_url }}"></script>
{%- if resources.wb_require_paths %}
<script>require.config({paths: {{ resources.wb_require_paths }}});</script>
{%- endif %}
{%- endblock html_head_js_requirejs -%}
{%- block html_head_js_mathjax -%}{%- endblock html_head_js_mathjax -%}
{%- block html_head_js_mermaidjs -%}{%- endblock html_head_js_mermaidjs -%}
"""


def log(msg: str) -> None:
    print(msg, flush=True)


# ---- offline widget renderer --------------------------------------------------------------


def _npm_install(folder: Path) -> str | None:
    """``npm install`` the widget renderer into ``folder``; returns None or why it failed."""
    npm = shutil.which("npm")
    if npm is None:
        return "npm not found on PATH"
    folder.mkdir(parents=True, exist_ok=True)
    if not (folder / "package.json").exists():
        (folder / "package.json").write_text('{"name": "wb-widgets", "private": true}\n')
    cmd = [npm, "install", "--no-audit", "--no-fund", "--loglevel=error", "--fetch-retries=1",
           "--fetch-timeout=60000", *NPM_PACKAGES]
    try:
        proc = subprocess.run(cmd, cwd=folder, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"npm install failed: {e}"
    if proc.returncode != 0:
        return f"npm install exited {proc.returncode}: {proc.stderr.strip()[-500:]}"
    return None


def vendor_widgets(out: Path, npm_dir: Path = NPM_DIR) -> dict[str, Any]:
    """Copy the offline widget renderer into ``out/vendor``; returns how pages load widgets.

    ``{"renderer": "offline", "require_js_url": ..., "widget_renderer_url": ...,
    "anywidget_path": ...}`` or ``{"renderer": "cdn (text fallback offline)", "why": ...}``.
    """
    dist = npm_dir / "node_modules" / "@jupyter-widgets" / "html-manager" / "dist"
    require = npm_dir / "node_modules" / "requirejs" / "require.js"
    if not (dist / "embed-amd.js").is_file() or not require.is_file():
        why = _npm_install(npm_dir)
        if why is not None:
            return {"renderer": "cdn (text fallback offline)", "why": why}
    vendor = out / "vendor"
    if vendor.exists():
        shutil.rmtree(vendor)
    shutil.copytree(dist, vendor)
    shutil.copy(require, vendor / "require.js")
    info: dict[str, Any] = {"renderer": "offline", "require_js_url": "vendor/require.js",
                            "widget_renderer_url": "vendor/embed-amd.js", "anywidget_path": ""}
    try:
        import anywidget

        amd = Path(anywidget.__file__).parent / "nbextension" / "index.js"
        if amd.is_file():
            shutil.copy(amd, vendor / "anywidget.js")
            info["anywidget_path"] = "vendor/anywidget"  # requirejs appends .js
    except ImportError:
        info["anywidget"] = "not installed: FigureWidgets will not render in the pages"
    return info


# ---- execute and export ---------------------------------------------------------------------


def execute(path: Path, timeout: int) -> tuple[Any, float, str | None]:
    """Run ``path`` in a fresh kernel (cwd = its folder); returns (notebook, seconds, error)."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3", record_timing=False,
                            store_widget_state=True,
                            resources={"metadata": {"path": str(path.parent)}})
    t0 = time.perf_counter()
    error = None
    try:
        client.execute()
    except CellExecutionError as e:
        error = str(e).strip().splitlines()[-1][:500] if str(e).strip() else repr(e)
    except (CellTimeoutError, DeadKernelError) as e:  # the page keeps the cells that ran
        error = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
    return nb, time.perf_counter() - t0, error


WIDGET_STATE_KEY = "application/vnd.jupyter.widget-state+json"
MODEL_REF = re.compile(r"IPY_MODEL_([0-9a-f]+)")


def prune_widget_state(nb: Any) -> int:
    """Keep only the widget models a displayed view reaches (children, layout, style...).

    nbclient records every model the kernel ever opened, closed ones included (e.g. the live
    plot ``SweepProgress`` swaps out); those would only add weight. Returns models dropped.
    """
    state = nb.metadata.get("widgets", {}).get(WIDGET_STATE_KEY, {}).get("state")
    if not state:
        return 0
    todo = [out["data"][WIDGET_VIEW_MIME]["model_id"]
            for cell in nb.cells for out in cell.get("outputs", [])
            if WIDGET_VIEW_MIME in out.get("data", {})]
    keep: set[str] = set()
    while todo:
        mid = todo.pop()
        if mid in keep or mid not in state:
            continue
        keep.add(mid)
        todo.extend(MODEL_REF.findall(json.dumps(state[mid].get("state", {}))))
    dropped = [mid for mid in state if mid not in keep]
    for mid in dropped:
        del state[mid]
    return len(dropped)


def count_outputs(nb: Any) -> dict[str, int]:
    """Figures and widget views a page should show once rendered.

    ``plotly_figures``: static figure outputs (HTML with a plotly div, or the plotly mimetype)
    plus FigureWidgets (anywidget models of plotly) in the saved widget state (pruned first, so
    only displayed ones count).
    """
    static = views = 0
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            html = data.get("text/html", "")
            html = "".join(html) if isinstance(html, list) else html
            if "plotly-graph-div" in html or PLOTLY_MIME in data:
                static += 1
            if WIDGET_VIEW_MIME in data:
                views += 1
    state = nb.metadata.get("widgets", {}).get(WIDGET_STATE_KEY, {}).get("state", {})
    fig_widgets = sum(1 for m in state.values() if m.get("model_name") == "AnyModel" and
                      "FigureWidget" in str(m.get("state", {}).get("_anywidget_id", "")))
    return {"plotly_static": static, "plotly_widgets": fig_widgets,
            "plotly_figures": static + fig_widgets, "widget_views": views}


def strip_cdn_mathjax(nb: Any) -> int:
    """Remove plotly's per-figure MathJax CDN script from HTML outputs; returns how many."""
    removed = 0
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            html = data.get("text/html")
            if html is None:
                continue
            text = "".join(html) if isinstance(html, list) else html
            text, n = CDN_MATHJAX.subn("", text)
            if n:
                data["text/html"] = text
                removed += n
    return removed


# Modules embed-amd.js defines inline. Webpack derives each bundle's public path (where its
# FontAwesome files are fetched from) from the module's requirejs URL, which defaults to
# <page dir>/<module id>.js: mapping the ids into vendor/ makes the fonts resolve there.
EMBED_MODULES = ("@jupyter-widgets/base", "@jupyter-widgets/base7", "@jupyter-widgets/controls",
                 "@jupyter-widgets/controls7", "@jupyter-widgets/html-manager",
                 "@jupyter-widgets/html-manager/dist/libembed-amd")


def require_paths(widgets: dict[str, Any]) -> dict[str, str]:
    """requirejs ``paths`` for the pages: the embed modules and anywidget, into vendor/."""
    if widgets.get("renderer") != "offline":
        return {}
    paths = {m: "vendor/" + m.rsplit("/", 1)[-1] for m in EMBED_MODULES}
    if widgets.get("anywidget_path"):
        paths["anywidget"] = widgets["anywidget_path"]
    return paths


def export_html(nb: Any, name: str, out: Path, widgets: dict[str, Any]) -> Path:
    """Write ``out/<name>.html`` with the offline template."""
    import jinja2
    from nbconvert import HTMLExporter

    exporter = HTMLExporter(extra_loaders=[jinja2.DictLoader({"wb_offline.html.j2": TEMPLATE})],
                            template_file="wb_offline.html.j2")
    if widgets.get("renderer") == "offline":
        exporter.require_js_url = widgets["require_js_url"]
        exporter.widget_renderer_url = widgets["widget_renderer_url"]
    resources = {"metadata": {"name": name},
                 "wb_require_paths": json.dumps(require_paths(widgets))}
    body, _ = exporter.from_notebook_node(nb, resources=resources)
    path = out / f"{name}.html"
    path.write_text(body, encoding="utf-8")
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("notebooks", nargs="*", type=Path,
                    help="notebooks to export (default: notebooks/*.ipynb)")
    ap.add_argument("--out", type=Path, default=REPO / "reports")
    ap.add_argument("--fast", action="store_true",
                    help="WORKBENCH_FAST=1: micro models and short runs (as in CI)")
    ap.add_argument("--timeout", type=int, default=600, help="seconds per cell")
    ns = ap.parse_args(argv)
    paths = ns.notebooks or sorted(NOTEBOOKS.glob("*.ipynb"))
    if not paths:
        log("no notebooks found")
        return 1
    ns.out.mkdir(parents=True, exist_ok=True)
    widgets = vendor_widgets(ns.out)
    log(f"widget renderer: {widgets['renderer']}" +
        (f" ({widgets['why']})" if "why" in widgets else ""))
    # The kernels inherit this environment.
    os.environ["PLOTLY_RENDERER"] = "notebook"
    if ns.fast:
        os.environ["WORKBENCH_FAST"] = "1"
    pages = []
    failed = 0
    for path in paths:
        path = path.resolve()
        log(f"executing {path.relative_to(REPO) if path.is_relative_to(REPO) else path} ...")
        nb, seconds, error = execute(path, ns.timeout)
        strip_cdn_mathjax(nb)
        prune_widget_state(nb)
        html = export_html(nb, path.stem, ns.out, widgets)
        counts = count_outputs(nb)
        failed += error is not None
        pages.append({"notebook": path.name, "html": html.name, "seconds": round(seconds, 1),
                      **counts, "error": error})
        log(f"  {html.relative_to(ns.out.parent) if html.is_relative_to(ns.out.parent) else html}"
            f" · {seconds:.0f} s · {counts['plotly_figures']} figures · "
            f"{counts['widget_views']} widget views" + (f" · FAILED: {error}" if error else ""))
    manifest = {"fast": os.environ.get("WORKBENCH_FAST") == "1", "widgets": widgets,
                "pages": pages}
    (ns.out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    log(f"manifest: {ns.out / 'manifest.json'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
