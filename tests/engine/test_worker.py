"""The EagleWorker: the policy's view of a step (decode batch, a last token decoded plainly)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import workbench as wb
from workbench.policy.policies import (
    Always,
    Decision,
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
    e = wb.Engine.from_pretrained(micro_target, draft=random_head,
                                  config=wb.EngineConfig(kv_budget_tokens=8192,
                                                         max_prefill_tokens=8))
    yield e
    e.close()


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
