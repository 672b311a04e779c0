"""The box: the same replay from box measurements, and the winner as an SGLang tier file.

Inputs are what the box already produces (docs/REFERENCE.md §6): ``bench threshold --url
BASELINE_URL,EAGLE3_URL`` (``threshold.json``: tok/s per level of a baseline and an EAGLE-3
server) and SGLang's request records (``--export-metrics-to-file``, read with
``read_request_metrics``). Nothing is recorded per position there, so acceptance is
*modelled* (docs/LAB.md):

* **step times**: a plain step of batch B takes 1000·B / tok/s of the baseline at level B, a
  speculative one 1000·B·τ / tok/s of the EAGLE-3 server (prefill folded into both). The
  target cost is fitted to the plain steps (``a + b·tokens``); what a speculative step costs
  beyond target(B·N) is fitted as the draft: (S−1)·draft(B·K) + draft(B·τ), the cost model's
  own spec-step formula;
* **acceptance**: per-depth rates a_d from the records' per-round accept lengths
  (``spec_correct_drafts_histogram``); with only per-request aggregates (τ) one rate for every
  depth, a with τ = 1 + a + a² + … + a^D. Each request position draws one uniform per depth
  (seeded, shared by every policy), and a shape accepts the leading depths whose draw is below
  a_d: deeper or other-width shapes than the server ran reuse the last (or the measured) rates
  — modelled, and said in ``BoxRun.notes``;
* **lengths**: the records' prompt and completion token counts, in finish order.

:func:`compile_tiers` turns a replayed policy's decisions into SGLang 0.5.23 adaptive tiers
(candidate lists where the policy varies the steps at a batch size), and :func:`check_tiers`
loads that file with SGLang's own ``AdaptiveSpeculativeParams`` and routes every batch size.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from workbench.errors import ConfigError
from workbench.policy.costmodel import CostModel, LinearCost
from workbench.policy.goodput import tau_of
from workbench.policy.policies import Shape, check_shape, depth_rates, shape_name
from workbench.remote.adaptive import Tiers

MAX_DEPTH = 64
EAGLE_MAX_RUNNING = 48  # SGLang 0.5.9 / 0.5.23: EAGLE's max_running_requests default


@dataclass
class BoxRun:
    """A run fitted from box measurements (module doc); replays like a RecordedRun."""

    shape: Shape
    prompt_lens: list[int]
    output_lens: list[int]
    rates: tuple[float, ...]
    cost_model: dict[str, Any]
    seed: int = 0
    meta: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    path: Path | None = None

    def __post_init__(self) -> None:
        rows = sum(max(n - 1, 0) for n in self.output_lens)
        self._u = np.random.default_rng(self.seed).random((rows, MAX_DEPTH))
        self._cache: dict[tuple[int, ...], np.ndarray] = {}

    @property
    def chain_steps(self) -> int:
        return self.shape[0]

    def row_offsets(self) -> list[int]:
        out, n = [], 0
        for length in self.output_lens:
            out.append(n)
            n += max(length - 1, 0)
        return out

    def check(self, shape: Sequence[int], where: str) -> Shape:
        s, k, n = check_shape(tuple(shape), where)
        depth = min(s, n - 1)
        if depth > len(self.rates):
            self._note(f"{shape_name((s, k, n))}: depths {len(self.rates) + 1}..{depth} "
                       f"take the last measured rate {self.rates[-1]:.3f} (the server ran "
                       f"{shape_name(self.shape)})")
        if k != self.shape[1]:
            self._note(f"{shape_name((s, k, n))}: top-k {k} takes the rates measured at top-k "
                       f"{self.shape[1]}")
        return (s, k, n)

    def _note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)

    def accept_table(self, shape: Sequence[int]) -> np.ndarray:
        key = tuple(shape)
        if key not in self._cache:
            s, _, n = key
            depth = min(s, n - 1, MAX_DEPTH)
            a = np.asarray([self.rates[min(d, len(self.rates) - 1)] for d in range(depth)])
            ok = self._u[:, :depth] < a
            self._cache[key] = np.where(ok.all(axis=1), depth, ok.argmin(axis=1))
        return self._cache[key]

    def save(self, folder: str | Path) -> Path:
        out = Path(folder)
        out.mkdir(parents=True, exist_ok=True)
        (out / "box.json").write_text(json.dumps({
            "shape": list(self.shape), "prompt_lens": self.prompt_lens,
            "output_lens": self.output_lens, "rates": list(self.rates),
            "cost_model": self.cost_model, "seed": self.seed, "meta": self.meta}) + "\n")
        self.path = out
        return out

    @classmethod
    def load(cls, folder: str | Path) -> BoxRun:
        p = Path(folder)
        try:
            d = json.loads((p / "box.json").read_text())
            run = cls(tuple(d["shape"]), [int(x) for x in d["prompt_lens"]],  # type: ignore[arg-type]
                      [int(x) for x in d["output_lens"]], tuple(float(a) for a in d["rates"]),
                      d["cost_model"], int(d.get("seed", 0)), d.get("meta", {}), path=p)
        except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"RUN {p}: not a fitted box run ({type(e).__name__}: {e})") \
                from None
        return run


def _bench_rows(threshold: str | Path | Mapping[str, Any]) -> list[dict[str, Any]]:
    if isinstance(threshold, Mapping):
        doc: Any = threshold
    else:
        p = Path(threshold)
        p = p / "threshold.json" if p.is_dir() else p
        if not p.is_file():
            raise ConfigError(f"--threshold-json: no bench threshold output at {p}")
        doc = json.loads(p.read_text())
    rows = doc.get("rows") if isinstance(doc, Mapping) else None
    if not rows or not all({"arm", "concurrency", "tok_s"} <= set(r) for r in rows):
        raise ConfigError("--threshold-json: expected `bench threshold --url` output (rows with "
                          "arm, concurrency, tok_s)")
    return list(rows)


def fit_steps(rows: Sequence[Mapping[str, Any]], shape: Shape, tau: float,
              prompt_len: float = 0.0, output_len: float = 1.0) -> CostModel:
    """The cost model of the module doc from baseline / eagle3 tok/s per level. A sweep's
    tok/s include every request's prefill: a closed loop of c requests of ``prompt_len`` in and
    ``output_len`` out takes c·O/tok_s = O·step(c) + c·prefill (plain; O/τ steps when
    speculating), prefill = target(P) (+ draft(P), the draft's extend, when speculating) — the
    replay prices it the same way, once."""
    base = {int(r["concurrency"]): float(r["tok_s"]) for r in rows if r["arm"] == "baseline"
            and r["tok_s"]}
    spec = {int(r["concurrency"]): (float(r["tok_s"]), float(r.get("tau") or tau))
            for r in rows if r["arm"] == "eagle3" and r["tok_s"]}
    if len(base) < 2 or not spec:
        raise ConfigError(f"--threshold-json: need baseline tok/s at two or more levels and "
                          f"eagle3 at one or more, got {sorted(base)} / {sorted(spec)}")
    o, p = float(output_len), float(prompt_len)
    # life(c) = a·(O + c) + b·(O·c + c·P)
    x = np.asarray([[o + c, o * c + c * p] for c in base])
    y = np.asarray([1e3 * c * o / t for c, t in base.items()])
    (a, b), *_ = np.linalg.lstsq(x, y, rcond=None)
    if a < 0 or b < 0:  # one term at its bound: the other alone
        k = 1 if a < 0 else 0
        v = max(0.0, float(np.dot(x[:, k], y) / np.dot(x[:, k], x[:, k])))
        a, b = (0.0, v) if k == 1 else (v, 0.0)
    target = LinearCost(float(a), float(b))
    s, k, n = shape
    xd, rd = [], []
    for c, (tok_s, t) in spec.items():
        steps = o / t
        life = 1e3 * c * o / tok_s
        rd.append(life - steps * target(c * n) - c * target(p))
        xd.append([steps * s + c, steps * ((s - 1) * c * k + c * t) + c * p])
    xd_a, rd_a = np.asarray(xd), np.maximum(np.asarray(rd), 0.0)
    if len(xd) > 1:
        (da, db), *_ = np.linalg.lstsq(xd_a, rd_a, rcond=None)
    else:
        da, db = 0.0, float(rd_a[0] / xd_a[0, 1])
    if da < 0 or db < 0:
        kk = 1 if da < 0 else 0
        v = max(0.0, float(np.dot(xd_a[:, kk], rd_a) / np.dot(xd_a[:, kk], xd_a[:, kk])))
        da, db = (0.0, v) if kk == 1 else (v, 0.0)
    return CostModel(target=target, draft=LinearCost(float(da), float(db)))


def tau_band(tau: float, depth: int, steps: Sequence[int] = range(1, 8)) -> dict[str, list[float]]:
    """Without a per-round histogram, τ of an S-step chain over every per-depth profile
    consistent with τ at ``depth`` (P(accepting >= d) non-increasing): flat (one P for every
    depth, rate 1 past the first) to front-loaded (all-or-nothing); beyond ``depth`` nothing is
    known (τ up to the flat profile carried on)."""
    x = (tau - 1.0) / depth
    out = {}
    for st in steps:
        if st <= depth:
            out[str(st)] = [1.0 + st * x, 1.0 + min(float(st), tau - 1.0)]
        else:
            out[str(st)] = [tau, tau + (st - depth) * x]
    return out


def _spread_evenly(records: Any) -> bool:
    """Every request's rounds within one of each other: the evenly spread approximation a
    record without ``spec_correct_drafts_histogram`` gets (remote.sglang)."""
    seen = [lens for lens in records["accept_lengths"] if lens and len(lens) > 1]
    return bool(seen) and all(max(lens) - min(lens) <= 1 for lens in seen)


def geometric_rate(tau: float, depth: int) -> float:
    """a with 1 + a + … + a^depth = τ (one rate for every depth)."""
    if not 1.0 <= tau <= depth + 1:
        raise ConfigError(f"box: τ {tau:.3f} outside 1..{depth + 1} for {depth} draft steps")
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if tau_of([mid] * depth) < tau else (lo, mid)
    return (lo + hi) / 2


def fit_box(threshold: str | Path | Mapping[str, Any], records: Any, shape: Sequence[int],
            seed: int = 0, max_running_requests: int = EAGLE_MAX_RUNNING,
            histogram: bool | None = None) -> BoxRun:
    """A :class:`BoxRun` from ``bench threshold --url`` output and a ``requests`` frame
    (``read_request_metrics``) of the EAGLE-3 server running ``shape``.
    ``max_running_requests``: the EAGLE-3 server's cap (SGLang's default for EAGLE is 48);
    the replay runs no more requests at once. ``histogram``: whether the records carry
    ``spec_correct_drafts_histogram`` (None: told from the rounds — evenly spread rounds are
    the approximation a record without one gets)."""
    s, k, n = check_shape(tuple(shape), "--shape")
    if records is None or len(records) == 0:
        raise ConfigError("--records: no request records (SGLang --export-metrics-to-file)")
    if max_running_requests < 1:
        raise ConfigError(f"--max-running-requests: must be >= 1, got {max_running_requests}")
    depth = min(s, n - 1)
    notes = []
    if histogram is None:
        histogram = not _spread_evenly(records)
    rounds = [int(t) - 1 for lens in records["accept_lengths"] for t in (lens or [])] \
        if histogram else []
    tau_mean = float(np.nanmean(records["tau"])) if len(records) else float("nan")
    band = None
    if rounds:
        rates = tuple(depth_rates(rounds, depth))
        rates = rates + (rates[-1],) * (depth - len(rates)) if rates else (0.0,)
        source = f"per-round accept lengths of {len(records)} requests ({len(rounds)} rounds)"
    else:
        rates = (geometric_rate(tau_mean, depth),) * depth
        band = tau_band(tau_mean, depth)
        source = f"per-request τ only (mean {tau_mean:.3f}): one rate for every depth"
        notes.append(f"no per-round histogram (SGLang before 0.5.23 sends none): τ {tau_mean:.3f} "
                     f"at {depth} steps is measured, every other chain's τ is a band "
                     f"(meta tau_band) and replays at one rate per depth inside it")
    tau_all = tau_of(rates)
    p, o = float(np.mean(records["prompt_len"])), float(np.mean(records["output_len"]))
    cm = fit_steps(_bench_rows(threshold), (s, k, n), tau_all, p, o)
    notes.append(f"prefill: the sweep's tok/s include it; priced once as target({p:.0f}) per "
                 f"request (+ the draft's extend), the records' mean prompt")
    meta = {"acceptance": source, "tau": tau_all, "histogram": bool(histogram),
            "max_running_requests": int(max_running_requests)}
    if band is not None:
        meta["tau_band"] = band
    return BoxRun((s, k, n), [int(x) for x in records["prompt_len"]],
                  [int(x) for x in records["output_len"]], rates, cm.to_dict(), seed,
                  meta, notes)


# -- SGLang adaptive tiers -------------------------------------------------------------------
def compile_tiers(steps: Sequence[tuple[int, str, float, int]], max_batch: int,
                  min_share: float = 0.05) -> tuple[Tiers, list[str]]:
    """A replayed policy's decode steps (``LevelResult.steps`` of every level, concatenated)
    → SGLang adaptive tiers: per batch size, the chain step counts it ran in at least
    ``min_share`` of its steps there (0 = off; a tree S·K·N runs as an S-step chain upstream,
    said in the notes); batch sizes it never saw take the nearest smaller one's; neighbouring
    sizes with the same candidates merge."""
    by: dict[int, Counter[int]] = {}
    notes: list[str] = []
    for b, name, _, _ in steps:
        st = 0
        if name != "off":
            shape = _parse_name(name)
            st = shape[0]
            if shape[1] != 1:
                note = (f"{name}: SGLang's adaptive tiers run chains (topk 1): compiled as a "
                        f"{st}-step chain")
                if note not in notes:
                    notes.append(note)
        by.setdefault(b, Counter())[st] += 1
    if not by:
        raise ConfigError("compile_tiers: the policy ran no decode step")
    tiers: dict[int, list[int]] = {}
    last: list[int] | None = None
    for b in range(1, max_batch + 1):
        if b in by:
            total = sum(by[b].values())
            cands = sorted(st for st, c in by[b].items() if c / total >= min_share)
        else:
            cands = last or sorted(by[min(by)])
        if cands != last:
            tiers[b] = cands
            last = cands
    return Tiers.of(tiers), notes


def _parse_name(name: str) -> Shape:
    from workbench.lab.arms import parse_shape

    shape = parse_shape(name, "compile_tiers")
    assert shape is not None
    return shape


def initial_steps(tiers: Tiers) -> int:
    """``--speculative-num-steps`` for a tier file: the largest positive candidate (SGLang
    needs it to be a candidate; a tier without it starts at its middle candidate)."""
    pos = [s for s in tiers.candidate_steps if s > 0]
    if not pos:
        raise ConfigError("tiers: every tier is off; launch without speculation")
    return max(pos)


def check_tiers(tiers: Tiers, path: str | Path, max_batch: int) -> list[dict[str, Any]]:
    """Write ``tiers`` to ``path`` and route batch sizes 1..max_batch with SGLang 0.5.23's own
    ``AdaptiveSpeculativeParams`` loaded from it; raises ConfigError where SGLang refuses the
    file or routes a batch otherwise than :meth:`Tiers.route`. Returns the routes."""
    from sglang.srt.speculative.adaptive_spec_params import AdaptiveSpeculativeParams

    p = Path(path)
    p.write_text(tiers.config_text())
    init = initial_steps(tiers)
    try:
        params = AdaptiveSpeculativeParams(init, str(p))
    except (ValueError, KeyError) as e:
        raise ConfigError(f"tiers {p}: SGLang refuses it: {e}") from None
    rows = []
    for b in range(1, max_batch + 1):
        ours = tiers.route(b, None, init)
        slot = params._route(b)
        theirs = (params._find_closest_bs(b), tuple(slot.candidate_steps), slot.current_steps)
        if theirs != (ours.tier, ours.candidates, ours.steps):
            raise ConfigError(f"tiers {p}: batch {b}: SGLang routes to {theirs}, ours "
                              f"{(ours.tier, ours.candidates, ours.steps)}")
        rows.append({"batch_size": b, "tier": ours.tier, "candidates": list(ours.candidates),
                     "steps": ours.steps})
    return rows
