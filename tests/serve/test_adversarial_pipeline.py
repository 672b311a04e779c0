"""Adversarial catalogue, pipelined heads (issue 53): every request head on a connection is
held to ``max_header_bytes`` (431 naming ``headers``), the second and later ones of a pipeline
too — before, a head buffered behind the first request in the same segment reached h11
unchecked (64 KiB + 100 … + 40,000 bytes → 200; ~128 KiB → h11's own 400)."""
from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from serve.serving import CANARY, serving, still_serves

from workbench.serve.server import ServeLimits, ServerHandle

LIMITS = ServeLimits()  # the default 64 KiB head bound
BOUND = LIMITS.max_header_bytes


@pytest.fixture(scope="module")
def adv(micro_target: Path, random_head: Path) -> Iterator[ServerHandle]:
    with serving(micro_target, random_head, LIMITS) as handle:
        yield handle


def head_of(size: int) -> bytes:
    """A GET /health head of exactly ``size`` bytes."""
    start, end = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: ", b"\r\n\r\n"
    return start + b"a" * (size - len(start) - len(end)) + end


def first(kind: str) -> bytes:
    if kind == "GET":
        return b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    body = json.dumps(CANARY).encode()
    return (b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body))


def statuses(adv: ServerHandle, data: bytes, n: int) -> tuple[list[bytes], bytes]:
    """Send ``data`` in one write; the status lines of the answers (until ``n`` came or the
    server closed), and the raw answers."""
    host, port = adv.url.removeprefix("http://").rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=30)
    got = b""
    try:
        s.sendall(data)
        while got.count(b"HTTP/1.1 ") < n or not got.endswith(b"}"):
            if not (chunk := s.recv(1 << 16)):
                break
            got += chunk
    except ConnectionResetError:
        pass
    finally:
        s.close()
    return [line.split(b"\r\n")[0] for line in got.split(b"HTTP/1.1 ")[1:]], got


@pytest.mark.parametrize("kind", ["GET", "POST"])
@pytest.mark.parametrize("size", [BOUND + 100, BOUND + 40_000, 2 * BOUND])
def test_a_pipelined_head_over_the_bound_gets_431(adv: ServerHandle, canary_text: str, kind: str,
                                                  size: int) -> None:
    got, raw = statuses(adv, first(kind) + head_of(size), 2)
    assert got == [b"200 OK", b"431 Request Header Fields Too Large"], raw[-400:]
    err = json.loads(raw.rpartition(b"\r\n\r\n")[2])["error"]
    assert err["field"] == "headers" and str(BOUND) in err["message"]
    still_serves(adv, canary_text)


def test_pipelined_heads_within_the_bound_are_answered(adv: ServerHandle) -> None:
    got, raw = statuses(adv, first("POST") + head_of(BOUND) + first("GET"), 3)
    assert got == [b"200 OK"] * 3, raw[-400:]
