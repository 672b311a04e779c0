"""The CPU form check: the box's terms (less collectives) fitted to forwards over a grid, held-out
points predicted. The fit is checked on forwards of a known form (timing is not asserted); one
tiny real grid checks the measuring path end to end."""

from __future__ import annotations

import json

import pytest

from workbench.lab.boxspec import geometry
from workbench.lab.formcheck import (
    GRID_C,
    GRID_Q,
    GRID_R,
    check,
    config_box,
    features,
    formcheck,
    model_ms,
)
from workbench.lab.formcheck import REPO_ROOT as ROOT


@pytest.mark.parametrize("model", ["wb-target", "wb-moe"])
def test_form_recovers_known_forwards(model: str) -> None:
    cfg = json.loads((ROOT / "data" / "models" / model / "config.json").read_text())
    g = geometry(config_box(cfg))
    assert (g.moe_layers > 0) == (model == "wb-moe")
    truth = (2.0, 1e-6, 2e-7, 4e-9)  # floor, ms/byte, attention, ms/FLOP
    pts = [{"R": r, "q": q, "C": c, "T": r * q, "features": features(g, r, q, c),
            "ms": model_ms(truth, features(g, r, q, c))}
           for r in GRID_R for q in GRID_Q for c in GRID_C]
    res = check(pts)
    assert res["within"] and res["max_held_out_error"] < 1e-3
    assert len(res["held_out"]) == len(pts) // 3


def test_formcheck_measures_the_engine() -> None:
    res = formcheck(["data/models/wb-moe"], repeats=1, grid=((1, 2), (1, 2), (16, 32)),
                    threads=1)
    m = res["models"]["data/models/wb-moe"]
    assert len(m["points"]) == 8 and all(p["ms"] > 0 for p in m["points"])
    assert res["machine"] and res["load_before"] is not None and "within" in res
