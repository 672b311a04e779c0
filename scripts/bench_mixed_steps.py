"""Mixed steps, one forward vs two (docs/DESIGN.md §4 "Mixed steps": the figures there).

``forward``: b verify trees of n nodes plus r one-node riders in ONE target forward, vs the
verify forward over the trees plus a plain decode forward over the riders (TWO); same requests
and KV, logits included, interleaved pairs, the median of the paired differences.

``steps``: a closed loop at concurrency C (max_new_tokens drawn from 2..24, so requests often
have one token left and decode plainly while others speculate), greedy, arms alternating
(``EagleWorker.plain_in_verify`` on / off). Both arms step identically (same outputs), so
steps pair up: mixed steps vs the rest (the control).

    OMP_NUM_THREADS=1 python scripts/bench_mixed_steps.py forward --gemm dense --reps 24
    OMP_NUM_THREADS=1 python scripts/bench_mixed_steps.py steps --levels 4,8 --repeats 6
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

import torch

import workbench as wb
from workbench.engine.runner import ForwardBatch

TARGET, DRAFT = "data/models/wb-target", "data/models/wb-eagle3"
SPECS = {"S3K2N6": wb.SpecConfig(num_steps=3, topk=2, num_draft_tokens=6),
         "S5K4N16": wb.SpecConfig(num_steps=5, topk=4, num_draft_tokens=16),
         "chain3": wb.SpecConfig(num_steps=3, topk=1)}
SHAPES = [(1, 1, 4), (1, 1, 6), (1, 1, 16), (2, 1, 8), (3, 1, 6), (2, 2, 6), (3, 1, 16),
          (4, 1, 16), (4, 4, 16), (6, 2, 6), (7, 1, 4), (2, 6, 6)]


def load() -> str:
    with open("/proc/loadavg") as f:
        return f.read().split()[0]


def corpus(e: wb.Engine) -> list[int]:
    with open("workbench/engine/worker.py") as f:
        return list(e.tokenizer.encode(f.read()))


def forward(args: argparse.Namespace) -> None:
    e = wb.Engine.from_pretrained(TARGET, draft=DRAFT, config=wb.EngineConfig(
        kv_budget_tokens=32768, gemm=args.gemm))
    print("gemm", e.runner.target.gemm, "threads", torch.get_num_threads())
    rng = random.Random(0)
    toks, run = corpus(e), e.runner
    reqs = []
    for _ in range(10):
        s = rng.randrange(0, len(toks) - 300)
        rid = e.add_request(toks[s : s + rng.randrange(60, 200)],
                            wb.SamplingParams(max_new_tokens=64, ignore_eos=True))
        reqs.append(e.requests[rid])
    while any(r.in_prefill for r in reqs):
        e.step()
    assert e.runner.pool is not None
    for r in reqs:
        e.runner.pool.reserve(r.blocks, r.kv_len + 40)
    dev = run.device

    def trees(rs: list[Any], n: int) -> ForwardBatch:
        starts = [r.kv_len for r in rs]
        mask = torch.ones(n, n, dtype=torch.bool, device=dev).tril()
        return ForwardBatch(
            rs, starts, [s + n for s in starts],
            torch.tensor([rng.randrange(1, 8000) for _ in range(len(rs) * n)], device=dev),
            torch.cat([torch.arange(s, s + n, device=dev) for s in starts]),
            [mask] * len(rs), True)

    def one(tb: ForwardBatch, riders: list[Any]) -> float:
        t = time.perf_counter()
        d = run.decode_batch(riders, True)
        fb = ForwardBatch(tb.reqs + riders, tb.starts + d.starts, tb.ends + d.ends,
                          torch.cat([tb.tokens, d.tokens]),
                          torch.cat([tb.positions, d.positions]),
                          list(tb.tree_masks or []) + [None] * len(riders), True)
        run.logits(run.forward(fb)[0])
        return (time.perf_counter() - t) * 1e3

    def two(tb: ForwardBatch, riders: list[Any]) -> float:
        t = time.perf_counter()
        run.logits(run.forward(tb)[0])
        run.logits(run.forward(run.decode_batch(riders, True))[0])
        return (time.perf_counter() - t) * 1e3

    print("b r  n | one ms | two ms | two-one ms, median of paired differences (IQR) | load")
    with torch.inference_mode():
        for b, r, n in SHAPES:
            tb, riders = trees(reqs[:b], n), reqs[b : b + r]
            for _ in range(3):
                one(tb, riders), two(tb, riders)
            ones, twos = [], []
            for k in range(args.reps):
                if k % 2:
                    ones.append(one(tb, riders)), twos.append(two(tb, riders))
                else:
                    twos.append(two(tb, riders)), ones.append(one(tb, riders))
            diffs = [b_ - a for a, b_ in zip(ones, twos, strict=True)]
            q = statistics.quantiles(diffs, n=4)
            print(f"{b} {r} {n:2d} | {statistics.median(ones):6.2f} | "
                  f"{statistics.median(twos):6.2f} | {statistics.median(diffs):+6.2f} "
                  f"({q[0]:+.2f}..{q[2]:+.2f}) | {load()}", flush=True)
    e.close()


def steps(args: argparse.Namespace) -> None:
    e = wb.Engine.from_pretrained(TARGET, draft=DRAFT,
                                  config=wb.EngineConfig(kv_budget_tokens=32768))
    print("gemm", e.runner.target.gemm, "spec", args.spec, flush=True)
    spec, toks = SPECS[args.spec], corpus(e)

    def workload(seed: int) -> list[tuple[list[int], int]]:
        r = random.Random(seed)
        out = []
        for _ in range(args.requests):
            s = r.randrange(0, len(toks) - 100)
            out.append((toks[s : s + r.randrange(8, 40)], r.randrange(2, 25)))
        return out

    def run(fold: bool, c: int, ps: list[tuple[list[int], int]]
            ) -> tuple[list[tuple[float, bool, int]], int, float]:
        e.worker.plain_in_verify = fold
        e.set_spec(spec)
        q, live, rows, ntok = list(ps), {}, [], 0
        t0 = time.perf_counter()
        while q or live:
            while q and len(live) < c:
                p, mx = q.pop(0)
                rid = e.add_request(p, wb.SamplingParams(max_new_tokens=mx, ignore_eos=True))
                live[rid] = e.requests[rid]
            before = {rid: (r.metrics.verify_ct, r.metrics.plain_steps)
                      for rid, r in live.items()}
            ts = time.perf_counter()
            outs = e.step()
            dt = (time.perf_counter() - ts) * 1e3
            v = sum(r.metrics.verify_ct > before[rid][0] for rid, r in live.items())
            pl = sum(r.metrics.plain_steps > before[rid][1] for rid, r in live.items())
            rows.append((dt, v > 0 and pl > 0, v))
            for o in outs:
                ntok += len(o.new_token_ids)
                if o.finished:
                    live.pop(o.rid, None)
        e.set_spec(None)
        return rows, ntok, time.perf_counter() - t0

    levels = [int(c) for c in args.levels.split(",")]
    res: dict[int, list[Any]] = {}
    for c in levels:
        run(True, c, workload(99)), run(False, c, workload(99))  # warm-up
    for rep in range(args.repeats):
        for c in levels:
            ps = workload(rep)
            out = {fold: run(fold, c, ps) for fold in ([True, False] if rep % 2 == 0
                                                       else [False, True])}
            (ra, na, wa), (rb, nb, wb_) = out[True], out[False]
            assert na == nb and [x[1:] for x in ra] == [x[1:] for x in rb], "arms diverged"
            res.setdefault(c, []).append((ra, rb, na, wa, wb_))
    print(f"== {args.spec}, {args.requests} requests, {args.repeats} repeats, load {load()}")
    for c in levels:
        runs = res[c]
        diff = [a[0] - b[0] for ra, rb, *_ in runs for a, b in zip(ra, rb, strict=True)
                if a[1]]
        ctl = [a[0] - b[0] for ra, rb, *_ in runs for a, b in zip(ra, rb, strict=True)
               if not a[1] and a[2] > 0]
        ms = {k: statistics.mean(w * 1e3 / len(r) for r, w in ((x[i], x[j]) for x in runs))
              for k, i, j in (("one", 0, 3), ("two", 1, 4))}
        tps = {k: statistics.mean(x[2] / x[j] for x in runs) for k, j in (("one", 3),
                                                                           ("two", 4))}
        print(f"c={c}: mixed steps one-two median {statistics.median(diff):+.2f} ms "
              f"(n={len(diff)}); control {statistics.median(ctl):+.2f} ms (n={len(ctl)}); "
              f"ms/step one {ms['one']:.2f} two {ms['two']:.2f}; "
              f"tok/s one {tps['one']:.1f} two {tps['two']:.1f}")
    e.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("forward")
    f.add_argument("--gemm", default="auto", choices=("auto", "dense", "onednn"))
    f.add_argument("--reps", type=int, default=24)
    s = sub.add_parser("steps")
    s.add_argument("--levels", default="4,8")
    s.add_argument("--repeats", type=int, default=6)
    s.add_argument("--requests", type=int, default=24)
    s.add_argument("--spec", default="S3K2N6", choices=sorted(SPECS))
    args = ap.parse_args()
    forward(args) if args.cmd == "forward" else steps(args)


if __name__ == "__main__":
    main()
