"""Adversarial catalogue, mixed hostile load (tests/serve/hostile_load.py): while every hostile
kind runs at once (n=16 floods, refused logprob and stop bombs, idle sockets, clients that never
read, slowloris, 20 MB bodies), no normal request is refused (the flood's share of the queue is
bounded; /health is never refused), every normal answer is exact, hostile requests are refused
or queued, and the server ends healthy with all KV back. Latency under this load vs alone is a
figure, not a test: tests/reliability/measure_mixed_load.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from serve.hostile_load import mixed_load
from serve.serving import serving

from workbench.serve.server import ServeLimits, ServerHandle

LIMITS = ServeLimits(max_body_bytes=1 << 20, read_timeout_s=2.0, keep_alive_s=1.0,
                     write_timeout_s=1.0, max_connections=256, max_waiting=64,
                     max_logprob_entries=20_000)
NORMAL = {"text": "def parse(path):", "sampling_params": {"max_new_tokens": 16,
                                                          "temperature": 0, "ignore_eos": True}}


@pytest.fixture(scope="module")
def adv(micro_target: Path, serve_head: Path) -> Iterator[ServerHandle]:
    with serving(micro_target, serve_head, LIMITS) as handle:
        yield handle


def test_mixed_hostile_load_refuses_no_normal_request(adv: ServerHandle) -> None:
    expected = httpx.post(adv.url + "/generate", json=NORMAL, timeout=60).json()["text"]
    got = mixed_load(adv.url, NORMAL, seconds=12.0)
    assert got["status"] and set(got["status"]) == {200}, got["status"]
    assert set(got["texts"]) == {expected}
    h = got["hostile"]
    assert set(h["top_logprobs_num 8192"]) == {400}, h
    assert set(h["800 x 10,000-char stops"]) <= {400, 413}, h  # 8 MB: over the body bound
    assert set(h["20 MB body"]) <= {413}, h
    assert h["flood n=16"].get(200), h  # the flood was served in its share
    assert httpx.get(adv.url + "/health", timeout=30).status_code == 200
    assert adv.wait_idle(120)
    assert adv.kv_usage()["used_blocks"] == 0
