"""Adversarial catalogue, connections: what one socket may hold, whatever its client does or
does not do (workbench/serve/connections.py). Each case is one of issue 25's failures with its
bound, then a normal request still returns exactly its text:

3. a client that never reads its answer: dropped once its unsent bytes make no progress for
   ``write_timeout_s`` (they were held past every timeout);
4. idle sockets beyond the request limit: /health and requests still answered (1,030 idle
   sockets made everything a 503); requests in progress at ``limit_concurrency`` → 503 for the
   next, never for /health;
5. Nagle off: TCP_NODELAY on every accepted socket; keep-alive /health is not slower than a
   fresh connection's (it waited ~40 ms);
8. a head over ``max_header_bytes`` → 431 naming ``headers`` (100 KB passed a 64 KiB bound);
10. a body far over ``max_body_bytes`` from a plain client → that client reads the 413 (it saw a
    reset connection).
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from serve.serving import CANARY, serving, still_serves

from workbench.serve.server import ServeLimits, ServerHandle

LIMITS = ServeLimits(max_body_bytes=1 << 20, max_header_bytes=16 << 10, read_timeout_s=3.0,
                     keep_alive_s=1.0, write_timeout_s=1.0, max_connections=48,
                     limit_concurrency=6, max_logprob_entries=8 << 20)


@pytest.fixture(scope="module")
def adv(micro_target: Path, random_head: Path) -> Iterator[ServerHandle]:
    with serving(micro_target, random_head, LIMITS) as handle:
        yield handle


def address(adv: ServerHandle) -> tuple[str, int]:
    host, port = adv.url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def open_connections(adv: ServerHandle) -> int:
    return len(adv.server.server_state.connections)


def wait_for(cond: object, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():  # type: ignore[operator]
            return True
        time.sleep(0.05)
    return False


def raw_request(path: str, body: bytes) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


# ---- 3. write timeout --------------------------------------------------------------------------


def test_a_client_that_never_reads_is_dropped(adv: ServerHandle, canary_text: str) -> None:
    """A stream of ~100 MB (every chunk repeats 300 alternatives for every position) to a
    socket with a 4 KB receive buffer that is never read: once the kernel's buffers and
    uvicorn's are full, nothing is taken; the server drops the connection after
    write_timeout_s without progress, and the request's KV is freed."""
    body = json.dumps({"input_ids": list(range(1, 121)), "stream": True,
                       "return_logprob": True, "top_logprobs_num": 299, "logprob_start_len": 0,
                       "sampling_params": {"max_new_tokens": 100, "temperature": 0,
                                           "ignore_eos": True}}).encode()
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(address(adv))
    port = s.getsockname()[1]

    def held() -> bool:
        return any(p.client and p.client[1] == port
                   for p in list(adv.server.server_state.connections))

    try:
        s.sendall(raw_request("/generate", body))
        assert wait_for(held, 30)
        t0 = time.monotonic()
        assert wait_for(lambda: not held(), 120), "still held"
        assert time.monotonic() - t0 > LIMITS.write_timeout_s
    finally:
        s.close()
    still_serves(adv, canary_text)


# ---- 4. idle sockets and the request bound -----------------------------------------------------


def test_idle_sockets_do_not_deny_service(adv: ServerHandle, canary_text: str) -> None:
    """Twice max_connections idle sockets (the 1,030 case at this server's scale): /health
    and a request are answered while they are open; the server holds at most its bound."""
    idle = []
    try:
        for _ in range(2 * LIMITS.max_connections):
            s = socket.create_connection(address(adv))
            idle.append(s)
        assert wait_for(lambda: open_connections(adv) <= LIMITS.max_connections, 10)
        with httpx.Client(timeout=30) as c:
            assert c.get(adv.url + "/health").status_code == 200
            r = c.post(adv.url + "/generate", json=CANARY)
            assert r.status_code == 200 and r.json()["text"] == canary_text
        assert open_connections(adv) <= LIMITS.max_connections
    finally:
        for s in idle:
            s.close()
    still_serves(adv, canary_text)


def test_health_answers_while_the_request_limit_is_full(adv: ServerHandle,
                                                        canary_text: str) -> None:
    long = {"text": "x = [", "stream": True,
            "sampling_params": {"max_new_tokens": 240, "temperature": 0, "ignore_eos": True}}
    started = threading.Barrier(LIMITS.limit_concurrency + 1)
    release = threading.Event()

    def hold() -> None:
        with httpx.Client(timeout=60) as c, c.stream("POST", adv.url + "/generate",
                                                     json=long) as r:
            assert r.status_code == 200
            started.wait()
            release.wait(30)

    threads = [threading.Thread(target=hold) for _ in range(LIMITS.limit_concurrency)]
    for t in threads:
        t.start()
    try:
        started.wait(30)
        with httpx.Client(timeout=30) as c:
            full = c.post(adv.url + "/generate", json=CANARY)
            assert full.status_code == 503 and "retry-after" in full.headers
            assert full.json()["error"]["message"].startswith("server:")
            assert c.get(adv.url + "/health").status_code == 200
    finally:
        release.set()
        for t in threads:
            t.join()
    still_serves(adv, canary_text)


# ---- 5. Nagle ----------------------------------------------------------------------------------


def test_every_accepted_connection_has_nodelay(adv: ServerHandle, canary_text: str) -> None:
    """Nagle + delayed ACK made keep-alive answers ~40 ms slower: every accepted connection,
    kept alive or fresh, has TCP_NODELAY set (the option, not a latency: a latency bound would
    measure whatever else the machine runs)."""
    def nodelay_on_every_connection() -> int:
        socks = [p.transport.get_extra_info("socket") for p in
                 list(adv.server.server_state.connections)]
        assert socks and all(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
                             for s in socks)
        return len(socks)

    with httpx.Client(timeout=30) as c:
        assert c.get(adv.url + "/health").status_code == 200
        nodelay_on_every_connection()
        for _ in range(5):
            assert c.get(adv.url + "/health").status_code == 200
        nodelay_on_every_connection()  # still set on the kept-alive connection
        with httpx.Client(timeout=30) as fresh:
            assert fresh.get(adv.url + "/health").status_code == 200
            assert nodelay_on_every_connection() >= 2  # a second connection, set too
    still_serves(adv, canary_text)


# ---- 8. the head bound -------------------------------------------------------------------------


@pytest.mark.parametrize("pieces", [1, 40])
def test_a_head_over_the_bound_gets_431(pieces: int, adv: ServerHandle,
                                        canary_text: str) -> None:
    """100 KB of headers against a 16 KiB bound, whole or in pieces: 431 naming the field."""
    head = (b"GET /health HTTP/1.1\r\nHost: x\r\n" +
            b"".join(b"X-Pad-%d: %s\r\n" % (i, b"a" * 1000) for i in range(100)) + b"\r\n")
    s = socket.create_connection(address(adv), timeout=10)
    try:
        step = -(-len(head) // pieces)
        for i in range(0, len(head), step):
            s.sendall(head[i : i + step])
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    finally:
        s.close()
    status, _, rest = data.partition(b"\r\n")
    assert status == b"HTTP/1.1 431 Request Header Fields Too Large", data[:200]
    err = json.loads(rest.partition(b"\r\n\r\n")[2])["error"]
    assert err["field"] == "headers" and str(LIMITS.max_header_bytes) in err["message"]
    still_serves(adv, canary_text)


# ---- 10. a 413 the client can read -----------------------------------------------------------


def test_a_plain_client_reads_the_413(adv: ServerHandle, canary_text: str) -> None:
    """http.client sends the whole 20 MB body, then reads: it gets the 413 (it got a reset)."""
    host, port = address(adv)
    conn = http.client.HTTPConnection(host, port, timeout=60)
    try:
        conn.request("POST", "/generate", body=b"x" * (20 << 20),
                     headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        assert r.status == 413
        err = json.loads(r.read())["error"]
        assert err["field"] == "body" and str(LIMITS.max_body_bytes) in err["message"]
    finally:
        conn.close()
    still_serves(adv, canary_text)


# ---- fairness: n=16 floods cannot starve single requests ---------------------------------------


def test_fanout_floods_cannot_take_the_single_requests_slots(adv: ServerHandle,
                                                             canary_text: str) -> None:
    """With 8 slots, requests of several choices share at most 4: a flood of them is refused
    (503) or queued, and a single request sent meanwhile is never refused."""
    saved = adv.loop.max_pending
    adv.loop.max_pending = 8
    stop = threading.Event()
    flood: list[int] = []

    def flooder() -> None:
        with httpx.Client(timeout=60) as c:
            while not stop.is_set():
                flood.append(c.post(adv.url + "/v1/completions", json={
                    "prompt": "x = [", "n": 3, "max_tokens": 24, "temperature": 0}).status_code)

    threads = [threading.Thread(target=flooder) for _ in range(5)]
    for t in threads:
        t.start()
    try:
        singles = []
        with httpx.Client(timeout=60) as c:
            deadline = time.monotonic() + 4
            while time.monotonic() < deadline:
                r = c.post(adv.url + "/generate", json=CANARY)
                singles.append(r.status_code)
                assert r.status_code != 200 or r.json()["text"] == canary_text
    finally:
        stop.set()
        for t in threads:
            t.join()
        adv.loop.max_pending = saved
    assert singles and set(singles) == {200}, singles
    assert 503 in flood and 200 in flood, flood  # the flood was refused and served in turn
    still_serves(adv, canary_text)


def test_a_flood_does_not_grow_in_the_gaps_between_a_clients_requests(adv: ServerHandle,
                                                                        canary_text: str) -> None:
    """One client sends single requests back to back while floods of several-choice requests
    run: their choices never outnumber that client's requests in the running batch, the gaps
    between its requests included (the flood grew by one choice per gap, and each next request
    shared the batch with all of them)."""
    loop = adv.loop
    loop.FANOUT_RAMP_S = 0.2  # type: ignore[misc]  # this server's loop only (restored below)
    stop = threading.Event()
    flood: list[int] = []
    seen: list[tuple[int, int]] = []  # (fan-out choices running, single requests live)

    def flooder() -> None:
        with httpx.Client(timeout=120) as c:
            while not stop.is_set():
                flood.append(c.post(adv.url + "/v1/completions", json={
                    "prompt": "x = [", "n": 4, "max_tokens": 64,
                    "temperature": 0.8}).status_code)

    def composition(_: object) -> tuple[int, int]:
        fan = sum(t.share == "fanout" for t in loop._live.values())
        return fan, len(loop._live) - fan

    singles = []
    with httpx.Client(timeout=60) as c:
        assert c.post(adv.url + "/generate", json=CANARY).status_code == 200
        sampler_done = threading.Event()

        def sample() -> None:
            while not sampler_done.is_set():
                seen.append(adv.call(composition))
                time.sleep(0.02)

        threads = [threading.Thread(target=flooder) for _ in range(3)]
        watcher = threading.Thread(target=sample)
        try:
            for t in threads:
                t.start()
            watcher.start()
            deadline = time.monotonic() + 6
            while time.monotonic() < deadline:
                r = c.post(adv.url + "/generate", json=CANARY)
                singles.append(r.status_code)
                assert r.status_code != 200 or r.json()["text"] == canary_text
        finally:
            sampler_done.set()
            watcher.join()
            stop.set()
            for t in threads:
                t.join()
            del loop.FANOUT_RAMP_S  # back to the class's value
    assert singles and set(singles) == {200}, singles
    assert 200 in flood, flood
    assert seen and max(fan for fan, _ in seen) <= 1, sorted(set(seen))
    still_serves(adv, canary_text)
