"""Models for the notebooks: the shipped pair when present, else a micro pair built in seconds.

The shipped models (``data/models/wb-target``, ``data/models/wb-eagle3``) take about an hour to
train. Until they exist — and always under ``WORKBENCH_FAST=1`` (CI) — :func:`demo_models` builds
a micro target (8 layers x 64, vocab 300, trained ~200 steps on a few standard-library files) and
a micro EAGLE-3 head (trained ~80 steps with the training-time test) into a cache folder, once:

    from workbench.train.demo_models import demo_models
    models = demo_models(fast=FAST)
    engine = wb.Engine.from_pretrained(models.target, draft=models.draft)

The cache folder is ``$WORKBENCH_DEMO_DIR`` or ``data/work/demo-models`` (git-ignored); a build
goes to a temporary sibling first and is renamed into place, so a killed build leaves no half
folder behind.
"""

from __future__ import annotations

import functools
import json
import shutil
import sysconfig
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workbench.data_io import DATA_DIR, REPO_ROOT, load_prompts
from workbench.errors import ConfigError
from workbench.train import target, upcycle
from workbench.train.eagle3 import DraftTrainConfig, data, train_draft, trainer
from workbench.train.target import TargetTrainConfig, train_target

SHIPPED_TARGET = DATA_DIR / "models" / "wb-target"
SHIPPED_DRAFT = DATA_DIR / "models" / "wb-eagle3"

# Small, stable standard-library files: the micro target learns them almost by heart, so a
# micro head trained for seconds already gets drafts accepted.
MICRO_CORPUS_FILES = ("bisect.py", "colorsys.py", "fnmatch.py", "genericpath.py", "keyword.py",
                      "stat.py", "this.py")

MICRO_TARGET: dict[str, Any] = dict(
    vocab_size=300, layers=8, hidden=64, heads=4, kv_heads=2, intermediate=128, seq_len=64,
    batch=8, steps=800, lr=3e-3, warmup=5, ckpt_every=400, eval_batches=2, threads=1, seed=0)
# The head also trains on the target's own continuations (regenerate): that is the text it
# will have to predict when serving, and it lifts τ from ~1.7 to ~2.5 on the micro pair.
MICRO_DRAFT: dict[str, Any] = dict(
    draft_vocab_size=128, steps=300, batch=4, seq_len=48, lr=3e-3, warmup=5, ttt_steps=5,
    regenerate=True, regen_sequences=64, regen_prompt_len=16, regen_batch=32, regen_mix=0.5,
    eval_batches=2, ckpt_every=100, threads=1, seed=0)
# Bump when the recipe changes so stale caches are rebuilt.
RECIPE_VERSION = 1

# Prompts drawn from the micro corpus (the micro target continues them confidently).
MICRO_PROMPTS = ("def insort_left(a, x, lo=0, hi=None, *, key=None):",
                 "def rgb_to_hsv(r, g, b):",
                 "def fnmatch(name, pat):",
                 "def S_ISDIR(mode):")


@dataclass(frozen=True)
class DemoModels:
    """Where the notebook's models live and what they are."""

    target: Path
    draft: Path
    kind: str  # "shipped" | "micro"
    prompts: tuple[str, ...]
    build_seconds: float = 0.0

    def describe(self) -> str:
        """One line for a notebook: which models, from where."""
        if self.kind == "shipped":
            return f"shipped models: {self.target.name} + {self.draft.name}"
        where = self.target.parent
        if where.is_relative_to(REPO_ROOT):
            where = where.relative_to(REPO_ROOT)
        return f"micro models (8 x 64 target, vocab 300, + micro EAGLE-3 head) in {where}"


def shipped_available() -> bool:
    """True when both shipped model folders hold a ``config.json``."""
    return (SHIPPED_TARGET / "config.json").is_file() and (SHIPPED_DRAFT / "config.json").is_file()


def default_cache_dir() -> Path:
    """``$WORKBENCH_DEMO_DIR`` or ``<repo>/data/work/demo-models``."""
    import os

    env = os.environ.get("WORKBENCH_DEMO_DIR")
    return Path(env) if env else DATA_DIR / "work" / "demo-models"


def _recipe() -> dict[str, Any]:
    return {"version": RECIPE_VERSION, "target": MICRO_TARGET, "draft": MICRO_DRAFT,
            "corpus": list(MICRO_CORPUS_FILES)}


@contextmanager
def quiet_progress() -> Iterator[None]:
    """Silence the trainers' tqdm bars and transformers' weight-loading bars for the block
    (a notebook would show a progress widget for each). The trainer modules that show bars
    import ``tqdm`` by name; this swaps in a disabled one in each.
    """
    from tqdm.auto import tqdm
    from transformers.utils import logging as hf_logging


    quiet = functools.partial(tqdm, disable=True)
    modules = (target, data, trainer, upcycle)
    saved = [m.tqdm for m in modules]
    hf_bars = hf_logging.is_progress_bar_enabled()
    for m in modules:
        m.tqdm = quiet  # type: ignore[attr-defined]
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        for m, bar in zip(modules, saved, strict=True):
            m.tqdm = bar  # type: ignore[attr-defined]
        if hf_bars:
            hf_logging.enable_progress_bar()


def _build_micro(folder: Path) -> None:
    """Corpus → micro target → micro head, all under ``folder``."""
    corpus = folder / "corpus"
    corpus.mkdir(parents=True)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name in MICRO_CORPUS_FILES:
        shutil.copy(stdlib / name, corpus / name)
    with quiet_progress():
        train_target(TargetTrainConfig(out=str(folder / "target"),
                                       work=str(folder / "work-target"), corpus=str(corpus),
                                       **MICRO_TARGET))
        train_draft(DraftTrainConfig(target=str(folder / "target"), out=str(folder / "draft"),
                                     work=str(folder / "work-draft"), corpus=str(corpus),
                                     **MICRO_DRAFT))


def micro_models(cache: str | Path | None = None, rebuild: bool = False) -> DemoModels:
    """The micro pair, built into ``cache`` on first use (~40 s on 2 busy CPU cores)."""
    root = Path(cache) if cache is not None else default_cache_dir()
    stamp = root / "recipe.json"
    t0 = time.perf_counter()
    fresh = stamp.is_file() and json.loads(stamp.read_text()) == _recipe()
    if rebuild or not fresh:
        root.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=root.name + ".", dir=root.parent))
        try:
            _build_micro(tmp)
            (tmp / "recipe.json").write_text(json.dumps(_recipe(), indent=2) + "\n")
            if root.exists():
                shutil.rmtree(root)
            tmp.rename(root)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp)
    return DemoModels(root / "target", root / "draft", "micro", MICRO_PROMPTS,
                      time.perf_counter() - t0)


def demo_models(fast: bool = False, cache: str | Path | None = None) -> DemoModels:
    """The shipped pair unless ``fast`` or it is missing; then the micro pair."""
    if not fast and shipped_available():
        return DemoModels(SHIPPED_TARGET, SHIPPED_DRAFT, "shipped", shipped_prompts())
    return micro_models(cache)


def shipped_prompts(n: int = 4) -> tuple[str, ...]:
    """``n`` held-out code prompts for the shipped models (the micro prompts if none saved)."""
    try:
        prompts = load_prompts("heldout", kinds=("code",), limit=n)
    except ConfigError:
        return MICRO_PROMPTS
    return tuple(p.prompt for p in prompts) or MICRO_PROMPTS


def recipe() -> dict[str, Any]:
    """The micro recipe (settings of both trainings), for display."""
    return json.loads(json.dumps(_recipe()))


__all__ = ["DemoModels", "MICRO_PROMPTS", "demo_models", "micro_models", "recipe",
           "shipped_available", "shipped_prompts"]
