"""Measure issue 25's done-when figures on a running ``workbench serve`` (a subprocess, so the
load generator does not share the server's interpreter):

    python tests/reliability/measure_mixed_load.py [--model data/models/wb-target]
        [--draft data/models/wb-eagle3] [--alone 20] [--load 40] [--scale 1]

1. /health over one keep-alive connection vs a fresh connection each time (medians of 200);
2. normal requests (16 greedy tokens) one after another, alone, then under the mixed hostile
   load of tests/serve/hostile_load.py: p50 of each, the ratio, and how many normal requests
   were refused; the hostile clients' outcomes.

Not a test: it prints numbers. Name the machine and its load (printed: ``os.getloadavg``)
beside them; on a shared machine they are provisional.
"""

from __future__ import annotations

import argparse
import http.client
import os
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ (serve.hostile_load)

from reliability.kit import serve_subprocess  # noqa: E402
from serve.hostile_load import mixed_load  # noqa: E402

NORMAL = {"text": "def parse(path):", "sampling_params": {"max_new_tokens": 16,
                                                          "temperature": 0, "ignore_eos": True}}


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


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="data/models/wb-target")
    ap.add_argument("--draft", default="data/models/wb-eagle3")
    ap.add_argument("--alone", type=float, default=20.0, help="seconds of normal requests alone")
    ap.add_argument("--load", type=float, default=40.0, help="seconds under the hostile load")
    ap.add_argument("--scale", type=int, default=1, help="multiplies the n=16 flood threads")
    ap.add_argument("--only", default=None, help="only the hostile kinds whose name has this")
    ns = ap.parse_args()
    proc, url = serve_subprocess(ns.model, ns.draft)
    try:
        httpx.post(url + "/generate", json=NORMAL, timeout=300).raise_for_status()
        print(f"load average before: {os.getloadavg()}")
        keep, fresh = health_latencies(url)
        print(f"/health median: keep-alive {keep * 1e3:.2f} ms, fresh connection "
              f"{fresh * 1e3:.2f} ms (difference {(keep - fresh) * 1e3:+.2f} ms)")
        got = mixed_load(url, NORMAL, ns.load, alone_s=ns.alone, scale=ns.scale, only=ns.only)
        print(f"load average after: {os.getloadavg()}")
        a, b = got["p50_alone"], got["p50_load"]
        print(f"normal requests alone: n={len(got['alone'])}, p50 {a * 1e3:.0f} ms")
        print(f"under the mixed hostile load: n={len(got['latency'])}, p50 {b * 1e3:.0f} ms "
              f"(x{b / a:.2f}), statuses {dict(Counter(got['status']))}")
        for name, outcome in got["hostile"].items():
            print(f"  hostile {name}: {outcome}")
    finally:
        proc.terminate()
        proc.wait(60)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
