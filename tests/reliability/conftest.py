"""Fixtures: the root random EAGLE-3 head as ``head``, and plain greedy references."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from helpers import make_engine
from reliability import kit

import workbench as wb


@pytest.fixture(scope="session")
def head(random_head: Path) -> Path:
    """The root ``random_head`` (tests/conftest.py) under this folder's short name."""
    return random_head


@pytest.fixture(scope="session")
def plain_engine(micro_target: Path) -> Iterator[wb.Engine]:
    e = make_engine(micro_target, None, kit.CONFIG)
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
