"""Timing thread counts on the engine's own GEMMs: which count is fastest right now.

:mod:`workbench.engine.contention` (the monitor) and :mod:`workbench.engine.autotune` (the init
stage) both decide the thread count the same way: each candidate count runs a decode M=1 and a
verify M=16 pass over the real prepared weights, the counts taking turns so a busy stretch hits
every count alike, and the median decides (under contention the typical step is what a user
gets). The measurement runs inside the engine's time — a monitor's re-timing stalls the request
being served — so a count that has already lost is not timed further: with a neighbour pinned
to one core of two, two threads take ~110 ms for the pair of passes against ~18 ms for one
(2-core EPYC family 26), and three more turns of the loser were ~0.35 s of a stall.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from workbench.engine.contention import Conditions

THREADS_BUDGET_S = 0.3  # one thread-count measurement (turns of decode and verify passes)
# a count whose fastest turn costs this many times another count's slowest is out of the
# running (it cannot win on medians); the margin covers a burst in one turn
DROP = 4.0
DROP_FLOOR_MS = 1.0  # and by at least this much: microsecond passes are all noise


def gemm_pass(target: Any, m: int) -> Callable[[], None]:
    """One pass over every GEMM of the target at ``m`` rows, with its prepared inference
    weights as they stand (no copy, no KV touched: safe while requests run)."""
    from workbench.models.gemm import gemm_ops
    from workbench.models.moe_model import MoeForCausalLM

    if isinstance(target, MoeForCausalLM):  # routed experts: no fixed GEMM list to replay
        return target.gemm_pass(m)
    if target._fast is None:
        target.fuse(target.gemm)
    lin, lin_add = gemm_ops(target.gemm)
    d = target.config.hidden_size
    layers = list(target._fast)
    head = target._head
    gen = torch.Generator().manual_seed(0)
    dt = target.lm_head.weight.dtype  # the model's (bf16 GEMMs take bf16 activations)
    x = torch.randn(m, d, generator=gen).to(dt)
    xi = torch.randn(m, target.config.intermediate_size, generator=gen).to(dt)
    xa = torch.randn(m, layers[0].h * layers[0].hd, generator=gen).to(dt)

    def run() -> None:
        with torch.inference_mode():
            for f in layers:
                lin(x, f.qkv, f.qkv_bias)
                lin_add(xa, f.o, x)
                lin(x, f.gate_up, f.gate_up_bias)
                if f.down_bias is None:
                    lin_add(xi, f.down, x)
                else:
                    lin(xi, f.down, f.down_bias)
            lin(x, head, None)

    return run


def time_threads(passes: Mapping[str, Callable[[], None]], candidates: Sequence[int],
                 budget_s: float = THREADS_BUDGET_S, min_rounds: int = 3,
                 max_rounds: int = 40, pin: Callable[[int], object] | None = None,
                 drop: float = DROP) -> dict[int, dict[str, float]]:
    """Median ms of each pass at each thread count, the counts taking turns; the thread count
    in force is restored afterwards. ``pin(n)``, when given, places the threads for count ``n``
    (``affinity.pin``) each time it takes its turn, and ``pin(before)`` at the end.

    A count whose fastest turn (its warm-up included) costs ``drop`` times another's slowest
    takes no more turns, and once one count is left nothing is timed further: a count's
    figures are the medians of its timed turns, or its warm-up where it had none."""
    before = torch.get_num_threads()

    def use(n: int) -> None:
        torch.set_num_threads(n)
        if pin is not None:
            pin(n)

    times: dict[int, dict[str, list[float]]] = {n: {k: [] for k in passes} for n in candidates}
    warm: dict[int, dict[str, float]] = {n: {} for n in candidates}
    turns: dict[int, list[float]] = {n: [] for n in candidates}  # each turn's summed ms
    running = list(candidates)

    def turn(n: int, timed: bool) -> None:
        use(n)
        total = 0.0
        for k, fn in passes.items():
            t0 = time.perf_counter()
            fn()
            ms = 1e3 * (time.perf_counter() - t0)
            total += ms
            if timed:
                times[n][k].append(ms)
            else:
                warm[n][k] = ms
        turns[n].append(total)

    def lost(n: int) -> bool:
        fastest = min(turns[n])
        return any(fastest >= max(drop * max(turns[m]), max(turns[m]) + DROP_FLOOR_MS)
                   for m in running if m != n)

    try:
        for n in candidates:  # warm-up: a thread count's first region spawns its threads
            turn(n, timed=False)
        running = [n for n in running if not lost(n)]
        t_end = time.perf_counter() + budget_s
        rounds = 0
        while len(running) > 1 and rounds < max_rounds and (
                rounds < min_rounds or time.perf_counter() < t_end):
            for n in running:
                turn(n, timed=True)
            running = [n for n in running if not lost(n)]
            rounds += 1
    finally:
        use(before)
    return {n: {k: statistics.median(v) if v else warm[n][k] for k, v in ts.items()}
            for n, ts in times.items()}


def thread_candidates(default: int, cond: Conditions | None = None) -> tuple[int, ...]:
    """The thread counts worth timing: all of this process's cores (``default``), one, and —
    with other processes busy — the cores they leave free."""
    out = {max(1, default), 1}
    if cond is not None and cond.others is not None and default > 2:
        out.add(max(1, default - math.ceil(cond.others)))
    return tuple(sorted(out, reverse=True))


def pick_threads(timings: Mapping[int, Mapping[str, float]], default: int,
                 margin: float = 0.05) -> int:
    """The count with the least summed pass time; ``default`` unless beaten by ``margin``."""
    def cost(n: int) -> float:
        return sum(timings[n].values())

    best = min(timings, key=cost)
    if default in timings and cost(default) <= cost(best) * (1 + margin):
        return default
    return best


