"""Continuous batching: waiting queue, admission by KV budget, chunked prefill, preemption.

Admission reserves the whole prefill (+1 for the first decode) so a half-prefilled request never
waits on memory; decode growth that does not fit preempts the most recently admitted request
(recompute: its KV is dropped and it re-prefills later — never a crash).

:meth:`Scheduler.plan_step` owns the whole batch of a step: admission, prefill chunks, the
policy decision (a callback) and every KV reservation and preemption, all before any forward;
it returns a :class:`ScheduledBatch` the engine then runs without touching the pool's budget.

Held requests (``Request.held``: a serving loop's backpressure, its client is not reading) keep
their KV and their place but leave every decode batch and take no batch slot: admission counts
only the requests that are not held, and the decode batch is the first ``max_batch_size`` that
are not (a request released while the batch is full waits a step; its output never changes).
KV follows readers (:meth:`Scheduler.evict_held_for`): when the next waiting request does not
fit the pool, held requests give their KV back (recompute preemption, newest first) — never
for nothing: only when that makes it fit. A preempted held request waits, skipped by
admission, until it is released; then it re-prefills its prompt and output, first in line.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from workbench.core import Request, Status
from workbench.engine.kv_cache import KVPool
from workbench.policy.policies import Decision


@dataclass
class Schedule:
    prefill: list[tuple[Request, int, int]]  # (request, start, end) token ranges this step
    decode: list[Request]


@dataclass
class DecodePlan:
    """The policy's answer for a decode batch: which requests draft trees of how many nodes."""

    decision: Decision
    speculate: list[Request]  # candidates (the others decode plainly)
    lookahead: int  # KV positions a speculating request needs past kv_len (tree nodes)


@dataclass
class ScheduledBatch:
    """One step's work, KV reserved: prefill chunks, then the decode batch split into requests
    that speculate (``lookahead`` reserved); the rest decode plainly (one position reserved:
    :meth:`plain_after` names them once the speculating requests have run)."""

    prefill: list[tuple[Request, int, int]]
    decode: list[Request]  # the policy's batch, in running order (preempted ones included)
    speculate: list[Request]
    decision: Decision | None  # None: no decode batch this step

    def plain_after(self, speculated: list[Request]) -> list[Request]:
        """The decode requests that did not speculate and still decode plainly this step (not
        preempted making room, not finished), in running order."""
        done = {id(r) for r in speculated}
        return [r for r in self.decode if id(r) not in done and r.status is Status.RUNNING
                and not r.in_prefill]


class Scheduler:
    def __init__(self, pool: KVPool, max_batch_size: int, max_prefill_tokens: int) -> None:
        self.pool = pool
        self.max_batch = max_batch_size
        self.max_prefill = max_prefill_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> Schedule:
        # 1. Admit in arrival order while the batch and the pool allow (held requests wait).
        while self.num_active() < self.max_batch:
            req = next((r for r in self.waiting if not r.held), None)
            if req is None or not (self.pool.can_fit(req.blocks, req.prefill_target + 1)
                                   or self.evict_held_for(req)):
                break
            self.waiting.remove(req)
            self.pool.reserve(req.blocks, req.prefill_target + 1)
            req.status = Status.RUNNING
            self.running.append(req)
        # 2. Chunked prefill within the token budget.
        budget = self.max_prefill
        prefill: list[tuple[Request, int, int]] = []
        for req in self.running:
            if req.in_prefill and budget > 0:
                end = min(req.prefill_target, req.kv_len + budget)
                prefill.append((req, req.kv_len, end))
                budget -= end - req.kv_len
        decode = [r for r in self.running if not r.in_prefill and not r.held][:self.max_batch]
        return Schedule(prefill, decode)

    def num_active(self) -> int:
        """Running requests that are not held (the ones that take batch slots)."""
        return sum(not r.held for r in self.running)

    def plan_step(self, plan: Callable[[list[Request]], DecodePlan]) -> ScheduledBatch:
        """Admit, chunk prefills, ask ``plan`` about the decode batch, then reserve: the
        speculating requests first (their lookahead), then one position for every other
        decode request. A preempted request leaves the prefill and decode lists."""
        sched = self.schedule()
        if not sched.decode:
            return ScheduledBatch(sched.prefill, [], [], None)
        p = plan(sched.decode)
        spec = self.ensure_decode_room(p.speculate, p.lookahead) if p.speculate else []
        chosen = {id(r) for r in spec}
        self.ensure_decode_room([r for r in sched.decode if id(r) not in chosen], 1)
        prefill = [c for c in sched.prefill if c[0].status is Status.RUNNING]
        return ScheduledBatch(prefill, sched.decode, spec, p.decision)

    def ensure_decode_room(self, reqs: list[Request], lookahead: int) -> list[Request]:
        """Reserve kv_len + lookahead positions for each request, preempting the newest
        running requests when the pool is short. Returns the requests that still decode."""
        # A request preempted earlier in this step (by another batch) no longer decodes.
        keep = [r for r in reqs if r.status is Status.RUNNING and not r.in_prefill]
        i = 0
        while i < len(keep):
            req = keep[i]
            need = req.kv_len + lookahead
            while not self.pool.can_fit(req.blocks, need):
                victim = self._newest_other(req)
                if victim is None:
                    return keep[:i]  # nothing left to preempt: this step runs with fewer
                self.preempt(victim)
                if victim in keep:
                    j = keep.index(victim)
                    keep.pop(j)
                    if j < i:
                        i -= 1
            self.pool.reserve(req.blocks, need)
            i += 1
        return keep

    def _newest_other(self, req: Request) -> Request | None:
        """The preemption victim: the newest held request (it is not stepping), else the
        newest running one."""
        for held_first in (True, False):
            for r in reversed(self.running):
                if r is not req and (r.held or not held_first):
                    return r
        return None

    def evict_held_for(self, req: Request) -> bool:
        """KV follows readers: preempt held running requests, newest first, until the waiting
        ``req`` fits (its prefill + 1). Nothing is preempted unless that makes it fit. True
        when it fits."""
        need = req.prefill_target + 1
        held = [r for r in reversed(self.running) if r.held]
        freeable = len(self.pool.free) + sum(len(r.blocks) for r in held)
        if self.pool.blocks_needed(req.blocks, need) > freeable:
            return False
        for r in held:
            if self.pool.can_fit(req.blocks, need):
                break
            self.preempt(r)
        return self.pool.can_fit(req.blocks, need)

    def preempt(self, req: Request) -> None:
        """Recompute preemption: drop KV and draft state, requeue at the front."""
        self.pool.release(req.blocks)
        self.running.remove(req)
        has_output = len(req.tokens) > len(req.prompt_ids)
        req.prefill_target = len(req.tokens) - 1 if has_output else len(req.tokens)
        req.sample_after_prefill = not has_output
        req.kv_len = 0
        req.draft.reset()
        req.status = Status.WAITING
        req.metrics.preemptions += 1
        self.waiting.appendleft(req)

    def finish(self, req: Request) -> None:
        self.pool.release(req.blocks)
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.draft.reset()
        req.status = Status.FINISHED
