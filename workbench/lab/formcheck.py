"""``python -m workbench lab formcheck``: the box's step-model form where it can be measured.

The native engine's target forwards (``calibrate.time_forward``: R requests x q new tokens at
context C, T = R*q, the minimum over ``repeats`` interleaved passes of the grid) over a grid of
R, q and C, for each shipped target (dense and MoE), are fitted with the box's terms less the
collectives (one rank):

    ms = F + beta * bytes(T) + R*C*(kappa * kv_bytes + a * layers * q)
         + max(0, gamma * T * flops_per_token - beta * bytes(T))

bytes, KV bytes and FLOPs come from the model's config (:func:`workbench.lab.boxspec.geometry`,
MoE experts by uniform coverage). The attention term is the box's: a decode part per context
token (the KV read, kappa per byte) and a verify part per context token per query token (a).
The box takes beta and kappa from its datasheet (both 1 / (eta * BW): weights and KV stream
from the same HBM) and gamma (1 / peak), and fits F and a. This machine has no datasheet, so all
five are fitted here, and beta and kappa apart: the engine reads weights as GEMM operands (on the
MoE target, expert by expert, each with its own dispatch) and the KV cache as a gather into a
contiguous copy before attention, two different rates with nothing to tie them.

Held out: a third of the grid spread over it, the cells whose grid indices (iR + iq + iC) sum to
2 mod 3 — every R, q and C value appears both fitted and held out, so a held-out point is a new
combination of measured values (interpolation over the grid, not extrapolation beyond its
largest context). The rest is fitted. An MoE target's one-token forwards (T = 1) take their own
path (the token's k experts in turn: no routing sort, gather or scatter, and no host read of the
expert counts), a floor the form does not have: they are measured and their prediction reported
(``outside``) but neither fitted nor held out. A result file names the machine and the load
around the run (figures under load are provisional).
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


PARAMS = ("floor_ms", "ms_per_byte", "ms_per_kv_byte", "attn_ms", "ms_per_flop")


def model_ms(p: Sequence[float] | np.ndarray, f: tuple[float, float, float, float]) -> float:
    """The form's ms for parameters ``p`` (:data:`PARAMS`) and features ``f``."""
    floor, beta, kappa, a, gamma = p
    wbytes, kv, att, flops = f
    mem = beta * wbytes
    return floor + mem + kappa * kv + a * att + max(0.0, gamma * flops - mem)


def fit_form(points: list[dict[str, Any]], tied: bool = False) -> list[float]:
    """:data:`PARAMS` by least squares in relative error, all >= 0 (the best of a few starts:
    the hinge makes the problem non-convex). ``tied``: the KV read at the weights' rate
    (kappa = beta, the box's datasheet tie), four free constants."""
    from scipy.optimize import least_squares

    ms = np.asarray([p["ms"] for p in points])
    feats = [p["features"] for p in points]

    def full(p: np.ndarray) -> np.ndarray:
        return np.asarray([p[0], p[1], p[1], p[3], p[4]]) if tied else p

    def resid(p: np.ndarray) -> np.ndarray:
        return np.asarray([model_ms(full(p), f) for f in feats]) / ms - 1.0

    def med(i: int) -> float:
        return max(float(np.median([f[i] for f in feats])), 1.0)

    scale = float(np.median(ms))
    best = None
    for split in (0.25, 0.5, 0.75):  # the share of the median forward each start gives floor
        x0 = np.asarray([split * scale, (1 - split) * scale / 2 / med(0),
                         (1 - split) * scale / 4 / med(1), (1 - split) * scale / 4 / med(2),
                         (1 - split) * scale / med(3)])
        sol = least_squares(resid, x0, bounds=(0.0, np.inf), x_scale="jac")
        if best is None or sol.cost < best.cost:
            best = sol
    assert best is not None
    return [float(v) for v in full(best.x)]


def held_out(points: list[dict[str, Any]]) -> list[bool]:
    """Whether each point is held out: grid indices (iR + iq + iC) = 2 mod 3 (module doc)."""
    axes = {k: sorted({p[k] for p in points}) for k in ("R", "q", "C")}
    return [sum(axes[k].index(p[k]) for k in axes) % 3 == 2 for p in points]


def measure(model: str, repeats: int, grid: tuple[Sequence[int], Sequence[int], Sequence[int]],
            threads: int | None = None) -> tuple[Geometry, list[dict[str, Any]]]:
    """Timed target forwards of ``model`` over ``grid`` (R, q, C)."""
    import workbench as wb
    from workbench.engine.calibrate import time_forward

    path = Path(model) if Path(model).is_absolute() else REPO_ROOT / model
    if not (path / "config.json").is_file():
        raise ConfigError(f"--models: no model at {model}")
    engine = wb.Engine.from_pretrained(
        str(path), config=wb.EngineConfig(threads=threads) if threads else None)
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


def check(points: list[dict[str, Any]], one_token_path: bool = False) -> dict[str, Any]:
    """Fit on the grid less its held-out third (:func:`held_out`), predict that third; each
    held-out point's error, their max and mean, and whether all are within TOLERANCE.
    ``one_token_path`` (an MoE target): its T = 1 points are predicted and reported as
    ``outside``, neither fitted nor held out (module doc)."""
    hold = held_out(points)
    outside = [p for p in points if one_token_path and p["T"] == 1]
    train = [p for p, h in zip(points, hold, strict=True) if not h and p not in outside]
    held = [p for p, h in zip(points, hold, strict=True) if h and p not in outside]
    if not train or not held:
        raise ConfigError(f"--grid: {len(points)} points leave {len(train)} to fit and "
                          f"{len(held)} to hold out; give at least two values of R, q or C")
    params = fit_form(train)

    def row(p: dict[str, Any]) -> dict[str, Any]:
        pred = model_ms(params, p["features"])
        return {"R": p["R"], "q": p["q"], "C": p["C"], "ms": p["ms"], "predicted": pred,
                "error": pred / p["ms"] - 1.0}

    rows = [row(p) for p in held]
    errs = [abs(r["error"]) for r in rows]
    fit_err = [abs(row(p)["error"]) for p in train]
    inside = train + held
    tied = fit_form(inside, tied=True)  # the form with the box's tie, fitted to every point
    return {"params": dict(zip(PARAMS, params, strict=True)),
            "fitted": [{k: p[k] for k in ("R", "q", "C")} for p in train],
            "held_out": rows, "outside": [row(p) for p in outside],
            "max_held_out_error": max(errs), "mean_held_out_error": float(np.mean(errs)),
            "max_fit_error": max(fit_err),
            "tied_kv_max_fit_error": max(abs(model_ms(tied, p["features"]) / p["ms"] - 1.0)
                                         for p in inside),
            "within": all(e <= TOLERANCE for e in errs)}


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
                           "repeats": repeats, "threads": threads, "tolerance": TOLERANCE,
                           "models": {}}
    for m in models:
        g, points = measure(m, repeats, grid, threads)
        res = check(points, one_token_path=g.moe_layers > 0)
        out["models"][m] = {"geometry": {"layers": g.layers, "moe_layers": g.moe_layers,
                                         "experts": g.num_experts, "top_k": g.top_k},
                            "points": [{k: v for k, v in p.items() if k != "features"}
                                       for p in points], **res}
    out["load_after"] = loadavg()
    out["seconds"] = time.time() - t0
    out["within"] = all(v["within"] for v in out["models"].values())
    return out
