"""Adversarial catalogue, aborts (issue 53): ``/abort_request`` reaches only the request whose
id it names, or the items of the batch that id named ("<rid>_<i>"), as SGLang's tokenizer
manager does; a prefix of another client's id ("0"…"f" against automatic hex ids, "req-1"
against "req-10") aborts nothing.

The victims are streams whose clients do not read yet (held by backpressure: live for as long
as the test needs), read to the end afterwards."""
from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from serve.serving import serving, still_serves
from serve.test_adversarial_backpressure import dechunk, read_all

from workbench.serve.server import ServeLimits, ServerHandle

LIMITS = ServeLimits(write_timeout_s=60.0, max_logprob_entries=8 << 20)
SAMPLING = {"max_new_tokens": 200, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def adv(micro_target: Path, random_head: Path) -> Iterator[ServerHandle]:
    with serving(micro_target, random_head, LIMITS) as handle:
        yield handle


def unread_stream(adv: ServerHandle, body: dict[str, Any]) -> socket.socket:
    """A streamed /generate whose client does not read (a 4 KB receive buffer): held soon."""
    raw = json.dumps({**body, "stream": True, "return_logprob": True, "top_logprobs_num": 20,
                      "logprob_start_len": 0, "sampling_params": SAMPLING}).encode()
    host, port = adv.url.removeprefix("http://").rsplit(":", 1)
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect((host, int(port)))
    s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(raw), raw))
    return s


def finish_reasons(s: socket.socket) -> dict[str, str]:
    """Read the stream to its end: rid → its last event's finish reason."""
    try:
        raw = read_all(s)
    finally:
        s.close()
    last: dict[str, str] = {}
    for line in dechunk(raw).split(b"\n"):
        if line.startswith(b"data: {"):
            meta = json.loads(line[6:])["meta_info"]
            last[meta["id"]] = (meta["finish_reason"] or {}).get("type")
    return last


def wait_held(adv: ServerHandle, n: int) -> None:
    deadline = time.monotonic() + 60
    while len(adv.loop.backpressure.held) < n:
        assert time.monotonic() < deadline, f"{len(adv.loop.backpressure.held)} of {n} held"
        time.sleep(0.02)


def abort(adv: ServerHandle, rid: str) -> None:
    r = httpx.post(adv.url + "/abort_request", json={"rid": rid}, timeout=30)
    assert r.status_code == 200, r.text


def test_a_prefix_of_another_id_aborts_nothing(adv: ServerHandle, canary_text: str) -> None:
    socks = [unread_stream(adv, {"text": "a"}),  # an automatic (hex) id
             unread_stream(adv, {"text": "b", "rid": "req-10"}),
             unread_stream(adv, {"text": ["c", "d"], "rid": "batch-1x"})]
    wait_held(adv, 4)
    for rid in [*"0123456789abcdef", "req-1", "req", "batch-1", "batch-1x_", "batch-1x_0_"]:
        abort(adv, rid)
    got = [finish_reasons(s) for s in socks]
    assert list(got[0].values()) == ["length"]
    assert got[1] == {"req-10": "length"}
    assert got[2] == {"batch-1x_0": "length", "batch-1x_1": "length"}
    still_serves(adv, canary_text)


def test_an_exact_id_or_a_batch_id_aborts_its_own(adv: ServerHandle) -> None:
    socks = [unread_stream(adv, {"text": "a", "rid": "req-1"}),
             unread_stream(adv, {"text": "b", "rid": "req-10"}),
             unread_stream(adv, {"text": ["c", "d"], "rid": "job"}),
             unread_stream(adv, {"text": ["e", "f"], "rid": ["x7", "y7"]})]
    wait_held(adv, 6)
    for rid in ("req-1", "job", "y7"):
        abort(adv, rid)
    got = [finish_reasons(s) for s in socks]
    assert got[0] == {"req-1": "abort"}
    assert got[1] == {"req-10": "length"}
    assert got[2] == {"job_0": "abort", "job_1": "abort"}  # "job" names its batch's items
    assert got[3] == {"x7": "length", "y7": "abort"}  # a list of ids: each its own
    assert adv.wait_idle(30) and adv.kv_usage()["used_blocks"] == 0
