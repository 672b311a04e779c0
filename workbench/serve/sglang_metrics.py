"""SGLang 0.5.23's request-latency and throughput metrics (names, types, labels and buckets as
its ``observability/metrics_collector.py`` defines them), kept by the engine loop:

- ``sglang:time_to_first_token_seconds`` (histogram; labels ``model_name``, ``is_streaming``):
  from the request's arrival at the server's engine loop to its first token;
- ``sglang:inter_token_latency_seconds`` (histogram; ``model_name``): per engine step that gave
  a request ``k`` new tokens after its first, the time since its previous tokens divided by
  ``k``, observed ``k`` times (SGLang's ``observe_inter_token_latency``: a speculative step's
  accepted block shares its step's time); observed when the request finishes;
- ``sglang:e2e_request_latency_seconds`` (histogram; ``model_name``, ``is_streaming``): arrival to
  finish, every finished request (aborted ones too, as upstream);
- ``sglang:gen_throughput`` (gauge, tokens/s): generated tokens over the engine's busy time,
  refreshed every :data:`LOG_INTERVAL` steps (SGLang's decode log interval) and when the engine
  goes idle; idle time between bursts does not count.

Everything here runs on the engine-loop thread (observations after each step and at each
finish; :meth:`ServeMetrics.render` from a ``loop.call``), so no lock is needed.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Any

TTFT_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)
E2E_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400, 600,
               1200, 1800, 2400)
ITL_BUCKETS = (0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040,
               0.060, 0.080, 0.100, 0.200, 0.400, 0.600, 0.800, 1.000, 2.000, 4.000, 6.000,
               8.000)
LOG_INTERVAL = 40  # steps between gen_throughput refreshes (SGLang's decode_log_interval)
IDLE_GAP_S = 0.5  # a step starting this long after the previous one ended begins a new burst


class Histogram:
    """A Prometheus histogram with cumulative buckets, one series per label value tuple."""

    def __init__(self, name: str, help_: str, buckets: tuple[float, ...],
                 labels: tuple[str, ...] = ()) -> None:
        self.name, self.help, self.buckets, self.labels = name, help_, buckets, labels
        self.series: dict[tuple[str, ...], tuple[list[int], list[float]]] = {}

    def observe(self, value: float, label_values: tuple[str, ...] = (), count: int = 1) -> None:
        counts, total = self.series.setdefault(label_values,
                                               ([0] * (len(self.buckets) + 1), [0.0]))
        counts[bisect_left(self.buckets, value)] += count
        total[0] += value * count

    def render(self, base: dict[str, str]) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        for values, (counts, total) in sorted(self.series.items()):
            labels = {**base, **dict(zip(self.labels, values, strict=True))}
            acc = 0
            for bound, c in zip((*self.buckets, float("inf")), counts, strict=True):
                acc += c
                le = "+Inf" if bound == float("inf") else repr(float(bound))
                lines.append(f"{self.name}_bucket{_labels({**labels, 'le': le})} {acc}")
            lines.append(f"{self.name}_sum{_labels(labels)} {total[0]!r}")
            lines.append(f"{self.name}_count{_labels(labels)} {acc}")
        return lines


def _labels(d: dict[str, str]) -> str:
    def esc(v: str) -> str:
        return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
    return "{" + ",".join(f'{k}="{esc(v)}"' for k, v in d.items()) + "}" if d else ""


class ServeMetrics:
    """The engine loop's latency histograms and generation throughput (module doc)."""

    def __init__(self) -> None:
        self.ttft = Histogram("sglang:time_to_first_token_seconds",
                              "Histogram of time to first token in seconds.", TTFT_BUCKETS,
                              ("is_streaming",))
        self.itl = Histogram("sglang:inter_token_latency_seconds",
                             "Histogram of inter-token latency in seconds.", ITL_BUCKETS)
        self.e2e = Histogram("sglang:e2e_request_latency_seconds",
                             "Histogram of End-to-end request latency in seconds", E2E_BUCKETS,
                             ("is_streaming",))
        self.gen_throughput = 0.0
        self._tic: float | None = None  # start of the current measuring window
        self._base = 0  # generated tokens at _tic
        self._steps = 0  # steps in the window
        self._last_end = 0.0

    def on_step(self, t0: float, t1: float, before: int, after: int, idle: bool) -> None:
        """One engine step ran from ``t0`` to ``t1``; the engine had generated ``before``
        tokens then and ``after`` now; ``idle``: it holds no work any more."""
        if self._tic is None or t0 - self._last_end > IDLE_GAP_S:
            self._tic, self._base, self._steps = t0, before, 0  # a new burst
        self._last_end = t1
        self._steps += 1
        if (self._steps >= LOG_INTERVAL or idle) and t1 > self._tic:
            self.gen_throughput = (after - self._base) / (t1 - self._tic)
            self._tic, self._base, self._steps = t1, after, 0

    def on_finish(self, arrival: float, first_token: float | None, token_times: list[float],
                  now: float, streaming: bool) -> None:
        """A request finished at ``now``: it arrived at ``arrival``, had its first token at
        ``first_token`` and ``token_times`` holds one timestamp per output token (a step's
        tokens share one). Its inter-token latencies are observed here, per step."""
        times = token_times
        i = 1
        while i < len(times):
            j = i
            while j < len(times) and times[j] == times[i]:
                j += 1
            if times[i] != times[i - 1]:  # the tokens of one step after the first token's
                self.itl.observe((times[i] - times[i - 1]) / (j - i), count=j - i)
            i = j
        label = ("true" if streaming else "false",)
        if first_token is not None:
            self.ttft.observe(max(0.0, first_token - arrival), label)
        self.e2e.observe(max(0.0, now - arrival), label)

    def render(self, model_name: str) -> str:
        base = {"model_name": model_name}
        lines = []
        for h in (self.ttft, self.itl, self.e2e):
            lines += h.render(base)
        return "\n".join(lines) + "\n"

    def snapshot(self) -> dict[str, Any]:
        return {"sglang:gen_throughput": self.gen_throughput}
