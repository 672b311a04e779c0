"""Byte budgets for the caches a client's request can fill (issue 53): the ``stop_regex``
programs, the stop-string automata and the regex matchers stay within their budgets however
many fresh keys clients send (an entry count alone let 1,280 fresh patterns add 80 MB)."""
from __future__ import annotations

import pytest

from workbench.engine import stops
from workbench.errors import RequestError
from workbench.stop_regex import (
    MAX_PROGRAM_BYTES,
    PROGRAM_CACHE_BYTES,
    BudgetCache,
    compile_pattern,
)


def test_fresh_patterns_stay_within_the_program_budget() -> None:
    for i in range(1280):
        compile_pattern(f"q{i}[a-z]{{2,40}}(x|y)+z")
    assert compile_pattern.nbytes <= PROGRAM_CACHE_BYTES
    assert len(compile_pattern) == PROGRAM_CACHE_BYTES // MAX_PROGRAM_BYTES
    assert compile_pattern("q1279[a-z]{2,40}(x|y)+z") is compile_pattern("q1279[a-z]{2,40}(x|y)+z")


def test_fresh_stop_sets_stay_within_their_budgets() -> None:
    for i in range(300):
        stops.stop_strings(tuple(f"{i}-{j}-" + "w" * 200 for j in range(20)))
        stops.stop_regexes((f"a{i}b+", f"c{i}d+"))
    assert stops.stop_strings.nbytes <= stops.STOP_CACHE_BYTES
    assert stops.stop_regexes.nbytes <= PROGRAM_CACHE_BYTES


def test_the_budget_cache_is_lru_by_bytes_and_never_caches_errors() -> None:
    built: list[str] = []

    def build(k: str) -> str:
        built.append(k)
        if k == "bad":
            raise RequestError("bad key")
        return k.upper()

    c: BudgetCache[str, str] = BudgetCache(build, len, budget=6)
    assert c("aa") == "AA" and c("bbb") == "BBB" and c("aa") == "AA"  # a hit
    assert built == ["aa", "bbb"] and c.nbytes == 5
    c("cc")  # over budget: the least recently used ("bbb") goes
    assert c.nbytes == 4 and len(c) == 2
    c("bbb")
    assert built[-1] == "bbb"
    assert c("toolongkey") == "TOOLONGKEY" and "toolongkey" not in c._entries  # never kept
    for _ in range(2):
        with pytest.raises(RequestError):
            c("bad")
    assert built.count("bad") == 2
