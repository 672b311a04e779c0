"""Fitting the box's two free constants to measured numbers, honestly.

The step model (:mod:`workbench.lab.boxmodel`) is linear in its two free constants, the
per-forward floor F (``fit.floor_ms``) and the attention cost a (``fit.attn_ns``): a measured
tok/s is ms per output token 1000 / tok_s = F * x_F + a * x_a + rest, a measured forward's ms
the same, with x_F, x_a, rest read off the model at (F, a) = (1, 0), (0, 1), (0, 0). The fit
solves those rows (least squares past two, F, a >= 0); every other term comes from the box.

What the numbers cannot separate is given as a range: τ (no histogram: the band of τ where
every prediction is within the tolerance), the crossing (the concurrency where plain decoding
overtakes speculation, over that band), each with the measurement that would narrow it.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import numpy as np

from workbench.errors import ConfigError
from workbench.lab.boxmodel import allreduce_us, crossing, forward, level, padded
from workbench.lab.boxspec import REPO_ROOT, geometry, rules, set_field
from workbench.lab.collectives import choose

SEEDS = REPO_ROOT / "data" / "seeds" / "seeds.json"
FIT_KEYS = ("spec_single_after", "plain_saturated")
TOLERANCE = 0.20


def load_seeds(path: str | Path = SEEDS) -> list[dict[str, Any]]:
    """The measured numbers (``data/seeds/seeds.json``: value, unit, mode, concurrency, the
    box state they were measured in, the sentence each comes from)."""
    doc = json.loads(Path(path).read_text())
    nums = doc.get("numbers") or []
    for x in nums:
        if x.get("unit") not in ("tok/s", "ms") or x.get("mode") not in ("plain", "spec",
                                                                         "verify"):
            raise ConfigError(f"{path}: number {x.get('key')!r} needs unit tok/s|ms and mode "
                              "plain|spec|verify")
    return nums


def load_claims(path: str | Path = SEEDS) -> list[dict[str, Any]]:
    """Signs the numbers' sentences state (``claims``: plain decoding at the same state and
    concurrency above or below a named number), each with its sentence."""
    return list(json.loads(Path(path).read_text()).get("claims") or [])


def claims_hold(box: dict[str, Any], obs: list[dict[str, Any]], claims: list[dict[str, Any]],
                tau: float) -> dict[str, bool]:
    """Each claim checked on the fitted ``box``: plain tok/s in the number's state and
    concurrency above (``plain_above``) or below (``plain_below``) the number."""
    by = {o["key"]: o for o in obs}
    out = {}
    for c in claims:
        ref = by.get(c.get("plain_above") or c.get("plain_below") or "")
        if ref is None:
            raise ConfigError(f"claim {c.get('key')!r}: names no measured number")
        b = state_box(box, ref)
        plain = level(b, _conc(b, ref), tau)["plain_tok_s"]
        above = plain > float(ref["value"])
        out[c["key"]] = above if "plain_above" in c else not above
    return out


def state_box(box: dict[str, Any], obs: dict[str, Any]) -> dict[str, Any]:
    """The box in the state the number was measured in (``state``: dotted overrides)."""
    for key, value in obs.get("state", {}).items():
        box = set_field(box, f"{key}={json.dumps(value)}")
    return box


def _conc(box: dict[str, Any], obs: dict[str, Any]) -> int:
    c = obs["concurrency"]
    return int(max(box["workload"]["levels"])) if c == "top" else int(c)


def _ms(box: dict[str, Any], obs: dict[str, Any], tau: float) -> float:
    """The number in the model's linear space: ms per output token, or a forward's ms."""
    b = state_box(box, obs)
    c = _conc(b, obs)
    if obs["mode"] == "verify":
        w = b["workload"]
        ctx = float(w["prompt_len"]) + float(w["output_len"]) / 2
        n = int(w["shape"][2])
        return sum(forward(b, padded(b, c, True) * n, c, ctx).values())
    row = level(b, c, tau)
    return 1e3 / row[f"{obs['mode']}_tok_s"]


def _measured_ms(obs: dict[str, Any]) -> float:
    return 1e3 / float(obs["value"]) if obs["unit"] == "tok/s" else float(obs["value"])


def _to_value(obs: dict[str, Any], ms: float) -> float:
    return 1e3 / ms if obs["unit"] == "tok/s" else ms


def _with(box: dict[str, Any], floor: float, attn: float) -> dict[str, Any]:
    out = copy.deepcopy(box)
    out["fit"] = {**out["fit"], "floor_ms": float(floor), "attn_ns": float(attn)}
    return out


def _rows(box: dict[str, Any], obs: list[dict[str, Any]], tau: float) -> np.ndarray:
    """Per number: (x_F, x_a, rest)."""
    out = []
    for o in obs:
        rest = _ms(_with(box, 0, 0), o, tau)
        out.append((_ms(_with(box, 1, 0), o, tau) - rest, _ms(_with(box, 0, 1), o, tau) - rest,
                    rest))
    return np.asarray(out)


def solve(box: dict[str, Any], obs: list[dict[str, Any]], tau: float) -> tuple[float, float]:
    """(F, a) fitted to ``obs`` (least squares in relative error; both >= 0)."""
    if not obs:
        raise ConfigError("box fit: no numbers to fit")
    x = _rows(box, obs, tau)
    y = np.asarray([_measured_ms(o) for o in obs])
    w = 1.0 / y
    a_mat, rhs = x[:, :2] * w[:, None], (y - x[:, 2]) * w
    if len(obs) == 1:  # one number fits the floor alone
        return max(0.0, float(rhs[0] / a_mat[0, 0])), float(box["fit"]["attn_ns"])
    sol, *_ = np.linalg.lstsq(a_mat, rhs, rcond=None)
    f, a = (max(0.0, float(v)) for v in sol)
    if sol[0] < 0 or sol[1] < 0:  # one constant at its bound: refit the other alone
        k = 1 if sol[0] < 0 else 0
        v = float(np.dot(a_mat[:, k], rhs) / np.dot(a_mat[:, k], a_mat[:, k]))
        f, a = (0.0, max(v, 0.0)) if k == 1 else (max(v, 0.0), 0.0)
    return f, a


def predict(box: dict[str, Any], obs: list[dict[str, Any]], tau: float) -> list[dict[str, Any]]:
    out = []
    for o in obs:
        pred = _to_value(o, _ms(box, o, tau))
        out.append({"key": o["key"], "seed": float(o["value"]), "unit": o["unit"],
                    "predicted": pred, "error": pred / float(o["value"]) - 1.0})
    return out


def fit(box: dict[str, Any], obs: list[dict[str, Any]], tau: float,
        fit_keys: tuple[str, ...] = FIT_KEYS) -> dict[str, Any]:
    """Fit F and a to the numbers named by ``fit_keys`` at ``tau``; predict every number;
    leave-one-out over the numbers measured in the box's own state."""
    by = {o["key"]: o for o in obs}
    missing = [k for k in fit_keys if k not in by]
    if missing:
        raise ConfigError(f"box fit: no measured number named {', '.join(missing)}")
    f, a = solve(box, [by[k] for k in fit_keys], tau)
    fitted = _with(box, f, a)
    rows = predict(fitted, obs, tau)
    for r in rows:
        r["fitted"] = r["key"] in fit_keys
    own = [o for o in obs if not o.get("state")]
    loo = []
    for o in own if len(own) > 2 else []:
        rest = [x for x in own if x is not o]
        lf, la = solve(box, rest, tau)
        p = predict(_with(box, lf, la), [o], tau)[0]
        loo.append({"key": o["key"], "floor_ms": lf, "attn_ns": la,
                    "predicted": p["predicted"], "error": p["error"]})
    return {"tau": tau, "floor_ms": f, "attn_ns": a, "box": fitted, "numbers": rows,
            "loo": loo}


def collective_rows(box: dict[str, Any], before: dict[str, Any]) -> list[dict[str, Any]]:
    """The bs=1 forwards' all-reduces by message size, fused (``box``) and unfused
    (``before``): the path each takes, µs per all-reduce, and the collectives' ms and share
    of the forward (a plain step's target forward, the verify, a draft forward, the extend)."""
    w = box["workload"]
    ctx = float(w["prompt_len"]) + float(w["output_len"]) / 2
    s, k, n = (int(v) for v in w["shape"])
    g = geometry(box)
    rows = []
    for name, tokens, which in (("plain step", 1, "model"), ("verify", n, "model"),
                                ("draft forward", k, "draft"), ("draft extend", n, "draft")):
        row: dict[str, Any] = {"forward": name, "tokens": tokens,
                               "message_bytes": tokens * g.hidden * 2}
        for state, b in (("fused", box), ("unfused", before)):
            f = forward(b, tokens, 1, ctx, which)
            r = rules(b)
            path = choose(b, tokens, g.hidden, r["allreduce_fusion"], r["custom_allreduce"])
            row.update({f"path_{state}": path,
                        f"us_{state}": allreduce_us(b, tokens, g.hidden),
                        f"collectives_{state}_ms": f["collectives"],
                        f"forward_{state}_ms": sum(f.values()),
                        f"share_{state}": f["collectives"] / sum(f.values())})
        rows.append(row)
    return rows


def fusion_account(res: dict[str, Any], obs: list[dict[str, Any]]) -> dict[str, Any]:
    """The before/after-fusion pair on the fitted box (constants kept, only the path
    switched): the collectives by message size, the unfused verify and single stream beside
    the seeds', plain decoding unfused at c = 1 (the sentence's "net-negative" sign), and the
    measurement that separates the readings the numbers leave open."""
    by = {o["key"]: o for o in obs}
    box, tau = res["box"], res["tau"]
    need = ("verify_before", "spec_single_before")
    if not all(k in by for k in need):
        return {}
    before = state_box(box, by["verify_before"])
    rows = collective_rows(box, before)
    verify = next(r for r in rows if r["forward"] == "verify")
    seed_v = float(by["verify_before"]["value"])
    one_before = level(state_box(box, by["spec_single_before"]), 1, tau)
    seed_s = float(by["spec_single_before"]["value"])
    return {"messages": rows,
            "verify_before_model_ms": verify["forward_unfused_ms"],
            "verify_before_seed_ms": seed_v,
            "verify_before_error": verify["forward_unfused_ms"] / seed_v - 1.0,
            "spec_single_before_model": one_before["spec_tok_s"],
            "spec_single_before_seed": seed_s,
            "spec_single_before_error": one_before["spec_tok_s"] / seed_s - 1.0,
            "plain_single_before_model": one_before["plain_tok_s"],
            "net_negative_before": one_before["plain_tok_s"] > seed_s,
            "narrow_with": "nccl-tests all_reduce_perf -g 8 -b 8K -e 128K on the box "
                           "without fusion (CUDA graphs on): the 14 KB and 57 KB rows are "
                           "the plain step's and the verify's all-reduces"}


def fit_band(box: dict[str, Any], obs: list[dict[str, Any]],
             grid: tuple[float, float, float] = (1.1, 4.0, 0.05),
             keys: tuple[str, ...] | None = None,
             claims: list[dict[str, Any]] | None = None,
             fit_keys: tuple[str, ...] = FIT_KEYS) -> dict[str, Any]:
    """The τ where every number named by ``keys`` (default: every number not fitted) is
    predicted within TOLERANCE and every claim holds, the fit redone at each τ."""
    keys = tuple(o["key"] for o in obs if o["key"] not in fit_keys) if keys is None else keys
    ok, rows = [], []
    for tau in np.arange(grid[0], grid[1] + 1e-9, grid[2]):
        t = round(float(tau), 3)
        if t > min(box["workload"]["shape"][0], box["workload"]["shape"][2] - 1) + 1:
            break
        res = fit(box, obs, t, fit_keys)
        errs = {r["key"]: r["error"] for r in res["numbers"] if r["key"] in keys}
        held = claims_hold(res["box"], obs, claims or [], t)
        good = all(abs(e) <= TOLERANCE for e in errs.values()) and all(held.values())
        rows.append({"tau": t, "floor_ms": res["floor_ms"], "attn_ns": res["attn_ns"],
                     **errs, **held, "within": good})
        if good:
            ok.append(t)
    return {"band": [min(ok), max(ok)] if ok else None, "rows": rows, "keys": list(keys),
            "narrow_with": "τ at the server: SGLang 0.5.23 records' spec_correct_drafts_histogram "
                           "(or the /generate spec_accept_length of the seeds' workload)"}


def why_not(band: dict[str, Any], claims: list[dict[str, Any]]) -> str:
    """Why a reading has no τ band: the τ where the numbers fit, the claims that hold at no
    τ, and the smallest worst error over the grid (with its number)."""
    names = [c["key"] for c in claims]
    rows = band["rows"]
    within = [r["tau"] for r in rows if all(abs(r[k]) <= TOLERANCE for k in band["keys"])]
    never = [k for k in names if not any(r.get(k) for r in rows)]
    best = min(rows, key=lambda r: max(abs(r[k]) for k in band["keys"]))
    worst = max(band["keys"], key=lambda k: abs(best[k]))
    span = f"{min(within):g}–{max(within):g}" if within else "none"
    return (f"the numbers fit at τ {span}; claims that hold at no τ: "
            f"{never or 'none (each holds somewhere, never together with the fit)'}; "
            f"closest at τ {best['tau']:g}: {worst} {best[worst]:+.0%}")


def crossing_band(box: dict[str, Any], obs: list[dict[str, Any]], band: list[float],
                  steps: int = 5) -> dict[str, Any]:
    """The crossing concurrency at the ends (and inside) of a τ band, each with its own fit
    (to FIT_KEYS when the numbers have them, else to every number)."""
    have = {o["key"] for o in obs}
    keys = FIT_KEYS if set(FIT_KEYS) <= have else tuple(o["key"] for o in obs)
    points = []
    for t in np.linspace(band[0], band[1], steps):
        res = fit(box, obs, float(t), keys)
        points.append({"tau": float(t), "crossing": crossing(res["box"], float(t))})
    found = [p["crossing"] for p in points if p["crossing"] is not None]
    lo, hi = (min(found), max(found)) if found else (None, None)
    if lo is None:
        measure = "measure plain and EAGLE-3 tok/s at c = 64, 128 (bench threshold --url)"
    else:
        cs = list(range(lo, hi + 2)) if hi - lo <= 6 else \
            sorted({lo, (lo + hi) // 2, hi, hi + 1})
        measure = (f"measure plain and EAGLE-3 tok/s at c = {', '.join(map(str, cs))} "
                   "(bench threshold --url): the seeds measured only c = 1 and saturation")
    return {"range": [lo, hi], "points": points, "narrow_with": measure}
