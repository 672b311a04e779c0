"""The latency histograms agree with what a client measures: the same requests, measured by a
client in its own process (kernel receive timestamps: tests/serve/latency_client.py) and by the
server (``/metrics`` before and after them, nothing else running), at concurrency 1, 2 and 8:
mean TTFT, inter-token latency and end-to-end latency within 10 % + 2 ms of the client's.

Both sides time the same events (the request's bytes sent / read, each chunk written /
received), so the agreement does not depend on how busy the machine is; the test asserts no
speed. ``--latency-buckets fine`` adds finer low buckets, stated on /server_info."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from serve.serving import CANARY, parse_metrics, serving, still_serves

from workbench.serve.server import ServeLimits, ServerHandle
from workbench.serve.sglang_metrics import FINE_LOW, TTFT_BUCKETS

CLIENT = Path(__file__).with_name("latency_client.py")
TTFT = "sglang:time_to_first_token_seconds"
ITL = "sglang:inter_token_latency_seconds"
E2E = "sglang:e2e_request_latency_seconds"
STREAM = '{is_streaming="true"}'


@pytest.fixture(scope="module")
def adv(micro_target: Path, random_head: Path) -> Iterator[ServerHandle]:
    with serving(micro_target, random_head, ServeLimits(latency_buckets="fine")) as handle:
        yield handle


def sums(h: ServerHandle) -> dict[str, float]:
    m = parse_metrics(httpx.get(h.url + "/metrics", timeout=60).text)
    return {k: m.get(k, 0.0) for k in (f"{TTFT}_sum{STREAM}", f"{TTFT}_count{STREAM}",
                                       f"{ITL}_sum", f"{ITL}_count", f"{E2E}_sum{STREAM}",
                                       f"{E2E}_count{STREAM}")}


def agree(client: float, server: float) -> bool:
    return abs(client - server) <= 0.1 * client + 0.002


@pytest.mark.parametrize("concurrency", [1, 2, 8])
def test_histograms_agree_with_the_client(adv: ServerHandle, canary_text: str,
                                          concurrency: int) -> None:
    each, max_new = (4 if concurrency < 8 else 2), 12
    assert adv.wait_idle(60)
    before = sums(adv)
    run = subprocess.run([sys.executable, str(CLIENT), adv.url, str(concurrency), str(each),
                          str(max_new)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    reqs = json.loads(run.stdout)
    assert adv.wait_idle(60)
    after = sums(adv)
    d = {k: after[k] - before[k] for k in after}
    n = concurrency * each
    assert len(reqs) == n and all(r["tokens"] == max_new for r in reqs)
    assert d[f"{TTFT}_count{STREAM}"] == n and d[f"{E2E}_count{STREAM}"] == n
    assert d[f"{ITL}_count"] == sum(r["itl_count"] for r in reqs)
    client = {"ttft": sum(r["ttft"] for r in reqs) / n, "e2e": sum(r["e2e"] for r in reqs) / n,
              "itl": sum(r["itl_sum"] for r in reqs) / sum(r["itl_count"] for r in reqs)}
    server = {"ttft": d[f"{TTFT}_sum{STREAM}"] / n, "e2e": d[f"{E2E}_sum{STREAM}"] / n,
              "itl": d[f"{ITL}_sum"] / d[f"{ITL}_count"]}
    print(f"\nconcurrency {concurrency}: client {client} server {server}")
    for k in client:
        assert agree(client[k], server[k]), (k, client, server)
    still_serves(adv, canary_text)


def test_fine_buckets_are_stated_and_rendered(adv: ServerHandle, canary_text: str) -> None:
    info = httpx.get(adv.url + "/server_info", timeout=60).json()["latency_buckets"]
    assert info["kind"] == "fine"
    assert info["time_to_first_token"] == [*FINE_LOW, *TTFT_BUCKETS]
    httpx.post(adv.url + "/generate", json=CANARY, timeout=60)
    m = parse_metrics(httpx.get(adv.url + "/metrics", timeout=60).text)
    assert f'{TTFT}_bucket{{is_streaming="false",le="0.001"}}' in m
    still_serves(adv, canary_text)


def test_a_bad_bucket_kind_is_refused() -> None:
    from workbench.errors import ConfigError

    with pytest.raises(ConfigError, match="latency_buckets"):
        ServeLimits(latency_buckets="finer")
