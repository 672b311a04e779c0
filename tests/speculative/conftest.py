"""Micro EAGLE-3 heads for the micro target."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

import workbench as wb
from workbench.models.synthetic import write_random_head

__all__ = ["write_random_head"]  # imported by other tests


@pytest.fixture(scope="session")
def trained_head(micro_target: Path, tiny_corpus: Path,
                 tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A micro head trained for a few seconds (acceptance well above zero)."""
    from workbench.train.eagle3 import DraftTrainConfig, train_draft

    root = tmp_path_factory.mktemp("trained_head")
    train_draft(DraftTrainConfig(target=str(micro_target), out=str(root / "head"),
                                 work=str(root / "work"), corpus=str(tiny_corpus),
                                 **MICRO_DRAFT_TRAINING))
    return root / "head"


@pytest.fixture(scope="module")
def engine(micro_target: Path, trained_head: Path) -> Iterator[wb.Engine]:
    """The micro target with the trained head (a module's own ``engine`` fixture overrides it)."""
    e = wb.Engine.from_pretrained(micro_target, draft=trained_head,
                                  config=wb.EngineConfig(kv_budget_tokens=8192))
    yield e
    e.close()


# Seconds on one core; regenerated (target-greedy) data makes acceptance clearly non-zero.
MICRO_DRAFT_TRAINING: dict = dict(
    draft_vocab_size=128, steps=80, batch=4, seq_len=48, lr=3e-3, warmup=5, ttt_steps=5,
    regenerate=True, regen_sequences=16, regen_prompt_len=16, regen_batch=16, eval_batches=2,
    ckpt_every=40, threads=1)
