"""``python -m workbench lab box``: a box (preset or file, ``--set`` overrides), its step model
fitted to measured numbers where the box has them (the seeds' five for ``--preset seeds``), and
what every policy would deliver at each concurrency, with ranges where the inputs cannot decide.
The Python API is :func:`box_report` (same arguments)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from workbench.errors import ConfigError
from workbench.lab import whatif
from workbench.lab.boxfit import (
    FIT_KEYS,
    SEEDS,
    claims_hold,
    crossing_band,
    fit,
    fit_band,
    fusion_account,
    load_claims,
    load_seeds,
    predict,
    why_not,
)
from workbench.lab.boxmodel import (
    crossing,
    crossing_one_server,
    level,
    off_level,
    prefill_ms,
    what_if,
)
from workbench.lab.boxspec import geometry, load_box, rules, with_sets
from workbench.lab.collectives import paths, reading_names, reading_sets

# vLLM's docs, dynamic speculative decoding with EAGLE-3 (workbench.lab.arms): batch -> tokens
VLLM_TABLE = ((1, 16, 5), (17, 32, 4), (33, 64, 3), (65, 128, 1), (129, None, 0))
SGLANG_TIERS = {1: [1, 3, 5, 7], 8: [0, 1, 3], 32: [0, 1], 64: [0]}  # 0.5.23 defaults


def chain_tau(tau: float, steps: int, depth: int) -> float:
    """τ of an ``steps``-step chain when the measured one has ``depth`` steps at ``tau`` (one
    rate a for every depth: τ = 1 + a + ... + a^depth)."""
    from workbench.lab.boxreplay import geometric_rate

    a = geometric_rate(tau, depth)
    return 1.0 + sum(a ** d for d in range(1, steps + 1))


def policy_rows(box: dict[str, Any], tau: float, levels: Sequence[int]) -> list[dict[str, Any]]:
    """tok/s per level of never, always, threshold (the crossing), Goodput (the best of its
    candidates — the shape, its chain, a 3-step chain, off — as a controller with the model's
    own step times would pick), SGLang 0.5.23's default tiers (the best of each tier's
    candidates: an upper bound of what its controller reaches; under 0.5.23's server rules,
    whatever version the box runs) and vLLM's table, every chain
    at the τ one per-depth rate gives it. ``never`` is the plain server; the others run on one
    EAGLE-3 server (its running-request cap and overlap rule, the draft kept warm when off)."""
    s0 = int(box["workload"]["shape"][0])
    n = crossing(box, tau)
    # the tiers column runs the rules of the version it is named for
    v23 = box if rules(box)["version"] == "0.5.23" else with_sets(box, ["server.version=0.5.23"])

    def chain(c: int, steps: int, b: dict[str, Any] = box) -> float:
        if steps == 0:  # off inside the EAGLE-3 server: its cap, its rules, a warm draft
            return off_level(b, c)["tok_s"]
        t = chain_tau(tau, steps, s0)
        return level(b, c, t, (steps, 1, steps + 1))["spec_tok_s"]

    out = []
    for c in levels:
        tier = max(k for k in SGLANG_TIERS if k <= c)
        vk = next(k for lo, hi, k in VLLM_TABLE if lo <= c and (hi is None or c <= hi))
        row = {"concurrency": c, "never": level(box, c, tau)["plain_tok_s"],
               "always": chain(c, s0),
               "threshold": chain(c, s0 if n is None or c < n else 0),
               "goodput": max(chain(c, s) for s in dict.fromkeys([0, s0, 3])),
               "sglang_0.5.23_tiers": max(chain(c, s, v23) for s in SGLANG_TIERS[tier]),
               "vllm_table": chain(c, vk)}
        out.append(row)
    return out


def sweep_numbers(threshold: Any, records: Any = None) -> tuple[list[dict[str, Any]],
                                                                float | None, dict[str, float]]:
    """A ``bench threshold --url`` sweep as numbers to fit (one per arm and level), the τ of
    the EAGLE-3 server (its records' mean accept length, else the sweep's), and the workload
    the records show (mean prompt and output tokens)."""
    import numpy as np

    from workbench.lab.boxreplay import _bench_rows

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


def _readings(box: dict[str, Any], obs: list[dict[str, Any]], claims: list[dict[str, Any]],
              fit_keys: tuple[str, ...], tau: float) -> list[dict[str, Any]]:
    """Each reading of the link (the given paths and every ``link.readings`` alternative):
    its τ band, or why the numbers refute it, and its predictions at ``tau``."""
    out = []
    g = geometry(box)
    n = int(box["workload"]["shape"][2])
    for name in reading_names(box):
        b = with_sets(box, reading_sets(box, name))
        band = fit_band(b, obs, claims=claims, fit_keys=fit_keys)
        res = fit(b, obs, tau, fit_keys)
        nccl = paths(b["link"], int(b["layout"]["tp"]))["nccl"]
        tp = int(b["layout"]["tp"])
        out.append({"reading": name, "sets": reading_sets(box, name), "band": band["band"],
                    "refuted": None if band["band"] else why_not(band, claims),
                    "nccl_source": nccl.source, "nccl_box": nccl.box,
                    "nccl_us_plain": nccl.time_us(g.hidden * 2, tp),
                    "nccl_us_verify": nccl.time_us(n * g.hidden * 2, tp),
                    "numbers": {r["key"]: r["error"] for r in res["numbers"]}, "box": b})
    return out


def _crossing_table(box: dict[str, Any], tau_ends: Sequence[float], obs: list[dict[str, Any]],
                    fit_keys: tuple[str, ...]) -> list[dict[str, Any]]:
    """The crossing by chain shape (1, 2, 3, 5 steps at the τ one per-depth rate gives each)
    and by routing (a plain server beside the EAGLE-3 one, or speculation off inside it),
    each as the range over ``tau_ends`` (each with its own fit)."""
    s0 = int(box["workload"]["shape"][0])
    fits = [(t, fit(box, obs, t, fit_keys)["box"]) for t in tau_ends]
    rows = []
    for steps in sorted({1, 2, 3, 5, s0}):
        shape = (steps, 1, steps + 1)
        for routing, fn in (("plain server beside", crossing),
                            ("off inside one server", crossing_one_server)):
            got = [fn(b, chain_tau(t, steps, s0), shape=shape) for t, b in fits]
            rows.append({"shape": f"{steps}-step chain", "routing": routing,
                         "crossing": [min(got, key=_none_last), max(got, key=_none_last)]})
    return rows


def _none_last(c: int | None) -> float:
    return float("inf") if c is None else float(c)


def box_report(preset: str | Path = "seeds", sets: Sequence[str] = (),
               seeds: str | Path | None = None, tau: float | None = None,
               fit_keys: Sequence[str] = FIT_KEYS, threshold: Any = None,
               records: Any = None, what_ifs: Sequence[str] = ()) -> dict[str, Any]:
    """The report of the module doc. ``sets`` describe the box before the fit; ``what_ifs``
    change the fitted box after it (never refitting: :mod:`workbench.lab.whatif`).
    ``seeds``: a numbers file (default ``data/seeds`` for the seeds preset, none otherwise);
    ``tau``: the speculative τ (default the workload's); ``threshold`` (+ ``records``, a
    ``read_request_metrics`` frame): a measured sweep of this box instead — both constants
    fitted to every row, τ and the workload from the records."""
    box = with_sets(load_box(preset), list(sets))
    if threshold is not None:
        out = _sweep_report(box, preset, sets, threshold, records, tau)
        return _with_what_if(out, what_ifs)
    tau = float(box["workload"]["tau"] if tau is None else tau)
    levels = [int(c) for c in box["workload"]["levels"]]
    if seeds is None and str(preset) == "seeds":
        seeds = SEEDS
    keys = tuple(fit_keys)
    out: dict[str, Any] = {"box": box.get("name"), "preset": str(preset), "sets": list(sets),
                           "tau": tau, "rules": rules(box), "provenance": box.get("provenance"),
                           "levels": levels}
    if seeds is None:
        out.update({"fitted": None, "fitted_box": box,
                    "what_if": what_if(box, levels, tau).to_dict(orient="records"),
                    "policies": policy_rows(box, tau, levels)})
        return _with_what_if(out, what_ifs)
    obs, claims = load_seeds(seeds), load_claims(seeds)
    readings = _readings(box, obs, claims, keys, tau)
    alive = [r for r in readings if r["band"] is not None]
    if not alive:
        raise ConfigError(
            "lab box: no reading of the link fits the numbers within ±20 % with their claims "
            "holding (τ 1.1..4): " + "; ".join(f"{r['reading']}: {r['refuted']}"
                                               for r in readings))
    box = alive[0]["box"]
    res = fit(box, obs, tau, keys)
    ends = [(r["box"], t) for r in alive for t in r["band"]]
    preds = [predict(fit(b, obs, t, keys)["box"], obs, t) for b, t in ends]
    for i, row in enumerate(res["numbers"]):
        vals = [p[i]["predicted"] for p in preds]
        row["band"] = [min(vals), max(vals)]
        row["sentence"] = next(o["sentence"] for o in obs if o["key"] == row["key"])
    cross = [crossing_band(r["box"], obs, r["band"]) for r in alive]
    found = [c for cr in cross for c in cr["range"] if c is not None]
    loo_err = max((abs(r["error"]) for r in res["loo"]), default=0.0)
    fitted = res["box"]
    out.update({
        "fitted": {"floor_ms": res["floor_ms"], "attn_ns": res["attn_ns"], "from": list(keys)},
        "fitted_box": fitted, "numbers": res["numbers"], "loo": res["loo"],
        "readings": [{k: v for k, v in r.items() if k != "box"} for r in readings],
        "reading": alive[0]["reading"],
        "tau_band": {"band": [min(r["band"][0] for r in alive),
                              max(r["band"][1] for r in alive)],
                     "narrow_with": FIT_BAND_NARROW,
                     "rule": "every predicted number within ±20 % and every claim of the "
                             "numbers' sentences holding (the fit redone at each τ), per "
                             "reading of the link",
                     "claims": [{**c, "holds": claims_hold(fitted, obs, [c], tau)[c["key"]]}
                                for c in claims]},
        "fusion": fusion_account(res, obs),
        "crossing": {"range": [min(found), max(found)] if found else [None, None],
                     "narrow_with": cross[0]["narrow_with"],
                     "loo_error": loo_err, "inside_error": _inside_error(fitted, tau, levels,
                                                                         loo_err),
                     "by_shape": _crossing_table(box, alive[0]["band"], obs, keys)},
        "saturation_level": saturation_sensitivity(box, obs, tau, keys),
        "policies_band": {f"{r['reading']} τ {t:g}": policy_rows(
            fit(r["box"], obs, t, keys)["box"], t, levels) for r in alive for t in r["band"]},
        "what_if": what_if(fitted, levels, tau).to_dict(orient="records"),
        "policies": policy_rows(fitted, tau, levels)})
    return _with_what_if(out, what_ifs)


FIT_BAND_NARROW = ("τ at the server: SGLang 0.5.23 records' spec_correct_drafts_histogram (or "
                   "the /generate spec_accept_length of the seeds' workload)")


def _inside_error(box: dict[str, Any], tau: float, levels: Sequence[int],
                  err: float) -> list[int]:
    """The levels where the gain is within the model's largest leave-one-out error of 1: the
    sign of speculation's gain there is not decided by the model."""
    out = []
    for c in levels:
        g = level(box, c, tau)["gain"]
        if 1.0 / (1.0 + err) < g < 1.0 + err:
            out.append(int(c))
    return out


def _with_what_if(out: dict[str, Any], what_ifs: Sequence[str]) -> dict[str, Any]:
    if what_ifs:
        box = whatif.apply(out["fitted_box"], what_ifs, out["levels"], out["tau"])
        out["what_ifs"] = {"sets": list(what_ifs),
                           "rows": whatif.compare(out["fitted_box"], box, out["levels"],
                                                  out["tau"]),
                           "policies": policy_rows(box, out["tau"], out["levels"])}
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
            "sets": list(sets), "tau": tau, "levels": levels, "fitted_box": res["box"],
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
        for r in rep.get("readings", []):
            state = (f"τ band {r['band']}" if r["band"] else f"refuted: {r['refuted']}")
            print(f"  link reading {r['reading']}: NCCL {r['nccl_us_plain']:.0f} µs at the plain "
                  f"step's message, {r['nccl_us_verify']:.0f} µs at the verify's; {state}")
        fa = rep["fusion"]
        if fa:
            for m in fa["messages"]:
                print(f"  {m['forward']:<14} {m['message_bytes'] / 1000:>5.0f} KB: fused: "
                      f"{m['path_fused']} path {m['us_fused']:.0f} µs ({m['share_fused']:.0%} of "
                      f"the forward); unfused: {m['path_unfused']} path {m['us_unfused']:.0f} µs"
                      f" ({m['share_unfused']:.0%})")
            print(f"fusion (reading {rep['reading']}, constants kept, path switched): unfused "
                  f"verify {fa['verify_before_model_ms']:.1f} ms (seeds ~"
                  f"{fa['verify_before_seed_ms']:.0f}, {fa['verify_before_error']:+.0%}); "
                  f"unfused EAGLE-3 single stream {fa['spec_single_before_model']:.1f} tok/s "
                  f"(seeds {fa['spec_single_before_seed']}), unfused plain "
                  f"{fa['plain_single_before_model']:.1f}: net-negative before fusion "
                  f"{'holds' if fa['net_negative_before'] else 'does not hold'}; separate the "
                  f"readings with {fa['narrow_with']}")
        for r in rep.get("saturation_level", []):
            errs = ", ".join(f"{k} {v:+.0%}" for k, v in r.items()
                             if k not in ("top_level", "floor_ms", "attn_ns"))
            print(f"  if 'saturating' was measured at c = {r['top_level']}: {errs}")
        cr = rep["crossing"]
        lo, hi = cr["range"]
        span = f"{lo}" if lo == hi else f"{lo}..{hi}"
        inside = cr.get("inside_error") or []
        err = (f"; at c = {', '.join(map(str, inside))} the gain is inside the model's "
               f"leave-one-out error (±{cr['loo_error']:.0%}): the sign is not decided there"
               if inside else "")
        print(f"stop speculating from concurrency {span} over the τ band{err}; "
              f"{cr['narrow_with']}")
        for r in cr.get("by_shape", []):
            lo, hi = r["crossing"]
            span = lo if lo == hi else f"{lo}..{hi}"
            print(f"  {r['shape']:<13} {r['routing']:<22} crossing {span}")
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


    wi = rep.get("what_ifs")
    if wi:
        print(f"what-if {' '.join(wi['sets'])} (the fitted constants kept: a prediction)")
        print(f"{'c':>4} {'plain':>8} {'→':>8} {'eagle3':>8} {'→':>8}")
        for r in wi["rows"]:
            print(f"{r['concurrency']:>4} {r['plain_tok_s']:>8.1f} "
                  f"{r['what_if_plain_tok_s']:>8.1f} {r['spec_tok_s']:>8.1f} "
                  f"{r['what_if_spec_tok_s']:>8.1f}")

