"""``python -m workbench lab box``: a box (preset or file, ``--set`` overrides), its step model
fitted to measured numbers where the box has them (the seeds' five for ``--preset seeds``), and
what every policy would deliver at each concurrency, with ranges where the inputs cannot decide.
The Python API is :func:`box_report` (same arguments)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from workbench.errors import ConfigError
from workbench.lab.boxfit import (
    FIT_KEYS,
    SEEDS,
    claims_hold,
    crossing_band,
    fit,
    fusion_account,
    load_claims,
    load_seeds,
    predict,
    tau_band,
)
from workbench.lab.boxmodel import crossing, level, off_level, prefill_ms, what_if
from workbench.lab.boxspec import load_box, rules, with_sets

# vLLM's docs, dynamic speculative decoding with EAGLE-3 (workbench.lab.arms): batch -> tokens
VLLM_TABLE = ((1, 16, 5), (17, 32, 4), (33, 64, 3), (65, 128, 1), (129, None, 0))
SGLANG_TIERS = {1: [1, 3, 5, 7], 8: [0, 1, 3], 32: [0, 1], 64: [0]}  # 0.5.23 defaults


def chain_tau(tau: float, steps: int, depth: int) -> float:
    """τ of an ``steps``-step chain when the measured one has ``depth`` steps at ``tau`` (one
    rate a for every depth: τ = 1 + a + ... + a^depth)."""
    from workbench.lab.box import geometric_rate

    a = geometric_rate(tau, depth)
    return 1.0 + sum(a ** d for d in range(1, steps + 1))


def policy_rows(box: dict[str, Any], tau: float, levels: Sequence[int]) -> list[dict[str, Any]]:
    """tok/s per level of never, always, threshold (the crossing), Goodput (the best of its
    candidates — the shape, its chain, a 3-step chain, off — as a controller with the model's
    own step times would pick), SGLang 0.5.23's default tiers (the best of each tier's
    candidates: an upper bound of what its controller reaches) and vLLM's table, every chain
    at the τ one per-depth rate gives it. ``never`` is the plain server; the others run on one
    EAGLE-3 server (its running-request cap and overlap rule, the draft kept warm when off)."""
    s0 = int(box["workload"]["shape"][0])
    n = crossing(box, tau)

    def chain(c: int, steps: int) -> float:
        if steps == 0:  # off inside the EAGLE-3 server: its cap, its rules, a warm draft
            return off_level(box, c)["tok_s"]
        t = chain_tau(tau, steps, s0)
        return level(box, c, t, (steps, 1, steps + 1))["spec_tok_s"]

    out = []
    for c in levels:
        tier = max(k for k in SGLANG_TIERS if k <= c)
        vk = next(k for lo, hi, k in VLLM_TABLE if lo <= c and (hi is None or c <= hi))
        row = {"concurrency": c, "never": level(box, c, tau)["plain_tok_s"],
               "always": chain(c, s0),
               "threshold": chain(c, s0 if n is None or c < n else 0),
               "goodput": max(chain(c, s) for s in dict.fromkeys([0, s0, 3])),
               "sglang_0.5.23_tiers": max(chain(c, s) for s in SGLANG_TIERS[tier]),
               "vllm_table": chain(c, vk)}
        out.append(row)
    return out


def sweep_numbers(threshold: Any, records: Any = None) -> tuple[list[dict[str, Any]],
                                                                float | None, dict[str, float]]:
    """A ``bench threshold --url`` sweep as numbers to fit (one per arm and level), the τ of
    the EAGLE-3 server (its records' mean accept length, else the sweep's), and the workload
    the records show (mean prompt and output tokens)."""
    import numpy as np

    from workbench.lab.box import _bench_rows

    obs, taus = [], []
    for r in _bench_rows(threshold):
        if r["arm"] not in ("baseline", "eagle3") or not r["tok_s"]:
            continue
        mode = "plain" if r["arm"] == "baseline" else "spec"
        obs.append({"key": f"{r['arm']}_c{int(r['concurrency'])}", "value": float(r["tok_s"]),
                    "unit": "tok/s", "mode": mode, "concurrency": int(r["concurrency"]),
                    "state": {}, "sentence": "bench threshold --url row"})
        if r.get("tau"):
            taus.append(float(r["tau"]))
    work: dict[str, float] = {}
    tau = float(np.mean(taus)) if taus else None
    if records is not None and len(records):
        tau = float(np.nanmean(records["tau"]))
        work = {"prompt_len": float(np.mean(records["prompt_len"])),
                "output_len": float(np.mean(records["output_len"]))}
    return obs, tau, work


def saturation_sensitivity(box: dict[str, Any], obs: list[dict[str, Any]], tau: float,
                           fit_keys: tuple[str, ...]) -> list[dict[str, Any]]:
    """The seeds name no concurrency for "saturating": the fit and its predictions with the
    sweep's top level at 64, 128 and 256 (the preset assumes its own levels)."""
    rows = []
    for top in (64, 128, 256):
        levels = [c for c in (1, 2, 4, 8, 16, 32, 64, 128, 256) if c <= top]
        b = with_sets(box, [f"workload.levels={levels}"])
        res = fit(b, obs, tau, fit_keys)
        rows.append({"top_level": top, "floor_ms": res["floor_ms"], "attn_ns": res["attn_ns"],
                     **{r["key"]: r["error"] for r in res["numbers"] if not r["fitted"]}})
    return rows


def box_report(preset: str | Path = "seeds", sets: Sequence[str] = (),
               seeds: str | Path | None = None, tau: float | None = None,
               fit_keys: Sequence[str] = FIT_KEYS, threshold: Any = None,
               records: Any = None) -> dict[str, Any]:
    """The report of the module doc. ``seeds``: a numbers file (default ``data/seeds`` for the
    seeds preset, none otherwise); ``tau``: the speculative τ (default the workload's);
    ``threshold`` (+ ``records``, a ``read_request_metrics`` frame): a measured sweep of this
    box instead — both constants fitted to every row, τ and the workload from the records."""
    box = with_sets(load_box(preset), list(sets))
    if threshold is not None:
        return _sweep_report(box, preset, sets, threshold, records, tau)
    tau = float(box["workload"]["tau"] if tau is None else tau)
    levels = [int(c) for c in box["workload"]["levels"]]
    if seeds is None and str(preset) == "seeds":
        seeds = SEEDS
    out: dict[str, Any] = {"box": box.get("name"), "preset": str(preset), "sets": list(sets),
                           "tau": tau, "rules": rules(box), "provenance": box.get("provenance")}
    if seeds is not None:
        obs = load_seeds(seeds)
        claims = load_claims(seeds)
        res = fit(box, obs, tau, tuple(fit_keys))
        band = tau_band(box, obs, claims=claims)
        if band["band"] is None:
            names = [c["key"] for c in claims]
            never = [k for k in names if not any(r.get(k) for r in band["rows"])]
            within = [r["tau"] for r in band["rows"]
                      if all(abs(v) <= 0.2 for k, v in r.items()
                             if k not in ("tau", "floor_ms", "attn_ns", "within", *names))]
            raise ConfigError(
                "lab box: no τ in 1.1..4 fits the numbers within ±20 % with their claims "
                f"holding: the numbers fit at τ {_span(within)}; claims that hold at no τ: "
                f"{never or 'none (each holds somewhere, never together with the fit)'}")
        lo, hi = band["band"]
        ends = [predict(fit(box, obs, t, tuple(fit_keys))["box"], obs, t) for t in (lo, hi)]
        for row, a, b in zip(res["numbers"], *ends, strict=True):
            row["band"] = sorted([a["predicted"], b["predicted"]])
            row["sentence"] = next(o["sentence"] for o in obs if o["key"] == row["key"])
        out.update({
            "fitted": {"floor_ms": res["floor_ms"], "attn_ns": res["attn_ns"],
                       "from": list(fit_keys)},
            "numbers": res["numbers"], "loo": res["loo"],
            "tau_band": {"band": band["band"], "narrow_with": band["narrow_with"],
                         "rule": "every prediction within ±20 % and every claim of the "
                                 "numbers' sentences holding (the fit redone at each τ)",
                         "claims": [{**c, "holds": claims_hold(res["box"], obs, [c], tau)[
                             c["key"]]} for c in claims]},
            "fusion": fusion_account(res, obs),
            "crossing": crossing_band(box, obs, band["band"])})
        out["saturation_level"] = saturation_sensitivity(box, obs, tau, tuple(fit_keys))
        out["policies_band"] = {str(t): policy_rows(fit(box, obs, t, tuple(fit_keys))["box"],
                                                    t, levels) for t in (lo, hi)}
        box = res["box"]
    else:
        out["fitted"] = None
    df = what_if(box, levels, tau)
    out["what_if"] = df.to_dict(orient="records")
    out["policies"] = policy_rows(box, tau, levels)
    return out


def _sweep_report(box: dict[str, Any], preset: Any, sets: Sequence[str], threshold: Any,
                  records: Any, tau: float | None) -> dict[str, Any]:
    obs, t, work = sweep_numbers(threshold, records)
    tau = t if tau is None else tau
    if tau is None:
        raise ConfigError("lab box --threshold-json: no τ (give --records, the EAGLE-3 "
                          "server's request records, or --tau)")
    for key, v in work.items():
        box = with_sets(box, [f"workload.{key}={round(v)}"])
    res = fit(box, obs, tau, tuple(o["key"] for o in obs))
    for row in res["numbers"]:
        row["band"] = [row["predicted"], row["predicted"]]
    levels = sorted({int(o["concurrency"]) for o in obs})
    prefill = {"model_ms": prefill_ms(res["box"], True)}
    if records is not None and len(records) and records["ttft_s"].notna().any():
        # the fastest tenth of first tokens: a prefill that waited for nothing
        prefill["ttft_p10_ms"] = float(records["ttft_s"].dropna().quantile(0.1)) * 1e3
        prefill["error"] = prefill["model_ms"] / prefill["ttft_p10_ms"] - 1.0
    return {"box": box.get("name"), "prefill": prefill, "preset": str(preset),
            "sets": list(sets), "tau": tau,
            "rules": rules(box), "provenance": box.get("provenance"),
            "fitted": {"floor_ms": res["floor_ms"], "attn_ns": res["attn_ns"],
                       "from": [o["key"] for o in obs]},
            "numbers": res["numbers"], "loo": res["loo"],
            "tau_band": {"band": [tau, tau], "narrow_with": "measured (records or sweep)"},
            "fusion": {}, "crossing": crossing_band(res["box"], obs, [tau, tau], steps=1),
            "what_if": what_if(res["box"], levels, tau).to_dict(orient="records"),
            "policies": policy_rows(res["box"], tau, levels)}


def print_report(rep: dict[str, Any]) -> None:
    print(f"{rep['box']}  (τ {rep['tau']:.2f}; SGLang {rep['rules']['version']} rules: "
          f"spec cap {rep['rules']['spec_max_running_requests']}, spec overlap "
          f"{rep['rules']['spec_overlap']}, all-reduce fusion {rep['rules']['allreduce_fusion']})")
    if rep.get("fitted"):
        f = rep["fitted"]
        print(f"fitted from {', '.join(f['from'])}: floor {f['floor_ms']:.2f} ms per target "
              f"forward, attention {f['attn_ns']:.2f} ns per context token per layer per query")
        print(f"τ band where the fit holds: {rep['tau_band']['band']} "
              f"(narrow it with {rep['tau_band']['narrow_with']})")
        for r in rep["numbers"]:
            tag = "fitted" if r["fitted"] else "predicted"
            print(f"  {r['key']:<20} seeds {r['seed']:>7.1f} {r['unit']:<5} {tag:>9} "
                  f"{r['predicted']:>7.1f} ({r['error']:+.0%}), band {r['band'][0]:.1f}.."
                  f"{r['band'][1]:.1f}")
        for r in rep["loo"]:
            print(f"  leave-one-out {r['key']:<20} {r['predicted']:>7.1f} ({r['error']:+.0%})")
        fa = rep["fusion"]
        if fa:
            print(f"fusion: the verify's collectives {fa['collectives_before_ms']:.1f} → "
                  f"{fa['collectives_after_ms']:.1f} ms; the model's unfused verify "
                  f"{fa['verify_before_model_ms']:.1f} ms of the seeds' ~"
                  f"{fa['verify_before_seed_ms']:.0f}: {fa['rest_from_verify_ms']:.1f} ms is "
                  f"not collectives ({fa['rest_from_single_stream_ms']:.1f} ms per round "
                  f"from the single-stream pair)")
            print(f"  were it the collectives, an unfused all-reduce would take "
                  f"{fa['allreduce_us_implied_by_verify']:.0f} µs (by the verify) / "
                  f"{fa['allreduce_us_implied_by_single_stream']:.0f} µs (by the single "
                  f"stream), not the given {fa['allreduce_us_given']:.0f}; settle it with "
                  f"{fa['narrow_with']}")
        for r in rep.get("saturation_level", []):
            errs = ", ".join(f"{k} {v:+.0%}" for k, v in r.items()
                             if k not in ("top_level", "floor_ms", "attn_ns"))
            print(f"  if 'saturating' was measured at c = {r['top_level']}: {errs}")
        cr = rep["crossing"]
        lo, hi = cr["range"]
        span = f"{lo}" if lo == hi else f"{lo}..{hi}"
        print(f"stop speculating from concurrency {span} over the τ band; {cr['narrow_with']}")
    pf = rep.get("prefill") or {}
    if "ttft_p10_ms" in pf:
        print(f"prefill: the model {pf['model_ms']:.1f} ms per request, the records' fastest "
              f"tenth of TTFT {pf['ttft_p10_ms']:.1f} ms ({pf['error']:+.0%})")
    names = [k for k in rep["policies"][0] if k != "concurrency"]
    print("tok/s by policy (τ " + f"{rep['tau']:.2f}" + (
        "; in brackets the range over the τ band, each with its own fit" if
        rep.get("policies_band") else "") + "; never is the plain server, the rest one EAGLE-3 "
        "server)")
    print(f"{'c':>4} " + " ".join(f"{n:>22}" for n in names))
    ends = list((rep.get("policies_band") or {}).values())
    for i, r in enumerate(rep["policies"]):
        cells = []
        for n in names:
            rng = sorted([r[n], *(e[i][n] for e in ends)])
            cells.append(f"{r[n]:.0f}" + (f" [{rng[0]:.0f}..{rng[-1]:.0f}]" if ends else ""))
        print(f"{r['concurrency']:>4} " + " ".join(f"{c:>22}" for c in cells))
    print(f"{'c':>4} {'plain':>8} {'eagle3':>8} {'gain':>6}  batch p/s")
    for r in rep["what_if"]:
        capped = [m for m in ("plain", "spec") if r[f"{m}_capped"]]
        note = f" ({'/'.join(capped)} at its cap: the server queues the rest)" if capped else ""
        print(f"{r['concurrency']:>4} {r['plain_tok_s']:>8.1f} {r['spec_tok_s']:>8.1f} "
              f"{r['gain']:>6.2f}  {r['plain_batch']}/{r['spec_batch']}{note}")


def _span(taus: list[float]) -> str:
    """``lo–hi`` of a τ list, or ``none``."""
    return f"{min(taus):g}–{max(taus):g}" if taus else "none"

