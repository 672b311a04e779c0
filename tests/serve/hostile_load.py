"""A mixed hostile load against a running server, with normal requests measured meanwhile.

Used by tests/serve/test_adversarial_load.py (behaviour: no normal request refused, every answer
exact) and tests/reliability/measure_mixed_load.py (figures: normal p50 under the load vs alone).

The hostile kinds, each on its own threads for the whole run: ``n=16`` floods (OpenAI
completions), answers with every alternative at every position (refused: the budget), 800 stop
strings of 10,000 characters (refused), idle sockets (a pool kept open), clients that never
read a big streamed answer, slowloris heads, and 20 MB bodies (413).

Every hostile HTTP request goes out on a fresh connection (the server sees what ``httpx.post``
sends), from a client each thread makes once: ``httpx.post`` builds a client, and with it a TLS
context loading the CA bundle, for every request, plain-HTTP ones included — half the
generator's CPU under this load, taken from the server it measures on a 2-core machine.
"""

from __future__ import annotations

import json
import socket
import statistics
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import httpx

KINDS = ("flood n=16", "top_logprobs_num 8192", "800 x 10,000-char stops", "100 idle sockets",
         "never reads", "slowloris", "20 MB body")  # the names hostile_threads tallies under


def _addr(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


_local = threading.local()


def _client() -> httpx.Client:
    """This thread's client, made once; no keep-alive: each request on a fresh connection."""
    c = getattr(_local, "client", None)
    if c is None:
        c = _local.client = httpx.Client(timeout=120, limits=httpx.Limits(
            max_keepalive_connections=0))
    return c


def _loop(stop: threading.Event, fn: Callable[[], Any], out: Counter[Any]) -> None:
    try:
        while not stop.is_set():
            try:
                out[fn()] += 1
            except (httpx.HTTPError, OSError) as e:  # a hostile client may be cut off: counted
                out[type(e).__name__] += 1
    finally:
        c = getattr(_local, "client", None)
        if c is not None:
            c.close()


def hostile_threads(url: str, stop: threading.Event, tally: dict[str, Counter[Any]],
                    scale: int = 1, only: str | None = None, every: int = 1,
                    ) -> list[threading.Thread]:
    """Start the hostile clients (``scale`` multiplies the flood threads, ``every`` the
    threads of every kind: 12 at 1, 24 at 2; ``only``: the kinds whose name contains it)."""
    host, port = _addr(url)
    threads: list[threading.Thread] = []

    def spawn(name: str, fn: Callable[[], Any], n: int = 1) -> None:
        assert name in KINDS, name
        if only is not None and only not in name:
            return
        tally[name] = Counter()
        for _ in range(n * every):
            threads.append(threading.Thread(target=_loop, args=(stop, fn, tally[name]),
                                            daemon=True))

    def flood() -> int:
        return _client().post(url + "/v1/completions", json={
            "prompt": "x = [", "n": 16, "max_tokens": 32, "temperature": 0.8}).status_code

    def logprob_bomb() -> int:
        time.sleep(0.2)
        return _client().post(url + "/generate", json={
            "text": "def f(", "return_logprob": True, "top_logprobs_num": 8192,
            "logprob_start_len": 0, "sampling_params": {"max_new_tokens": 128}}).status_code

    stop_body = json.dumps({"text": "def f(", "sampling_params": {
        "max_new_tokens": 32, "stop": ["z" * 10_000] * 800}}).encode()
    big = b"x" * (20 << 20)

    def stop_bomb() -> int:
        time.sleep(0.2)
        return _client().post(url + "/generate", content=stop_body,
                          headers={"Content-Type": "application/json"}).status_code

    def idle_pool() -> str:
        socks = [socket.create_connection((host, port)) for _ in range(100)]
        stop.wait(2.0)
        for s in socks:
            s.close()
        return "cycled"

    def non_reader() -> str:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect((host, port))
        body = json.dumps({"input_ids": list(range(1, 100)), "stream": True,
                           "return_logprob": True, "top_logprobs_num": 20,
                           "sampling_params": {"max_new_tokens": 64}}).encode()
        s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        stop.wait(3.0)
        s.close()
        return "held"

    def slowloris() -> str:
        s = socket.create_connection((host, port))
        try:
            for b in b"POST /generate HTTP/1.1\r\nHost: x\r\n":
                if stop.is_set():
                    break
                s.sendall(bytes([b]))
                time.sleep(0.3)
        except OSError:
            return "dropped"
        finally:
            s.close()
        return "sent"

    def big_body() -> int:
        time.sleep(0.5)
        return _client().post(url + "/generate", content=big,
                          headers={"Content-Type": "application/json"}).status_code

    spawn("flood n=16", flood, 4 * scale)
    spawn("top_logprobs_num 8192", logprob_bomb)
    spawn("800 x 10,000-char stops", stop_bomb)
    spawn("100 idle sockets", idle_pool)
    spawn("never reads", non_reader, 2)
    spawn("slowloris", slowloris, 2)
    spawn("20 MB body", big_body)
    for t in threads:
        t.start()
    return threads


def normal_requests(url: str, body: dict[str, Any], seconds: float,
                    ) -> tuple[list[float], list[int], list[str]]:
    """Normal requests one after another for ``seconds``: latencies, statuses, texts."""
    lat, status, texts = [], [], []
    deadline = time.monotonic() + seconds
    with httpx.Client(timeout=120) as c:
        while time.monotonic() < deadline:
            t0 = time.perf_counter()
            r = c.post(url + "/generate", json=body)
            lat.append(time.perf_counter() - t0)
            status.append(r.status_code)
            texts.append(r.json().get("text", "") if r.status_code == 200 else r.text)
    return lat, status, texts


def normal_workers(url: str, body: dict[str, Any], seconds: float, workers: int,
                   ) -> tuple[list[float], list[int], list[str]]:
    """:func:`normal_requests` on ``workers`` threads at once, their results together."""
    if workers == 1:
        return normal_requests(url, body, seconds)
    out: list[tuple[list[float], list[int], list[str]]] = []
    threads = [threading.Thread(target=lambda: out.append(normal_requests(url, body, seconds)))
               for _ in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(out) == workers, "a normal worker failed (see its traceback above)"
    return ([x for o in out for x in o[0]], [x for o in out for x in o[1]],
            [x for o in out for x in o[2]])


def mixed_load(url: str, body: dict[str, Any], seconds: float, alone_s: float = 0.0,
               scale: int = 1, only: str | None = None) -> dict[str, Any]:
    """Normal requests alone for ``alone_s`` seconds, then under the hostile load for
    ``seconds``; the hostile clients' outcomes tallied."""
    alone = normal_requests(url, body, alone_s)[0] if alone_s else []
    stop = threading.Event()
    tally: dict[str, Counter[Any]] = {}
    threads = hostile_threads(url, stop, tally, scale, only)
    time.sleep(1.0)  # the load builds up
    try:
        lat, status, texts = normal_requests(url, body, seconds)
    finally:
        stop.set()
        for t in threads:
            t.join(180)
    return {"alone": alone, "latency": lat, "status": status, "texts": texts,
            "hostile": {k: dict(v) for k, v in tally.items()},
            "p50_alone": statistics.median(alone) if alone else None,
            "p50_load": statistics.median(lat) if lat else None}
