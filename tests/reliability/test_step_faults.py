"""Run-time faults: bad logits, a fault in every step phase, raising hooks, KV exhaustion and
aborts at every point of a step. The engine never crashes, never leaks KV, never hangs, and
every request it did not fail produces exactly the target's greedy output.

Step-fault policy (``Engine.step`` docstring): the exception propagates out of ``step`` — never
swallowed — after every request running in that step was failed (``finish_reason="error"``,
``error`` naming the fault) and its KV freed; waiting and later requests are unaffected.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from helpers import id_prompts, make_engine
from reliability import kit

import workbench as wb
from workbench.trace import events as ev
from workbench.trace.tracer import HookError, HookFailed

Reference = Callable[[list[int], int], list[int]]
PHASES = ("schedule", "prefill", "draft", "verify", "accept", "commit", "extend", "sampler")


@pytest.fixture(scope="module")
def spec_engine(micro_target: Path, head: Path) -> Iterator[wb.Engine]:
    e = make_engine(micro_target, head, kit.CONFIG, max_batch_size=2)
    yield e
    e.close()


@pytest.fixture(autouse=True)
def _reset(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "spec_engine" in request.fixturenames:
        e = request.getfixturevalue("spec_engine")
        for h in list(e.hooks._hooks.values()):
            e.hooks.unregister(h.handle)
        e.set_spec(None)


def test_nan_logits_in_a_speculative_step_fail_that_request_only(spec_engine: wb.Engine,
                                                                 reference: Reference) -> None:
    e = spec_engine
    e.set_spec(kit.SPEC)
    ps = id_prompts(2, seed=11, lo=4)
    a, b = (e.add_request(p, kit.greedy(10)) for p in ps)
    while e.requests[a].in_prefill or e.requests[b].in_prefill:
        e.step()
    verify_before = e.output(b).metrics.verify_ct
    with wb.faults.inject(f"step:nan_logits@{b}"):
        outs = {o.rid: o for o in e.step()}
    assert outs[b].finished and outs[b].finish_reason == "error"
    assert "non-finite logits" in outs[b].error
    assert e.output(b).metrics.verify_ct == verify_before, "a failed verify is not recorded"
    kit.drain(e)
    assert e.output(a).token_ids == reference(ps[0], 10)
    assert e.output(a).metrics.verify_ct > 0, "request a did speculate"
    assert kit.kv_used(e) == 0


@pytest.mark.parametrize("phase", PHASES)
def test_fault_in_each_step_phase_fails_that_step_and_the_engine_keeps_serving(
        phase: str, spec_engine: wb.Engine, reference: Reference) -> None:
    e = spec_engine
    e.set_spec(None if phase == "sampler" else kit.SPEC)  # the sampler runs in plain steps
    ps = id_prompts(4, seed=PHASES.index(phase), lo=4)
    a, b, c = (e.add_request(p, kit.greedy(8)) for p in ps[:3])  # max_batch_size 2: c waits
    if phase != "prefill":
        e.step()  # prefill (+ warm draft extend)
        assert e.num_running() == 2 and e.num_waiting() == 1
    with wb.faults.inject(f"step:{phase}"), \
            pytest.raises(wb.faults.InjectedFault, match=f"step:{phase}") as ei:
        e.step()
    if sys.version_info >= (3, 11):
        assert any(f"requests [{a}, {b}] were failed" in n for n in ei.value.__notes__)
    for rid in (a, b):
        out = e.output(rid)
        assert out.finish_reason == "error" and f"injected fault at step:{phase}" in out.error
    assert e.num_running() == 0 and e.num_waiting() == 1 and kit.kv_used(e) == 0
    d = e.add_request(ps[3], kit.greedy(8))
    kit.drain(e)
    assert e.output(c).token_ids == reference(ps[2], 8)
    assert e.output(d).token_ids == reference(ps[3], 8)
    assert kit.kv_used(e) == 0


def test_generate_after_a_step_fault_leaves_nothing_behind(spec_engine: wb.Engine,
                                                           reference: Reference) -> None:
    e = spec_engine
    ps = id_prompts(3, seed=5, lo=4)
    with wb.faults.inject("step:verify"), pytest.raises(wb.faults.InjectedFault):
        e.generate(ps, kit.greedy(6), spec=kit.SPEC)
    assert not e.has_unfinished() and kit.kv_used(e) == 0 and e.spec is None
    out = e.generate(ps, kit.greedy(6), spec=kit.SPEC)
    assert [o.token_ids for o in out] == [reference(p, 6) for p in ps]


def test_raising_hook_is_isolated_and_outputs_are_unchanged(spec_engine: wb.Engine,
                                                            reference: Reference) -> None:
    e = spec_engine
    ps = id_prompts(3, seed=7, lo=4)

    def boom(event: ev.Event) -> None:
        raise ValueError("hook bug")

    h = e.hooks.register(boom, [ev.DraftStep])
    with pytest.warns(HookError, match="hook bug"):
        out = e.generate(ps, kit.greedy(8), spec=kit.SPEC)
    assert h not in e.hooks, "a raising hook is unregistered"
    assert e.hooks.errors[-1][1:] == ("DraftStep", "ValueError('hook bug')")
    assert [o.token_ids for o in out] == [reference(p, 8) for p in ps]
    assert kit.kv_used(e) == 0


def test_fatal_hook_is_a_step_fault(spec_engine: wb.Engine, reference: Reference) -> None:
    e = spec_engine
    ps = id_prompts(2, seed=8, lo=4)

    def boom(event: ev.Event) -> None:
        raise ValueError("fatal hook")

    e.hooks.register(boom, [ev.Verified], fatal=True)
    with pytest.raises(HookFailed, match="fatal hook"):
        e.generate(ps, kit.greedy(8), spec=kit.SPEC)
    assert not e.has_unfinished() and kit.kv_used(e) == 0
    out = e.generate(ps, kit.greedy(8), spec=kit.SPEC)  # the hook unregistered itself
    assert [o.token_ids for o in out] == [reference(p, 8) for p in ps]


def test_kv_exhaustion_with_spec_preempts_never_crashes(micro_target: Path, head: Path,
                                                        reference: Reference) -> None:
    e = make_engine(micro_target, head, kit.CONFIG, kv_budget_tokens=96, page_size=8,
                    max_prefill_tokens=32)
    try:
        e.set_spec(kit.SPEC)
        ps = id_prompts(8, seed=3, lo=10, hi=30)
        rids = [e.add_request(p, kit.greedy(16)) for p in ps]
        kit.drain(e)
        outs = [e.output(r) for r in rids]
        assert [o.token_ids for o in outs] == [reference(p, 16) for p in ps]
        assert sum(o.metrics.preemptions for o in outs) > 0, "pool was meant to be too small"
        assert kit.kv_used(e) == 0
    finally:
        e.close()


def test_a_request_larger_than_the_pool_finishes_instead_of_waiting_forever(
        micro_target: Path, head: Path, reference: Reference) -> None:
    """64-token pool, 50-token prompt, 30 new tokens: the context is capped at the pool."""
    e = make_engine(micro_target, head, kit.CONFIG, kv_budget_tokens=64, page_size=8)
    try:
        assert e.max_model_len == 64
        for spec in (None, kit.SPEC):
            e.set_spec(spec)
            p = list(range(1, 51))
            rid = e.add_request(p, kit.greedy(30))
            kit.drain(e, max_steps=100)
            out = e.output(rid)
            assert out.finish_reason == "length" and len(p) + len(out.token_ids) == 64
            assert out.token_ids == reference(p, 30)[: len(out.token_ids)]
            assert kit.kv_used(e) == 0
        with pytest.raises(wb.RequestError, match="does not fit the context"):
            e.add_request(list(range(1, 65)))
    finally:
        e.close()


ABORT_EVENTS = (ev.RequestAdmitted, ev.Prefill, ev.DraftExtended, ev.DraftStep, ev.TreeBuilt,
                ev.Verified, ev.RequestFinished, ev.PolicyDecision, ev.StepTiming, ev.KVUsage)


@pytest.mark.parametrize("event", ABORT_EVENTS, ids=lambda c: c.__name__)
def test_abort_from_a_hook_at_every_phase(event: type[ev.Event], spec_engine: wb.Engine,
                                          reference: Reference) -> None:
    """A hook aborts another request (and, on its next call, the request the event is about):
    no crash, no hang, aborted requests say so, the others are exact, KV back to 0."""
    e = spec_engine
    e.set_spec(kit.SPEC)
    ps = id_prompts(4, seed=21, lo=4)
    rids: list[int] = []
    aborted: list[int] = []

    def abort_someone(x: ev.Event) -> None:
        own = getattr(x, "rid", None)
        if own is None:
            own = (getattr(x, "rids", None) or [None])[0]
        if len(aborted) == 0 and len(rids) >= 2:
            victim = next((r for r in reversed(rids) if r != own
                           and not e.requests[r].finished), None)
        elif len(aborted) == 1 and own is not None and not e.requests[own].finished:
            victim = own
        else:
            return
        if victim is not None:
            aborted.append(victim)
            e.abort(victim)

    e.hooks.register(abort_someone, [event])
    with warnings.catch_warnings():
        warnings.simplefilter("error", HookError)  # the hook itself must not have raised
        rids.extend(e.add_request(p, kit.greedy(10)) for p in ps)
        kit.drain(e)
    assert aborted, f"no {event.__name__} event came"
    for r, p in zip(rids, ps, strict=True):
        out = e.output(r)
        want = reference(p, 10)
        if r in aborted and out.finish_reason == "abort":
            assert out.token_ids == want[: len(out.token_ids)]
        else:
            assert out.token_ids == want and out.finish_reason == "length", (r, out)
    assert kit.kv_used(e) == 0


def test_generate_returns_when_a_hook_aborts_its_requests(spec_engine: wb.Engine) -> None:
    e = spec_engine
    e.hooks.register(lambda x: e.abort(x.rid), [ev.RequestAdmitted])
    outs = e.generate(id_prompts(3, seed=2), kit.greedy(5), spec=kit.SPEC)
    assert [o.finish_reason for o in outs] == ["abort"] * 3 and kit.kv_used(e) == 0


def test_abort_between_steps_at_every_point(spec_engine: wb.Engine,
                                            reference: Reference) -> None:
    e = spec_engine
    e.set_spec(kit.SPEC)
    ps = id_prompts(3, seed=31, lo=4)
    for k in range(8):  # abort request 1 after k steps: waiting, prefill, decode, finished
        rids = [e.add_request(p, kit.greedy(8)) for p in ps]
        for _ in range(k):
            e.step()
        e.abort(rids[1])
        e.abort(rids[1])  # twice is harmless
        kit.drain(e)
        for i, r in enumerate(rids):
            out = e.output(r)
            want = reference(ps[i], 8)
            if i == 1 and out.finish_reason == "abort":
                assert out.token_ids == want[: len(out.token_ids)]
            else:
                assert out.token_ids == want, (k, i)
        assert kit.kv_used(e) == 0
