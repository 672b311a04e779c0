"""Policies that need this machine's numbers, resolved by the engine.

``BatchThreshold("auto")`` and ``Goodput()`` (no cost model) are placeholders: where
speculation stops paying depends on the CPU, the torch build, the thread count and both
models. The engine resolves them:

* init stage ``policy_costmodel`` reads this machine's calibrated cost model from the cache
  (``policy.json`` next to autotune's cache file, keyed like autotune's choices: CPU model and
  flags, torch, threads, device, dtype, both models' fingerprints) — instant, nothing measured
  at init. Without a draft model there is nothing to calibrate.
* ``Engine.set_spec`` (so ``generate``/``stream``) with such a policy: when the cache has no
  entry yet, :func:`calibrate` measures now (``costmodel.calibrate`` at fixed, small sizes and
  ``costmodel.measure_tau`` on the target's own continuations of :data:`SEED_PROMPTS`) and
  writes it, so a second start is instant; then ``BatchThreshold("auto")`` becomes
  ``BatchThreshold.from_cost_model`` at the spec's shape and measured τ, and ``Goodput()``
  gets a copy of the cost model and the measured per-depth acceptance. The resolved policy and
  its reason are in ``Engine.choices["policy"]``, the cost model's provenance in
  ``Engine.choices["policy_costmodel"]``.

A calibration that fails raises ConfigError naming the stage (``policy_costmodel: ...``); the
engine keeps its previous spec. Calibrating steps the engine, so it needs an idle one.
Call :func:`calibrate` with the workload's prompts to measure τ there instead (τ depends on
the text).
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeGuard

import torch

from workbench.config import SpecConfig
from workbench.engine import autotune, contention
from workbench.engine.calibrate import calibrate as fit_cost_model
from workbench.engine.calibrate import measure_tau
from workbench.engine.prompts import Prompt
from workbench.errors import ConfigError
from workbench.policy.costmodel import CostModel
from workbench.policy.goodput import Goodput
from workbench.policy.policies import BatchThreshold

if TYPE_CHECKING:
    from workbench.engine.engine import Engine

STAGE = "policy_costmodel"
CACHE_NAME = "policy.json"
# calibration at fixed, small sizes (bounded: 36 timed forwards on scratch KV, 3 short runs of
# 12 tokens per kind, one τ run; ~2 s for the shipped demo models on a 2-core EPYC)
BATCHES = (1, 2, 4, 8, 16, 32)
# τ measured on the target's own greedy continuation of a few token seeds: text the target
# itself writes, which is what a draft trained on its outputs is judged on (τ grows with the
# length generated: 64 tokens, as `bench concurrency` measures it)
SEED_PROMPTS = 8
TAU_TOKENS = 64


def cache_file() -> Path | None:
    """``policy.json`` beside autotune's cache (None: caching disabled, as for autotune)."""
    path = autotune.cache_path()
    return None if path is None else path.with_name(CACHE_NAME)


def _key(engine: Engine, shape: tuple[int, int, int]) -> str:
    return json.dumps({"machine": json.loads(autotune.cache_key(engine)), "shape": list(shape)},
                      sort_keys=True)


def _read(path: Path | None) -> dict[str, Any]:
    """Entries of the cache (autotune's reader: a corrupt cache is ignored and rewritten)."""
    return autotune.read_cache(path)


def _write(path: Path | None, key: str, entry: dict[str, Any]) -> None:
    if path is None:
        return
    entries = _read(path)
    entries[key] = entry
    autotune.replace_cache(path, entries, 1)


def stage(engine: Engine) -> str:
    """The init stage: load the cached cost model of the default shape (5, 4, 16), if any."""
    if engine.runner.draft is None:
        return "no draft model: nothing to calibrate"
    shape = SpecConfig().shape
    entry = _read(cache_file()).get(_key(engine, shape))
    if not _valid(entry):
        return ("not cached: measured when a policy needs it (BatchThreshold('auto'), "
                "Goodput() without a cost model), then cached")
    engine.choices[STAGE] = {**entry, "source": "cached"}
    return _describe(engine.choices[STAGE])


def _valid(entry: Any) -> TypeGuard[dict[str, Any]]:
    """A cache entry with every field (one from an older layout is measured again)."""
    return autotune.final(entry) is not None and isinstance(entry, dict) and all(
        name in entry for name in ("shape", "model", "tau", "rates", "topk", "context",
                                   "tau_on", "seconds")) and isinstance(entry["model"], dict)


def _describe(entry: dict[str, Any]) -> str:
    how = f"measured {entry['seconds']:.1f} s" if entry["source"] == "measured" else \
        f"cached (measured {entry['seconds']:.1f} s at an earlier start)"
    shape = "S{}K{}N{}".format(*entry["shape"])
    busy = "; PROVISIONAL (measured on a contended machine, not cached)" \
        if entry.get("provisional") else ""
    return f"cost model {shape} {how}; τ {entry['tau']:.2f} on {entry['tau_on']}{busy}"


def calibrate(engine: Engine, shape: tuple[int, int, int] | None = None,
              prompts: list[Prompt] | None = None) -> dict[str, Any]:
    """Measure the cost model and τ of ``shape`` (default: SpecConfig's) on this engine, cache
    it, and keep it in ``engine.choices["policy_costmodel"]``. ``prompts``: measure τ on them
    (the workload's text) instead of the target's own continuations of token seeds."""
    shape = shape or SpecConfig().shape
    if engine.runner.draft is None:
        raise ConfigError(f"{STAGE}: the engine has no draft model")
    live = sum(1 for r in engine.requests.values() if not r.finished)
    if live:
        raise ConfigError(f"{STAGE}: calibrating steps the engine; it has {live} live "
                          "request(s) — finish or abort them first")
    t0 = time.perf_counter()
    a = contention.cpu_sample()
    try:
        cm = fit_cost_model(engine, batch_sizes=tuple(
            b for b in BATCHES if b <= engine.config.max_batch_size), shape=shape)
        if prompts:
            on = f"{len(prompts)} given prompts"
            acc = measure_tau(engine, list(prompts), shape, max_new_tokens=TAU_TOKENS,
                              batch=len(prompts))
        else:
            assert engine.model_config is not None  # load_config ran
            vocab = engine.model_config.vocab_size
            g = torch.Generator().manual_seed(0)
            seeds = [torch.randint(1, vocab, (4,), generator=g).tolist()
                     for _ in range(SEED_PROMPTS)]
            on = f"the target's own continuations of {SEED_PROMPTS} token seeds"
            acc = measure_tau(engine, seeds, shape, max_new_tokens=TAU_TOKENS,
                              batch=SEED_PROMPTS)
    except ConfigError as e:
        raise ConfigError(f"{STAGE}: calibration failed: {e}") from e
    except RuntimeError as e:
        raise ConfigError(f"{STAGE}: calibration failed: {type(e).__name__}: {e}") from e
    # measured while the machine was contended: this run uses it, the cache never keeps it
    provisional, cond = autotune.measured_conditions(a, contention.cpu_sample())
    entry = {"shape": list(shape), "model": cm.to_dict(), "tau": acc.tau, "topk": acc.topk,
             "rates": list(acc.rates), "context": acc.context, "tau_on": on,
             "seconds": time.perf_counter() - t0, "provisional": provisional,
             "conditions": cond}
    if not provisional:
        _write(cache_file(), _key(engine, shape), entry)
    engine.choices[STAGE] = {**entry, "source": "measured"}
    return engine.choices[STAGE]


def _entry(engine: Engine, shape: tuple[int, int, int]) -> dict[str, Any]:
    """The engine's measured/cached entry for ``shape``: in memory, else the cache, else
    measured now."""
    have = engine.choices.get(STAGE)
    if isinstance(have, dict) and tuple(have.get("shape", ())) == shape:
        return have
    entry = _read(cache_file()).get(_key(engine, shape))
    if _valid(entry):
        engine.choices[STAGE] = {**entry, "source": "cached"}
        return engine.choices[STAGE]
    return calibrate(engine, shape)


def resolve(engine: Engine, spec: SpecConfig) -> SpecConfig:
    """``spec`` with its policy resolved on this machine when it needs the engine
    (``BatchThreshold("auto")``, ``Goodput()``); otherwise ``spec`` itself."""
    policy = spec.policy
    if not getattr(policy, "needs_engine", False):
        return spec
    shape = spec.shape
    entry = _entry(engine, shape)
    cm = CostModel.from_dict(entry["model"])
    if isinstance(policy, BatchThreshold):
        resolved: Any = BatchThreshold.from_cost_model(
            cm, shape, entry["tau"], context=entry["context"], draft_state=spec.draft_state,
            max_batch=engine.config.max_batch_size)
        reason = resolved.basis.reason() if resolved.basis is not None else ""
    elif isinstance(policy, Goodput):
        resolved = policy.resolved(cm, {entry["topk"]: entry["rates"]} if entry["rates"]
                                   else None)
        reason = (f"cost model {entry['source']}; acceptance seeded from τ {entry['tau']:.2f} "
                  f"on {entry['tau_on']}" if not policy.accept_seed else
                  f"cost model {entry['source']}; acceptance seeded by the caller")
    else:
        raise ConfigError(f"{STAGE}: spec.policy {policy!r} needs an engine, but this engine "
                          "does not know how to resolve it")
    engine.choices["policy"] = {"policy": repr(resolved), "reason": reason,
                                "cost_model": entry["source"]}
    return dataclasses.replace(spec, policy=resolved)
