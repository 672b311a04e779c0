"""Measured choices at engine init: every machine-dependent "auto" is timed, not assumed.

Which GEMM path is fastest depends on the CPU (ISA, cache sizes) and torch build: oneDNN-packed
weights won by 1.6-2.5x at small M on a 2-core AMD EPYC and lost by 1.57x on a 2-core Intel Xeon
with the whole target in L3 (issue 18). So the engine's ``autotune`` init stage times the
candidates on the model's *real* weights at the shapes the engine runs — a bs=1 decode
(M=1), a verify of the default tree width (M=16) and a prefill bucket (M=128) — within a
bounded budget, picks the fastest, and caches the outcome per (CPU model, ISA flags, torch
version, threads, model fingerprint) in a JSON file, so a second start reads it instantly.

* cache file: ``$WORKBENCH_AUTOTUNE_CACHE`` or ``~/.cache/workbench/autotune.json``
  (``WORKBENCH_AUTOTUNE_CACHE=off`` disables the cache: every start measures);
* a forced choice (``EngineConfig(gemm="dense")``) is never measured: recorded as ``forced``;
* choices with a single candidate on this device (attention on CPU: the torch backend) are
  recorded as ``only``; the thread count is recorded as it stands (``EngineConfig.threads``
  or torch's default) — it is not measured here, since on a shared machine a thread-count
  timing measures the neighbours.

Every choice is a :class:`Choice` in ``Engine.choices`` (name → dict), and the stage's detail
line says what was chosen, from where, with the timings; ``bench`` saves them with results.

**Provisional choices.** Every measurement records the conditions it ran under
(:class:`~workbench.engine.contention.Conditions`: other processes' CPU use, steal, load, the
CPU and the time). One taken while the machine was contended is *provisional*: the engine uses
it for this run, and it is never written to the cache, so the next quiet start measures again
(twice a verdict measured under load became a machine's default: a GEMM choice "measured at
load 2.1" halved a later quiet run). A cache entry marked provisional is never read back.
``bench --strict`` refuses a result that ran on a provisional choice. The thread count is
measured only when the machine is contended at init (all cores when quiet) and re-measured by
the engine's :class:`~workbench.engine.contention.ContentionMonitor` while it runs.

For result stamps: :func:`choice_records` (one flat dict per choice: what, how, where, at what
load, provisional or not), :func:`provisional_names` and :func:`conditions_line`.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from workbench.engine import affinity, contention
from workbench.machine import cpu_flags, cpu_model
from workbench.models.gemm import gemm_pass, onednn_ok, prepared_gemms

if TYPE_CHECKING:
    from workbench.engine.engine import Engine
    from workbench.engine.runner import ModelRunner

ENV_CACHE = "WORKBENCH_AUTOTUNE_CACHE"
DEFAULT_CACHE = Path.home() / ".cache" / "workbench" / "autotune.json"
# 2: least-of-interleaved timings (v1 medians could cache a load spike); 3: choices measured
# under contention are provisional and never cached (v2 cached them, named by a load note)
CACHE_VERSION = 3
BUDGET_S = 4.0  # wall-clock budget for all gemm timings at one init
# a candidate must beat the default by this much to replace it (timing noise on a shared CPU)
MARGIN = 0.03
# the shapes a GEMM choice is measured at: bs=1 decode, default tree verify, a prefill bucket
SHAPES: dict[str, int] = {"decode M=1": 1, "verify M=16": 16, "prefill M=128": 128}
# their weights in the score (a bs=1 decode step dominates a notebook session)
WEIGHTS: dict[str, float] = {"decode M=1": 2.0, "verify M=16": 1.0, "prefill M=128": 0.5}


@dataclass(frozen=True)
class Choice:
    """One decided "auto": ``choice`` among ``candidates``; ``source`` is ``measured``,
    ``cached`` (measured at an earlier start on this machine kind), ``forced`` (set in the
    config) or ``only`` (one candidate here); ``timings_ms`` candidate → shape → least ms
    (:func:`interleaved_min_ms`)."""

    name: str
    choice: str
    source: str
    candidates: tuple[str, ...] = ()
    timings_ms: dict[str, dict[str, float]] = field(default_factory=dict)
    seconds: float = 0.0
    note: str = ""
    # measured while the machine was contended: used for this run, never cached as final
    provisional: bool = False
    # where and under what load it was measured (contention.Conditions.to_dict() + "cpu")
    conditions: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["candidates"] = list(self.candidates)
        return d

    def detail(self) -> str:
        """``gemm=dense (measured 0.41 s; dense 1.9/4.1/19 ms, onednn 2.4/3.0/21 ms)``."""
        parts = [f"{self.name}={self.choice} ({self.source}"]
        if self.source in ("measured", "cached", "forced") and self.timings_ms:
            shown = ", ".join(f"{c} " + "/".join(f"{v:.3g}" for v in t.values()) + " ms"
                              for c, t in self.timings_ms.items())
            labels = "/".join(next(iter(self.timings_ms.values())).keys())
            took = f" {self.seconds:.2f} s" if self.source == "measured" else ""
            parts.append(f"{took}; {labels}: {shown}")
        if self.note:
            parts.append(f"; {self.note}")
        if self.provisional:
            busy = contention.Conditions(**_cond_fields(self.conditions)).describe() \
                if self.conditions else "contended"
            parts.append(f"; PROVISIONAL, measured {busy}")
        return "".join(parts) + ")"


def _cond_fields(d: Mapping[str, Any]) -> dict[str, Any]:
    names = contention.Conditions.__dataclass_fields__
    return {k: v for k, v in d.items() if k in names}


def measured_conditions(a: contention.CpuSample | None,
                        b: contention.CpuSample | None) -> tuple[bool, dict[str, Any]]:
    """(provisional, conditions) of a measurement that ran from sample ``a`` to ``b``."""
    cond = contention.between(a, b)
    return cond.contended, {**cond.to_dict(), "cpu": cpu_model()}


def cache_path() -> Path | None:
    """The cache file (None: caching disabled by ``WORKBENCH_AUTOTUNE_CACHE=off``)."""
    raw = os.environ.get(ENV_CACHE, "")
    if raw.lower() in ("off", "0", "none", "false"):
        return None
    return Path(raw).expanduser() if raw else DEFAULT_CACHE


def model_fingerprint(folder: str | Path | None, model: torch.nn.Module | None) -> str:
    """Short hash of a checkpoint folder's config.json and weight file sizes, plus the loaded
    parameters' shapes and dtypes (a model built in memory has no folder)."""
    h = hashlib.sha1()
    if folder is not None and Path(folder).is_dir():
        for f in sorted(Path(folder).iterdir()):
            if f.name == "config.json":
                h.update(f.read_bytes())
            elif f.suffix in (".safetensors", ".bin", ".pt"):
                h.update(f"{f.name}:{f.stat().st_size}".encode())
    if model is not None:
        for name, p in model.named_parameters():
            h.update(f"{name}:{tuple(p.shape)}:{p.dtype}".encode())
    return h.hexdigest()[:16]


def cache_key(engine: Engine) -> str:
    """Everything a measured choice depends on: CPU model and flags, torch version, threads,
    device and dtype, and both models' fingerprints."""
    return json.dumps({
        "v": CACHE_VERSION, "cpu": cpu_model(), "flags": cpu_flags(), "torch": torch.__version__,
        "threads": torch.get_num_threads(), "device": engine.config.device,
        "dtype": engine.config.dtype,
        "target": model_fingerprint(engine.model_path, engine.runner.target),
        "draft": model_fingerprint(engine.draft_path, engine.runner.draft)
        if engine.runner.draft is not None else None,
    }, sort_keys=True)


def read_cache(path: Path | None) -> dict[str, Any]:
    """The cache's entries (key → {choice name → Choice dict}); {} when absent or unreadable
    (a corrupt cache is ignored and rewritten, never trusted)."""
    if path is None or not path.is_file():
        return {}
    try:
        doc = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    entries = doc.get("entries") if isinstance(doc, dict) else None
    return entries if isinstance(entries, dict) else {}


def final(entry: Any) -> dict[str, Any] | None:
    """A cached choice that may be used as this machine's verdict: a dict not marked
    provisional (a provisional one, hand-copied or from a writer that did not know the rule,
    is never read back as final)."""
    if not isinstance(entry, dict) or entry.get("provisional", False) is not False:
        return None
    return entry


def write_cache(path: Path | None, key: str, choices: Mapping[str, Choice]) -> None:
    """Merge this key's final measured choices into the cache (atomic replace; concurrent
    writers may drop each other's entry, which only costs a re-measure). Provisional choices
    are never written."""
    keep = {n: c for n, c in choices.items() if c.source == "measured" and not c.provisional}
    if path is None or not keep:
        return
    entries = read_cache(path)
    old = entries.get(key)
    entry: dict[str, Any] = dict(old) if isinstance(old, dict) else {}
    entry.update({n: c.to_dict() for n, c in keep.items()})
    entries[key] = entry
    replace_cache(path, entries, CACHE_VERSION)


def replace_cache(path: Path, entries: Mapping[str, Any], version: int) -> None:
    """Write a cache file of ``entries`` atomically (a temporary file, then ``os.replace``):
    a reader sees the old file or the new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"version": version, "entries": dict(entries)}, indent=1) + "\n")
    os.replace(tmp, path)


def median_ms(fn: Callable[[], Any], budget_s: float, min_reps: int = 3,
              max_reps: int = 30) -> float:
    """Median wall ms of ``fn()`` after one warm-up call, repeated until ``budget_s`` is
    spent (at least ``min_reps``, at most ``max_reps`` times)."""
    fn()
    times: list[float] = []
    t_end = time.perf_counter() + budget_s
    while len(times) < max_reps and (len(times) < min_reps or time.perf_counter() < t_end):
        t0 = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def _gemm_weights(target: Any) -> list[tuple[str, torch.Tensor, torch.Tensor | None]]:
    """(kind, dense weight, bias) of every target GEMM in run order: per layer qkv (linear),
    o (linear + residual), gate/up (linear), down (linear + residual); then the head."""
    out: list[tuple[str, torch.Tensor, torch.Tensor | None]] = []
    for layer in target.model.layers:
        a, mlp = layer.self_attn, layer.mlp
        out.append(("lin", a.fused[0], a.fused[1]))
        out.append(("add", a.o_proj.weight, None))
        out.append(("lin", mlp.fused[0], mlp.fused[1]))
        out.append(("add" if mlp.down_proj.bias is None else "lin", mlp.down_proj.weight,
                    mlp.down_proj.bias))
    out.append(("lin", target.lm_head.weight, None))
    return out


def interleaved_min_ms(fns: Mapping[str, Callable[[], Any]], budget_s: float,
                       min_rounds: int = 5, max_rounds: int = 30) -> dict[str, float]:
    """Least wall ms of each of ``fns``, run in turns (a, b, a, b, …) after one warm-up call
    each, until ``budget_s`` is spent (at least ``min_rounds``, at most ``max_rounds`` turns).

    On a shared machine interference only ever adds time, and taking turns puts a busy
    stretch on every candidate alike: the least time of each is its own cost. (A median per
    candidate, timed one candidate after the other, once cached a neighbour's spike as a
    choice: dense "decode 8 ms, verify 393 ms" vs oneDNN "99 ms, 66 ms" on an idle-time
    0.1/0.5 ms pair; 2-core EPYC, session 22.)"""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    t_end = time.perf_counter() + budget_s
    rounds = 0
    while rounds < max_rounds and (rounds < min_rounds or time.perf_counter() < t_end):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(1e3 * (time.perf_counter() - t0))
        rounds += 1
    return {name: min(ts) for name, ts in times.items()}


def time_gemm_paths(target: Any, candidates: tuple[str, ...], shapes: Mapping[str, int],
                    budget_s: float) -> dict[str, dict[str, float]]:
    """Least ms of one pass over all the target's GEMMs (its real weights, prepared as each
    candidate reads them) at each row count M of ``shapes``: the candidates take turns
    (:func:`interleaved_min_ms`), so a busy stretch of a shared machine hits them alike."""
    weights = _gemm_weights(target)
    prepared = {c: prepared_gemms(weights, c) for c in candidates}
    dt = weights[0][1].dtype  # the model's (bf16 GEMMs take bf16 activations)
    per = budget_s / max(1, len(shapes))
    out: dict[str, dict[str, float]] = {c: {} for c in candidates}
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for label, m in shapes.items():
            passes = {c: gemm_pass(prepared[c], c, m, dt, gen) for c in candidates}
            for c, ms in interleaved_min_ms(passes, per).items():
                out[c][label] = ms
    return out


def pick(timings: Mapping[str, Mapping[str, float]], default: str,
         weights: Mapping[str, float] = WEIGHTS, margin: float = MARGIN) -> str:
    """The candidate with the lowest weighted geometric mean of its time relative to the best
    at each shape; ``default`` unless another beats it by more than ``margin``."""
    shapes = list(next(iter(timings.values())).keys())
    best = {s: min(t[s] for t in timings.values()) for s in shapes}
    total = sum(weights.get(s, 1.0) for s in shapes)

    def score(c: str) -> float:
        return math.exp(sum(weights.get(s, 1.0) * math.log(timings[c][s] / best[s])
                            for s in shapes) / total)

    winner = min(timings, key=score)
    if winner != default and default in timings and score(default) <= score(winner) * (1 + margin):
        return default
    return winner


def decide_gemm(runner: ModelRunner, cached: Mapping[str, Any] | None,
                budget_s: float = BUDGET_S) -> Choice:
    """The GEMM path: forced, only one candidate (not a float32 CPU model), cached, or
    measured (:func:`time_gemm_paths`, :func:`pick`; dense wins ties: no packed copy)."""
    want, target = runner.config.gemm, runner.target
    assert target is not None  # the autotune stage runs after load_target
    if want != "auto":
        return Choice("gemm", want, "forced", (want,))
    if "onednn" not in target.gemm_paths:
        return Choice("gemm", "dense", "only", ("dense",),
                      note=f"a {type(target).__name__} runs dense GEMMs only")
    w = target.lm_head.weight
    if not onednn_ok(w):
        return Choice("gemm", "dense", "only", ("dense",),
                      note=f"oneDNN packing needs float32 (or bf16 kernels) on CPU ({w.dtype} on "
                           f"{w.device})")
    c = final((cached or {}).get("gemm"))
    if c is not None and c.get("choice") in ("dense", "onednn"):
        return Choice("gemm", c["choice"], "cached", tuple(c.get("candidates", ())),
                      c.get("timings_ms", {}), c.get("seconds", 0.0),
                      conditions=c.get("conditions", {}))
    t0 = time.perf_counter()
    cands = ("dense", "onednn")
    a = contention.cpu_sample()
    timings = time_gemm_paths(target, cands, SHAPES, budget_s)
    provisional, cond = measured_conditions(a, contention.cpu_sample())
    # the turns and least times make a busy machine's measurement usable for this run; the
    # conditions decide whether it may stand as the machine's verdict (cached) or not
    return Choice("gemm", pick(timings, "dense"), "measured", cands, timings,
                  time.perf_counter() - t0, provisional=provisional, conditions=cond)


def decide_threads(runner: ModelRunner) -> Choice:
    """The thread count: forced (``EngineConfig.threads``), off the CPU or with
    ``contention='off'`` torch's default; on a quiet machine all cores (a short look at the
    machine); on a contended one measured (:func:`contention.time_threads` over decode and
    verify GEMM passes) and provisional — it answers the moment's load, so it is never cached,
    and the engine's contention monitor re-measures it as the load changes."""
    threads = torch.get_num_threads()
    if runner.config.threads:
        return Choice("threads", str(threads), "forced", (str(threads),),
                      note="EngineConfig.threads")
    if torch.device(runner.config.device).type != "cpu" or runner.config.contention == "off":
        why = "contention='off'" if runner.config.contention == "off" else "not a CPU engine"
        return Choice("threads", str(threads), "only", (str(threads),),
                      note=f"torch default ({why})")
    # the process's thread count, not what another engine of this process adapted it to
    threads = max(threads, contention.PROCESS_THREADS)
    if threads == 1:
        return Choice("threads", "1", "only", ("1",), note="one thread: nothing to adapt")
    t0 = time.perf_counter()
    a = contention.cpu_sample()
    time.sleep(contention.LOOK_S)
    cond = contention.between(a, contention.cpu_sample())
    cond_d = {**cond.to_dict(), "cpu": cpu_model()}
    if not cond.contended:
        torch.set_num_threads(threads)
        affinity.pin(threads, None)  # all cores (an engine closed under contention pinned)
        return Choice("threads", str(threads), "only", (str(threads),),
                      seconds=time.perf_counter() - t0, conditions=cond_d,
                      note=f"all cores: the machine is {cond.describe()}; re-measured when "
                           "the steps drift or it turns busy")
    cands = contention.thread_candidates(threads, cond)
    assert runner.target is not None  # the autotune stage runs after load_target
    passes = {"decode M=1": contention.gemm_pass(runner.target, 1),
              "verify M=16": contention.gemm_pass(runner.target, 16)}
    # fewer threads run on the cores the others leave free (engine/affinity.py)
    order = affinity.quiet_cpus()
    timings = contention.time_threads(passes, cands, pin=lambda n: affinity.pin(n, order))
    best = contention.pick_threads(timings, threads)
    torch.set_num_threads(best)
    cpus = affinity.pin(best, order)
    where = f"; pinned to CPU(s) {cpus}, the least busy" if cpus else ""
    return Choice("threads", str(best), "measured", tuple(str(n) for n in cands),
                  {str(n): t for n, t in timings.items()}, time.perf_counter() - t0,
                  note="median of turns" + where, provisional=True,
                  conditions={**cond_d, "cpus": cpus})


def apply_gemm(runner: ModelRunner, choice: str) -> None:
    """Re-prepare the target's (and draft's) inference weights for ``choice`` if needed."""
    for model in (runner.target, runner.draft):
        if model is not None and model.gemm != choice:
            model.fuse(choice)


Decide = Callable[["ModelRunner", "Mapping[str, Any] | None"], "Choice | None"]


def autotune(engine: Engine, more: tuple[Decide, ...] = ()) -> dict[str, Choice]:
    """The engine's ``autotune`` init stage: decide every "auto" (see the module docstring),
    apply it, cache what was measured. ``more``: further deciders run after the GEMM path is
    applied, each given the runner and this machine's cache entry (``engine/shape_choices``:
    the row floor, the draft's dtype); one returning None adds nothing. Returns name →
    :class:`Choice`."""
    path = cache_path()
    choices: dict[str, Choice] = {"threads": decide_threads(engine.runner)}
    key = cache_key(engine)  # after the thread count: the cache is keyed by it
    cached = read_cache(path).get(key)
    gemm = decide_gemm(engine.runner, cached)
    apply_gemm(engine.runner, gemm.choice)
    choices["gemm"] = gemm
    for decide in more:
        c = decide(engine.runner, cached)
        if c is not None:
            choices[c.name] = c
    attn = engine.config.attention_backend
    dev = torch.device(engine.config.device).type
    if engine.config.batch_invariant:
        choices["attention"] = Choice("attention", "invariant", "only", ("invariant",),
                                      note="batch_invariant: the C row kernel")
    elif attn == "auto" and dev == "cpu":
        # no second CPU kernel to time: a manual matmul/softmax path would have to serve
        # decode and verify alike to keep their rows bit-consistent, and it measured slower at
        # T=1 (13.6 vs 11.0 µs per layer, 2-core EPYC; docs/MEASUREMENTS.md §1)
        choices["attention"] = Choice("attention", "torch", "only", ("torch",),
                                      note="SDPA flash; triton/flashinfer need CUDA")
    elif attn != "auto":
        choices["attention"] = Choice("attention", attn, "forced", (attn,))
    choices["omp_wait"] = Choice(
        "omp_wait", contention.omp_wait_policy(), "only", (contention.omp_wait_policy(),),
        note="fixed when torch loaded (OMP_WAIT_POLICY); the thread count adapts instead")
    write_cache(path, key, choices)
    return choices


def describe(choices: Mapping[str, Choice]) -> str:
    """The init stage's detail line: every choice with its source and timings."""
    return "; ".join(c.detail() for c in choices.values())


# -- the conditions a result ran with (for saved results and page stamps) -------------------

def choice_records(choices: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One flat record per choice of ``Engine.choices`` (dicts or :class:`Choice`):
    ``name``, ``choice``, ``source`` (measured / cached / forced / only / ...),
    ``provisional`` (bool), and where and at what load it was measured: ``measured_at``
    (time), ``cpu``, ``cores``, ``load1``, ``others`` (other processes' CPU use, in cores),
    ``steal`` — None where not measured (forced, only one candidate)."""
    out = []
    for name, c in choices.items():
        d = c.to_dict() if isinstance(c, Choice) else dict(c) if isinstance(c, Mapping) else {}
        cond = d.get("conditions") or {}
        out.append({"name": name, "choice": str(d.get("choice", d.get("policy", ""))),
                    "source": str(d.get("source", "")),
                    "provisional": bool(d.get("provisional", False)),
                    "measured_at": cond.get("time"), "cpu": cond.get("cpu"),
                    "cores": cond.get("cores"), "load1": cond.get("load1"),
                    "others": cond.get("others"), "steal": cond.get("steal")})
    return out


def provisional_names(choices: Mapping[str, Any]) -> list[str]:
    """The names of the choices that were measured under contention (provisional)."""
    return [r["name"] for r in choice_records(choices) if r["provisional"]]


def conditions_line(choices: Mapping[str, Any]) -> str:
    """One line for a stamp: ``gemm=onednn (measured 2026-12-01 14:40, AMD EPYC, load 1.3,
    others 0.9 of 2 cores: PROVISIONAL); threads=2 (only); ...``."""
    parts = []
    for r in choice_records(choices):
        how = r["source"]
        if r["measured_at"]:
            how += f" {r['measured_at']}, {r['cpu']}, load {r['load1']}"
            if r["others"] is not None:
                how += f", others {r['others']:.2f} of {r['cores']} cores"
        if r["provisional"]:
            how += ": PROVISIONAL"
        parts.append(f"{r['name']}={r['choice']} ({how})")
    return "; ".join(parts)
