"""Serving soak (issue 53, marked slow): the server's memory flattens under a mixed hostile
load. Two normal clients and the hostile clients of tests/serve/hostile_load.py (floods,
log-probability and stop-string bombs, idle sockets, non-reading streams, slowloris, 20 MB
bodies), plus a client sending fresh ``stop_regex`` patterns and stop strings every request
(each a new cache key), run for ``WORKBENCH_SERVE_SOAK_S`` seconds (default 600). The process's
RSS is sampled every 5 s; over the run's last half its least-squares slope must stay under
0.5 MB/min, and every normal answer is exact.

``WORKBENCH_SERVE_SOAK_S=600 pytest -m slow tests/serve/test_serve_soak.py -s``
"""
from __future__ import annotations

import os
import random
import statistics
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from serve.hostile_load import hostile_threads, normal_requests
from serve.serving import CANARY, serving

from workbench.reliability import rss_bytes
from workbench.serve.server import ServeLimits, ServerHandle

# Measured once (docs/SERVING.md): +0.74 MB/min over the last half of 600 s, so the bound is
# not met yet; the test stays as the check (an unexpected pass is reported, not an error).
pytestmark = [pytest.mark.slow,
              pytest.mark.xfail(reason="RSS slope over the last half above 0.5 MB/min "
                                       "(issue 53: not done)", strict=False)]
MB = 1e6
SLOPE_MB_PER_MIN = 0.5


@pytest.fixture(scope="module")
def adv(micro_target: Path, random_head: Path) -> Iterator[ServerHandle]:
    with serving(micro_target, random_head, ServeLimits(write_timeout_s=10.0)) as handle:
        yield handle


def fresh_stops(url: str, stop: threading.Event, out: Counter[Any]) -> None:
    """Every request a new stop_regex pattern set and a new stop-string set."""
    rng = random.Random(53)
    with httpx.Client(timeout=120) as c:
        while not stop.is_set():
            tag = rng.randrange(1 << 60)
            pats = [f"q{tag:x}{i}[a-z]{{2,40}}(x|y)+z" for i in range(8)]
            strings = [f"{tag:x}-{i}-" + "w" * 200 for i in range(16)]
            r = c.post(url + "/generate", json={"text": "def f(", "sampling_params": {
                "max_new_tokens": 8, "stop_regex": pats, "stop": strings}})
            out[r.status_code] += 1


def slope_mb_per_min(samples: list[tuple[float, int]]) -> float:
    ts = [t for t, _ in samples]
    mt, mr = statistics.fmean(ts), statistics.fmean(r for _, r in samples)
    num = sum((t - mt) * (r - mr) for t, r in samples)
    den = sum((t - mt) ** 2 for t in ts)
    return num / den / MB * 60


def test_rss_flattens_under_a_mixed_hostile_load(adv: ServerHandle) -> None:
    seconds = float(os.environ.get("WORKBENCH_SERVE_SOAK_S", "600"))
    want = httpx.post(adv.url + "/generate", json=CANARY, timeout=60).json()["text"]
    stop = threading.Event()
    tally: dict[str, Counter[Any]] = {"fresh stops": Counter()}
    threads = hostile_threads(adv.url, stop, tally)
    threads.append(threading.Thread(target=fresh_stops, args=(adv.url, stop,
                                                               tally["fresh stops"])))
    threads[-1].start()
    normal: list[tuple[list[float], list[int], list[str]]] = []
    clients = [threading.Thread(target=lambda: normal.append(
        normal_requests(adv.url, CANARY, seconds))) for _ in range(2)]
    samples: list[tuple[float, int]] = []
    t0 = time.monotonic()
    for c in clients:
        c.start()
    try:
        while time.monotonic() - t0 < seconds:
            samples.append((time.monotonic() - t0, rss_bytes()))
            time.sleep(5.0)
    finally:
        for c in clients:
            c.join(300)
        stop.set()
        for t in threads:
            t.join(180)
    statuses = [s for o in normal for s in o[1]]
    texts = [x for o in normal for x in o[2]]
    assert statuses and set(statuses) == {200}, Counter(statuses)
    assert all(t == want for t in texts)
    half = [s for s in samples if s[0] >= seconds / 2]
    slope = slope_mb_per_min(half)
    print(f"\nserve soak: {seconds:.0f} s, {len(statuses)} normal requests, RSS "
          f"{samples[0][1] / MB:.0f} -> {samples[-1][1] / MB:.0f} MB, last-half slope "
          f"{slope:+.2f} MB/min; hostile: { {k: dict(v) for k, v in tally.items()} }")
    assert slope < SLOPE_MB_PER_MIN, f"RSS still grows {slope:.2f} MB/min over the last half"
    assert adv.wait_idle(60) and adv.kv_usage()["used_blocks"] == 0
