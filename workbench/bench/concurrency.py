"""Closed-loop concurrency sweep: where does speculation stop paying, and what do policies buy?

For each concurrency level c, every arm keeps c requests in flight (a new one joins as soon as
one finishes) through ``add_request``/``step`` on one engine; the arms of a level run back to
back (order rotated per repeat) so they share the machine's noise. One row per (arm, level):
output tok/s, TTFT / TPOT / ITL p50 and p99, τ, share of decode steps that speculated, mean
plain and speculative step times, and a token-for-token comparison with the baseline arm.

Derived measurements:
* **K=0 tax**: arm ``never`` (SpecConfig(policy=Never()): the speculative engine with drafting
  off, draft_state auto) vs ``baseline`` → ``k0_tax = 1 − tok/s(never)/tok/s(baseline)``, and
  per step, ``k0_tax_step`` = median steady-state step ms of never / baseline − 1 (steps at the
  full batch without prefill work: far less noisy than whole-run tok/s).
* **cost per switch**: arms ``flip_warm`` / ``flip_cold`` (RandomFlip(0.5), warm vs cold draft)
  → ``switch_extra_ms`` = mean ms of a speculative step right after an off step minus one right
  after a speculative step (cold pays the draft catch-up there; warm pays a draft extend on
  every plain step instead, visible in ``plain_ms``). See :func:`switch_costs`.
* :func:`find_threshold`: the smallest level where baseline tok/s ≥ eagle3 tok/s, and the
  suggested ``BatchThreshold(n)``; the ``threshold`` arm itself takes n from the cost model
  calibrated on this machine (``default_arms``), and ``config.policy_basis`` says why.

Steps that also ran a prefill chunk are excluded from the per-step times (not from tok/s).
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import math
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
from tqdm.auto import tqdm

from workbench.bench.sanity import LoadSampler, mark, report, sanity_flags
from workbench.config import SamplingParams, SpecConfig
from workbench.engine.calibrate import calibrate, measure_tau
from workbench.errors import ConfigError
from workbench.machine import loadavg, machine_info
from workbench.policy.goodput import Goodput
from workbench.policy.policies import Always, BatchThreshold, Never, RandomFlip, RecordingPolicy
from workbench.stats import mean_ci, percentile

if TYPE_CHECKING:
    from workbench.engine.engine import Engine

Prompt = str | Sequence[int]
LEVELS = (1, 2, 4, 8, 16, 32, 64)


def default_arms(engine: Engine, spec: SpecConfig | None = None, threshold: int | str = "auto",
                 cost_model: Any = None, flips: bool = True, prompts: Sequence[Prompt] = (),
                 tau: float | None = None,
                 max_new_tokens: int = 64) -> dict[str, SpecConfig | None]:
    """baseline, eagle3 (Always), never (K=0 tax), threshold (BatchThreshold), goodput (with a
    cost model calibrated now unless given; candidates: the spec's shape, the chain of the same
    depth and a 3-step chain) — the last three with ``draft_state="auto"`` — and the warm/cold
    RandomFlip pair. Without a draft model only the baseline.

    ``threshold``: an integer n forces ``BatchThreshold(n)``; "auto" (the default) takes n
    from the same cost model (``BatchThreshold.from_cost_model``: where plain decoding is
    predicted to catch up on this machine) at accept length ``tau``, measured on ``prompts``
    at ``max_new_tokens`` per request (``measure_tau``; τ grows with the length) unless given.
    The policy's ``basis`` says why. With ``prompts`` Goodput starts from the per-depth
    acceptance measured there (``accept_seed``), not from its prior guess."""
    if engine.runner.draft is None:
        return {"baseline": None}

    spec = spec or SpecConfig()
    shape = spec.shape
    off = dataclasses.replace(spec, draft_state="auto")  # policies that turn drafting off
    # Goodput may also pick cheaper chains (mid batch sizes: less verify work per request)
    candidates = list(dict.fromkeys([shape, (shape[0], 1, shape[0] + 1), (3, 1, 4)]))
    cm = cost_model if cost_model is not None else calibrate(engine, shape=shape)
    # measured on the workload: the auto threshold's τ and Goodput's starting acceptance
    acc = measure_tau(engine, list(prompts), shape, max_new_tokens=max_new_tokens) \
        if prompts else None
    if threshold == "auto":
        context = 0.0
        if tau is None:
            if acc is None:
                raise ConfigError("default_arms.threshold: 'auto' needs the accept length: "
                                  "pass prompts= (measured) or tau=, or an integer threshold")
            tau, context = acc.tau, acc.context
        policy = BatchThreshold.from_cost_model(cm, shape, tau, context=context,
                                                draft_state=off.draft_state,
                                                max_batch=engine.config.max_batch_size)
    elif isinstance(threshold, int) and not isinstance(threshold, bool):
        policy = BatchThreshold(threshold)
    else:
        raise ConfigError(f"default_arms.threshold: expected 'auto' or an integer >= 0, got "
                          f"{threshold!r}")
    arms: dict[str, SpecConfig | None] = {
        "baseline": None,
        "eagle3": dataclasses.replace(spec, policy=Always()),
        "never": dataclasses.replace(off, policy=Never()),
        "threshold": dataclasses.replace(off, policy=policy),
        "goodput": dataclasses.replace(off, policy=Goodput(
            cm.copy(), candidates=candidates, accept_seed=acc.seed() if acc else None)),
    }
    if flips:
        arms["flip_warm"] = dataclasses.replace(spec, policy=RandomFlip(0.5, seed=0),
                                                draft_state="warm")
        arms["flip_cold"] = dataclasses.replace(spec, policy=RandomFlip(0.5, seed=0),
                                                draft_state="cold")
    return arms


def policy_bases(arms: Mapping[str, SpecConfig | None]) -> dict[str, dict[str, Any]]:
    """Arm → why its policy is set as it is (a ``basis`` such as ``BatchThreshold``'s from
    the cost model), for the printed and saved results."""
    out: dict[str, dict[str, Any]] = {}
    for arm, spec in arms.items():
        basis = None if spec is None else getattr(spec.policy, "basis", None)
        if spec is not None and basis is not None:
            out[arm] = {"policy": repr(spec.policy), **basis.to_dict()}
    return out


@dataclass
class _Run:
    outputs: dict[int, list[int]]  # prompt index → output ids (first request that used it)
    row: dict[str, Any]


class _Loop:
    """One arm's closed loop: keep ``concurrency`` requests in flight until ``num_requests``
    have finished, one :meth:`advance` (admit + ``engine.step()``) at a time.

    The loop keeps its own clock: the time spent inside its own advances. Run alone, that is
    the wall time; interleaved with other arms' loops (each on its own engine), every arm is
    timed on the same stretch of the machine's life, so slow drift cancels between arms.
    Latencies (TTFT, TPOT, ITL) are measured on the same own clock: every timestamp the engine
    records for this arm's requests falls inside one of its advances.
    """

    def __init__(self, engine: Engine, prompts: Sequence[Prompt], spec: SpecConfig | None,
                 concurrency: int, num_requests: int, sp: SamplingParams) -> None:
        self.rec = None
        if spec is not None:
            reset = getattr(spec.policy, "reset", None)
            if callable(reset):
                reset()  # every cell starts from the same policy state
            self.rec = RecordingPolicy(spec.policy)
            spec = dataclasses.replace(spec, policy=self.rec)
        self.engine, self.prompts, self.sp = engine, prompts, sp
        self.concurrency, self.num_requests = concurrency, num_requests
        st = engine.stats
        self.steps0 = dict(st.steps)
        self.acc0 = len(st.accept_lengths)
        self.previous = engine.spec
        engine.set_spec(spec)
        self.live: dict[int, int] = {}  # rid → prompt index
        self.outputs: dict[int, list[int]] = {}
        self.metrics: list[Any] = []
        self.prefill_steps: set[int] = set()  # recorder rows of steps that ran a prefill chunk
        self.steady: list[float] = []  # ms of steps at the full batch with no prefill chunk
        self.tokens = 0
        self.nxt = 0
        self.busy = 0.0  # own clock: seconds spent in advance()
        self.spans: list[tuple[float, float]] = []  # (wall start, own clock then) per advance
        self.closed = False

    @property
    def done(self) -> bool:
        return self.nxt >= self.num_requests and not self.live

    def advance(self) -> None:
        e, rec = self.engine, self.rec
        t0 = time.perf_counter()
        self.spans.append((t0, self.busy))
        while self.nxt < self.num_requests and len(self.live) < self.concurrency:
            i = self.nxt % len(self.prompts)
            self.live[e.add_request(self.prompts[i], self.sp)] = i
            self.nxt += 1
        prefilling = any(e.requests[r].in_prefill for r in self.live)
        n_rows = len(rec.rows) if rec is not None else 0
        ts = time.perf_counter()
        outs = e.step()
        if not prefilling and len(self.live) == self.concurrency:
            self.steady.append(1e3 * (time.perf_counter() - ts))
        if prefilling and rec is not None and len(rec.rows) > n_rows:
            self.prefill_steps.add(len(rec.rows) - 1)
        for o in outs:
            if o.finished and o.rid in self.live:
                i = self.live.pop(o.rid)
                out = e.output(o.rid)
                self.outputs.setdefault(i, out.token_ids)
                self.tokens += len(out.token_ids)
                self.metrics.append(out.metrics)
        self.busy += time.perf_counter() - t0

    def own(self, t: float) -> float:
        """A wall-clock timestamp taken during one of this loop's advances → own clock."""
        i = bisect.bisect_right(self.spans, (t, math.inf)) - 1
        wall, own = self.spans[max(i, 0)]
        return own + (t - wall)

    def close(self) -> None:
        """Abort what is still in flight and restore the engine's spec (idempotent)."""
        if self.closed:
            return
        self.closed = True
        for rid in self.live:
            self.engine.abort(rid)
        self.engine.set_spec(self.previous)

    def result(self) -> _Run:
        self.close()
        st, own = self.engine.stats, self.own
        seconds = self.busy
        ttft, tpot, itl = [], [], []
        for m in self.metrics:
            if m.first_token is not None:
                ttft.append(1e3 * (own(m.first_token) - own(m.arrival)))
            tt = [own(t) for t in m.token_times]
            if len(tt) > 1 and m.first_token is not None:
                tpot.append(1e3 * (tt[-1] - own(m.first_token)) / (len(tt) - 1))
                # ITL between emissions: tokens of one verify step share a timestamp (a chunk)
                gaps = np.diff(np.asarray(tt))
                itl.extend((1e3 * gaps[gaps > 0]).tolist())
        steps = {k: st.steps.get(k, 0) - self.steps0.get(k, 0) for k in ("plain", "spec")}
        accepts = st.accept_lengths[self.acc0:]
        row: dict[str, Any] = {
            "concurrency": self.concurrency, "requests": len(self.metrics),
            "tokens": self.tokens, "seconds": seconds,
            "tok_s": self.tokens / seconds if seconds > 0 else float("nan"),
            "ttft_p50_ms": percentile(ttft, 50), "ttft_p99_ms": percentile(ttft, 99),
            "tpot_p50_ms": percentile(tpot, 50), "tpot_p99_ms": percentile(tpot, 99),
            "itl_p50_ms": percentile(itl, 50), "itl_p99_ms": percentile(itl, 99),
            "tau": float(np.mean(accepts)) if accepts else 1.0,
            "spec_share": steps["spec"] / max(1, steps["spec"] + steps["plain"]),
            "decode_steps": steps["spec"] + steps["plain"],
            # median ms of a step at the full batch without prefill work: the per-step cost of
            # an arm (robust to ramp-up, drain and prefill, unlike tok/s over the whole run)
            "steady_step_ms": float(np.median(self.steady)) if self.steady else float("nan"),
        }
        row.update(_step_times(self.rec, self.prefill_steps))
        return _Run(self.outputs, row)


def _closed_loop(engine: Engine, prompts: Sequence[Prompt], spec: SpecConfig | None,
                 concurrency: int, num_requests: int, sp: SamplingParams) -> _Run:
    """One arm alone: keep ``concurrency`` requests in flight until ``num_requests`` finish."""
    loop = _Loop(engine, prompts, spec, concurrency, num_requests, sp)
    try:
        while not loop.done:
            loop.advance()
    finally:
        loop.close()
    return loop.result()


def _interleaved(engines: Mapping[str, Any], prompts: Sequence[Prompt],
                 arms: Mapping[str, SpecConfig | None], order: Sequence[str], concurrency: int,
                 num_requests: int, sp: SamplingParams) -> dict[str, _Run]:
    """Every arm on its own engine, advanced one step each per round until all finish. The
    order within a round is shuffled (seeded): an arm's step finds the caches as the step
    before it left them, so no arm may always follow the same one."""
    loops: dict[str, _Loop] = {}
    rng = random.Random(concurrency)
    try:
        for a in order:
            loops[a] = _Loop(engines[a], prompts, arms[a], concurrency, num_requests, sp)
        live = list(loops.values())
        while live:
            rng.shuffle(live)
            for lp in live:
                lp.advance()
            live = [lp for lp in live if not lp.done]
    finally:
        for lp in loops.values():
            lp.close()
    return {a: lp.result() for a, lp in loops.items()}


def _step_times(rec: RecordingPolicy | None, skip: set[int]) -> dict[str, float]:
    """Mean plain / spec step ms, switches, and the extra ms of a spec step after an off one."""
    nan = float("nan")
    if rec is None or not rec.rows:
        return {"plain_ms": nan, "spec_ms": nan, "switches": 0, "switch_extra_ms": nan}
    on = [r.decision.speculate for r in rec.rows]
    ms = [r.ms for r in rec.rows]
    plain = [m for i, m in enumerate(ms) if not on[i] and i not in skip]
    spec = [m for i, m in enumerate(ms) if on[i] and i not in skip]
    after_off: list[float] = []
    after_on: list[float] = []
    for i in range(1, len(on)):
        if on[i] and i not in skip:
            (after_on if on[i - 1] else after_off).append(ms[i])
    switches = sum(1 for i in range(1, len(on)) if on[i] != on[i - 1])
    extra = float(np.mean(after_off) - np.mean(after_on)) if after_off and after_on else nan
    return {"plain_ms": float(np.mean(plain)) if plain else nan,
            "spec_ms": float(np.mean(spec)) if spec else nan,
            "switches": switches, "switch_extra_ms": extra}


def run_concurrency(engine: Engine, prompts: Sequence[Prompt],
                    levels: Sequence[int] = LEVELS,
                    arms: Mapping[str, SpecConfig | None] | None = None,
                    max_new_tokens: int = 64, requests_per_level: int | None = None,
                    repeats: int = 1, warmup: bool = True, out: str | Path | None = None,
                    name: str = "concurrency", progress: bool = True,
                    engines: Mapping[str, Any] | None = None) -> pd.DataFrame:
    """Closed-loop sweep; one row per (arm, concurrency, repeat). Greedy, ``ignore_eos``.

    ``arms`` default to :func:`default_arms`; put ``baseline`` (spec None) first so the others
    can be compared with it token for token (column ``lossless``). ``requests_per_level``
    defaults to max(2·c, len(prompts)). With ``out`` the table is saved there (CSV + JSON with
    machine info); ``df.attrs`` holds machine info and the saved path.

    ``engines`` (arm → its own engine, same models): the arms of a cell run *interleaved* —
    one step of each per round, in a shuffled order — and each is timed on its own clock (see
    :class:`_Loop`), so every arm sees the same machine state and drift cancels from ratios.
    Without it the arms of a cell run back to back on ``engine`` (order rotated per repeat).
    """
    if not prompts:
        raise ValueError("run_concurrency: no prompts")
    arms = dict(arms) if arms is not None else \
        default_arms(engine, prompts=prompts, max_new_tokens=max_new_tokens)
    if engines is not None:
        missing = [a for a in arms if a not in engines]
        if missing:
            raise ValueError(f"run_concurrency: engines: no engine for arms {missing}")
    eng = {a: (engines[a] if engines is not None else engine) for a in arms}
    sp = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    if warmup:  # allocator, rotary tables, first-call overheads
        wsp = SamplingParams(max_new_tokens=min(8, max_new_tokens), ignore_eos=True)
        for a, spec in arms.items():
            _closed_loop(eng[a], prompts[:1], spec, 1, 1, wsp)
    names = list(arms)
    rows = []
    load = LoadSampler().start()
    cells = [(c, r) for c in levels for r in range(repeats)]
    bar = tqdm(total=len(cells) * len(names), desc="bench concurrency", unit="run",
               disable=not progress)
    for c, r in cells:
        n_req = requests_per_level or max(2 * c, len(prompts))
        order = names[r % len(names):] + names[: r % len(names)] if r else names
        if "baseline" in order:  # the reference outputs come first
            order = ["baseline"] + [a for a in order if a != "baseline"]
        ref: dict[int, list[int]] | None = None
        before = loadavg()
        if engines is not None:
            bar.set_postfix_str(f"c={c} interleaved")
            runs = _interleaved(eng, prompts, arms, order, c, n_req, sp)
        else:
            runs = {}
            for arm in order:
                bar.set_postfix_str(f"c={c} {arm}")
                runs[arm] = _closed_loop(engine, prompts, arms[arm], c, n_req, sp)
                bar.update(1)
        after = loadavg()
        for arm in order:
            run = runs[arm]
            if arm == "baseline":
                ref = run.outputs
            same = None if ref is None else all(
                ref.get(i, ids) == ids for i, ids in run.outputs.items())
            rows.append({"arm": arm, "repeat": r, **run.row, "lossless": same,
                         "load_before": before[0] if before else float("nan"),
                         "load_after": after[0] if after else float("nan")})
        if engines is not None:
            bar.update(len(order))
    bar.close()
    load.stop()
    df = pd.DataFrame(rows)
    df = _add_ratios(df)
    df.attrs["machine"] = machine_info()
    df.attrs["load"] = load.as_dict()
    df.attrs["config"] = {"levels": list(levels), "max_new_tokens": max_new_tokens,
                          "prompts": len(prompts), "repeats": repeats,
                          "requests_per_level": requests_per_level,
                          "interleaved": engines is not None,
                          "arms": {k: repr(v) for k, v in arms.items()},
                          "policy_basis": policy_bases(arms)}
    if out is not None:
        df.attrs["saved"] = str(save_results(df, out, name))
    return df


def _add_ratios(df: pd.DataFrame) -> pd.DataFrame:
    base = df[df["arm"] == "baseline"].groupby("concurrency")["tok_s"].mean()
    df["vs_baseline"] = df["tok_s"] / df["concurrency"].map(base)
    df["k0_tax"] = np.where(df["arm"] == "never", 1.0 - df["vs_baseline"], np.nan)
    # the same tax per steady-state step: median step ms of never over baseline's, minus 1
    step = df[df["arm"] == "baseline"].groupby("concurrency")["steady_step_ms"].mean()
    df["k0_tax_step"] = np.where(df["arm"] == "never",
                                 df["steady_step_ms"] / df["concurrency"].map(step) - 1.0, np.nan)
    return df


def summarize(df: pd.DataFrame, conf: float = 0.95) -> pd.DataFrame:
    """Mean over repeats: one row per (arm, concurrency). With more than one repeat also
    ``tok_s_lo/hi`` and ``vs_baseline_lo/hi``: Student-t confidence intervals at ``conf``
    (``workbench.stats.mean_ci``); a ``flags`` column is kept (joined codes)."""
    skip = ("arm", "concurrency", "repeat", "lossless", "flags")
    num = [c for c in df.columns if c not in skip and pd.api.types.is_numeric_dtype(df[c])]
    g = df.groupby(["arm", "concurrency"], sort=False)
    s = g[num].mean()
    s["lossless"] = g["lossless"].agg(lambda x: bool(x.dropna().all()) if x.notna().any()
                                      else None)
    if "repeat" in df and df["repeat"].nunique() > 1:
        for col in ("tok_s", "vs_baseline"):
            if col in df:
                ci = g[col].agg(lambda x: mean_ci(x.tolist(), conf))
                s[f"{col}_lo"] = [c[1] for c in ci]
                s[f"{col}_hi"] = [c[2] for c in ci]
    if "flags" in df:
        s["flags"] = g["flags"].agg(lambda x: ",".join(sorted({c for v in x if v
                                                               for c in str(v).split(",")})))
    return s.reset_index()


def switch_costs(df: pd.DataFrame, warm: str = "flip_warm",
                 cold: str = "flip_cold") -> pd.DataFrame:
    """Per level: extra ms per switch-on (cold catch-up vs warm) and the plain-step ms each
    pays. Warm keeps the draft current on every plain step; cold pays once per switch."""
    s = summarize(df).set_index(["arm", "concurrency"])
    rows = []
    for c in sorted(df["concurrency"].unique()):
        if (warm, c) not in s.index or (cold, c) not in s.index:
            continue
        w, k = s.loc[(warm, c)], s.loc[(cold, c)]
        rows.append({"concurrency": c,
                     "warm_switch_extra_ms": w["switch_extra_ms"],
                     "cold_switch_extra_ms": k["switch_extra_ms"],
                     "warm_plain_ms": w["plain_ms"], "cold_plain_ms": k["plain_ms"],
                     "warm_tok_s": w["tok_s"], "cold_tok_s": k["tok_s"],
                     "switches": w["switches"] + k["switches"]})
    return pd.DataFrame(rows)


@dataclass(frozen=True)
class Threshold:
    """crossover: smallest level where baseline tok/s ≥ eagle3 tok/s (None: eagle3 always
    wins); suggested_n: the largest level below it (0: never speculate), for BatchThreshold."""

    crossover: int | None
    suggested_n: int
    table: pd.DataFrame


def find_threshold(df: pd.DataFrame, spec_arm: str = "eagle3",
                   baseline_arm: str = "baseline") -> Threshold:
    s = summarize(df)
    t = s.pivot(index="concurrency", columns="arm", values="tok_s")
    if spec_arm not in t or baseline_arm not in t:
        raise ValueError(f"find_threshold: need arms {baseline_arm!r} and {spec_arm!r}, have "
                         f"{list(t.columns)}")
    t = t[[baseline_arm, spec_arm]].sort_index()
    t["speedup"] = t[spec_arm] / t[baseline_arm]
    levels = list(t.index)
    cross = next((int(c) for c in levels if t.loc[c, baseline_arm] >= t.loc[c, spec_arm]), None)
    if cross is None:
        n = int(levels[-1])
    else:
        below = [int(c) for c in levels if c < cross]
        n = below[-1] if below else 0
    return Threshold(cross, n, t.reset_index())


def save_results(df: pd.DataFrame, folder: str | Path, name: str = "concurrency") -> Path:
    """``<name>.csv`` (all rows) and ``<name>.json`` (machine, config, rows, derived tables)."""
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    load = df.attrs.get("load")
    flags = sanity_flags(summarize(df), load=load)
    flags += [f for f in sanity_flags(df[[c for c in ("arm", "concurrency", "repeat",
                                                        "load_before", "load_after")
                                          if c in df]])
              if f.row is not None]  # per-cell load
    df = mark(df, flags)
    df.to_csv(out / f"{name}.csv", index=False)
    doc: dict[str, Any] = report(flags, load, df.attrs.get("machine", machine_info()))
    doc["config"] = df.attrs.get("config", {})
    doc["rows"] = json.loads(df.to_json(orient="records"))
    arms = set(df["arm"])
    if {"baseline", "eagle3"} <= arms:
        th = find_threshold(df)
        doc["threshold"] = {"crossover": th.crossover, "suggested_n": th.suggested_n}
    sc = switch_costs(df)
    if not sc.empty:
        doc["switch_costs"] = json.loads(sc.to_json(orient="records"))
    (out / f"{name}.json").write_text(json.dumps(doc, indent=2) + "\n")
    return out / f"{name}.json"
