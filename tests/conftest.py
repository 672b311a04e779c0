"""Session fixtures: a tiny corpus, a tiny trained target and a random EAGLE-3 head for it,
built once per test run."""

from __future__ import annotations

import os
import sys
from pathlib import Path

# Must precede any triton import (transformers may import it): kernel tests run on CPU.
os.environ.setdefault("TRITON_INTERPRET", "1")
# Engine init's measured choices are cached per test session, never in ~/.cache (autotune.py)
os.environ.setdefault("WORKBENCH_AUTOTUNE_CACHE", os.path.join(
    __import__("tempfile").mkdtemp(prefix="wb-autotune-"), "autotune.json"))

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # tests/helpers.py

from helpers import write_tiny_corpus, write_trained_target  # noqa: E402


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder of a few small standard-library ``*.py`` files."""
    return write_tiny_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="session")
def micro_target(tmp_path_factory: pytest.TempPathFactory, tiny_corpus: Path) -> Path:
    """An 8-layer x 64 target (vocab 300) trained 200 steps on ``tiny_corpus``: an HF folder."""
    root = tmp_path_factory.mktemp("micro_target")
    write_trained_target(root / "model", tiny_corpus, root / "work")
    return root / "model"


@pytest.fixture(scope="session")
def random_head(micro_target: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight EAGLE-3 head for ``micro_target`` (accepts ~nothing; real format)."""
    from workbench.models.synthetic import write_random_head

    return write_random_head(micro_target, tmp_path_factory.mktemp("random_head"))

