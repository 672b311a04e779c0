"""Session fixtures: a tiny corpus, a tiny trained target and each kind of EAGLE-3 head for it
(``random_head``: random weights; ``trained_head``: trained for seconds), built once per test
run. Folders use them by these names; none writes its own."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

# Must precede any triton import (transformers may import it): kernel tests run on CPU.
os.environ.setdefault("TRITON_INTERPRET", "1")
# Engine init's measured choices are cached per test session, never in ~/.cache (autotune.py)
os.environ.setdefault("WORKBENCH_AUTOTUNE_CACHE", os.path.join(
    __import__("tempfile").mkdtemp(prefix="wb-autotune-"), "autotune.json"))

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # tests/helpers.py

from helpers import (  # noqa: E402
    MICRO_DRAFT_TRAINING,
    write_tiny_corpus,
    write_trained_target,
)
from leaks import no_socket_outlives_the_run, pytest_runtest_setup  # noqa: E402, F401


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


@pytest.fixture(scope="session")
def trained_head(micro_target: Path, tiny_corpus: Path,
                 tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A micro head for ``micro_target`` trained for a few seconds on regenerated data
    (acceptance well above zero)."""
    from workbench.train.eagle3 import DraftTrainConfig, train_draft

    root = tmp_path_factory.mktemp("trained_head")
    train_draft(DraftTrainConfig(target=str(micro_target), out=str(root / "head"),
                                 work=str(root / "work"), corpus=str(tiny_corpus),
                                 **MICRO_DRAFT_TRAINING))
    return root / "head"


@pytest.fixture(autouse=True)
def home_affinity() -> Iterator[None]:
    """A test whose engine pinned the process to fewer cores (engine/affinity.py) leaves the
    next test all of them."""
    yield
    from workbench.engine import affinity

    if affinity.current() is not None:
        affinity.pin(len(affinity.HOME or ()), None)


@pytest.fixture(autouse=True)
def machine_conditions(monkeypatch: pytest.MonkeyPatch) -> dict[str, float]:
    """The machine's load is an input of the provisional-choice rule (engine/contention.py):
    every test runs on a machine that reads as quiet (other processes 0 cores, no steal) unless
    it sets ``machine_conditions["others"]`` / ``["steal"]``; the window itself is measured."""
    import dataclasses

    from workbench.engine import contention

    state = {"others": 0.0, "steal": 0.0}
    real = contention.between

    def pinned(a: object, b: object, drift: float | None = None) -> contention.Conditions:
        c = real(a, b, drift)  # type: ignore[arg-type]
        return dataclasses.replace(c, others=state["others"], steal=state["steal"], load1=0.0)

    monkeypatch.setattr(contention, "between", pinned)
    return state
