"""Mixed steps: when some requests speculate and others decode plainly (one token left, no
draft state, a catch-up that failed), the others ride in the verify forward as one-node trees
(``EagleWorker.plain_in_verify``, the CPU default) instead of a second, plain forward. Both
ways give the same tokens, finish reasons, stops, draft-token marks, per-request and engine
stats, draft extends (warm / cold / auto) and sampled tokens (seeded); logprobs agree to float
rounding, not bit for bit: a row's result depends on the batch it is computed in (MKL picks
another GEMM kernel for fewer than 4 rows, SDPA pads keys to the batch's longest context;
docs/REFERENCE.md §3 "Mixed steps")."""

from __future__ import annotations

import random

import pytest

import workbench as wb
from workbench.core import LogprobParams
from workbench.trace import DraftExtended
from workbench.trace.tracer import RecordingTracer

LOGPROB_TOL = 1e-5  # float32 rounding of the same row in another batch (observed <= 3e-6)


def workload(engine: wb.Engine, n: int, seed: int) -> list[tuple[list[int], wb.SamplingParams]]:
    """Short, varied max_new_tokens (requests often have one token left), greedy and seeded
    sampling, a stop id on some greedy ones (a token their plain greedy output has)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [rng.randrange(1, 299) for _ in range(rng.randrange(3, 20))]
        kw: dict = dict(max_new_tokens=rng.randrange(2, 14), ignore_eos=True)
        if i % 3 == 1:
            kw.update(temperature=0.9, seed=100 + i)
        elif i % 2 == 0:
            kw["max_new_tokens"] += 4
            ref = engine.generate([prompt], wb.SamplingParams(**kw))[0].token_ids
            kw.update(stop_token_ids=(ref[rng.randrange(2, 5)],))
        out.append((prompt, wb.SamplingParams(**kw)))
    return out


def run(engine: wb.Engine, one_forward: bool, spec: wb.SpecConfig,
        reqs: list[tuple[list[int], wb.SamplingParams]], batch: int
        ) -> tuple[list[wb.RequestOutput], dict, list[tuple], int]:
    """Closed loop at ``batch`` in flight: outputs, engine stats, the draft extends
    (step, rids, rows, holes) and the number of mixed steps."""
    engine.worker.plain_in_verify = one_forward
    engine.worker.plain_streak = 0  # draft_state auto: both runs start an off stretch alike
    engine.stats.reset()
    rec, prev = RecordingTracer(), engine.tracer
    engine.set_tracer(rec)
    engine.set_spec(spec)
    try:
        queue = list(enumerate(reqs))
        live: dict[int, int] = {}
        out: dict[int, wb.RequestOutput] = {}
        mixed = 0
        index: dict[int, int] = {}  # rid → request number (rids differ between runs)
        while queue or live:
            while queue and len(live) < batch:
                i, (p, sp) = queue.pop(0)
                live[engine.add_request(p, sp, logprobs=LogprobParams(top_k=2))] = i
                index.update(live)
            before = {rid: (engine.requests[rid].metrics.verify_ct,
                            engine.requests[rid].metrics.plain_steps) for rid in live}
            engine.step()
            now = {rid: (engine.requests[rid].metrics.verify_ct,
                         engine.requests[rid].metrics.plain_steps) for rid in live}
            verified = any(now[r][0] > before[r][0] for r in live)
            plain = any(now[r][1] > before[r][1] for r in live)
            mixed += verified and plain
            for rid in [r for r in live if engine.requests[r].finished]:
                out[live.pop(rid)] = engine.output(rid)
        extends = [(e.step - engine.step_id, [index[r] for r in e.rids], e.rows, e.holes)
                   for e in rec.events if isinstance(e, DraftExtended)]
        stats = {k: v for k, v in vars(engine.stats).items()}
        return [out[i] for i in range(len(reqs))], stats, extends, mixed
    finally:
        engine.set_spec(None)
        engine.set_tracer(prev)
        engine.worker.plain_in_verify = True


def metrics_of(o: wb.RequestOutput) -> tuple:
    m = o.metrics
    return (m.verify_ct, m.accept_lengths, m.drafted_tokens, m.accepted_per_depth,
            m.plain_steps, m.spec_plain_steps, m.preemptions)


@pytest.mark.parametrize("draft_state", ["warm", "cold", "auto"])
@pytest.mark.parametrize("shape", [(3, 2, 6), (3, 1, 0)])
def test_one_forward_equals_two_forwards(engine: wb.Engine, draft_state: str,
                                         shape: tuple[int, int, int | None]) -> None:
    s, k, n = shape
    spec = wb.SpecConfig(num_steps=s, topk=k, num_draft_tokens=n, draft_state=draft_state)
    reqs = workload(engine, 10, seed=s * 10 + k)
    one, st1, ext1, mixed1 = run(engine, True, spec, reqs, 4)
    two, st2, ext2, mixed2 = run(engine, False, spec, reqs, 4)
    assert mixed1 == mixed2 >= 3, "the workload must produce mixed steps"
    for a, b in zip(one, two, strict=True):
        assert a.token_ids == b.token_ids
        assert (a.finish_reason, a.matched_stop) == (b.finish_reason, b.matched_stop)
        assert a.from_draft == b.from_draft
        assert metrics_of(a) == metrics_of(b)
        assert a.output_logprobs is not None and b.output_logprobs is not None
        assert len(a.output_logprobs) == len(b.output_logprobs) == len(a.token_ids)
        assert max(abs(x - y) for x, y in zip(a.output_logprobs, b.output_logprobs,
                                              strict=True)) <= LOGPROB_TOL
        assert [[t for t, _ in row] for row in a.output_top_logprobs or []] == \
            [[t for t, _ in row] for row in b.output_top_logprobs or []]
    assert any(a.finish_reason == "stop" for a in one), "a stop id must end some request"
    assert any(a.from_draft and a.metrics.plain_steps for a in one)
    assert st1 == st2  # steps by mode, verify counts, τ, accepted per position, tokens
    assert ext1 == ext2  # the same draft extends: who, how many rows, which holes
    assert engine.kv_usage()["used_blocks"] == 0


def test_riders_share_the_verify_forward(engine: wb.Engine) -> None:
    """A mixed step runs one target forward (the plain requests' rows ride in it)."""
    calls: list[int] = []
    forward = engine.runner.forward

    def counting(batch):  # noqa: ANN001, ANN202 -- a pass-through spy on the public runner
        calls.append(len(batch.reqs))
        return forward(batch)

    engine.runner.forward = counting  # type: ignore[method-assign]
    try:
        spec = wb.SpecConfig(num_steps=3, topk=2, num_draft_tokens=6)
        engine.set_spec(spec)
        a = engine.add_request([5, 6, 7, 8], wb.SamplingParams(max_new_tokens=12,
                                                                ignore_eos=True))
        b = engine.add_request([9, 10, 11], wb.SamplingParams(max_new_tokens=2,
                                                               ignore_eos=True))
        engine.step()  # prefill both; b has one token left
        assert len(engine.requests[b].output_ids) == 1
        calls.clear()
        engine.step()  # a speculates, b decodes its last token: one forward for both
        assert calls == [2]
        assert engine.requests[b].finished and engine.requests[b].metrics.plain_steps == 1
        assert engine.requests[a].metrics.verify_ct == 1
        while engine.has_unfinished():
            engine.step()
    finally:
        del engine.runner.forward
        engine.set_spec(None)
