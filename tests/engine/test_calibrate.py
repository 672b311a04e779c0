"""Calibration (engine/calibrate.py): forwards timed through the runner on scratch KV that is
released, whole steps for the overheads, τ on the workload's prompts; stats restored."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import small_engine

import workbench as wb
from workbench.engine.calibrate import calibrate, measure_tau, time_forward
from workbench.engine.runner import ForwardBatch


@pytest.fixture(scope="module")
def engine(micro_target: Path, random_head: Path) -> Iterator[wb.Engine]:
    yield from small_engine(micro_target, random_head)


def test_calibrate_leaves_no_kv(engine: wb.Engine) -> None:
    steps_before = dict(engine.stats.steps)
    cm = calibrate(engine, batch_sizes=(1, 2, 4), repeats=1, shape=(3, 2, 6), step_tokens=4)
    assert engine.kv_usage()["used_blocks"] == 0
    assert engine.stats.steps == steps_before  # calibration runs do not pollute the stats
    # what the fit says about speed (spec vs plain, batch 4 vs 1) is a measurement: it lives in
    # `bench` and the notebooks; under load a fit may even rank them the other way. Here: a
    # usable model, every step prediction positive and finite.
    for ms in (cm.plain_step_ms(1), cm.spec_step_ms(1, 3, 2, 6),
               cm.spec_step_ms(4, 3, 2, 6)):
        assert 0 < ms < float("inf")


def test_measure_tau_restores_stats_and_frees_kv(engine: wb.Engine) -> None:
    steps_before = dict(engine.stats.steps)
    acc = measure_tau(engine, [[5, 6, 7, 8], [9, 10, 11], [12, 13]], (2, 2, 4),
                      max_new_tokens=6)
    # a random head accepts nothing: every speculating request-step emits the bonus token only
    assert acc.tau == 1.0 and acc.samples > 0 and acc.context > 2
    # the per-depth rates Goodput starts from: depth 1 never accepted, deeper never reached
    assert acc.topk == 2 and acc.rates == (0.0,) and acc.seed() == {2: (0.0,)}
    assert engine.stats.steps == steps_before
    assert engine.kv_usage()["used_blocks"] == 0
    with pytest.raises(wb.ConfigError, match="measure_tau"):
        measure_tau(engine, [], (2, 2, 4))


def test_forwards_are_timed_through_the_runner(engine: wb.Engine,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The cost model times the path the step loop takes: ``runner.forward`` (CUDA graphs and
    compiled steps included) and ``runner.draft_forward``, over scratch requests whose blocks
    come back to the pool."""
    runner = engine.runner
    seen: list[tuple[str, list[int], list[int]]] = []
    forward, draft_forward = runner.forward, runner.draft_forward

    def spy_forward(batch: ForwardBatch):  # type: ignore[no-untyped-def]
        seen.append(("target", batch.starts, batch.q_lens))
        return forward(batch)

    def spy_draft(batch: ForwardBatch, hidden, logit_rows=None):  # type: ignore[no-untyped-def]
        seen.append(("draft", batch.starts, batch.q_lens))
        return draft_forward(batch, hidden, logit_rows)

    monkeypatch.setattr(runner, "forward", spy_forward)
    monkeypatch.setattr(runner, "draft_forward", spy_draft)
    free = len(runner.pool.free)
    assert time_forward(runner, 3, 4, 20, repeats=1, draft=False) > 0
    assert time_forward(runner, 2, 1, 9, repeats=1, draft=True) > 0
    # repeats + 1 runs each (the first pays first-use costs)
    assert seen == [("target", [20] * 3, [4] * 3)] * 2 + [("draft", [9] * 2, [1] * 2)] * 2
    assert len(runner.pool.free) == free

