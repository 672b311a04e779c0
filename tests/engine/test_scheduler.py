"""Scheduler: admission by batch size and KV budget, chunked prefill, decode room with
preemption of the newest requests, finish — and no leaked KV blocks."""

from __future__ import annotations

import random

import torch

from workbench.config import SamplingParams
from workbench.core import Request, Status
from workbench.engine.kv_cache import KVPool
from workbench.engine.scheduler import DecodePlan, Scheduler
from workbench.policy.policies import Decision

PAGE = 4


def make(blocks: int = 16, batch: int = 4, prefill: int = 64) -> Scheduler:
    pool = KVPool(blocks, PAGE, layers=1, kv_heads=1, head_dim=2, dtype=torch.float32,
                  device="cpu")
    return Scheduler(pool, max_batch_size=batch, max_prefill_tokens=prefill)


def req(rid: int, prompt_len: int) -> Request:
    return Request(rid=rid, prompt_ids=list(range(1, prompt_len + 1)), sampling=SamplingParams())


def run_prefill(s: Scheduler) -> list[tuple[int, int, int]]:
    """One schedule; the engine's part: prefill advances kv_len, the last chunk samples."""
    chunks = s.schedule().prefill
    for r, _, end in chunks:
        r.kv_len = end
        if not r.in_prefill and r.sample_after_prefill:
            r.tokens.append(0)
    return [(r.rid, start, end) for r, start, end in chunks]


def decode(r: Request, n: int = 1) -> None:
    """A decode step that kept ``n`` tokens: kv_len stays len(tokens) − 1."""
    r.tokens.extend([0] * n)
    r.kv_len += n


def held(s: Scheduler) -> list[int]:
    return sorted(s.pool.free + [b for r in s.running for b in r.blocks])


def test_admission_in_arrival_order_up_to_max_batch() -> None:
    s = make(batch=2)
    rs = [req(i, 4) for i in range(3)]
    for r in rs:
        s.add(r)
    sched = s.schedule()
    assert s.running == rs[:2] and list(s.waiting) == rs[2:]
    assert [r.status for r in rs] == [Status.RUNNING, Status.RUNNING, Status.WAITING]
    assert [(r.rid, a, b) for r, a, b in sched.prefill] == [(0, 0, 4), (1, 0, 4)]
    assert sched.decode == []
    # admission reserves the whole prompt + 1 (the first decode): 5 positions = two pages
    assert [len(r.blocks) for r in rs] == [2, 2, 0]


def test_admission_stops_at_the_first_request_that_does_not_fit() -> None:
    """Head-of-line: a request that does not fit waits, and a later one that would fit does
    not jump it (arrival order is kept; no starvation of big prompts)."""
    s = make(blocks=4)
    a, big, small = req(0, 6), req(1, 10), req(2, 3)
    s.add(a)
    run_prefill(s)  # 7 positions: 2 blocks, 2 free
    s.add(big)  # 11 positions: 3 blocks
    s.add(small)  # 4 positions: 1 block — would fit
    assert s.schedule().prefill == []
    assert list(s.waiting) == [big, small] and big.blocks == small.blocks == []
    s.finish(a)
    assert [rid for rid, _, _ in run_prefill(s)] == [1, 2]
    assert s.pool.free == []


def test_chunked_prefill_shares_the_token_budget_in_admission_order() -> None:
    s = make(blocks=32, prefill=10)
    a, b, c = req(0, 7), req(1, 9), req(2, 2)
    for r in (a, b, c):
        s.add(r)
    assert run_prefill(s) == [(0, 0, 7), (1, 0, 3)]  # c gets nothing this step
    assert run_prefill(s) == [(1, 3, 9), (2, 0, 2)]
    assert not any(r.in_prefill for r in (a, b, c))
    sched = s.schedule()
    assert sched.prefill == [] and sched.decode == [a, b, c]
    assert [len(r.tokens) for r in (a, b, c)] == [8, 10, 3]  # each sampled its first token


def test_a_prefilling_request_is_not_in_the_decode_list() -> None:
    s = make(prefill=4)
    a, b = req(0, 2), req(1, 10)
    s.add(a)
    run_prefill(s)
    s.add(b)
    sched = s.schedule()
    assert [(r.rid, x, y) for r, x, y in sched.prefill] == [(1, 0, 4)]
    assert sched.decode == [a]


def test_decode_room_reserves_the_lookahead() -> None:
    s = make()
    a = req(0, 3)
    s.add(a)
    run_prefill(s)
    assert a.kv_len == 3 and len(a.blocks) == 1
    assert s.ensure_decode_room([a], 6) == [a]  # a 6-node tree at positions [3, 9): 3 pages
    assert len(a.blocks) == 3
    decode(a, 2)  # two tokens accepted; the engine trims the rejected lookahead
    s.pool.trim(a.blocks, a.kv_len + 1)
    assert len(a.blocks) == 2 and a.kv_len == 5


def test_preemption_takes_the_newest_first_and_requeues_at_the_front() -> None:
    s = make(blocks=6)
    rs = [req(i, 7) for i in range(3)]  # 8 positions each: 2 blocks each, pool full
    for r in rs:
        s.add(r)
    run_prefill(s)
    late = req(9, 1)
    s.add(late)
    assert s.pool.free == []
    kept = s.ensure_decode_room(rs, 4)  # each needs 7 + 4 = 11 positions: 3 blocks
    assert kept == [rs[0], rs[1]]
    assert s.running == [rs[0], rs[1]] and list(s.waiting) == [rs[2], late]
    victim = rs[2]
    assert victim.status is Status.WAITING and victim.blocks == [] and victim.kv_len == 0
    assert victim.metrics.preemptions == 1
    # it had sampled a token after prefill: recompute the prompt + that token, minus the
    # root, and do not sample again at the end of the re-prefill
    assert victim.prefill_target == len(victim.tokens) - 1 == 7
    assert victim.sample_after_prefill is False
    assert [len(r.blocks) for r in kept] == [3, 3]
    assert held(s) == list(range(6))


def test_preempting_a_request_earlier_in_the_batch_keeps_the_rest() -> None:
    """The newest request may sit before the one that needs room in the decode list: it is
    dropped from the batch and the remaining requests still get their room."""
    s = make(blocks=7)
    a, b, c = req(0, 7), req(1, 7), req(2, 7)
    for r in (a, b, c):
        s.add(r)
    run_prefill(s)  # 2 blocks each, 1 free
    kept = s.ensure_decode_room([c, a, b], 4)  # c (newest) first: it takes the free block
    # a then needs a block: c is the newest other running request, so c is preempted even
    # though it already got its room; b then finds c's blocks
    assert kept == [a, b]
    assert c.status is Status.WAITING and list(s.waiting) == [c]
    assert [len(r.blocks) for r in (a, b)] == [3, 3]
    assert held(s) == list(range(7))


def test_without_anything_to_preempt_the_step_runs_with_fewer() -> None:
    s = make(blocks=2)
    a = req(0, 7)
    s.add(a)
    run_prefill(s)
    assert s.ensure_decode_room([a], 4) == []  # needs 3 blocks, alone in a 2-block pool
    assert a.status is Status.RUNNING and len(a.blocks) == 2


def test_requests_preempted_by_another_batch_no_longer_decode() -> None:
    s = make(blocks=6)
    a, b = req(0, 7), req(1, 7)
    s.add(a)
    s.add(b)
    run_prefill(s)
    s.preempt(b)
    assert s.ensure_decode_room([a, b], 1) == [a]


def test_preempted_request_without_output_samples_again_after_prefill() -> None:
    s = make(blocks=8, prefill=4)
    a, b = req(0, 3), req(1, 10)
    s.add(a)
    s.add(b)
    run_prefill(s)  # b half-prefilled
    assert b.in_prefill and len(b.tokens) == 10
    s.preempt(b)
    assert b.prefill_target == 10 and b.sample_after_prefill is True and b.kv_len == 0


def test_finish_releases_everything_and_drops_draft_state() -> None:
    s = make()
    a, b, w = req(0, 5), req(1, 5), req(2, 5)
    for r in (a, b):
        s.add(r)
    run_prefill(s)
    a.draft.logits = torch.zeros(3)
    a.draft.holes = [(0, 2)]
    s.add(w)
    s.finish(a)
    s.finish(w)  # a waiting request (aborted before admission)
    assert a.status is Status.FINISHED and a.blocks == [] and a.draft.logits is None
    assert a.draft.holes == [] and w.status is Status.FINISHED
    assert s.running == [b] and not s.waiting
    s.finish(b)
    assert not s.has_work() and s.pool.used_blocks == 0


def test_random_workload_never_leaks_blocks() -> None:
    """Arrivals, chunked prefill, speculative decode room, preemptions and finishes in random
    order: blocks are always free or held by exactly one running request, and all come back."""
    rng = random.Random(1)
    s = make(blocks=24, batch=5, prefill=16)
    rid = 0
    for _ in range(400):
        if rng.random() < 0.3:
            s.add(req(rid, rng.randrange(1, 30)))
            rid += 1
        run_prefill(s)
        decoding = [r for r in s.running if not r.in_prefill]
        look = rng.choice([1, 4, 8])
        for r in s.ensure_decode_room(decoding, look):
            decode(r, rng.randrange(1, look + 1))
            s.pool.trim(r.blocks, r.kv_len + 1)
        for r in list(s.running):
            if len(r.tokens) > 40 or rng.random() < 0.05:
                s.finish(r)
        assert held(s) == list(range(24))
        assert all(r.blocks == [] for r in s.waiting)
        assert len(s.running) <= 5
    for r in list(s.running) + list(s.waiting):
        s.finish(r)
    assert s.pool.used_blocks == 0 and not s.has_work()


def test_a_held_request_leaves_decode_batches_and_batch_slots_but_keeps_its_kv() -> None:
    """Backpressure (Request.held): a held request is skipped when the decode batch is planned
    and takes no batch slot (a waiting request is admitted beside it), keeps its KV, its
    place and its tokens, and decodes again once released; the decode batch never exceeds
    max_batch_size (a released request beyond it waits a step)."""
    s = make(blocks=32, batch=2)
    a, b, c = req(0, 4), req(1, 4), req(2, 4)
    for r in (a, b, c):
        s.add(r)
    run_prefill(s)
    assert s.schedule().decode == [a, b] and list(s.waiting) == [c]
    a.held = True
    blocks, kv, tokens = list(a.blocks), a.kv_len, list(a.tokens)
    sched = s.schedule()  # c is admitted in a's slot and prefills; a is not stepped
    assert s.running == [a, b, c] and s.num_active() == 2
    assert [r.rid for r, _, _ in sched.prefill] == [2] and sched.decode == [b]
    run_prefill(s)
    plan = s.plan_step(lambda reqs: DecodePlan(Decision(False), [], 0))
    assert plan.decode == [b, c] and a.blocks == blocks and a.kv_len == kv and a.tokens == tokens
    assert a.status is Status.RUNNING and s.running[0] is a
    a.held = False
    assert s.schedule().decode == [a, b]  # running order, capped at max_batch_size
    b.held = c.held = True
    assert s.schedule().decode == [a]
    a.held = True
    assert s.schedule().decode == [] and s.has_work()  # every request held: nothing to step
    for r in (a, b, c):
        s.finish(r)
    assert sorted(s.pool.free) == list(range(32))
