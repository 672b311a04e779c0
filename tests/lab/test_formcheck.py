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
    PARAMS,
    check,
    config_box,
    features,
    formcheck,
    held_out,
    model_ms,
)
from workbench.lab.formcheck import REPO_ROOT as ROOT


def grid_points(model: str, truth: tuple[float, ...]) -> tuple[bool, list[dict]]:
    cfg = json.loads((ROOT / "data" / "models" / model / "config.json").read_text())
    g = geometry(config_box(cfg))
    return g.moe_layers > 0, [
        {"R": r, "q": q, "C": c, "T": r * q, "features": features(g, r, q, c),
         "ms": model_ms(truth, features(g, r, q, c))}
        for r in GRID_R for q in GRID_Q for c in GRID_C]


@pytest.mark.parametrize("model", ["wb-target", "wb-moe"])
def test_form_recovers_known_forwards(model: str) -> None:
    # floor, ms/byte, ms per KV byte (a rate of its own, not the weights'), attention, ms/FLOP
    truth = (2.0, 1e-6, 6e-6, 2e-7, 4e-9)
    moe, pts = grid_points(model, truth)
    assert moe == (model == "wb-moe")
    res = check(pts, one_token_path=moe)
    assert set(res["params"]) == set(PARAMS)
    assert res["within"] and res["max_held_out_error"] < 1e-3
    assert res["mean_held_out_error"] <= res["max_held_out_error"]
    # the MoE target's one-token forwards are reported apart, neither fitted nor held out
    ones = [p for p in pts if p["T"] == 1]
    assert len(res["outside"]) == (len(ones) if moe else 0)
    assert len(res["held_out"]) + len(res["fitted"]) + len(res["outside"]) == len(pts)


def test_held_out_third_spreads_over_the_grid() -> None:
    _, pts = grid_points("wb-target", (2.0, 1e-6, 1e-6, 2e-7, 4e-9))
    hold = held_out(pts)
    assert sum(hold) == len(pts) // 3
    for axis in ("R", "q", "C"):  # every value both fitted and held out: no extrapolation axis
        for v in {p[axis] for p in pts}:
            assert {h for p, h in zip(pts, hold, strict=True) if p[axis] == v} == {True, False}


def test_formcheck_measures_the_engine() -> None:
    res = formcheck(["data/models/wb-moe"], repeats=1, grid=((1, 2), (1, 2), (16, 32)),
                    threads=1)
    m = res["models"]["data/models/wb-moe"]
    assert len(m["points"]) == 8 and all(p["ms"] > 0 for p in m["points"])
    assert m["outside"] and all(r["R"] * r["q"] == 1 for r in m["outside"])
    assert res["machine"] and res["load_before"] is not None and "within" in res
