"""Adversarial catalogue, stalled readers of large answers: four clients each ask for a ~25 MB
non-streamed answer (a batch of log-probability tables) and never read a byte. Each
connection is dropped once its unsent bytes make no progress for the write timeout, its
buffers go with it, the engine holds no KV, and the process's memory comes back: RSS within
10 % of what it was after the same four answers were read (the allocator's high-water mark of
that work counted in both). Then the canary answers as before."""

from __future__ import annotations

import gc
import json
import logging
import random
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from serve.serving import CANARY, still_serves

import workbench as wb
from workbench.serve.server import ServeLimits, ServerHandle, start_server

WRITE_TIMEOUT_S = 2.0
LIMITS = ServeLimits(write_timeout_s=WRITE_TIMEOUT_S, max_logprob_entries=8 << 20)
ANSWER_MB = 25
CLIENTS = 4


@pytest.fixture(scope="module")
def adv(micro_target: Path) -> Iterator[ServerHandle]:
    engine = wb.Engine.from_pretrained(micro_target, config=wb.EngineConfig(
        kv_budget_tokens=24576, max_model_len=1024))
    handle = start_server(engine, limits=LIMITS)
    try:
        yield handle
    finally:
        handle.stop()
        engine.close()


def big_body() -> bytes:
    """A /generate batch whose answer is ~25 MB: 4 prompts of 950 tokens, each position's
    token and 200 alternatives with their text."""
    rng = random.Random(0)
    ids = [rng.randrange(1, 299) for _ in range(950)]
    return json.dumps({"input_ids": [ids] * 4, "return_logprob": True,
                       "top_logprobs_num": 200, "logprob_start_len": 0,
                       "return_text_in_logprobs": True,
                       "sampling_params": {"max_new_tokens": 1, "temperature": 0}}).encode()


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 1e6


def open_connections(adv: ServerHandle) -> int:
    return len(adv.server.server_state.connections)


def test_stalled_readers_of_large_answers_are_dropped_and_memory_returns(
        adv: ServerHandle, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    body = big_body()
    sizes: list[int] = []

    def read_one() -> None:
        r = httpx.post(adv.url + "/generate", content=body, timeout=300,
                       headers={"content-type": "application/json"})
        assert r.status_code == 200, r.text[:300]
        sizes.append(len(r.content))

    readers = [threading.Thread(target=read_one) for _ in range(CLIENTS)]
    for t in readers:
        t.start()
    for t in readers:
        t.join()
    assert len(sizes) == CLIENTS and min(sizes) > ANSWER_MB * 1e6 * 0.9, sizes
    canary = httpx.post(adv.url + "/generate", json=CANARY, timeout=60).json()["text"]
    assert adv.wait_idle(60)
    gc.collect()
    before = rss_mb()

    host, port = adv.url.removeprefix("http://").rsplit(":", 1)
    stalled = []
    for _ in range(CLIENTS):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect((host, int(port)))
        s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        stalled.append(s)
    try:
        # wait for the drops themselves: the server may not have accepted a socket yet when
        # this loop starts (a busy machine), so "no open connection" alone proves nothing
        def drops() -> list[logging.LogRecord]:
            return [r for r in caplog.records if "none taken" in r.getMessage()]

        deadline = time.monotonic() + 240
        while ((len(drops()) < CLIENTS or open_connections(adv))
               and time.monotonic() < deadline):
            time.sleep(0.2)
        assert len(drops()) == CLIENTS, [(r.name, r.getMessage()) for r in caplog.records]
        assert open_connections(adv) == 0, "a stalled reader kept its connection"
    finally:
        for s in stalled:
            s.close()
    assert adv.wait_idle(60) and adv.kv_usage()["used_blocks"] == 0
    gc.collect()
    after = rss_mb()
    print(f"\nRSS {before:.0f} MB after the answers were read, {after:.0f} MB after the stalls")
    assert after <= before * 1.1, (before, after)
    still_serves(adv, canary)
