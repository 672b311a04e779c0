"""Where the engine loop's time goes, by the kind of batch it stepped (``/server_info``'s
``step_profile``; tests/reliability/measure_mixed_load.py prints it per load window).

Each step is counted under its batch's kind: ``greedy`` (every running request greedy),
``sampled`` (at least one with temperature > 0: the sampled sampling and verify paths run),
``logprobs`` (at least one asks for log-probabilities; counted here before ``sampled``). Per
kind: steps, wall seconds, CPU seconds of the loop thread (``time.thread_time``), requests
stepped (Σ batch sizes) and tokens generated. CPU well below wall means the thread waited for a
core or for the GIL (other processes, or the server's own event loop); CPU per step growing with
the kind means the step's own work grew. Cheap: two clock reads and one pass over the running
batch per step. Loop thread only; :meth:`StepProfile.snapshot` is read there too.
"""

from __future__ import annotations

import time
from typing import Any

KINDS = ("greedy", "sampled", "logprobs")


class StepProfile:
    def __init__(self) -> None:
        self._acc = {k: [0, 0.0, 0.0, 0, 0] for k in KINDS}  # steps, wall, cpu, reqs, tokens
        self._kind = "greedy"
        self._batch = 0
        self._t0 = self._c0 = 0.0

    def before(self, running: list[Any]) -> None:
        """The step about to run on ``running``: the requests the engine holds (running, or
        waiting to be scheduled; the loop hands it at most ``max_batch_size``)."""
        kind = "greedy"
        for r in running:
            if r.logprobs is not None:
                kind = "logprobs"
                break
            if not r.sampling.greedy:
                kind = "sampled"
        self._kind, self._batch = kind, len(running)
        self._c0, self._t0 = time.thread_time(), time.perf_counter()

    def after(self, tokens: int) -> None:
        """The step ended having generated ``tokens`` tokens."""
        wall, cpu = time.perf_counter() - self._t0, time.thread_time() - self._c0
        a = self._acc[self._kind]
        a[0] += 1
        a[1] += wall
        a[2] += cpu
        a[3] += self._batch
        a[4] += tokens

    def snapshot(self) -> dict[str, dict[str, float]]:
        return {k: {"steps": a[0], "wall_s": a[1], "cpu_s": a[2], "requests": a[3],
                    "tokens": a[4]} for k, a in self._acc.items()}
