"""Latency samples for CDF plots: every TTFT, TPOT and inter-token gap of a closed-loop run.

``workbench.bench.concurrency`` reports percentiles per (arm, level); a CDF needs the samples
themselves. :func:`latency_samples` runs the same kind of closed loop (``concurrency`` requests
in flight, a new one admitted as soon as one finishes, greedy, ``ignore_eos``) on one engine
and returns one row per sample, ready for :func:`workbench.viz.figures.latency_cdf`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from workbench.config import SamplingParams, SpecConfig

if TYPE_CHECKING:
    import pandas as pd

    from workbench.engine.engine import Engine


def closed_loop_outputs(engine: Engine, prompts: Sequence[str], spec: SpecConfig | None,
                        concurrency: int, num_requests: int,
                        max_new_tokens: int) -> list[Any]:
    """Keep ``concurrency`` requests in flight until ``num_requests`` finished; returns their
    ``RequestOutput`` s (with ``metrics``: arrival, first_token, token_times). The engine's
    spec is restored afterwards."""
    if concurrency < 1 or num_requests < 1:
        raise ValueError(f"closed_loop_outputs: concurrency and num_requests must be >= 1, got "
                         f"{concurrency}, {num_requests}")
    if not prompts:
        raise ValueError("closed_loop_outputs: no prompts")
    previous = engine.spec
    engine.set_spec(spec)
    sp = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    live: list[int] = []
    done: list[Any] = []
    admitted = 0
    try:
        while len(done) < num_requests:
            while len(live) < concurrency and admitted < num_requests:
                live.append(engine.add_request(prompts[admitted % len(prompts)], sp))
                admitted += 1
            engine.step()
            for rid in [r for r in live if engine.requests[r].finished]:
                live.remove(rid)
                done.append(engine.output(rid, text=False))
    finally:
        for rid in live:
            engine.abort(rid)
        engine.set_spec(previous)
    return done


def latency_rows(outputs: Sequence[Any], **labels: Any) -> list[dict[str, Any]]:
    """One row per sample: ``metric`` (ttft / tpot / itl) and ``ms``, plus ``labels``."""
    rows: list[dict[str, Any]] = []
    for out in outputs:
        m = out.metrics
        if m.first_token is None:
            continue
        rows.append({**labels, "metric": "ttft", "ms": 1e3 * (m.first_token - m.arrival)})
        tt = np.asarray(m.token_times, dtype=float)
        if len(tt) > 1:
            rows.append({**labels, "metric": "tpot",
                         "ms": 1e3 * (tt[-1] - m.first_token) / (len(tt) - 1)})
            gaps = np.diff(tt)  # tokens of one verify step share a timestamp: one emission
            rows += [{**labels, "metric": "itl", "ms": 1e3 * g} for g in gaps[gaps > 0]]
    return rows


def latency_samples(engine: Engine, prompts: Sequence[str],
                    arms: Mapping[str, SpecConfig | None], levels: Sequence[int],
                    max_new_tokens: int = 32, requests_per_level: int | None = None
                    ) -> pd.DataFrame:
    """Closed-loop runs of every arm at every level; columns arm, concurrency, metric
    (``ttft`` / ``tpot`` / ``itl``), ms. ``requests_per_level`` defaults to max(2c, 4)."""
    import pandas as pd

    rows: list[dict[str, Any]] = []
    for c in levels:
        n = requests_per_level or max(2 * c, 4)
        for arm, spec in arms.items():
            outs = closed_loop_outputs(engine, prompts, spec, c, n, max_new_tokens)
            rows += latency_rows(outs, arm=arm, concurrency=c)
    return pd.DataFrame(rows, columns=["arm", "concurrency", "metric", "ms"])
