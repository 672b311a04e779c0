"""Soak: many requests through one speculative engine the way a server drives it — random prompt
lengths, greedy / temperature / top-p sampling, random aborts, a policy that flips speculation
on and off (and the tree shape) every step, warm and cold drafts, and a KV pool small enough to
force preemption. Afterwards: the pool is empty, no request is left, RSS did not grow, and every
greedy request that was not aborted produced exactly the target's plain greedy output.

The CI variant runs 500 requests; the ``slow`` one runs ``WORKBENCH_SOAK_N`` (default 10,000):
``WORKBENCH_SOAK_N=10000 pytest -m slow tests/reliability/test_soak.py -s``.
"""

from __future__ import annotations

import dataclasses
import os
import random
import time
from pathlib import Path

import pytest
from reliability import kit

import workbench as wb
from workbench.reliability import rss_bytes

SHAPES = ((3, 2, 6), (2, 1, 3), (4, 2, 8))  # (S, K, N) the flipping policy picks from
MiB = 1 << 20


@dataclasses.dataclass
class Figures:
    requests: int = 0
    aborted: int = 0
    greedy_checked: int = 0
    preemptions: int = 0
    steps: int = 0
    spec_steps: int = 0
    flips: int = 0
    tokens: int = 0
    rss_warm_mib: float = 0.0
    rss_end_mib: float = 0.0
    seconds: float = 0.0


def sampling(rng: random.Random) -> wb.SamplingParams:
    n = rng.randint(1, 8)
    eos = rng.random() < 0.5
    kind = rng.random()
    if kind < 0.5:
        return wb.SamplingParams(max_new_tokens=n, ignore_eos=eos)
    seed = rng.randrange(1 << 30)
    if kind < 0.75:
        return wb.SamplingParams(max_new_tokens=n, temperature=0.8, seed=seed, ignore_eos=eos)
    return wb.SamplingParams(max_new_tokens=n, temperature=1.0, top_p=0.9, seed=seed,
                             ignore_eos=eos)


def run_soak(target: Path, head: Path, plain: wb.Engine, n: int, seed: int = 0) -> Figures:
    t0 = time.perf_counter()
    rng = random.Random(seed)
    work = [(kit.prompts(1, seed=rng.randrange(1 << 30), lo=1, hi=48)[0], sampling(rng))
            for _ in range(n)]
    e = kit.engine(target, head, kv_budget_tokens=192, page_size=8, max_prefill_tokens=64,
                   max_batch_size=16)
    policy = wb.RandomFlip(p=0.5, seed=seed, shapes=SHAPES)
    fig = Figures(requests=n)
    outputs: dict[int, wb.RequestOutput] = {}
    aborted: set[int] = set()
    live: list[int] = []
    rid_of: dict[int, int] = {}  # engine rid → index into work
    submitted = 0
    warm_at = n // 5
    try:
        while submitted < n or e.has_unfinished():
            # Warm drafts for the first half, cold for the second (switched while requests run).
            state = "warm" if submitted < n // 2 else "cold"
            if e.spec is None or e.spec.draft_state != state:
                e.set_spec(wb.SpecConfig(num_steps=3, topk=2, num_draft_tokens=6, policy=policy,
                                         draft_state=state))
            while submitted < n and len(live) < 24:  # more than max_batch_size: some wait
                rid = e.add_request(*work[submitted])
                rid_of[rid] = submitted
                live.append(rid)
                submitted += 1
            if live and rng.random() < 0.15:  # ~10 % of requests end aborted
                victim = rng.choice(live)
                e.abort(victim)
                aborted.add(victim)
            e.step()
            fig.steps += 1
            for rid in [r for r in live if e.requests[r].finished]:
                live.remove(rid)
                outputs[rid] = e.release(rid)
            if fig.rss_warm_mib == 0.0 and len(outputs) >= warm_at:
                fig.rss_warm_mib = rss_bytes() / MiB
        fig.rss_end_mib = rss_bytes() / MiB
        assert kit.kv_used(e) == 0, "KV pool not back to zero"
        assert e.requests == {} and e.num_running() == e.num_waiting() == 0
        fig.spec_steps = e.stats.steps.get("spec", 0)
    finally:
        e.close()
    fig.flips = policy.flips
    assert len(outputs) == n
    # Check every output; greedy ones against the target's plain greedy decoding (batched:
    # continuous batching equals running alone, tests/engine).
    greedy = [(rid, i) for rid, i in rid_of.items() if work[i][1].greedy]
    refs = plain.generate([work[i][0] for _, i in greedy], [work[i][1] for _, i in greedy])
    want = {rid: ref.token_ids for (rid, _), ref in zip(greedy, refs, strict=True)}
    for rid, out in outputs.items():
        sp = work[rid_of[rid]][1]
        fig.preemptions += out.metrics.preemptions
        fig.tokens += len(out.token_ids)
        assert len(out.token_ids) <= sp.max_new_tokens and out.error is None, out
        if out.finish_reason == "abort":
            assert rid in aborted
            fig.aborted += 1
            if rid in want:
                assert out.token_ids == want[rid][: len(out.token_ids)], rid
        else:
            assert out.finish_reason in ("length", "stop"), out
            if rid in want:
                assert out.token_ids == want[rid], (rid, work[rid_of[rid]])
                fig.greedy_checked += 1
    fig.seconds = time.perf_counter() - t0
    return fig


def check(fig: Figures) -> None:
    print(f"\nsoak: {fig}")
    assert fig.aborted > 0 and fig.preemptions > 0, "the soak must abort and preempt"
    assert fig.flips > 0 and 0 < fig.spec_steps < fig.steps, "speculation must flip on and off"
    assert fig.greedy_checked > fig.requests // 4
    grown = fig.rss_end_mib - fig.rss_warm_mib
    assert grown <= max(32.0, 0.1 * fig.rss_warm_mib), f"RSS grew {grown:.1f} MiB after warm-up"


def test_soak_500(micro_target: Path, head: Path, plain_engine: wb.Engine,
                  record_property: pytest.RecordProperty) -> None:
    fig = run_soak(micro_target, head, plain_engine, 500)
    for k, v in dataclasses.asdict(fig).items():
        record_property(k, v)
    check(fig)


@pytest.mark.slow
def test_soak_long(micro_target: Path, head: Path, plain_engine: wb.Engine,
                   request: pytest.FixtureRequest) -> None:
    if "WORKBENCH_SOAK_N" not in os.environ and "slow" not in request.config.getoption("-m"):
        pytest.skip("long soak: select it with -m slow (N from WORKBENCH_SOAK_N, default 10000)")
    fig = run_soak(micro_target, head, plain_engine, int(os.environ.get("WORKBENCH_SOAK_N",
                                                                         "10000")), seed=1)
    check(fig)
