"""The pages' prose follows their data: the notebooks' saved-result cells (tagged ``results``
in the ``.py``, run after the page's ``parameters`` cell) are executed in a real kernel on two
different result sets, and

* every claim on the page follows from its own interval (``prose.check_claims``),
* the prose changes with the data — what one result set resolves, the other leaves "not
  resolved at this noise"; counts, flags and suggestions move with the files,
* a claim edited to say what its interval denies is caught.

Result set A: three repeats with little noise (EAGLE-3 clearly faster at low concurrency and
slower at high; a trained and a random pair of one shape that disagree). Result set B: the
committed ``data/results`` (one repeat, no intervals).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
from pathlib import Path

import pytest

from workbench.viz import prose as P

pytest.importorskip("nbclient")
pytest.importorskip("jupytext")

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "data" / "results"
PAGES = ("03_acceptance", "04_concurrency_and_dynamic_disable", "06_gpu_box")


def results_notebook(name: str):  # type: ignore[no-untyped-def]
    """The page's parameters cell and its cells tagged ``results``, from the paired .py."""
    import jupytext

    nb = jupytext.read(REPO / "notebooks" / f"{name}.py")
    keep = [c for c in nb.cells if c.cell_type == "code" and
            {"parameters", "results"} & set(c.metadata.get("tags", []))]
    assert any("results" in c.metadata.get("tags", []) for c in keep), \
        f"{name}: no cell tagged results"
    nb.cells = keep
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    return nb


def execute(name: str, results: Path) -> str:
    """Run the page's result cells with ``WORKBENCH_RESULTS=results``; all HTML/text out."""
    from nbclient import NotebookClient

    nb = results_notebook(name)
    env = {"WORKBENCH_RESULTS": str(results), "WORKBENCH_FAST": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the kernel inherits the environment
    try:
        # on a loop of its own, closed after (.execute() would leave jupyter_core's loop open
        # for the rest of the process: tests/leaks.py)
        asyncio.run(NotebookClient(nb, timeout=300, kernel_name="python3", resources={
            "metadata": {"path": str(REPO / "notebooks")}}).async_execute())
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    out = []
    for cell in nb.cells:
        for o in cell.get("outputs", []):
            assert o.get("output_type") != "error", f"{name}: {o.get('evalue')}"
            data = o.get("data", {})
            out.append(str(data.get("text/html", "")) or str(data.get("text/plain", "")) or
                       str(o.get("text", "")))
    return "\n".join(out)


def text(html: str) -> str:
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", html.replace("&#x27;", "'")))


@pytest.fixture(scope="module")
def set_a(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three repeats, ±1 % noise: every EAGLE-3/baseline ratio resolved; the trained pair
    and its random twin disagree beyond noise."""
    import pandas as pd

    out = tmp_path_factory.mktemp("results_a")
    for f in RESULTS.glob("*.json"):
        shutil.copy(f, out / f.name)
    rows = pd.read_csv(RESULTS / "concurrency.csv")
    reps = []
    for r, eps in enumerate((-0.01, 0.0, 0.01)):
        # the arms move in opposite directions from repeat to repeat: real, small noise
        sign = rows["arm"].map(lambda a: 1 if a == "baseline" else -1)
        reps.append(rows.assign(repeat=r, tok_s=rows.tok_s * (1 + eps * sign)))
    pd.concat(reps, ignore_index=True).to_csv(out / "concurrency.csv", index=False)
    doc = json.loads((RESULTS / "concurrency.json").read_text())
    doc["config"]["repeats"] = 3
    (out / "concurrency.json").write_text(json.dumps(doc))
    shapes = json.loads((RESULTS / "shapes.json").read_text())
    for row in shapes["rows"]:
        row["speedup_lo"], row["speedup_hi"] = row["speedup"] * 0.97, row["speedup"] * 1.03
    twin = next(r for r in shapes["rows"] if r["random"] and r["layers"] == 18 and
                r["hidden"] == 256)
    twin.update(speedup=1.0, speedup_lo=0.97, speedup_hi=1.03)
    (out / "shapes.json").write_text(json.dumps(shapes))
    return out


@pytest.fixture(scope="module")
def pages_a(set_a: Path) -> dict[str, str]:
    return {p: execute(p, set_a) for p in PAGES}


@pytest.fixture(scope="module")
def pages_b() -> dict[str, str]:
    return {p: execute(p, RESULTS) for p in PAGES}


def test_every_claim_follows_from_its_interval(pages_a: dict[str, str],
                                               pages_b: dict[str, str]) -> None:
    for which, pages in (("A", pages_a), ("B", pages_b)):
        for name, html in pages.items():
            assert P.check_claims(html) == [], f"set {which}, {name}"
    assert sum(len(P.parse_claims(h)) for h in pages_a.values()) >= 5


def test_concurrency_prose_follows_the_saved_sweep(pages_a: dict[str, str],
                                                   pages_b: dict[str, str]) -> None:
    a = text(pages_a["04_concurrency_and_dynamic_disable"])
    b = text(pages_b["04_concurrency_and_dynamic_disable"])
    # repeats and levels are read from the files, compared with this page's own run
    assert "3 repeats" in a and "more levels and more repeats" in a
    assert "1 repeat," in b and "more levels and fewer repeats" in b
    # A resolves EAGLE-3 faster at c = 1 and slower at c = 16; B resolves nothing
    claims_a = {c["text"].split(":")[0]: c["verdict"] for c in
                P.parse_claims(pages_a["04_concurrency_and_dynamic_disable"])}
    assert P.ABOVE in claims_a.values() and P.BELOW in claims_a.values()
    claims_b = P.parse_claims(pages_b["04_concurrency_and_dynamic_disable"])
    assert claims_b and {c["verdict"] for c in claims_b} == {P.UNRESOLVED}
    assert "no intervals" in b and "no intervals" not in a
    # the saved run names its conditions: the GEMM path and how it was chosen
    assert "gemm=onednn (cached)" in a


def test_shape_study_prose_and_flags_follow_the_file(pages_a: dict[str, str],
                                                     pages_b: dict[str, str]) -> None:
    a, b = pages_a["03_acceptance"], pages_b["03_acceptance"]
    assert 'data-codes="trained_vs_random"' in a and "1 disagreement(s) beyond noise" in text(a)
    assert 'data-flags="0"' in b and "no disagreement beyond noise detectable" in text(b)
    assert "carries no intervals" in text(b) and "carries no intervals" not in text(a)
    posed = json.loads((RESULTS / "shapes.json").read_text())["config"]["tau"]
    assert f"posed τ = {posed:g}" in text(a) and f"posed τ = {posed:g}" in text(b)


def test_threshold_page_says_when_its_source_is_unresolved(pages_a: dict[str, str],
                                                           pages_b: dict[str, str]) -> None:
    a, b = text(pages_a["06_gpu_box"]), text(pages_b["06_gpu_box"])
    assert "not resolved at this noise" in b and "not resolved at this noise" not in a
    assert "3 repeats" in a and "1 repeat:" in b
    assert "models: the shipped pair" in a  # no longer "the micro models"


def test_a_claim_edited_against_its_interval_is_caught(pages_b: dict[str, str]) -> None:
    html = pages_b["04_concurrency_and_dynamic_disable"]
    lie = html.replace('data-verdict="unresolved"', 'data-verdict="above"', 1)
    assert lie != html and P.check_claims(lie)
