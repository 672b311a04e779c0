"""A micro engine (target + briefly trained EAGLE-3 head) and its traces, shared by the viz
tests. Everything runs on the CPU in seconds."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

import workbench as wb
from workbench.trace.tracer import RecordingTracer

pytest.importorskip("plotly")
pytest.importorskip("ipywidgets")

PROMPTS = ("def fnmatch(name, pat):", "def S_ISDIR(mode):", "import os\n")


@pytest.fixture(scope="session")
def micro_head(micro_target: Path, tiny_corpus: Path,
               tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A head trained 60 steps with the training-time test (~2 s): drafts get accepted."""
    from workbench.train.eagle3 import DraftTrainConfig, train_draft

    root = tmp_path_factory.mktemp("viz_head")
    train_draft(DraftTrainConfig(
        target=str(micro_target), out=str(root / "head"), work=str(root / "work"),
        corpus=str(tiny_corpus), draft_vocab_size=128, steps=60, batch=4, seq_len=48, lr=3e-3,
        warmup=5, ttt_steps=5, regenerate=False, eval_batches=2, ckpt_every=30, threads=1))
    return root / "head"


@pytest.fixture(scope="session")
def engine(micro_target: Path, micro_head: Path) -> Iterator[wb.Engine]:
    e = wb.Engine.from_pretrained(micro_target, draft=micro_head,
                                  config=wb.EngineConfig(kv_budget_tokens=4096))
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
