"""The ModelRunner (engine/runner.py): ForwardBatch building, every forward, the StepGraphs seam.

Scratch requests hold their own KV blocks (released at the end); the micro target with a random
head on CPU."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import workbench as wb
from workbench.core import DraftTree, Request
from workbench.engine.runner import ForwardBatch, ModelRunner


@pytest.fixture(scope="module")
def engine(micro_target: Path, random_head: Path) -> Iterator[wb.Engine]:
    e = wb.Engine.from_pretrained(micro_target, draft=random_head,
                                  config=wb.EngineConfig(kv_budget_tokens=2048, compile="off"))
    yield e
    e.close()


def scratch(runner: ModelRunner, tokens: list[int], rid: int = -1) -> Request:
    r = Request(rid=rid, prompt_ids=list(tokens), sampling=wb.SamplingParams())
    assert runner.pool is not None
    runner.pool.reserve(r.blocks, len(tokens) + 16)
    return r


def release(runner: ModelRunner, *reqs: Request) -> None:
    assert runner.pool is not None
    for r in reqs:
        runner.pool.release(r.blocks)


def test_forward_batch_lengths() -> None:
    fb = ForwardBatch([], [3, 10], [5, 11], torch.arange(3), torch.arange(3))
    assert fb.q_lens == [2, 1] and fb.num_tokens == 3


def test_chunked_prefill_then_decode_equals_one_prefill(engine: wb.Engine) -> None:
    """KV written by one forward is what the next attends to: two chunks and a decode row give
    the hidden state one forward over the whole sequence gives."""
    runner = engine.runner
    toks = [5, 17, 33, 2, 90, 41, 8, 77]
    a, b = scratch(runner, toks, -1), scratch(runner, toks, -2)
    try:
        with torch.inference_mode():
            whole, _ = runner.forward(runner.prefill_batch([(a, 0, 8)], want_aux=False))
            runner.forward(runner.prefill_batch([(b, 0, 5)], want_aux=False))
            runner.forward(runner.prefill_batch([(b, 5, 7)], want_aux=False))
            b.kv_len = 7  # decode: the root (the last token) at position kv_len
            last, _ = runner.forward(runner.decode_batch([b], want_aux=False))
        torch.testing.assert_close(last[0], whole[7], rtol=1e-4, atol=1e-4)
    finally:
        release(runner, a, b)


def test_verify_batch_puts_riders_after_the_trees(engine: wb.Engine) -> None:
    runner = engine.runner
    s, r = scratch(runner, [5, 6, 7], -1), scratch(runner, [8, 9, 10, 11], -2)
    s.kv_len, r.kv_len = 2, 3
    n = 4
    tree = DraftTree(tokens=torch.tensor([[7, 1, 2, 3]]), parents=torch.tensor([[-1, 0, 0, 1]]),
                     depth=torch.tensor([[0, 1, 1, 2]]), positions=torch.tensor([[2, 3, 3, 4]]),
                     mask=torch.ones(1, n, n).bool(), scores=torch.zeros(1, n),
                     draft_probs=torch.ones(1, n))
    try:
        fb = runner.verify_batch([s], tree, ride=[r])
        assert fb.reqs == [s, r] and fb.starts == [2, 3] and fb.ends == [2 + n, 4]
        assert fb.tokens.tolist() == [7, 1, 2, 3, 11] and fb.positions.tolist() == [2, 3, 3, 4, 3]
        assert fb.tree_masks is not None and fb.tree_masks[1] is None and fb.want_aux
    finally:
        release(runner, s, r)


class Graphs:
    """A StepGraphs stand-in: serves one-row forwards, says None to the rest."""

    def __init__(self) -> None:
        self.runs, self.closed = 0, False

    def run(self, tokens: torch.Tensor, positions: torch.Tensor, write_slots: torch.Tensor,
            q_lens: list[int], kv_slots: list[torch.Tensor],
            tree_masks: list[torch.Tensor | None] | None = None, want_aux: bool = False
            ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        if q_lens != [1]:
            return None
        self.runs += 1
        return torch.full((1, 4), 7.0), None

    def close(self) -> None:
        self.closed = True


def test_step_graphs_serve_what_they_can_and_close_with_the_runner(micro_target: Path) -> None:
    e = wb.Engine.from_pretrained(micro_target, config=wb.EngineConfig(kv_budget_tokens=512,
                                                                       compile="off"))
    g = Graphs()
    e.runner.graphs = g
    r = scratch(e.runner, [5, 6, 7])
    try:
        with torch.inference_mode():
            h, _ = e.runner.forward(e.runner.prefill_batch([(r, 0, 3)], want_aux=False))
            assert h.shape[0] == 3 and g.runs == 0  # a 3-row chunk: eager
            r.kv_len = 2
            h, _ = e.runner.forward(e.runner.decode_batch([r], want_aux=False))
            assert g.runs == 1 and bool((h == 7.0).all())  # one row: the graphs' answer
    finally:
        release(e.runner, r)
    e.close()
    assert g.closed and e.runner.graphs is None and e.runner.pool is None


def test_draft_slots_leave_the_holes_out(engine: wb.Engine) -> None:
    runner = engine.runner
    r = scratch(runner, list(range(1, 11)))
    try:
        r.draft.holes = [(2, 5)]
        assert runner.pool is not None
        full = runner.pool.slots(r.blocks, 0, 8)
        kept = runner.draft_slots(r, 8)
        assert kept.tolist() == full[[0, 1, 5, 6, 7]].tolist()
    finally:
        release(runner, r)
