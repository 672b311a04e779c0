"""Fixtures: an EAGLE-3 random head for the micro target, and plain greedy references."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from reliability import kit

import workbench as wb


@pytest.fixture(scope="session")
def head(micro_target: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from speculative.conftest import write_random_head  # tests/ is on sys.path (tests/conftest.py)

    return write_random_head(micro_target, tmp_path_factory.mktemp("reliability_head"))


@pytest.fixture(scope="session")
def plain_engine(micro_target: Path) -> Iterator[wb.Engine]:
    e = kit.engine(micro_target)
    yield e
    e.close()


@pytest.fixture(scope="session")
def reference(plain_engine: wb.Engine) -> Callable[[list[int], int], list[int]]:
    """``reference(prompt, n)``: the target's greedy continuation (plain decoding, alone)."""
    cache: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def run(prompt: list[int], n: int) -> list[int]:
        key = (tuple(prompt), n)
        if key not in cache:
            cache[key] = plain_engine.generate([prompt], kit.greedy(n))[0].token_ids
        return cache[key]

    return run
