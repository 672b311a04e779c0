"""The speculative tests' default engine: the micro target with the root ``trained_head``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import make_engine

import workbench as wb


@pytest.fixture(scope="module")
def engine(micro_target: Path, trained_head: Path) -> Iterator[wb.Engine]:
    """The micro target with the trained head (a module's own ``engine`` fixture overrides it)."""
    e = make_engine(micro_target, trained_head, kv_budget_tokens=8192)
    yield e
    e.close()
