"""The EagleWorker (engine/worker.py): the policy's view of a step, the extend rule, riders in the
verify forward, and the phases (timed, with their fault points, by one context manager)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import small_engine

import workbench as wb
from workbench import faults
from workbench.engine.worker import phase
from workbench.policy.policies import (
    Always,
    Decision,
    Never,
    PolicyContext,
)


class Spy:
    """Records every PolicyContext; speculates always."""

    def __init__(self) -> None:
        self.contexts: list[PolicyContext] = []

    def decide(self, c: PolicyContext) -> Decision:
        self.contexts.append(c)
        return Always().decide(c)

    def observe(self, decision: Decision, measured_ms: float, accepted: list[int]) -> None:
        pass


@pytest.fixture(scope="module")
def engine(micro_target: Path, random_head: Path) -> Iterator[wb.Engine]:
    yield from small_engine(micro_target, random_head)


def test_prefill_requests_not_counted(engine: wb.Engine) -> None:
    spy = Spy()
    engine.set_spec(wb.SpecConfig(num_steps=2, topk=2, num_draft_tokens=4, policy=spy))
    sp = wb.SamplingParams(max_new_tokens=30, ignore_eos=True)
    try:
        a = engine.add_request([5, 6, 7], sp)
        engine.step()  # a prefills (3 tokens) and samples its first token
        b = engine.add_request(list(range(1, 41)), sp)  # 40 tokens: 5 chunks of 8
        seen = []
        while engine.requests[b].in_prefill:
            engine.step()
            seen.append(spy.contexts[-1].decode_batch)
        assert len(seen) == 5 and seen == [1] * 5  # b never counted while prefilling
        engine.step()
        assert spy.contexts[-1].decode_batch == 2
        engine.abort(a)
        engine.abort(b)
    finally:
        engine.set_spec(None)
    assert engine.kv_usage()["used_blocks"] == 0


def test_last_token_decodes_plainly_and_policy_is_told(engine: wb.Engine) -> None:
    """A request with one token left cannot gain from a draft: it decodes plainly even when
    the policy says speculate, and the policy observes a plain decision for that step (its
    cost model must not learn a plain step's time as a speculative one)."""
    seen: list[tuple[bool, str, int]] = []

    class Recorder:
        def decide(self, ctx: Any) -> Decision:
            return Decision(True, num_steps=2, topk=2, num_draft_tokens=4, reason="on")

        def observe(self, d: Decision, ms: float, accepted: list[int]) -> None:
            seen.append((d.speculate, d.reason, len(accepted)))

    spec = wb.SpecConfig(num_steps=2, topk=2, num_draft_tokens=4, policy=Recorder())
    sp = wb.SamplingParams(max_new_tokens=4, ignore_eos=True)
    out = engine.generate([[5, 6, 7, 8, 9]], sp, spec=spec)[0]
    assert len(out.token_ids) == 4
    # random head: every verify accepts nothing, so steps emit 1 token: prefill gives token 1,
    # two verifies tokens 2-3, and the last token is a plain step the policy hears as plain
    assert seen[:-1] == [(True, "on", 1)] * (len(seen) - 1) and len(seen) == 3
    assert seen[-1] == (False, "on; ran plain", 0)
    assert out.metrics.plain_steps == 1


# -- phases ---------------------------------------------------------------------------------
def test_phase_times_and_checks_its_fault_point() -> None:
    phases: dict[str, float] = {"commit": 1.0}
    with phase(phases, "commit"):
        pass
    assert phases["commit"] > 1.0  # added to what the step already spent there
    with faults.inject("step:verify"), pytest.raises(faults.InjectedFault):
        with phase(phases, "verify", fault="verify"):
            raise AssertionError("the fault point fires before the block")
    assert "verify" not in phases  # a phase that raises records nothing
    with pytest.raises(ValueError), phase(phases, "accept"):
        raise ValueError("the step fails")
    assert "accept" not in phases


def test_a_speculative_step_reports_its_phases(engine: wb.Engine) -> None:
    spec = wb.SpecConfig(num_steps=2, topk=2, num_draft_tokens=4)
    with wb.trace(engine, events=["StepTiming"]) as tr:
        engine.generate([[5, 6, 7, 8]], wb.SamplingParams(max_new_tokens=4), spec=spec)
    t = tr.frame("timing")
    spec_steps = t[t["mode"] == "spec"]
    assert len(spec_steps) > 0
    for col in ("draft_ms", "verify_ms", "accept_ms", "commit_ms", "extend_ms"):
        assert (spec_steps[col] > 0).all(), col


# -- the extend rule ------------------------------------------------------------------------
@pytest.mark.parametrize("state", ["warm", "cold"])
def test_plain_steps_extend_the_draft_per_draft_state(engine: wb.Engine, state: str) -> None:
    """warm: the draft reads every plain step's token (its length follows kv_len); cold: it
    does not until speculation comes back, then one catch-up extends it."""
    off = wb.SpecConfig(num_steps=2, topk=2, num_draft_tokens=4, policy=Never(),
                        draft_state=state)
    sp = wb.SamplingParams(max_new_tokens=12, ignore_eos=True)
    engine.set_spec(off)
    rid = engine.add_request([5, 6, 7, 8, 9], sp)
    try:
        for _ in range(4):
            engine.step()
        r = engine.requests[rid]
        if state == "warm":
            assert r.draft.len == r.kv_len
        else:
            assert r.draft.len < r.kv_len and r.draft.pending_rows == r.kv_len - r.draft.len
        engine.set_spec(dataclasses.replace(off, policy=Always()))
        engine.step()  # speculates: catch-up, draft, verify, commit, extend
        assert r.draft.len == r.kv_len and r.draft.pending_rows == 0
    finally:
        engine.abort(rid)
        engine.set_spec(None)
    assert engine.kv_usage()["used_blocks"] == 0


# -- riders ---------------------------------------------------------------------------------
def test_riders_join_the_verify_forward(engine: wb.Engine,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode request that cannot speculate (one token left) rides in the speculating
    requests' verify forward: one target forward for the step, not two; its output is the
    one it gets alone."""
    spec = wb.SpecConfig(num_steps=2, topk=2, num_draft_tokens=4)
    sp_long = wb.SamplingParams(max_new_tokens=8, ignore_eos=True)
    sp_short = wb.SamplingParams(max_new_tokens=2, ignore_eos=True)
    alone = engine.generate([[9, 8, 7]], sp_short, spec=spec)[0].token_ids
    runner = engine.runner
    forward = runner.forward
    calls: list[int] = []

    def count(batch: Any) -> Any:
        calls.append(len(batch.reqs))
        return forward(batch)

    assert engine.worker.plain_in_verify  # CPU: riders on
    engine.set_spec(spec)
    a = engine.add_request([5, 6, 7, 8], sp_long)
    b = engine.add_request([9, 8, 7], sp_short)
    try:
        engine.step()  # prefill both (each samples its first token)
        monkeypatch.setattr(runner, "forward", count)
        engine.step()  # a speculates; b has one token left: it rides
        assert calls == [2]  # one forward over a's tree and b's row
        monkeypatch.undo()
        while engine.has_unfinished():
            engine.step()
        assert engine.output(b).token_ids == alone
    finally:
        engine.abort(a)
        engine.abort(b)
        engine.set_spec(None)

