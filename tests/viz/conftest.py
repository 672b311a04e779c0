"""A micro engine (target + the root trained EAGLE-3 head) and its traces, shared by the viz
tests. Everything runs on the CPU in seconds."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import make_engine

import workbench as wb
from workbench.trace.tracer import RecordingTracer

pytest.importorskip("plotly")
pytest.importorskip("ipywidgets")

PROMPTS = ("def fnmatch(name, pat):", "def S_ISDIR(mode):", "import os\n")


@pytest.fixture(scope="session")
def engine(micro_target: Path, trained_head: Path) -> Iterator[wb.Engine]:
    """The micro target with the root ``trained_head``: drafts get accepted."""
    e = make_engine(micro_target, trained_head, kv_budget_tokens=4096)
    yield e
    e.close()


SPEC = wb.SpecConfig(num_steps=4, topk=3, num_draft_tokens=10)


@pytest.fixture(scope="session")
def traced(engine: wb.Engine) -> tuple[RecordingTracer, list[wb.RequestOutput]]:
    """Three greedy requests of different lengths under EAGLE-3 (S4 K3 N10), traced."""
    sps = [wb.SamplingParams(max_new_tokens=16 * (i + 1), ignore_eos=True) for i in range(3)]
    with wb.trace(engine) as rec:
        outs = engine.generate(list(PROMPTS), sps, spec=SPEC)
    return rec, outs
