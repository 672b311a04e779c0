"""Measure issue 25's done-when figures on a running ``workbench serve`` (a subprocess, so the
load generator does not share the server's interpreter):

    python tests/reliability/measure_mixed_load.py [--model data/models/wb-target]
        [--draft data/models/wb-eagle3] [--alone 20] [--load 40] [--scale 1] [--only KIND]
        [--each]

1. /health over one keep-alive connection vs a fresh connection each time (medians of 200),
   and whether they are equal within 2 ms (issue 25's bound);
2. normal requests (16 greedy tokens) one after another, alone, then under the mixed hostile
   load of tests/serve/hostile_load.py: p50 of each, the ratio (the goal: at most 2), and how
   many normal requests were refused (the goal: none); the hostile clients' outcomes;
3. where the CPU went in each window: the server process, this process (the load generator
   and the normal client), and everything else on the machine (other users: the load), as
   core-seconds and as shares of the machine's cores (/proc/stat, /proc/PID/stat). A server
   that needs less than a core while the normal p50 grows points at the CPUs' contention,
   not at the server's scheduling; the generator's own share shows how much of the machine
   the load took away from the server; and the engine loop's steps by batch kind (greedy,
   with sampled requests, with log-probabilities: /server_info's step_profile), wall vs the
   loop thread's CPU per step (CPU well below wall: the step waited for a core or the GIL).

The arrangement (issue 40): the server in its own process, unpinned; this process runs the 40
normal clients (``--normal 40``) and the 24 hostile threads of every kind (``--every 2``) of
tests/serve/hostile_load.py, unpinned too, on the same cores, each hostile HTTP request on a
fresh connection from a client its thread made once (what the server receives is what
``httpx.post`` sends, without a TLS context built per request on the generator's side).

``--each`` repeats step 2 once per hostile kind alone (which kinds cost the normal requests).
Not a test: it prints numbers. The machine's load is printed (load averages and the other
processes' CPU share); figures measured while other processes use the CPUs are provisional.
"""

from __future__ import annotations

import argparse
import http.client
import os
import resource
import statistics
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ (serve.hostile_load)

from reliability.kit import serve_subprocess  # noqa: E402
from serve.hostile_load import KINDS, hostile_threads, normal_workers  # noqa: E402

NORMAL = {"text": "def parse(path):", "sampling_params": {"max_new_tokens": 16,
                                                          "temperature": 0, "ignore_eos": True}}
TICK = os.sysconf("SC_CLK_TCK")
CORES = os.cpu_count() or 1


def health_latencies(url: str, n: int = 200) -> tuple[float, float]:
    """Medians of GET /health with http.client (no client-side setup in the timing): over one
    keep-alive connection, and over a fresh connection each time."""
    host, port = url.removeprefix("http://").rsplit(":", 1)

    def get(c: http.client.HTTPConnection) -> None:
        c.request("GET", "/health")
        r = c.getresponse()
        r.read()
        assert r.status == 200, r.status

    keep = []
    c = http.client.HTTPConnection(host, int(port), timeout=30)
    get(c)
    for _ in range(n):
        t0 = time.perf_counter()
        get(c)
        keep.append(time.perf_counter() - t0)
    c.close()
    fresh = []
    for _ in range(n):
        t0 = time.perf_counter()
        c = http.client.HTTPConnection(host, int(port), timeout=30)
        get(c)
        fresh.append(time.perf_counter() - t0)
        c.close()
    return statistics.median(keep), statistics.median(fresh)


def step_profile(url: str) -> dict[str, dict[str, float]]:
    return httpx.get(url + "/server_info", timeout=60).json()["step_profile"]


def steps_line(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]) -> str:
    """The engine loop's steps in a window, by batch kind (workbench/serve/step_profile.py):
    per step, wall and loop-thread CPU milliseconds and the mean batch."""
    parts = []
    for kind, a in after.items():
        d = {k: a[k] - before[kind][k] for k in a}
        if d["steps"]:
            n = d["steps"]
            parts.append(f"{kind}: {n} steps, {1e3 * d['wall_s'] / n:.1f} ms wall / "
                         f"{1e3 * d['cpu_s'] / n:.1f} ms CPU per step, batch "
                         f"{d['requests'] / n:.1f}, {d['tokens'] / max(d['wall_s'], 1e-9):.0f} "
                         "tok/s")
    return "engine steps: " + ("; ".join(parts) or "none")


class CpuMeter:
    """CPU seconds used by the server process, by this process (the generator and the normal
    client, every thread) and by the whole machine, between :meth:`start` and :meth:`stop`."""

    def __init__(self, server_pid: int) -> None:
        self.pid = server_pid

    def _read(self) -> tuple[float, float, float, float]:
        with open(f"/proc/{self.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        server = (int(fields[11]) + int(fields[12])) / TICK  # utime, stime
        ru = resource.getrusage(resource.RUSAGE_SELF)
        with open("/proc/stat") as f:
            cpu = [int(x) for x in f.readline().split()[1:]]
        busy = (sum(cpu) - cpu[3] - cpu[4]) / TICK  # all but idle and iowait
        return server, ru.ru_utime + ru.ru_stime, busy, time.monotonic()

    def start(self) -> None:
        self._t0 = self._read()

    def stop(self) -> dict[str, float]:
        s1, g1, b1, t1 = self._read()
        s0, g0, b0, t0 = self._t0
        wall = t1 - t0
        server, gen, busy = s1 - s0, g1 - g0, b1 - b0
        return {"wall_s": wall, "server_cpu_s": server, "generator_cpu_s": gen,
                "others_cpu_s": max(busy - server - gen, 0.0), "machine_cpu_s": busy}


def cpu_line(c: dict[str, float]) -> str:
    cap = c["wall_s"] * CORES
    parts = [f"{name} {c[key]:.1f} core-s ({100 * c[key] / cap:.0f}% of {CORES} cores)"
             for name, key in (("server", "server_cpu_s"), ("generator+client", "generator_cpu_s"),
                               ("other processes", "others_cpu_s"))]
    return f"CPU over {c['wall_s']:.1f} s: " + ", ".join(parts)


def window(url: str, meter: CpuMeter, seconds: float, scale: int, only: str | None,
           normal: int = 1, every: int = 1) -> tuple[dict[str, Any], dict[str, float], str]:
    """``mixed_load``'s window, with the CPU and the engine's steps counted while the normal
    requests run (not while the hostile clients' last requests drain afterwards)."""
    stop = threading.Event()
    tally: dict[str, Counter[Any]] = {}
    threads = hostile_threads(url, stop, tally, scale, only, every)
    time.sleep(1.0)  # the load builds up
    try:
        before = step_profile(url)
        meter.start()
        lat, status, _ = normal_workers(url, NORMAL, seconds, normal)
        cpu = meter.stop()
        steps = steps_line(before, step_profile(url))
    finally:
        stop.set()
        for t in threads:
            t.join(180)
    got = {"latency": lat, "status": status, "p50_load": statistics.median(lat),
           "hostile": {k: dict(v) for k, v in tally.items()}}
    return got, cpu, steps


def report(label: str, alone_p50: float, got: dict[str, Any], cpu: dict[str, float],
           steps: str) -> None:
    b = got["p50_load"]
    refused = sum(s == 503 for s in got["status"])
    print(f"{label}: n={len(got['latency'])}, p50 {b * 1e3:.0f} ms (x{b / alone_p50:.2f} of "
          f"alone; goal <= 2), statuses {dict(Counter(got['status']))}, 503s {refused} "
          "(goal 0)")
    print("  " + cpu_line(cpu))
    print("  " + steps)
    for name, outcome in got["hostile"].items():
        print(f"  hostile {name}: {outcome}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="data/models/wb-target")
    ap.add_argument("--draft", default="data/models/wb-eagle3")
    ap.add_argument("--alone", type=float, default=20.0, help="seconds of normal requests alone")
    ap.add_argument("--load", type=float, default=40.0, help="seconds under the hostile load")
    ap.add_argument("--scale", type=int, default=1, help="multiplies the n=16 flood threads")
    ap.add_argument("--only", default=None, help="only the hostile kinds whose name has this")
    ap.add_argument("--each", action="store_true",
                    help="also one window per hostile kind alone (--load seconds each)")
    ap.add_argument("--normal", type=int, default=1,
                    help="normal clients at once (alone and under the load)")
    ap.add_argument("--every", type=int, default=1,
                    help="multiplies every hostile kind's threads (12 at 1, 24 at 2)")
    ns = ap.parse_args()
    proc, url = serve_subprocess(ns.model, ns.draft)
    meter = CpuMeter(proc.pid)
    try:
        httpx.post(url + "/generate", json=NORMAL, timeout=300).raise_for_status()
        print(f"machine: {CORES} cores; load average before: {os.getloadavg()}")
        keep, fresh = health_latencies(url)
        print(f"/health median: keep-alive {keep * 1e3:.2f} ms, fresh connection "
              f"{fresh * 1e3:.2f} ms (difference {(keep - fresh) * 1e3:+.2f} ms; "
              f"{'within' if abs(keep - fresh) <= 2e-3 else 'NOT within'} 2 ms)")
        before = step_profile(url)
        meter.start()
        alone = normal_workers(url, NORMAL, ns.alone, ns.normal)[0]
        cpu = meter.stop()
        a = statistics.median(alone)
        print(f"normal requests alone: n={len(alone)}, p50 {a * 1e3:.0f} ms")
        print("  " + cpu_line(cpu))
        print("  " + steps_line(before, step_profile(url)))
        got, cpu, steps = window(url, meter, ns.load, ns.scale, ns.only, ns.normal, ns.every)
        report("under the mixed hostile load", a, got, cpu, steps)
        if ns.each:
            for kind in KINDS:
                got, cpu, steps = window(url, meter, ns.load, ns.scale, kind, ns.normal,
                                         ns.every)
                report(f"under '{kind}' alone", a, got, cpu, steps)
        print(f"load average after: {os.getloadavg()}")
    finally:
        proc.terminate()
        proc.wait(60)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
