"""A streaming client that measures what the server's latency histograms claim to measure, run
as its own process (no GIL shared with the server): ``python latency_client.py URL CONCURRENCY
REQUESTS_EACH MAX_NEW_TOKENS`` prints one JSON line: per request its TTFT, its inter-token
gaps' sum and token count, and its end-to-end latency, in seconds.

Times come from the kernel: each read's receive timestamp (``SO_TIMESTAMPNS``: when the bytes
reached this socket, not when this process got round to reading them), so a busy machine that
delays the client does not lengthen what it measures. A request starts just before its bytes
are sent (the connection is open already, as a keep-alive client's is). Each concurrent client
is a process of its own: clients on threads of one interpreter waited for each other's lock
between reading the clock and sending."""

from __future__ import annotations

import json
import multiprocessing as mp
import re
import socket
import struct
import sys
import time
from typing import Any
from urllib.parse import urlparse

EVENT = re.compile(rb"data: (.*?)\n\n", re.S)
SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)
PROMPTS = ["def parse(path):", "import os\n", "class Node:", "for i in range("]


def kernel_time(ancdata: list) -> float:
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS:
            sec, nsec = struct.unpack("qq", data[:16])
            return sec + nsec * 1e-9
    raise RuntimeError("no receive timestamp on the socket (SO_TIMESTAMPNS)")


def connect(host: str, port: int) -> socket.socket:
    s = socket.create_connection((host, port))
    s.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def one(s: socket.socket, host: str, port: int, prompt: str, max_new: int) -> dict:
    """One streamed /generate on the open connection ``s`` (kept open for the next)."""
    body = json.dumps({"text": prompt, "stream": True, "sampling_params": {
        "max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}}).encode()
    head = (f"POST /generate HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json"
            f"\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    if True:
        t0 = time.time()
        s.sendall(head + body)
        buf, pos = b"", 0
        ttft, last, gaps, tokens_after, sent = None, 0.0, 0.0, 0, 0
        while True:
            data, anc, _, _ = s.recvmsg(1 << 16, socket.CMSG_SPACE(16))
            if not data:
                raise RuntimeError("the server closed the connection mid-answer")
            t = kernel_time(anc)
            buf += data
            for m in EVENT.finditer(buf, pos):
                pos = m.end()
                if m.group(1) == b"[DONE]":
                    continue
                n = len(json.loads(m.group(1))["output_ids"])
                if n <= sent:
                    continue
                if ttft is None:
                    ttft = t - t0
                else:
                    gaps += t - last
                    tokens_after += n - sent
                sent, last = n, t
            if buf.endswith(b"0\r\n\r\n") and b"[DONE]" in buf:
                return {"ttft": ttft, "itl_sum": gaps, "itl_count": tokens_after,
                        "e2e": t - t0, "tokens": sent}


def worker(host: str, port: int, w: int, each: int, max_new: int, start: Any,
           out: Any) -> None:
    """One client process: its own connection and interpreter, so no other client's thread
    holds a lock between its clock read and its send."""
    try:
        with connect(host, port) as s:
            start.wait()
            out.put([one(s, host, port, PROMPTS[(w + i) % len(PROMPTS)], max_new)
                     for i in range(each)])
    except BaseException as e:  # noqa: BLE001 (sent to the parent, which fails the run)
        out.put(repr(e))
        raise


def main() -> None:
    url, conc, each, max_new = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    u = urlparse(url)
    host, port = u.hostname or "127.0.0.1", int(u.port or 80)
    ctx = mp.get_context("fork")
    start, out = ctx.Barrier(conc), ctx.Queue()
    procs = [ctx.Process(target=worker, args=(host, port, w, each, max_new, start, out))
             for w in range(conc)]
    for p in procs:
        p.start()
    results: list[dict] = []
    for _ in procs:
        got = out.get(timeout=300)
        if isinstance(got, str):
            raise RuntimeError(f"a client process failed: {got}")
        results += got
    for p in procs:
        p.join(60)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
