"""One recording of the shipped pair, shared by the lab tests (built once per session)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from labkit import COST, MAX_NEW, SHAPE

import workbench as wb
from workbench.bench.workloads import load_prompts
from workbench.lab.record import RecordedRun, record
from workbench.train.demo_models import SHIPPED_DRAFT, SHIPPED_TARGET


@pytest.fixture(scope="session")
def lab_prompts() -> list[str]:
    return [p.prompt for p in load_prompts(limit=4)]


@pytest.fixture(scope="session")
def lab_engine() -> Iterator[wb.Engine]:
    e = wb.Engine.from_pretrained(SHIPPED_TARGET, draft=SHIPPED_DRAFT,
                                  config=wb.EngineConfig(draft_dtype="same"))
    yield e
    e.close()


@pytest.fixture(scope="session")
def recorded(lab_engine: wb.Engine, lab_prompts: list[str],
             tmp_path_factory: pytest.TempPathFactory) -> RecordedRun:
    """Saved and loaded back: every test reads what ``lab replay`` would read."""
    run = record(lab_engine, lab_prompts, SHAPE, MAX_NEW, cost_model=COST)
    folder = run.save(tmp_path_factory.mktemp("lab") / "run")
    return RecordedRun.load(folder)


@pytest.fixture(scope="session")
def run_dir(recorded: RecordedRun) -> Path:
    assert recorded.path is not None
    return recorded.path
