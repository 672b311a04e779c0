"""SGLang 0.5.23's request-latency and throughput metrics (names, types, labels and buckets as
its ``observability/metrics_collector.py`` defines them):

- ``sglang:time_to_first_token_seconds`` (histogram; labels ``model_name``, ``is_streaming``),
  ``sglang:inter_token_latency_seconds`` (histogram; ``model_name``) and
  ``sglang:e2e_request_latency_seconds`` (histogram; ``model_name``, ``is_streaming``): measured
  from the request's arrival off the socket to the writes of its answer
  (:mod:`workbench.serve.latency`); SGLang's inter-token rule: a chunk (or engine step) that
  gave a request ``k`` new tokens after its first shares its time among them, observed ``k``
  times; every finished request counts, aborted ones too, as upstream;
- ``sglang:gen_throughput`` (gauge, tokens/s): generated tokens over the engine's busy time,
  refreshed every :data:`LOG_INTERVAL` steps (SGLang's decode log interval) and when the engine
  goes idle; idle time between bursts does not count.

Buckets: SGLang's (``"sglang"``, the default), or ``"fine"`` (``serve --latency-buckets fine``):
SGLang's bounds plus finer ones below them (:data:`FINE_LOW`, :data:`FINE_ITL_LOW`), so
PromQL quantiles resolve latencies of a few milliseconds. ``/server_info`` states which.

The histograms are observed on the event loop and rendered on the engine-loop thread: a lock
guards them. ``gen_throughput`` is the engine loop's alone.
"""

from __future__ import annotations

import threading
from bisect import bisect_left
from typing import Any

TTFT_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)
E2E_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400, 600,
               1200, 1800, 2400)
ITL_BUCKETS = (0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040,
               0.060, 0.080, 0.100, 0.200, 0.400, 0.600, 0.800, 1.000, 2.000, 4.000, 6.000,
               8.000)
# "fine": added below SGLang's lowest bounds (SGLang's 0.1 s-first TTFT buckets put every
# latency of a few ms in one bucket)
FINE_LOW = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075)
FINE_ITL_LOW = (0.0005, 0.001, 0.0015)
LATENCY_BUCKETS = ("sglang", "fine")


def buckets(kind: str) -> dict[str, tuple[float, ...]]:
    """The TTFT, inter-token and end-to-end bucket bounds of ``kind`` (:data:`LATENCY_BUCKETS`)."""
    if kind not in LATENCY_BUCKETS:
        raise ValueError(f"latency_buckets: one of {list(LATENCY_BUCKETS)}, got {kind!r}")
    if kind == "sglang":
        return {"ttft": TTFT_BUCKETS, "itl": ITL_BUCKETS, "e2e": E2E_BUCKETS}
    return {"ttft": FINE_LOW + TTFT_BUCKETS, "itl": FINE_ITL_LOW + ITL_BUCKETS,
            "e2e": FINE_LOW + E2E_BUCKETS}


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
    """The latency histograms (module doc; thread-safe) and generation throughput (engine
    loop only). ``latency_buckets``: ``"sglang"`` or ``"fine"``."""

    def __init__(self, latency_buckets: str = "sglang") -> None:
        b = buckets(latency_buckets)
        self.latency_buckets = latency_buckets
        self.ttft = Histogram("sglang:time_to_first_token_seconds",
                              "Histogram of time to first token in seconds.", b["ttft"],
                              ("is_streaming",))
        self.itl = Histogram("sglang:inter_token_latency_seconds",
                             "Histogram of inter-token latency in seconds.", b["itl"])
        self.e2e = Histogram("sglang:e2e_request_latency_seconds",
                             "Histogram of End-to-end request latency in seconds", b["e2e"],
                             ("is_streaming",))
        self._lock = threading.Lock()
        self.gen_throughput = 0.0
        self._tic: float | None = None  # start of the current measuring window
        self._base = 0  # generated tokens at _tic
        self._steps = 0  # steps in the window
        self._last_end = 0.0

    def describe(self) -> dict[str, Any]:
        """``/server_info``'s ``latency_buckets``: which, and each histogram's bounds."""
        return {"kind": self.latency_buckets, "time_to_first_token": list(self.ttft.buckets),
                "inter_token": list(self.itl.buckets), "e2e": list(self.e2e.buckets),
                "measured": "from the request's first bytes read off the socket to its "
                            "answer's chunks written"}

    def observe_ttft(self, seconds: float, streaming: bool) -> None:
        with self._lock:
            self.ttft.observe(seconds, ("true" if streaming else "false",))

    def observe_itl(self, seconds: float, count: int = 1) -> None:
        with self._lock:
            self.itl.observe(seconds, count=count)

    def observe_e2e(self, seconds: float, streaming: bool) -> None:
        with self._lock:
            self.e2e.observe(seconds, ("true" if streaming else "false",))

    def observe_token_times(self, times: list[float]) -> None:
        """Inter-token latencies of one request from its engine token times (one per output
        token; a step's tokens share one): per step after the first token's, the time since
        the previous step's tokens over their number."""
        i = 1
        while i < len(times):
            j = i
            while j < len(times) and times[j] == times[i]:
                j += 1
            if times[i] != times[i - 1]:
                self.observe_itl((times[i] - times[i - 1]) / (j - i), j - i)
            i = j

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

    def render(self, model_name: str) -> str:
        base = {"model_name": model_name}
        lines = []
        with self._lock:
            for h in (self.ttft, self.itl, self.e2e):
                lines += h.render(base)
        return "\n".join(lines) + "\n"

    def snapshot(self) -> dict[str, Any]:
        return {"sglang:gen_throughput": self.gen_throughput}
