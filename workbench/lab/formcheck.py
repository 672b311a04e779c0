"""``python -m workbench lab formcheck``: the box's step-model form where it can be measured.

The native engine's target forwards (``calibrate.time_forward``: R requests x q new tokens at
context C, T = R*q, the minimum over ``repeats`` interleaved passes of the grid) over a grid of
R, q and C, for each shipped target (dense and MoE), are fitted with the box's terms less the
collectives (one rank):

    ms = F + beta * bytes(T) + R*C*(beta * kv_bytes + a * layers * q)
         + max(0, gamma * T * flops_per_token - beta * bytes(T))

bytes, KV bytes and FLOPs come from the model's config (:func:`workbench.lab.boxspec.geometry`,
MoE experts by uniform coverage). The box takes beta (1 / (eta * BW)) and gamma (1 / peak) from
its datasheets and fits F and a; this machine has no datasheet, so all four are fitted here, on
two thirds of the grid, and the held-out third is predicted. A result file names the machine and
the load around the run (figures under load are provisional).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from workbench.errors import ConfigError
from workbench.lab.boxmodel import coverage
from workbench.lab.boxspec import REPO_ROOT, Geometry, geometry

MODELS = ("data/models/wb-target", "data/models/wb-moe")
GRID_R = (1, 2, 4, 8)
GRID_Q = (1, 4)
GRID_C = (32, 128, 384)
TOLERANCE = 0.10


def config_box(config: dict[str, Any]) -> dict[str, Any]:
    """A one-rank box section for an HF config (Llama/Qwen dense, Mixtral/Qwen-MoE)."""
    m = dict(config)
    if m.get("num_local_experts"):  # Mixtral: every layer routed, experts of intermediate_size
        m.update({"n_routed_experts": m["num_local_experts"], "first_k_dense_replace": 0,
                  "moe_intermediate_size": m["intermediate_size"], "n_shared_experts": 0})
    if m.get("num_experts") and not m.get("n_routed_experts"):  # Qwen3-MoE
        m.update({"n_routed_experts": m["num_experts"], "first_k_dense_replace": 0,
                  "n_shared_experts": 0})
    dtype = str(m.get("dtype") or m.get("torch_dtype") or "bfloat16")
    m["dense_bits"] = 32 if "32" in dtype else 16
    return {"model": m, "layout": {"tp": 1, "ep": 1}}


def features(g: Geometry, r: int, q: int, c: int) -> tuple[float, float, float, float]:
    """(bytes, KV bytes, attention units, FLOPs) of one forward."""
    t = r * q
    wbytes = g.replicated_bytes + g.dense_bytes + g.moe_layers * coverage(g, t) * g.expert_bytes
    return wbytes, r * c * g.kv_bytes_per_token, r * c * q * g.layers, t * g.flops_per_token


def model_ms(p: Sequence[float], f: tuple[float, float, float, float]) -> float:
    floor, beta, a, gamma = p
    wbytes, kv, att, flops = f
    mem = beta * wbytes
    return floor + mem + beta * kv + a * att + max(0.0, gamma * flops - mem)


def fit_form(points: list[dict[str, Any]]) -> list[float]:
    """(F, beta, a, gamma) by least squares in relative error, all >= 0."""
    from scipy.optimize import least_squares

    ms = np.asarray([p["ms"] for p in points])
    feats = [p["features"] for p in points]

    def resid(p: np.ndarray) -> np.ndarray:
        return np.asarray([model_ms(p, f) for f in feats]) / ms - 1.0

    b0 = float(np.median(ms)) / max(float(np.median([f[0] for f in feats])), 1.0)
    x0 = np.asarray([float(ms.min()) / 2, b0 / 2, 1e-6, b0 / 100])
    sol = least_squares(resid, x0, bounds=(0.0, np.inf), x_scale="jac")
    return [float(v) for v in sol.x]


def measure(model: str, repeats: int, grid: tuple[Sequence[int], Sequence[int], Sequence[int]],
            threads: int | None = None) -> tuple[Geometry, list[dict[str, Any]]]:
    """Timed target forwards of ``model`` over ``grid`` (R, q, C)."""
    import workbench as wb
    from workbench.engine.calibrate import time_forward

    path = Path(model) if Path(model).is_absolute() else REPO_ROOT / model
    if not (path / "config.json").is_file():
        raise ConfigError(f"--models: no model at {model}")
    cfg = {"threads": threads} if threads else {}
    engine = wb.Engine.from_pretrained(str(path), config=wb.EngineConfig(**cfg)) if cfg else \
        wb.Engine.from_pretrained(str(path))
    box = config_box(json.loads((path / "config.json").read_text()))
    target = engine.runner.target
    if target is not None:  # the bytes the engine reads: its own dtype, not the config's
        box["model"]["dense_bits"] = 8 * next(target.parameters()).element_size()
    g = geometry(box)
    cells = [(r, q, c) for r in grid[0] for q in grid[1] for c in grid[2]]
    best = dict.fromkeys(cells, float("inf"))
    try:  # interleaved passes: a burst of load lands on one pass of every point, not one point
        for _ in range(repeats):
            for r, q, c in cells:
                best[(r, q, c)] = min(best[(r, q, c)],
                                      time_forward(engine.runner, r, q, c, 1, draft=False))
    finally:
        engine.close()
    points = [{"R": r, "q": q, "C": c, "T": r * q, "ms": best[(r, q, c)],
               "features": features(g, r, q, c)} for r, q, c in cells]
    return g, points


def check(points: list[dict[str, Any]]) -> dict[str, Any]:
    """Fit on two thirds of the grid (every point whose index mod 3 is not 2), predict the
    rest; each held-out point's error and whether all are within TOLERANCE."""
    train = [p for i, p in enumerate(points) if i % 3 != 2]
    held = [p for i, p in enumerate(points) if i % 3 == 2]
    params = fit_form(train)
    rows = []
    for p in held:
        pred = model_ms(params, p["features"])
        rows.append({"R": p["R"], "q": p["q"], "C": p["C"], "ms": p["ms"], "predicted": pred,
                     "error": pred / p["ms"] - 1.0})
    fit_err = [model_ms(params, p["features"]) / p["ms"] - 1.0 for p in train]
    return {"params": dict(zip(("floor_ms", "ms_per_byte", "attn_ms", "ms_per_flop"), params,
                               strict=True)),
            "held_out": rows, "max_held_out_error": max(abs(r["error"]) for r in rows),
            "max_fit_error": max(abs(e) for e in fit_err),
            "within": all(abs(r["error"]) <= TOLERANCE for r in rows)}


def formcheck(models: Sequence[str] = MODELS, repeats: int = 5,
              grid: tuple[Sequence[int], Sequence[int], Sequence[int]] = (GRID_R, GRID_Q,
                                                                          GRID_C),
              threads: int | None = None) -> dict[str, Any]:
    """The benchmark of the module doc: per model its points, fit and held-out errors, with the
    machine and the load before and after."""
    from workbench.machine import loadavg, machine_info

    before, t0 = loadavg(), time.time()
    out: dict[str, Any] = {"benchmark": "lab formcheck", "machine": machine_info(),
                           "load_before": before, "grid": {"R": list(grid[0]),
                                                           "q": list(grid[1]),
                                                           "C": list(grid[2])},
                           "repeats": repeats, "tolerance": TOLERANCE, "models": {}}
    for m in models:
        g, points = measure(m, repeats, grid, threads)
        res = check(points)
        out["models"][m] = {"geometry": {"layers": g.layers, "moe_layers": g.moe_layers,
                                         "experts": g.num_experts, "top_k": g.top_k},
                            "points": [{k: v for k, v in p.items() if k != "features"}
                                       for p in points], **res}
    out["load_after"] = loadavg()
    out["seconds"] = time.time() - t0
    out["within"] = all(v["within"] for v in out["models"].values())
    return out
