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
from typing import Any

import torch

from workbench.machine import cpu_flags, cpu_model, loadavg
from workbench.models.gemm import gemm_ops, onednn_ok, prepare_weight

ENV_CACHE = "WORKBENCH_AUTOTUNE_CACHE"
DEFAULT_CACHE = Path.home() / ".cache" / "workbench" / "autotune.json"
CACHE_VERSION = 2  # 2: least-of-interleaved timings (v1 medians could cache a load spike)
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
        return "".join(parts) + ")"


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


def cache_key(engine: Any) -> str:
    """Everything a measured choice depends on: CPU model and flags, torch version, threads,
    device and dtype, and both models' fingerprints."""
    return json.dumps({
        "v": CACHE_VERSION, "cpu": cpu_model(), "flags": cpu_flags(), "torch": torch.__version__,
        "threads": torch.get_num_threads(), "device": engine.config.device,
        "dtype": engine.config.dtype,
        "target": model_fingerprint(engine.model_path, engine.target),
        "draft": model_fingerprint(engine.draft_path, engine.draft)
        if engine.draft is not None else None,
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


def write_cache(path: Path | None, key: str, choices: Mapping[str, Choice]) -> None:
    """Merge this key's measured choices into the cache (atomic replace; concurrent writers
    may drop each other's entry, which only costs a re-measure)."""
    if path is None:
        return
    entries = read_cache(path)
    old = entries.get(key)
    entry: dict[str, Any] = dict(old) if isinstance(old, dict) else {}
    entry.update({n: c.to_dict() for n, c in choices.items() if c.source == "measured"})
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
    prepared = {c: [(k, prepare_weight(w.detach(), c), b) for k, w, b in weights]
                for c in candidates}
    per = budget_s / max(1, len(shapes))
    out: dict[str, dict[str, float]] = {c: {} for c in candidates}
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for label, m in shapes.items():
            xs: dict[int, torch.Tensor] = {}
            for _, w, _ in weights:
                xs.setdefault(w.shape[1], torch.randn(m, w.shape[1], generator=gen))
            res = {n: torch.randn(m, n, generator=gen) for n in {w.shape[0] for _, w, _ in
                                                                   weights}}
            passes: dict[str, Callable[[], None]] = {}
            for c in candidates:
                lin, lin_add = gemm_ops(c)
                ws = prepared[c]

                def one_pass(lin: Any = lin, lin_add: Any = lin_add, ws: Any = ws,
                             xs: dict[int, torch.Tensor] = xs,
                             res: dict[int, torch.Tensor] = res) -> None:
                    for (kind, w, b), (_, dw, _) in zip(ws, weights, strict=True):
                        x = xs[dw.shape[1]]
                        if kind == "add":
                            lin_add(x, w, res[dw.shape[0]])
                        else:
                            lin(x, w, b)

                passes[c] = one_pass
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


def decide_gemm(engine: Any, cached: Mapping[str, Any] | None,
                budget_s: float = BUDGET_S) -> Choice:
    """The GEMM path: forced, only one candidate (not a float32 CPU model), cached, or
    measured (:func:`time_gemm_paths`, :func:`pick`; dense wins ties: no packed copy)."""
    want = engine.config.gemm
    if want != "auto":
        return Choice("gemm", want, "forced", (want,))
    w = engine.target.lm_head.weight
    if not onednn_ok(w):
        return Choice("gemm", "dense", "only", ("dense",),
                      note=f"oneDNN packing needs float32 on CPU ({w.dtype} on {w.device})")
    if cached and cached.get("gemm", {}).get("choice") in ("dense", "onednn"):
        c = cached["gemm"]
        return Choice("gemm", c["choice"], "cached", tuple(c.get("candidates", ())),
                      c.get("timings_ms", {}), c.get("seconds", 0.0))
    t0 = time.perf_counter()
    cands = ("dense", "onednn")
    load = loadavg()
    timings = time_gemm_paths(engine.target, cands, SHAPES, budget_s)
    cores = os.cpu_count() or 1
    # recorded, not acted on: the turns and least times above are what make a busy machine's
    # measurement hold (skipping the cache instead would re-measure at every start under load)
    note = (f"measured at load {load[0]:.1f} on {cores} cores"
            if load is not None and load[0] > cores else "")
    return Choice("gemm", pick(timings, "dense"), "measured", cands, timings,
                  time.perf_counter() - t0, note=note)


def apply_gemm(engine: Any, choice: str) -> None:
    """Re-prepare the target's (and draft's) inference weights for ``choice`` if needed."""
    if engine.target.gemm != choice:
        engine.target.fuse(choice)
    if engine.draft is not None and engine.draft.gemm != choice:
        engine.draft.fuse(choice)


def autotune(engine: Any) -> dict[str, Choice]:
    """The engine's ``autotune`` init stage: decide every "auto" (see the module docstring),
    apply it, cache what was measured. Returns name → :class:`Choice`."""
    path = cache_path()
    key = cache_key(engine)
    cached = read_cache(path).get(key)
    choices: dict[str, Choice] = {}
    gemm = decide_gemm(engine, cached)
    apply_gemm(engine, gemm.choice)
    choices["gemm"] = gemm
    attn = engine.config.attention_backend
    dev = torch.device(engine.config.device).type
    if attn == "auto" and dev == "cpu":
        # no second CPU kernel to time: a manual matmul/softmax path would have to serve
        # decode and verify alike to keep their rows bit-consistent, and it measured slower at
        # T=1 (13.6 vs 11.0 µs per layer, 2-core EPYC; docs/DESIGN.md §4a)
        choices["attention"] = Choice("attention", "torch", "only", ("torch",),
                                      note="SDPA flash; triton/flashinfer need CUDA")
    elif attn != "auto":
        choices["attention"] = Choice("attention", attn, "forced", (attn,))
    threads = torch.get_num_threads()
    choices["threads"] = Choice(
        "threads", str(threads), "forced" if engine.config.threads else "only", (str(threads),),
        note="EngineConfig.threads" if engine.config.threads else "torch default, not measured")
    if any(c.source == "measured" for c in choices.values()):
        write_cache(path, key, choices)
    return choices


def describe(choices: Mapping[str, Choice]) -> str:
    """The init stage's detail line: every choice with its source and timings."""
    return "; ".join(c.detail() for c in choices.values())
