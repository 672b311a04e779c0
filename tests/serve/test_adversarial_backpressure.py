"""Adversarial catalogue, backpressure (workbench/serve/backpressure.py): a stream whose client
does not read stops costing engine steps. Once more than ``Backpressure.HOLD_AT`` of its chunks
are unread (the writer is blocked), or more than ``HOLD_BYTES`` bytes its client has not read
(the kernel's buffers still take them: the hostile load's smaller streams), the request is
held — left out of decode batches, its KV and place kept — and it runs again once its client
reads; its answer is exactly the engine's greedy output. A normal request beside two held
streams runs in batches of one (issue 25: in the mixed hostile load each step also carried the
two never-reading clients' logprob-heavy streams).
"""
from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from serve.serving import serving

import workbench as wb
from workbench.serve.server import ServeLimits, ServerHandle

# a write timeout long enough that the held streams are not dropped while the tests look
LIMITS = ServeLimits(max_body_bytes=1 << 20, read_timeout_s=5.0, keep_alive_s=5.0,
                     write_timeout_s=60.0, max_logprob_entries=8 << 20)
PROMPT = list(range(1, 121))
MAX_NEW = 80


@pytest.fixture(scope="module")
def adv(micro_target: Path, random_head: Path) -> Iterator[ServerHandle]:
    with serving(micro_target, random_head, LIMITS) as handle:
        yield handle


def wait_for(cond: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return False


def non_reader(adv: ServerHandle, top: int = 200, start: int | None = 0) -> socket.socket:
    """A stream of growing chunks (every chunk repeats ``top`` alternatives for every position
    from ``start``) on a socket with a 4 KB receive buffer that is not read."""
    body = json.dumps({"input_ids": PROMPT, "stream": True, "return_logprob": True,
                       "top_logprobs_num": top, "logprob_start_len": start,
                       "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0,
                                           "ignore_eos": True}}).encode()
    host, port = adv.url.removeprefix("http://").rsplit(":", 1)
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect((host, int(port)))
    s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    return s


def held_tokens(adv: ServerHandle) -> dict[int, int]:
    """rid → output tokens so far, of every held request (read on the loop thread)."""
    return adv.call(lambda e: {rid: len(e.requests[rid].tokens) for rid in
                               adv.loop.backpressure.held})


def read_all(s: socket.socket) -> bytes:
    s.settimeout(120)
    data = bytearray()
    while chunk := s.recv(1 << 20):
        data += chunk
    return bytes(data)


def dechunk(raw: bytes) -> bytes:
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head[:200]
    out = bytearray()
    while True:
        size_line, _, body = body.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            return bytes(out)
        out += body[:size]
        body = body[size + 2:]


@pytest.mark.parametrize(("top", "start"), [(200, 0), (20, None)],
                         ids=["writer blocked", "kernel buffers"])
def test_a_stream_not_read_is_held_then_resumes_with_the_same_output(
        adv: ServerHandle, solo: Callable[[list[int], int], wb.RequestOutput], top: int,
        start: int | None) -> None:
    s = non_reader(adv, top, start)
    try:
        assert wait_for(lambda: bool(adv.loop.backpressure.held), 60), "never held"
        before = held_tokens(adv)
        time.sleep(1.0)
        assert held_tokens(adv) == before, "a held request was stepped"
        (n,) = before.values()
        assert n < len(PROMPT) + MAX_NEW  # held before it finished
        raw = read_all(s)  # the client reads: released, it runs to the end
    finally:
        s.close()
    events = [line.removeprefix(b"data: ") for line in dechunk(raw).split(b"\n")
              if line.startswith(b"data: ")]
    assert events[-1] == b"[DONE]"
    final = json.loads(events[-2])
    want = solo(PROMPT, MAX_NEW)
    assert final["output_ids"] == want.token_ids and final["text"] == want.text
    assert final["meta_info"]["finish_reason"]["type"] == "length"
    assert adv.loop.backpressure.held == set()
    assert adv.wait_idle(30) and adv.kv_usage()["used_blocks"] == 0


def test_a_normal_request_beside_two_held_streams_runs_alone(adv: ServerHandle) -> None:
    socks = [non_reader(adv, 20, None), non_reader(adv, 20, None)]  # the hostile load's kind
    try:
        assert wait_for(lambda: len(adv.loop.backpressure.held) == 2, 60), "not both held"
        info0 = httpx.get(adv.url + "/server_info", timeout=30).json()
        held0 = held_tokens(adv)
        normal = {"input_ids": PROMPT[:20], "sampling_params": {"max_new_tokens": 16,
                                                                "temperature": 0,
                                                                "ignore_eos": True}}
        r = httpx.post(adv.url + "/generate", json=normal, timeout=60)
        assert r.status_code == 200, r.text
        info1 = httpx.get(adv.url + "/server_info", timeout=30).json()
        assert held_tokens(adv) == held0  # the held streams took no step meanwhile
        steps = requests = 0
        for kind, a in info1["step_profile"].items():
            steps += a["steps"] - info0["step_profile"][kind]["steps"]
            requests += a["requests"] - info0["step_profile"][kind]["requests"]
        assert steps > 0 and requests == steps  # every step a batch of one
        assert info1["backpressure"]["held"] == 2
        assert info1["backpressure"]["holds_total"] >= 2
    finally:
        for s in socks:
            s.close()
    assert adv.wait_idle(60) and adv.kv_usage()["used_blocks"] == 0
