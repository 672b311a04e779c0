"""Lossless while the contention monitor flips the thread count between steps: speculative
outputs (a trained head, so paths are accepted and committed) equal the plain baseline."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import workbench as wb
from workbench.engine import contention


@pytest.fixture()
def threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_spec_lossless_while_threads_flip(threads: None, micro_target: Path, trained_head: Path,
                                          machine_conditions: dict[str, float],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    busy = {"now": False}
    monkeypatch.setattr(contention, "PROCESS_THREADS", 2)
    monkeypatch.setattr(contention, "time_threads", lambda passes, cands, budget_s=0.0, pin=None: {
        n: {"p": 1.0 if n == (1 if busy["now"] else max(cands)) else 9.0} for n in cands})
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12, 13], [14, 15]]
    sp = wb.SamplingParams(max_new_tokens=20)
    spec = wb.SpecConfig(num_steps=3, topk=2, num_draft_tokens=6)
    torch.set_num_threads(2)
    with wb.Engine.from_pretrained(micro_target, draft=trained_head,
                                   config=wb.EngineConfig(gemm="onednn")) as e:
        mon = e.contention
        assert mon is not None and mon.default == 2
        mon.enabled = False
        plain = [o.token_ids for o in e.generate(prompts, sp)]
        mon.enabled = True

        def flip(a: contention.Adaptation) -> None:
            busy["now"] = not busy["now"]
            machine_conditions["others"] = 1.2 if busy["now"] else 0.0

        mon.on_change = flip
        busy["now"], machine_conditions["others"] = True, 1.2  # threads 2 on a busy machine
        monkeypatch.setattr(contention, "CHECK_S", 0.0)
        monkeypatch.setattr(contention, "BACKOFF_S", (0.0, 0.0))
        mon._next_check = 0.0
        outs = e.generate(prompts, sp, spec=spec)
        assert [o.token_ids for o in outs] == plain
        assert sum(o.metrics.accept_length for o in outs) / len(outs) > 1.0  # drafts accepted
        moves = [(a.before, a.after) for a in mon.log]
        assert (2, 1) in moves and (1, 2) in moves and len(moves) >= 4
