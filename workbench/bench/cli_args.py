"""``python -m workbench bench``: the parsed flags → what a benchmark runs on.

Prompts, engines (``--engine`` overrides on the measured "auto" choices), the ``--spec`` shape,
``--levels``, ``--repeats``, ``--threshold``, and :func:`sweep`: a concurrency sweep with one
engine per arm, every engine closed afterwards. Every flag error is a ConfigError naming the flag.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import workbench as wb
from workbench import data_io
from workbench.bench.cli_output import print_choices, run_choices
from workbench.bench.concurrency import LEVELS, run_concurrency
from workbench.config import SpecConfig, engine_config, parse_overrides
from workbench.data_io import load_prompts, read_prompts_file
from workbench.errors import ConfigError
from workbench.models.gguf import find_gguf
from workbench.models.loader import resolve_path

if TYPE_CHECKING:
    from workbench.engine.engine import Engine

QUICK_LEVELS = (1, 4, 16)


def prompts(ns: argparse.Namespace) -> list[str]:
    """``--prompts-file F.jsonl`` (every prompt in it), else ``--prompts`` held-out prompts
    (at most 4 with ``--quick``)."""
    if getattr(ns, "prompts_file", None):
        return read_prompts_file(ns.prompts_file)

    path = data_io.PROMPTS_DIR / "heldout.jsonl"  # read at call time: tests point it elsewhere
    if not path.is_file():
        raise ConfigError(f"bench: no prompts at {path}; write them first with "
                          "`python -m workbench make-prompts`")
    limit = min(ns.prompts, 4) if ns.quick else ns.prompts
    out = [p.prompt for p in load_prompts(limit=limit)]
    if not out:
        raise ConfigError(f"bench: {path} holds no prompts; rerun "
                          "`python -m workbench make-prompts`")
    return out


def engine_overrides(ns: argparse.Namespace, attr: str = "engine") -> dict[str, Any]:
    """``--engine gemm=dense,threads=2`` → {"gemm": "dense", "threads": 2} (errors name the
    flag and the field); ``attr="engine_b"`` reads ``--engine-b``."""
    return parse_overrides(str(getattr(ns, attr, "") or ""), "--" + attr.replace("_", "-"))


def model_exists(path: Path) -> bool:
    """A target the loader reads (its own resolution, no weights or metadata read): a folder
    with config.json, a ``.gguf`` file or a folder holding one, a pointer folder (``gguf.json``)
    whose cache holds it. Errors of the resolution (an ambiguous folder, a pointer whose file
    is not fetched) propagate, naming the path."""
    if not path.exists():
        return False
    folder = resolve_path(path)
    return (folder / "config.json").is_file() or find_gguf(folder) is not None


def engine(ns: argparse.Namespace, need_draft: bool, max_batch: int = 64,
           kv_budget_tokens: int | None = None, variant: bool = False) -> Any:
    """The ``--model``/``--draft`` engine (baseline only when the draft is missing and
    ``need_draft`` is False); ``variant``: with the ``--engine-b`` overrides on top."""
    target = Path(ns.model)
    if not model_exists(target):
        raise ConfigError(f"bench: no target model at {target} (train one with "
                          "`python -m workbench train-target`, or pass --model)")
    draft = Path(ns.draft) if ns.draft else None
    if draft is not None and not (draft / "config.json").is_file():
        if need_draft:
            raise ConfigError(f"bench {ns.which}: no draft model at {draft} (train one with "
                              "`python -m workbench train-draft`, or pass --draft)")
        print(f"note: no draft at {draft}; running the baseline only")
        draft = None
    cfg = engine_config(ns, max_batch_size=max(64, max_batch))
    if variant:
        cfg = dataclasses.replace(cfg, **engine_overrides(ns, "engine_b"))
    if kv_budget_tokens is not None:
        cfg = dataclasses.replace(cfg, kv_budget_tokens=kv_budget_tokens)
    return wb.Engine.from_pretrained(target, draft=draft, config=cfg)


def spec(ns: argparse.Namespace) -> Any:
    """``--spec S,K,N`` → SpecConfig (errors name the flag)."""
    parts = str(getattr(ns, "spec", "5,4,16")).split(",")
    try:
        s, k, n = (int(x) for x in parts)
    except ValueError:
        raise ConfigError(f"--spec: expected three integers S,K,N, got {ns.spec!r}") from None
    try:
        return SpecConfig(num_steps=s, topk=k, num_draft_tokens=n)
    except ConfigError as e:
        raise ConfigError(f"--spec {ns.spec}: {e}") from e


def repeats(ns: argparse.Namespace) -> int:
    r = getattr(ns, "repeats", 1)
    if not isinstance(r, int) or r < 1:
        raise ConfigError(f"--repeats: must be an integer >= 1, got {r!r}")
    return r


def levels(ns: argparse.Namespace) -> tuple[int, ...]:
    """``--levels 1,4,16`` (default: the full sweep, or QUICK_LEVELS with ``--quick``)."""
    raw = getattr(ns, "levels", None)
    if raw is None:
        return QUICK_LEVELS if ns.quick else LEVELS
    try:
        out = tuple(int(x) for x in str(raw).split(","))
    except ValueError:
        raise ConfigError(f"--levels: expected comma-separated integers, got {raw!r}") from None
    if not out or min(out) < 1:
        raise ConfigError(f"--levels: concurrency levels must be >= 1, got {raw!r}")
    return out


def threshold(ns: argparse.Namespace) -> int | str:
    """``--threshold auto`` (the crossover the cost model predicts on this machine) or an
    integer n >= 0 (a forced ``BatchThreshold(n)``)."""
    raw = str(getattr(ns, "threshold", "auto") or "auto").strip()
    if raw == "auto":
        return raw
    try:
        n = int(raw)
    except ValueError:
        raise ConfigError(f"--threshold: expected 'auto' or an integer >= 0, got {raw!r}") \
            from None
    if n < 0:
        raise ConfigError(f"--threshold: expected 'auto' or an integer >= 0, got {raw!r}")
    return n


def max_new(ns: argparse.Namespace) -> int:
    return min(ns.max_new_tokens, 32) if ns.quick else ns.max_new_tokens


def arm_engines(ns: argparse.Namespace, ref: Engine, arms: dict[str, Any],
                prompt_list: list[str], level_list: tuple[int, ...]) -> dict[str, Any]:
    """One engine per arm (interleaved sweep), unless ``--sequential``. Every arm is then timed
    on the same stretch of the machine's life; the pools are sized for the sweep, since up to
    seven engines share the memory."""
    if getattr(ns, "sequential", False) or len(arms) < 2:
        return {}
    longest = max(len(ref.tokenize(p)) for p in prompt_list)
    need = max(level_list) * (longest + max_new(ns) + 2 * ref.config.page_size + 64)
    engines: dict[str, Any] = {}
    try:
        for a in arms:
            engines[a] = engine(ns, need_draft=ref.runner.draft is not None,
                                max_batch=max(level_list), kv_budget_tokens=need)
    except BaseException:
        for e in engines.values():
            e.close()
        raise
    return engines


def sweep(ns: argparse.Namespace, prompt_list: list[str], level_list: tuple[int, ...],
          arms: Callable[[Any], dict[str, Any]], *, need_draft: bool,
          name: str) -> tuple[Any, dict[str, Any]]:
    """One concurrency sweep: a reference engine, one engine per arm (:func:`arm_engines`),
    every engine closed afterwards. ``arms(engine)`` names the arms. Returns the frame and the
    reference engine's measured choices."""
    ref = engine(ns, need_draft=need_draft, max_batch=max(level_list))
    engines: dict[str, Any] = {}
    try:
        print_choices(ref)
        arm_map = arms(ref)
        engines = arm_engines(ns, ref, arm_map, prompt_list, level_list)
        df = run_concurrency(ref, prompt_list, levels=level_list, arms=arm_map,
                             max_new_tokens=max_new(ns), out=ns.out, name=name,
                             repeats=repeats(ns), engines=engines or None)
        choices = run_choices(ref)
    finally:
        ref.close()
        for e in engines.values():
            e.close()
    return df, choices
