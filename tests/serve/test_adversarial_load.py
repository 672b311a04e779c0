"""Adversarial catalogue, mixed hostile load (tests/serve/hostile_load.py): while every hostile
kind runs at once (n=16 floods, refused logprob and stop bombs, idle sockets, clients that never
read, slowloris, 20 MB bodies), no normal request is refused (the flood's share of the queue is
bounded; /health is never refused), every normal answer is exact, hostile requests are refused
or queued, and the server ends healthy with all KV back. Latency under this load vs alone is a
figure, not a test: tests/reliability/measure_mixed_load.py.

A client that goes away while its request still waits for a batch slot takes it out of the
queue at once (it used to be noticed only once the request reached the engine, so a flood of
abandoned requests kept their slots and their queue positions).
"""

from __future__ import annotations

import dataclasses
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from serve.hostile_load import mixed_load
from serve.serving import ENGINE_CONFIG, SPEC, serving

import workbench as wb
from workbench.serve.server import ServeLimits, ServerHandle, start_server

LIMITS = ServeLimits(max_body_bytes=1 << 20, read_timeout_s=2.0, keep_alive_s=1.0,
                     write_timeout_s=1.0, max_connections=256, max_waiting=64,
                     max_logprob_entries=20_000)
NORMAL = {"text": "def parse(path):", "sampling_params": {"max_new_tokens": 16,
                                                          "temperature": 0, "ignore_eos": True}}


@pytest.fixture(scope="module")
def adv(micro_target: Path, random_head: Path) -> Iterator[ServerHandle]:
    with serving(micro_target, random_head, LIMITS) as handle:
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


def wait_for(cond: object, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():  # type: ignore[operator]
            return True
        time.sleep(0.02)
    return False


def test_a_client_gone_while_queued_leaves_the_queue(micro_target: Path,
                                                     random_head: Path) -> None:
    """One batch slot, taken by a long request; a second client sends a request (it queues in
    the loop) and goes away. The queued request is aborted while the first still runs: its
    slot and queue place are free at once, and the first request's answer is untouched."""
    engine = wb.Engine.from_pretrained(micro_target, draft=random_head,
                                       config=dataclasses.replace(ENGINE_CONFIG,
                                                                  max_batch_size=1))
    engine.set_spec(SPEC)
    handle = start_server(engine, "127.0.0.1", 0, limits=LIMITS)
    loop = handle.loop
    long_body = {"text": "def parse(path):", "sampling_params": {
        "max_new_tokens": 200, "temperature": 0, "ignore_eos": True}}
    try:
        expected = httpx.post(handle.url + "/generate", json=long_body, timeout=120).json()
        got: dict[str, httpx.Response] = {}
        first = threading.Thread(target=lambda: got.setdefault("r", httpx.post(
            handle.url + "/generate", json=long_body, timeout=120)))
        first.start()
        assert wait_for(lambda: loop.num_running == 1, 30)
        gate, abort_queued = threading.Event(), threading.Event()
        queue_abort = loop.abort

        def noted_abort(ticket: Any) -> None:
            queue_abort(ticket)
            abort_queued.set()

        loop.abort = noted_abort  # type: ignore[method-assign]
        parked = loop.call(lambda e: gate.wait(60))  # the loop thread waits between two steps
        try:
            host, port = handle.url.removeprefix("http://").rsplit(":", 1)
            s = socket.create_connection((host, int(port)))
            body = json.dumps(long_body).encode()
            s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                      b"\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            assert wait_for(lambda: loop.num_pending == 2, 30)  # submitted, not admitted
            s.close()
            # the server notices the disconnect while the loop is parked (waited for, not
            # slept on: a busy machine takes its time)
            assert abort_queued.wait(30), "the disconnect was never noticed"
        finally:
            gate.set()
            del loop.abort  # the class's method again
        parked.result(60)
        # the abort was queued behind the submit: one drain of commands, before any step
        assert wait_for(lambda: loop.num_pending == 1, 5), loop.num_pending
        assert first.is_alive() and loop.num_running == 1  # the long request still runs
        first.join(120)
        assert got["r"].status_code == 200 and got["r"].json()["text"] == expected["text"]
        assert loop.finished_total.get("abort") == 1, loop.finished_total
        assert handle.wait_idle(60)
        assert handle.kv_usage()["used_blocks"] == 0
    finally:
        handle.stop()
        engine.close()
