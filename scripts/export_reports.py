"""Execute the notebooks and export each as an HTML page under ``reports/``, plus an index.

    python scripts/export_reports.py                 # every notebooks/*.ipynb (full runs)
    python scripts/export_reports.py --fast          # WORKBENCH_FAST=1: micro models (CI)
    python scripts/export_reports.py --fast notebooks/01_quickstart.ipynb --out /tmp/r

What makes the pages work offline and stay small (ECOSYSTEM-NOTES.md, "Plotly/ipywidgets in
exported HTML"):

1. The kernel runs with ``PLOTLY_RENDERER=notebook``, which inlines plotly.js (~4.8 MB) into
   the first figure's output. The exporter cuts it out into ``reports/vendor/plotly.min.js``
   (written once, shared by every page) and leaves a ``<script src="vendor/plotly.min.js">``.
2. Widget state is stored at execution and rendered by ``@jupyter-widgets/html-manager@1``
   installed with npm into ``data/work/npm-widgets`` and copied, with ``require.js``, to
   ``reports/vendor``. Plotly's ``FigureWidget`` is an anywidget whose state carries its whole
   ES module (~5 MB, plotly.js inside) per widget: the exporter moves each distinct module into
   ``vendor/anywidget-esm.js`` (once for all pages) and leaves ``wb-esm:<hash>`` in the state;
   the vendored ``vendor/anywidget.js`` (anywidget's AMD build, patched in one place) resolves
   that reference. Without npm the pages fall back to nbconvert's CDN URLs: offline, widgets
   show as text (figures are unaffected); the manifest says which happened.
3. A page that cannot load ``vendor/`` (copied without its folder) says so in place of each
   widget and figure ("copy the whole reports/ folder"), instead of silently showing nothing.
4. MathJax and Mermaid (CDN scripts the notebooks do not use) are left out of the template,
   and the MathJax ``<script src=...cdnjs...>`` that plotly's HTML renderer adds to every
   figure is removed from the outputs (no figure uses LaTeX). ``# NBVAL_*`` marker lines
   (for pytest's nbval) are stripped from the exported code.
5. Each page starts with a stamp (date, commit, machine, load before and after its run, run
   time, sanity status: the ``wb-sanity`` blocks of :mod:`workbench.viz.report` it shows), and
   ``reports/index.html`` lists every page with the same facts. Pages of notebooks that no
   longer exist (or, on a full export, any page not exported now) are removed.

Writes ``reports/<notebook>.html``, ``reports/index.html`` and ``reports/manifest.json`` (per
page: seconds, figures and widget views expected, errors, stamp), which
``scripts/check_reports.py`` reads. Exit status 1 if any notebook failed to execute.
"""

from __future__ import annotations

import argparse
import hashlib
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

# Shown in place of a widget or figure whose scripts cannot load (the page was copied without
# vendor/). Defined first in <head> so every onerror below can call it.
FALLBACK_JS = r"""
function wbMissing(what) {
  var msg = 'This interactive output could not load (' + what + '). The page needs the '
    + 'vendor/ folder beside it: copy the whole reports/ folder, not the page alone '
    + '(or run the notebook in Jupyter).';
  function note(parent, kind) {
    if (!parent || parent.querySelector('.wb-missing')) return;
    var d = document.createElement('div');
    d.className = 'wb-missing';
    d.setAttribute('style', 'font:13px sans-serif;color:#8a4b00;background:#fff4e5;'
      + 'border-left:4px solid #8a4b00;padding:8px 12px;margin:4px 0');
    d.textContent = '\u26a0 ' + kind + ' not shown: ' + msg;
    parent.insertBefore(d, parent.firstChild);
  }
  function apply() {
    document.querySelectorAll('script[type="application/vnd.jupyter.widget-view+json"]')
      .forEach(function (s) {
        var p = s.parentElement;
        if (p && !p.querySelector('.widget-box, .lm-Widget, .jupyter-widgets.widget-inline-hbox'))
          note(p, 'Widget');
      });
    if (!window.Plotly) {
      document.querySelectorAll('.plotly-graph-div').forEach(function (d) {
        if (!d.querySelector('.main-svg')) note(d.parentElement, 'Figure');
      });
    }
  }
  if (document.readyState === 'loading') document.addEventListener('DOMContentLoaded', apply);
  else apply();
}
"""

# The lab template minus the CDN scripts the notebooks do not need, plus requirejs paths, the
# shared anywidget modules and the fallback messages.
TEMPLATE = r"""
{%- extends 'lab/index.html.j2' -%}
{%- block html_head_js_requirejs -%}
<script>{{ resources.wb_fallback_js }}</script>
{%- set req = resources.require_js_url %}
<script src="{{ req }}" onerror="wbMissing('{{ req }}')"></script>
<script>
if (window.require) {
{%- if resources.wb_require_paths %}
  require.config({paths: {{ resources.wb_require_paths }}});
{%- endif %}
  require.onError = function (err) {
    wbMissing('widget module ' + (err.requireModules || [err.message]).join(', '));
  };
}
</script>
{%- if resources.wb_esm %}
<script src="vendor/anywidget-esm.js" onerror="wbMissing('vendor/anywidget-esm.js')"></script>
{%- endif %}
{%- endblock html_head_js_requirejs -%}
{%- block html_head_js_mathjax -%}{%- endblock html_head_js_mathjax -%}
{%- block html_head_js_mermaidjs -%}{%- endblock html_head_js_mermaidjs -%}
{% block jupyter_widgets %}
{%- if "widgets" in nb.metadata %}
<script>
document.addEventListener('DOMContentLoaded', function () {
  var s = document.createElement('script');
{%- set cdn = resources.jupyter_widgets_base_url ~ '@jupyter-widgets/html-manager@'
    ~ resources.html_manager_semver_range ~ '/dist/embed-amd.js' %}
  s.src = '{{ resources.widget_renderer_url or cdn }}';
  s.onerror = function () { wbMissing(s.src.split('/').slice(-2).join('/')); };
  document.body.appendChild(s);
});
</script>
{%- endif %}
{% endblock jupyter_widgets %}
"""

NBVAL_LINE = re.compile(r"^[ \t]*# ?NBVAL_[A-Z_]+[ \t]*\n?", re.MULTILINE)
SANITY_BLOCK = re.compile(r'class="wb-sanity"[^>]*?data-flags="(\d+)"')
CONDITIONS_BLOCK = re.compile(r'class="wb-conditions" data-conditions="([^"]*)"')
ESM_PREFIX = "wb-esm:"
# anywidget's loader, patched so that "wb-esm:<key>" reads the module text that
# vendor/anywidget-esm.js put into window.WB_ESM (a classic script: works from file://).
ANYWIDGET_HOOK = "async function loadEsm(esm) {\n"
ANYWIDGET_PATCH = ANYWIDGET_HOOK + (
    '  if (typeof esm === "string" && esm.startsWith("' + ESM_PREFIX + '")) {\n'
    '    var shared = (window.WB_ESM || {})[esm.slice(' + str(len(ESM_PREFIX)) + ')];\n'
    '    if (shared === undefined) { wbMissing("vendor/anywidget-esm.js"); '
    'throw new Error("anywidget: shared module " + esm + " not loaded"); }\n'
    '    esm = shared;\n'
    '  }\n')


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
    # merged, not replaced: plotly.min.js and anywidget-esm.js serve pages not re-exported now
    shutil.copytree(dist, vendor, dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("*.map", "embed.js", "*.LICENSE.txt"))
    shutil.copy(require, vendor / "require.js")
    info: dict[str, Any] = {"renderer": "offline", "require_js_url": "vendor/require.js",
                            "widget_renderer_url": "vendor/embed-amd.js", "anywidget_path": ""}
    try:
        import anywidget

        amd = Path(anywidget.__file__).parent / "nbextension" / "index.js"
        if amd.is_file():
            text = amd.read_text(encoding="utf-8")
            if ANYWIDGET_HOOK in text:
                text = text.replace(ANYWIDGET_HOOK, ANYWIDGET_PATCH, 1)
                info["shared_esm"] = True
            else:  # another anywidget build: keep each module inline in the state
                info["shared_esm"] = False
                info["anywidget_note"] = "loadEsm not found: FigureWidget modules stay inline"
            (vendor / "anywidget.js").write_text(text, encoding="utf-8")
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


def strip_nbval_markers(nb: Any) -> int:
    """Remove ``# NBVAL_*`` lines (pytest-nbval's markers) from code cells; returns how many."""
    removed = 0
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.source, n = NBVAL_LINE.subn("", cell.source)
            removed += n
    return removed


def share_plotlyjs(nb: Any, vendor: Path) -> int:
    """Move the plotly.js bundle that ``PLOTLY_RENDERER=notebook`` inlines into an output out
    to ``vendor/plotly.min.js``, leaving a script tag; returns how many copies were cut."""
    from plotly.offline import get_plotlyjs

    js = get_plotlyjs()
    cut = 0
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            html = data.get("text/html")
            if html is None:
                continue
            text = "".join(html) if isinstance(html, list) else html
            while js in text:
                i = text.index(js)
                start = text.rfind("<script", 0, i)
                end = text.index("</script>", i + len(js)) + len("</script>")
                text = (text[:start] + '<script src="vendor/plotly.min.js" charset="utf-8" '
                        "onerror=\"wbMissing('vendor/plotly.min.js')\"></script>" + text[end:])
                cut += 1
            data["text/html"] = text
    if cut:
        vendor.mkdir(parents=True, exist_ok=True)
        target = vendor / "plotly.min.js"
        if not target.is_file() or target.stat().st_size != len(js.encode()):
            target.write_text(js, encoding="utf-8")
    return cut


ESM_FILE = "anywidget-esm.js"
ESM_HEAD = "window.WB_ESM = Object.assign(window.WB_ESM || {}, "
ESM_TAIL = ");\n"


def read_esm_store(vendor: Path) -> dict[str, str]:
    """The shared anywidget modules already in ``vendor/anywidget-esm.js`` (key → text)."""
    path = vendor / ESM_FILE
    if not path.is_file():
        return {}
    text = path.read_text(encoding="utf-8")
    if not (text.startswith(ESM_HEAD) and text.endswith(ESM_TAIL)):
        raise ValueError(f"{path}: not written by this script (unexpected layout)")
    return json.loads(text[len(ESM_HEAD):-len(ESM_TAIL)])


def write_esm_store(vendor: Path, store: dict[str, str]) -> None:
    vendor.mkdir(parents=True, exist_ok=True)
    (vendor / ESM_FILE).write_text(ESM_HEAD + json.dumps(store) + ESM_TAIL, encoding="utf-8")


def share_widget_esm(nb: Any, store: dict[str, str], min_chars: int = 10_000) -> int:
    """Replace each anywidget model's ``_esm`` (its whole ES module) by ``wb-esm:<sha1>`` and
    put the text into ``store``; returns how many models now share a module."""
    state = nb.metadata.get("widgets", {}).get(WIDGET_STATE_KEY, {}).get("state", {})
    shared = 0
    for model in state.values():
        esm = model.get("state", {}).get("_esm")
        if isinstance(esm, str) and len(esm) >= min_chars and not esm.startswith(ESM_PREFIX):
            key = hashlib.sha1(esm.encode()).hexdigest()[:16]
            store[key] = esm
            model["state"]["_esm"] = ESM_PREFIX + key
            shared += 1
    return shared


def sanity_status(nb: Any) -> dict[str, Any]:
    """Sanity blocks a page shows (``workbench.viz.report``): how many, and flags in them."""
    blocks = flags = 0
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            html = out.get("data", {}).get("text/html", "")
            text = "".join(html) if isinstance(html, list) else html
            for m in SANITY_BLOCK.finditer(text):
                blocks += 1
                flags += int(m.group(1))
    status = "not checked (no benchmark numbers)" if blocks == 0 else \
        ("clean" if flags == 0 else f"{flags} flag{'s' if flags != 1 else ''}")
    return {"blocks": blocks, "flags": flags, "status": status}


def _html_outputs(nb: Any) -> list[str]:
    out = []
    for cell in nb.cells:
        for o in cell.get("outputs", []):
            html = o.get("data", {}).get("text/html", "")
            out.append("".join(html) if isinstance(html, list) else html)
    return out


def conditions_of(nb: Any) -> list[str]:
    """The conditions (measured engine choices) a page's ``wb-conditions`` blocks name, in
    order, each once: the page's own engine first, then any saved run it shows."""
    import html as H

    seen: list[str] = []
    for text in _html_outputs(nb):
        for m in CONDITIONS_BLOCK.finditer(text):
            line = H.unescape(m.group(1))
            if line not in seen:
                seen.append(line)
    return seen


def claims_status(nb: Any) -> dict[str, Any]:
    """The computed claims a page shows (``workbench.viz.prose``) and any that do not follow
    from their own interval (``check_claims``)."""
    sys.path.insert(0, str(REPO))
    from workbench.viz.prose import check_claims, parse_claims

    texts = _html_outputs(nb)
    return {"claims": sum(len(parse_claims(t)) for t in texts),
            "problems": [p for t in texts for p in check_claims(t)]}


def page_title(nb: Any, default: str) -> str:
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            for line in cell.source.splitlines():
                if line.startswith("# "):
                    return line[2:].strip()
    return default


def stamp_html(entry: dict[str, Any]) -> str:
    """The banner at the top of a page: when, what code, which machine, how loaded, sanity."""
    import html as H

    lb, la = entry.get("load_before"), entry.get("load_after")
    loaded = any(x is not None and x[0] > entry["cores"] for x in (lb, la))
    san = entry["sanity"]
    claims = entry.get("claims") or {"claims": 0, "problems": []}
    color = "#1b5e20" if san["flags"] == 0 and not loaded and not claims["problems"] \
        else "#8a4b00"
    load = f"{lb[0]:.2f} → {la[0]:.2f}" if lb and la else "n/a"
    conds = entry.get("conditions") or []
    cond = ("<br>conditions (measured choices): " + "<br>&nbsp;&nbsp;".join(
        H.escape(c) for c in conds)) if conds else \
        "<br>conditions: no measured choices shown on this page"
    prose = (f"<br>prose: {claims['claims']} computed claim(s)"
             + (f" — <b>{len(claims['problems'])} do not follow from their intervals</b>"
                if claims["problems"] else
                (", each worded by its own interval" if claims["claims"] else "")))
    return (
        f'<div class="wb-stamp" style="font:13px sans-serif;border:1px solid #ddd;'
        f'border-left:5px solid {color};padding:8px 12px;margin:0 0 12px 0;background:#fafafa">'
        f"<b>{H.escape(entry['title'])}</b><br>"
        f"run {H.escape(entry['date'])} · commit <code>{H.escape(str(entry['commit']))}</code> · "
        f"{'FAST (micro models)' if entry['fast'] else 'full run'} · "
        f"{entry['seconds']:.0f} s<br>"
        f"machine: {H.escape(entry['machine'])}<br>"
        f"load (1-min, before → after, {entry['cores']} cores): {load}"
        f"{' — <b>loaded</b>: absolute speeds are low and ratios noisier' if loaded else ''}"
        f"{cond}{prose}"
        f"<br>sanity: <b>{H.escape(san['status'])}</b>"
        f"{' (see the ⚠ blocks below)' if san['flags'] else ''} · "
        '<a href="index.html">all reports</a></div>')


def write_index(out: Path, pages: list[dict[str, Any]], widgets: dict[str, Any]) -> Path:
    """``reports/index.html``: one row per page with its stamp facts."""
    import html as H

    rows = []
    for p in pages:
        lb, la = p.get("load_before"), p.get("load_after")
        load = f"{lb[0]:.2f} → {la[0]:.2f}" if lb and la else "n/a"
        san = p.get("sanity", {}).get("status", "n/a")
        blocks = p.get("sanity", {}).get("blocks", 0)
        claims = p.get("claims") or {}
        contra = claims.get("problems") or []
        bad = p.get("error") or p.get("sanity", {}).get("flags") or contra
        color = "#8a4b00" if bad else ("#1b5e20" if blocks else "#666666")
        hot = any(x is not None and x[0] > p.get("cores", 1) for x in (lb, la))
        rows.append(
            f"<tr><td><a href=\"{H.escape(p['html'])}\">{H.escape(p['html'])}</a><br>"
            f"<small>{H.escape(p.get('title', ''))}</small></td>"
            f"<td>{H.escape(p.get('date', ''))}</td><td><code>{H.escape(str(p.get('commit')))}"
            f"</code></td><td>{H.escape(p.get('machine', ''))}</td>"
            f"<td style='color:{'#8a4b00' if hot else '#222222'}'>{load}"
            f"{'<br>loaded' if hot else ''}</td>"
            f"<td>{p['seconds']:.0f} s{' (FAST)' if p.get('fast') else ''}</td>"
            f"<td>{p.get('plotly_figures', 0)} / {p.get('widget_views', 0)}</td>"
            f"<td>{claims.get('claims', 0)}"
            f"{f' — {len(contra)} contradicted' if contra else ''}"
            f"</td><td style=\"color:{color}\">{H.escape(san)}"
            f"{'<br>FAILED: ' + H.escape(p['error']) if p.get('error') else ''}</td></tr>")
    total = sum(p["seconds"] for p in pages)
    body = f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>workbench reports</title>
<style>body{{font:14px sans-serif;margin:24px;max-width:1300px}}
table{{border-collapse:collapse}}td,th{{border:1px solid #ddd;padding:6px 8px;
vertical-align:top;text-align:left}}th{{background:#f3f3f3}}</style></head><body>
<h1>workbench reports</h1>
<p>{len(pages)} pages, {total:.0f} s of notebook execution in all. Each page was executed
top to bottom by <code>scripts/export_reports.py</code>; the load is the 1-minute load average
before and after that page ran (above the core count, other work competed for the CPU and the
speeds on that page are low). Sanity: the checks of <code>workbench.bench.sanity</code> on the
numbers a page shows ("clean": every check passed; pages without benchmark numbers are not
checked). Computed claims: sentences rendered from the page's data by
<code>workbench.viz.prose</code>, each worded by its own interval (a page whose claim its
interval denies is marked). Widgets: {H.escape(widgets.get('renderer', ''))}. Open pages
from this folder (they load <code>vendor/</code>).</p>
<table><tr><th>page</th><th>date</th><th>commit</th><th>machine</th><th>load (1-min)</th>
<th>run time</th><th>figures / widgets</th><th>computed claims</th><th>sanity</th></tr>
{''.join(rows)}
</table></body></html>
"""
    path = out / "index.html"
    path.write_text(body, encoding="utf-8")
    return path


def remove_stale(out: Path, keep: set[str]) -> list[str]:
    """Delete ``out/*.html`` pages (and their screenshots) not in ``keep``; returns names."""
    gone = []
    for page in sorted(out.glob("*.html")):
        if page.name == "index.html" or page.name in keep:
            continue
        page.unlink()
        shot = out / "screenshots" / f"{page.stem}.png"
        if shot.exists():
            shot.unlink()
        gone.append(page.name)
    return gone


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


def export_html(nb: Any, name: str, out: Path, widgets: dict[str, Any],
                esm_shared: bool = False) -> Path:
    """Write ``out/<name>.html`` with the offline template."""
    import jinja2
    from nbconvert import HTMLExporter

    exporter = HTMLExporter(extra_loaders=[jinja2.DictLoader({"wb_offline.html.j2": TEMPLATE})],
                            template_file="wb_offline.html.j2")
    if widgets.get("renderer") == "offline":
        exporter.require_js_url = widgets["require_js_url"]
        exporter.widget_renderer_url = widgets["widget_renderer_url"]
    resources = {"metadata": {"name": name}, "wb_fallback_js": FALLBACK_JS,
                 "wb_esm": esm_shared,
                 "wb_require_paths": json.dumps(require_paths(widgets))}
    body, _ = exporter.from_notebook_node(nb, resources=resources)
    path = out / f"{name}.html"
    path.write_text(body, encoding="utf-8")
    return path


def machine_line() -> tuple[str, int, str | None]:
    """("AMD EPYC 9B14 · 2 cores · L3 32 MiB · torch 2.13.0+cpu", cores, commit)."""
    sys.path.insert(0, str(REPO))
    from workbench.machine import machine_info

    m = machine_info()
    l3 = f" · L3 {m['l3'] / (1 << 20):g} MiB" if m.get("l3") else ""
    gpu = f" · {m['cuda']}" if m.get("cuda") else ""
    return (f"{m['cpu']} · {m['cores']} cores{l3}{gpu} · torch {m['torch']}",
            int(m["cores"] or 1), m.get("commit"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("notebooks", nargs="*", type=Path,
                    help="notebooks to export (default: notebooks/*.ipynb)")
    ap.add_argument("--out", type=Path, default=REPO / "reports")
    ap.add_argument("--fast", action="store_true",
                    help="WORKBENCH_FAST=1: micro models and short runs (as in CI)")
    ap.add_argument("--timeout", type=int, default=600, help="seconds per cell")
    ns = ap.parse_args(argv)
    everything = not ns.notebooks
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
    fast = os.environ.get("WORKBENCH_FAST") == "1"
    import nbformat

    machine, cores, commit = machine_line()
    vendor = ns.out / "vendor"
    store = read_esm_store(vendor)
    share_esm = bool(widgets.get("shared_esm"))
    # earlier pages stay listed unless re-exported now or their notebook is gone
    old = ns.out / "manifest.json"
    previous = {} if everything or not old.is_file() else \
        {p["html"]: p for p in json.loads(old.read_text()).get("pages", [])}
    pages: dict[str, dict[str, Any]] = {}
    failed = 0
    for path in paths:
        path = path.resolve()
        log(f"executing {path.relative_to(REPO) if path.is_relative_to(REPO) else path} ...")
        load_before = list(os.getloadavg())
        nb, seconds, error = execute(path, ns.timeout)
        load_after = list(os.getloadavg())
        strip_cdn_mathjax(nb)
        strip_nbval_markers(nb)
        prune_widget_state(nb)
        share_plotlyjs(nb, vendor)
        shared = share_widget_esm(nb, store) if share_esm else 0
        counts = count_outputs(nb)
        entry = {"notebook": path.name, "html": f"{path.stem}.html",
                 "title": page_title(nb, path.stem), "seconds": round(seconds, 1),
                 "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                 "commit": commit, "machine": machine, "cores": cores, "fast": fast,
                 "load_before": [round(x, 2) for x in load_before],
                 "load_after": [round(x, 2) for x in load_after],
                 "sanity": sanity_status(nb), "conditions": conditions_of(nb),
                 "claims": claims_status(nb), **counts, "error": error}
        nb.cells.insert(0, nbformat.v4.new_markdown_cell(stamp_html(entry)))
        if shared:
            write_esm_store(vendor, store)
        html = export_html(nb, path.stem, ns.out, widgets, esm_shared=shared > 0)
        failed += error is not None
        pages[html.name] = entry
        log(f"  {html.relative_to(ns.out.parent) if html.is_relative_to(ns.out.parent) else html}"
            f" · {seconds:.0f} s · {html.stat().st_size / 1e6:.2f} MB · "
            f"{counts['plotly_figures']} figures · {counts['widget_views']} widget views · "
            f"sanity {entry['sanity']['status']}" + (f" · FAILED: {error}" if error else ""))
    existing = {p.stem for p in NOTEBOOKS.glob("*.ipynb")}
    for name, entry in previous.items():
        if name not in pages and Path(name).stem in existing and (ns.out / name).is_file():
            pages[name] = entry
    gone = remove_stale(ns.out, set(pages))
    if gone:
        log(f"removed stale pages: {', '.join(gone)}")
    ordered = [pages[k] for k in sorted(pages)]
    manifest = {"fast": fast, "widgets": widgets, "pages": ordered}
    (ns.out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    index = write_index(ns.out, ordered, widgets)
    log(f"manifest: {ns.out / 'manifest.json'} · index: {index}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
