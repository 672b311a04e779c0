"""The recording's step-time model: forward costs measured on scratch KV (``calibrate``'s
components), the per-step overheads refitted from whole steps on the recorded prompts.

``calibrate`` fits the overheads from steps on random-token prompts, where almost nothing is
accepted; on real text a speculative step commits τ ≈ 4 tokens (KV compaction, appends, the
extend over the accepted path), so its overhead there was 20-25 % short of a measured step on
the EPYC (21.8 vs 27.5 ms at bs=1, S5K4N16). Here the overheads come from closed loops on the
recorded prompts: plain steps (``Never``, cold draft) and speculative ones (``Always`` at the
recorded shape) at a few batch sizes; each step's residual — its time less the components it
ran (target over B·N rows, S−1 draft steps over B·K, the extend over its Σ(m+1) accepted
tokens) — and the *mean* residual per (kind, batch) is one overhead sample: tokens/s is total
tokens over total time, so a replay must predict mean step times (on the loaded EPYC, load 6,
bs=1: plain 13.0 ms median / 14.8 mean, S5K4N16 35.7 / 34.3).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from workbench.engine.calibrate import calibrate
from workbench.policy.costmodel import CostModel, LinearCost
from workbench.policy.policies import Always, Never, RecordingPolicy, Shape

BATCHES = (1, 4, 16)


def _steps(engine: Any, prompts: Sequence[str], spec: Any, batch: int,
           tokens: int) -> list[tuple[int, float, float, Any, tuple[int, ...]]]:
    """(batch, context, ms, decision, accepted) of each pure decode step of ``batch`` prompts
    run together (the first decode step, which pays first-use costs, left out)."""
    import dataclasses

    from workbench.config import SamplingParams

    rec = RecordingPolicy(spec.policy)
    previous = engine.spec
    engine.set_spec(dataclasses.replace(spec, policy=rec))
    sp = SamplingParams(max_new_tokens=tokens, ignore_eos=True)
    rows = []
    rids: list[int] = []
    try:
        rids = [engine.add_request(prompts[i % len(prompts)], sp) for i in range(batch)]
        live = set(rids)
        while live:
            prefilling = any(engine.requests[r].in_prefill for r in live)
            n = len(rec.rows)
            t0 = time.perf_counter()
            outs = engine.step()
            ms = 1e3 * (time.perf_counter() - t0)
            live -= {o.rid for o in outs if o.finished}
            if not prefilling and len(rec.rows) > n:
                r = rec.rows[-1]
                rows.append((r.batch, float(r.context), ms, r.decision, r.accepted))
    finally:
        for rid in rids:
            engine.abort(rid)
        engine.set_spec(previous)
    return rows[1:]


def fit_step_model(engine: Any, prompts: Sequence[str], shape: Shape,
                   contexts: Sequence[int] = (128, 384), batches: Sequence[int] = BATCHES,
                   tokens: int = 32) -> CostModel:
    """The cost model of the module doc (components from ``calibrate``, overheads refitted on
    ``prompts``)."""
    from workbench.config import SpecConfig

    comp = calibrate(engine, shape=shape, contexts=contexts, steps=False)
    s, k, n = shape
    resid: dict[tuple[str, int], list[float]] = {}
    for b in batches:
        if b > engine.config.max_batch_size:
            continue
        for kind, policy in (("plain", Never()), ("spec", Always())):
            spec = SpecConfig(num_steps=s, topk=k, num_draft_tokens=n, policy=policy,
                              draft_state="cold" if kind == "plain" else "auto")
            for batch, ctx, ms, d, acc in _steps(engine, prompts, spec, b, tokens):
                if kind == "plain":
                    pred = comp.target_ms(batch, ctx)
                elif d.speculate and acc:
                    pred = (comp.target_ms(len(acc) * d.num_draft_tokens + batch - len(acc),
                                           ctx)
                            + (d.num_steps - 1) * comp.draft_ms(len(acc) * d.topk, ctx)
                            + comp.draft_ms(sum(a + 1 for a in acc), ctx))
                else:
                    continue
                resid.setdefault((kind, batch), []).append(ms - pred)
    fitted = {}
    for kind in ("plain", "spec"):
        pts = sorted((b, float(np.mean(v))) for (kd, b), v in resid.items() if kd == kind)
        fitted[kind] = LinearCost.fit([p[0] for p in pts], [p[1] for p in pts]) if pts \
            else LinearCost()
    return CostModel(target=comp.target, draft=comp.draft, plain_overhead=fitted["plain"],
                     spec_overhead=fitted["spec"])
