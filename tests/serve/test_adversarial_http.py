"""An adversarial catalogue over real HTTP on loopback: every case asserts its status (and the
field it names) and then that a normal request still returns exactly the text it returned
before. One server per module, with tight limits so the connection cases finish in seconds.

Covered: sampling parameters that used to produce NaN (top_p underflow, ...), a request whose
numbers fail (request-scoped: it alone gets a 500 with an error id), malformed and hostile
bodies (nested JSON, lone surrogates, huge bodies by Content-Length, sent and chunked), bounds
(prompt characters, context, queue → 503 + Retry-After), stop strings (lossless, trimmed,
matched string), slowloris / short body / idle connections (dropped), an API key, a
200-request burst, and ``workbench serve`` exiting non-zero when its engine loop dies.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import logging
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from serve.serving import CANARY, TEXT_PROMPTS, serving, still_serves

import workbench as wb
from workbench.serve.server import ServeLimits, ServerHandle

LIMITS = ServeLimits(max_body_bytes=1 << 20, max_prompt_chars=4096, read_timeout_s=1.0,
                     keep_alive_s=1.0, max_header_bytes=16 << 10, health_step_s=1.0)
DEADLINE_S = 15.0  # a connection case that is not over by then has hung


@pytest.fixture(scope="module")
def adv(micro_target: Path, random_head: Path) -> Iterator[ServerHandle]:
    with serving(micro_target, random_head, LIMITS) as handle:
        yield handle


@pytest.fixture()
def client(adv: ServerHandle) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=adv.url, timeout=60) as c:
        yield c


def gen(text: str = "def f(", **sp: Any) -> dict[str, Any]:
    return {"text": text, "sampling_params": {"max_new_tokens": 4, **sp}}


def nested(depth: int) -> bytes:
    return b'{"text": "a", "sampling_params": {"stop": ' + b"[" * depth + b"]" * depth + b"}}"


# (path, body: dict or raw bytes, status, field the error names or None)
CASES: dict[str, tuple[str, Any, int, str | None]] = {
    # numbers that used to reach NaN: now a valid distribution (the top token at least)
    "top_p 1e-300": ("/generate", gen(temperature=1, top_p=1e-300), 200, None),
    "top_p 5e-324": ("/generate", gen(temperature=1, top_p=5e-324), 200, None),
    "completions top_p 1e-46": ("/v1/completions", {"prompt": "a", "max_tokens": 4,
                                                    "temperature": 1, "top_p": 1e-46}, 200, None),
    "min_p 0.999999": ("/generate", gen(temperature=1, min_p=0.999999), 200, None),
    "temperature 1e-30": ("/generate", gen(temperature=1e-30), 200, None),
    "temperature 1e30": ("/generate", gen(temperature=1e30), 200, None),
    "temperature 1e308 top_p tiny": ("/generate", gen(temperature=1e308, top_p=1e-300), 200,
                                     None),
    "top_k 1 temperature 50": ("/generate", gen(temperature=50, top_k=1), 200, None),
    "all filters at once": ("/generate", gen(temperature=0.01, top_k=2, top_p=1e-200,
                                             min_p=0.99), 200, None),
    "seed at the top of the range": ("/generate", gen(temperature=1, seed=2**64 - 1), 200, None),
    "huge max_new_tokens capped by context": ("/generate", gen(max_new_tokens=10**12,
                                                               temperature=0), 200, None),
    "stop token id outside the vocabulary": ("/generate", gen(stop_token_ids=[10**9]), 200, None),
    "1000 stop strings": ("/generate", gen(stop=[f"zz{i}" for i in range(1000)]), 400,
                          "sampling_params.stop"),
    "10k-character stop string": ("/generate", gen(stop=["q" * 10_000]), 400,
                                  "sampling_params.stop"),
    # values refused with the field named
    "seed 2**70": ("/generate", gen(seed=2**70), 400, "sampling_params.seed"),
    "seed 2**64": ("/generate", gen(seed=2**64), 400, "sampling_params.seed"),
    "completions seed 2**70": ("/v1/completions", {"prompt": "a", "seed": 2**70}, 400, "seed"),
    "temperature NaN": ("/generate", b'{"text": "a", "sampling_params": {"temperature": NaN}}',
                        400, "sampling_params.temperature"),
    "temperature Infinity": ("/generate", b'{"text": "a", "sampling_params": '
                             b'{"temperature": Infinity}}', 400, "sampling_params.temperature"),
    "temperature string": ("/generate", gen(temperature="hot"), 400,
                           "sampling_params.temperature"),
    "top_p zero": ("/generate", gen(top_p=0), 400, "sampling_params.top_p"),
    "top_p above one": ("/generate", gen(top_p=1.5), 400, "sampling_params.top_p"),
    "min_p one": ("/generate", gen(min_p=1), 400, "sampling_params.min_p"),
    "top_k -2": ("/generate", gen(top_k=-2), 400, "sampling_params.top_k"),
    "max_new_tokens -1": ("/generate", gen(max_new_tokens=-1), 400,
                          "sampling_params.max_new_tokens"),
    "max_new_tokens float": ("/generate", gen(max_new_tokens=2.5), 400,
                             "sampling_params.max_new_tokens"),
    "stop_token_ids -1": ("/generate", gen(stop_token_ids=[-1]), 400,
                          "sampling_params.stop_token_ids"),
    "stop_token_ids string": ("/generate", gen(stop_token_ids=["x"]), 400,
                              "sampling_params.stop_token_ids"),
    "stop_token_ids scalar": ("/generate", gen(stop_token_ids=5), 400,
                              "sampling_params.stop_token_ids"),
    "ignore_eos string": ("/generate", gen(ignore_eos="no"), 400, "sampling_params.ignore_eos"),
    "no_stop_trim string": ("/generate", gen(no_stop_trim="yes"), 400,
                            "sampling_params.no_stop_trim"),
    "empty stop string": ("/generate", gen(stop=[""]), 400, "sampling_params.stop"),
    "stop number": ("/generate", gen(stop=5), 400, "sampling_params.stop"),
    "lone surrogate in text": ("/generate", b'{"text": "a\\ud800b"}', 400, "text"),
    "lone surrogate in stop": ("/generate", b'{"text": "a", "sampling_params": '
                               b'{"stop": ["\\udfff"]}}', 400, "sampling_params.stop"),
    "lone surrogate in prompt": ("/v1/completions", b'{"prompt": "\\ud83d"}', 400, "prompt"),
    "nested JSON 100k deep": ("/generate", nested(100_000), 400, "body"),
    "nested JSON 5k deep": ("/generate", nested(5_000), 400, "body"),
    "malformed JSON": ("/generate", b'{"text": "a", ', 400, "body"),
    "not an object": ("/generate", b'[1, 2]', 400, "body"),
    "empty body": ("/generate", b"", 400, "body"),
    "not UTF-8": ("/generate", b"\xff\xfe{}", 400, "body"),
    "unknown field": ("/generate", {"text": "a", "beam": 2}, 400, "beam"),
    "unknown sampling field": ("/generate", gen(beam_width=2), 400,
                               "sampling_params.beam_width"),
    "text and input_ids": ("/generate", {"text": "a", "input_ids": [1]}, 400, "text"),
    "no prompt": ("/generate", {}, 400, "text"),
    # batches (SGLang's list of prompts): bounded before any item is parsed or admitted
    "10,000-item text batch": ("/generate", {"text": ["a"] * 10_000}, 400, "text"),
    "10,000-item input_ids batch": ("/generate", {"input_ids": [[1, 2]] * 10_000}, 400,
                                    "input_ids"),
    "batch larger than the server holds": ("/generate", {"text": ["a"] * 1000}, 400, "text"),
    "batch with one bad item last": ("/generate", {"text": ["a"] * 20 + [""]}, 400,
                                     "text[20]"),
    "batch with one item over the context": ("/generate", {"input_ids": [[5]] * 3 + [[5] * 300]},
                                             400, "input_ids[3]"),
    "empty batch": ("/generate", {"text": []}, 400, "text"),
    "batch with sampling params for another size": ("/generate", {
        "text": ["a", "b", "c"], "sampling_params": [{}, {}]}, 400, "sampling_params"),
    "batch with a repeated rid": ("/generate", {"text": ["a", "b"], "rid": ["r", "r"]}, 400,
                                  "rid"),
    # stop_regex: RE2 (linear time), bounded patterns, a bounded window
    "stop_regex 10k characters": ("/generate", gen(stop_regex="a" * 10_000), 400,
                                  "sampling_params.stop_regex"),
    "stop_regex 33 patterns": ("/generate", gen(stop_regex=[f"p{i}" for i in range(33)]), 400,
                               "sampling_params.stop_regex"),
    "stop_regex 10,000 patterns": ("/generate", gen(stop_regex=["q"] * 10_000), 400,
                                   "sampling_params.stop_regex"),
    "stop_regex backreference": ("/generate", gen(stop_regex=r"(a)\1"), 400,
                                 "sampling_params.stop_regex"),
    "stop_regex lookahead": ("/generate", gen(stop_regex="(?=a)a"), 400,
                             "sampling_params.stop_regex"),
    "stop_regex unbalanced": ("/generate", gen(stop_regex="(("), 400,
                              "sampling_params.stop_regex"),
    "stop_regex matching the empty string": ("/generate", gen(stop_regex="x*"), 400,
                                             "sampling_params.stop_regex"),
    "stop_regex compiling too large": ("/generate", gen(stop_regex=r"\pL{1000}"), 400,
                                       "sampling_params.stop_regex"),
    "stop_regex nested repetition": ("/generate", gen(stop_regex="(((a{9}){9}){9}){9}"), 400,
                                     "sampling_params.stop_regex"),
    "stop_regex wrong type": ("/generate", gen(stop_regex=5), 400,
                              "sampling_params.stop_regex"),
    "stop_regex lone surrogate": ("/generate", b'{"text": "a", "sampling_params": '
                                  b'{"stop_regex": ["\\ud800"]}}', 400,
                                  "sampling_params.stop_regex"),
    "stop_regex catastrophic for backtracking": ("/generate", {
        "text": "a" * 150, "sampling_params": {"max_new_tokens": 32,
                                                "stop_regex": ["(a+)+@", "(.*.*)*@@", "(a|a)*@"]}},
        200, None),
    "completions stop_regex invalid": ("/v1/completions", {"prompt": "a",
                                                           "stop_regex": "(?<=a)b"}, 400,
                                       "stop_regex"),
    # SGLang's control routes
    "abort_request rid number": ("/abort_request", {"rid": 7}, 400, "rid"),
    "abort_request abort_all string": ("/abort_request", {"abort_all": "yes"}, 400, "abort_all"),
    "abort_request unknown field": ("/abort_request", {"rid": "x", "kill": True}, 400, "kill"),
    "abort_request rid of nothing": ("/abort_request", {"rid": "no-such-request"}, 200, None),
    "flush_cache timeout not a number": ("/flush_cache?timeout=soon", {}, 400, "timeout"),
    "flush_cache timeout 10**9": ("/flush_cache?timeout=1e9", {}, 400, "timeout"),
    "flush_cache timeout NaN": ("/flush_cache?timeout=nan", {}, 400, "timeout"),
    # max_new_tokens 0 (prefill only): nothing to stream
    "max_new_tokens 0 streaming": ("/generate", {**gen(max_new_tokens=0), "stream": True}, 400,
                                   "sampling_params.max_new_tokens"),
    "max_new_tokens 0 streaming batch": ("/generate", {"text": ["a", "b"], "stream": True,
                                                       "sampling_params": {"max_new_tokens": 0}},
                                         400, "sampling_params.max_new_tokens"),
    "max_new_tokens 0": ("/generate", gen(max_new_tokens=0), 200, None),
    # OpenAI: max_tokens 0 only scores the prompt (echo); a budget over the context is refused
    "max_tokens 0 without echo": ("/v1/completions", {"prompt": "a", "max_tokens": 0}, 400,
                                  "max_tokens"),
    "max_tokens 10**9": ("/v1/completions", {"prompt": "a", "max_tokens": 10**9}, 400,
                         "max_tokens"),
    "chat max_tokens 0": ("/v1/chat/completions", {"messages": [{"role": "user",
                                                                 "content": "a"}],
                                                   "max_tokens": 0}, 400, "max_tokens"),
    "input_ids floats": ("/generate", {"input_ids": [1.5, 2]}, 400, "input_ids"),
    "input_ids negative": ("/generate", {"input_ids": [1, -1]}, 400, "input_ids"),
    "input_ids outside the vocabulary": ("/generate", {"input_ids": [1, 10**9]}, 400,
                                         "input_ids"),
    "input_ids longer than the context": ("/generate", {"input_ids": [5] * 300}, 400,
                                          "input_ids"),
    "text over the character bound": ("/generate", {"text": "x" * 5000}, 400, "text"),
    "prompt over the character bound": ("/v1/completions", {"prompt": "y" * 5000}, 400,
                                        "prompt"),
    "text under the char bound, over the context": ("/generate", {"text": "\u00e9 " * 2000},
                                                    400, "text"),
    "stream string": ("/generate", {"text": "a", "stream": "yes"}, 400, "stream"),
    "rid number": ("/generate", {"text": "a", "rid": 5}, 400, "rid"),
    "body over the limit (sent)": ("/generate", b'{"text": "' + b"a" * (2 << 20) + b'"}', 413,
                                   "body"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_case(name: str, adv: ServerHandle, canary_text: str, client: httpx.Client) -> None:
    path, body, status, field = CASES[name]
    kw: dict[str, Any] = {"content": body, "headers": {"content-type": "application/json"}} \
        if isinstance(body, bytes) else {"json": body}
    try:
        r = client.post(path, **kw)
    except httpx.WriteError:  # a 413 may close the socket while the client is still sending
        assert status == 413
    else:
        assert r.status_code == status, r.text
        if status != 200:
            assert r.json()["error"]["field"] == field, r.text
        elif path == "/generate":
            meta = r.json()["meta_info"]
            assert meta["finish_reason"]["type"] in ("length", "stop"), meta
    still_serves(adv, canary_text)


def test_huge_body_by_content_length_is_refused_before_reading(adv: ServerHandle,
                                                              canary_text: str) -> None:
    """50 MB announced, none sent: the 413 comes from the headers alone."""
    head = (b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 52428800\r\n\r\n")
    reply = exchange(adv, head)
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
    assert b'"field":"body"' in reply.replace(b" ", b"")
    still_serves(adv, canary_text)


def test_chunked_body_over_the_limit(adv: ServerHandle, canary_text: str) -> None:
    def chunks() -> Iterator[bytes]:
        yield b'{"text": "'
        for _ in range(40):
            yield b"a" * 65536
        yield b'"}'

    try:
        r = httpx.post(adv.url + "/generate", content=chunks(), timeout=30,
                       headers={"content-type": "application/json"})
    except httpx.HTTPError:  # closed while still sending: refused all the same
        pass
    else:
        assert r.status_code == 413 and r.json()["error"]["field"] == "body"
    still_serves(adv, canary_text)


def test_wrong_method_and_unknown_path(client: httpx.Client, adv: ServerHandle,
                                       canary_text: str) -> None:
    assert client.get("/generate").status_code == 405
    r = client.get("/nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == 404
    still_serves(adv, canary_text)


def test_oversized_header_is_refused(adv: ServerHandle, canary_text: str) -> None:
    head = (b"POST /generate HTTP/1.1\r\nHost: x\r\nX-Big: " + b"b" * (64 << 10) +
            b"\r\nContent-Length: 2\r\n\r\n{}")
    reply = exchange(adv, head)
    assert reply == b"" or reply.startswith((b"HTTP/1.1 400", b"HTTP/1.1 431")), reply[:200]
    still_serves(adv, canary_text)


# ---- connections -----------------------------------------------------------------------------


def address(adv: ServerHandle) -> tuple[str, int]:
    m = re.match(r"http://([\d.]+):(\d+)", adv.url)
    assert m
    return m.group(1), int(m.group(2))


def exchange(adv: ServerHandle, data: bytes) -> bytes:
    """Send ``data`` on a fresh connection, then read until the server closes it."""
    with socket.create_connection(address(adv), timeout=DEADLINE_S) as s:
        try:
            s.sendall(data)
        except (BrokenPipeError, ConnectionResetError):
            pass
        out = b""
        while True:
            try:
                chunk = s.recv(65536)
            except ConnectionResetError:
                return out
            if not chunk:
                return out
            out += chunk


def dropped_within(adv: ServerHandle, first: bytes, trickle: bytes | None) -> float:
    """Seconds until the server closes a connection that sent ``first`` and then ``trickle``
    every 0.2 s; fails if it is still open after DEADLINE_S."""
    t0 = time.monotonic()
    with socket.create_connection(address(adv), timeout=0.2) as s:
        if first:
            s.sendall(first)
        while time.monotonic() - t0 < DEADLINE_S:
            try:
                if trickle:
                    s.sendall(trickle)
                if s.recv(65536) == b"":
                    return time.monotonic() - t0
            except TimeoutError:
                continue
            except (BrokenPipeError, ConnectionResetError):
                return time.monotonic() - t0
    raise AssertionError(f"connection still open after {DEADLINE_S} s")


@pytest.mark.parametrize("kind", ["slowloris headers", "short body", "idle connection"])
def test_slow_clients_are_dropped(kind: str, adv: ServerHandle, canary_text: str) -> None:
    if kind == "slowloris headers":
        dropped_within(adv, b"POST /generate HTTP/1.1\r\nHost: x\r\n", b"X-a: b\r\n")
    elif kind == "short body":
        dropped_within(adv, b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n"
                            b"Content-Type: application/json\r\n\r\n{\"text\"", None)
    else:
        dropped_within(adv, b"", None)
    still_serves(adv, canary_text)


def test_many_slow_connections_do_not_block_normal_requests(adv: ServerHandle,
                                                            canary_text: str) -> None:
    socks = []
    try:
        for _ in range(30):
            s = socket.create_connection(address(adv), timeout=5)
            s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 50\r\n\r\n{")
            socks.append(s)
        still_serves(adv, canary_text)  # while they hang
        time.sleep(LIMITS.read_timeout_s + 0.5)
        for s in socks:
            s.settimeout(DEADLINE_S)
            assert s.recv(100) == b"", "a stalled upload was not dropped"
    finally:
        for s in socks:
            s.close()
    still_serves(adv, canary_text)


def test_client_gone_during_upload_is_quiet(adv: ServerHandle, canary_text: str,
                                            caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        for _ in range(5):
            s = socket.create_connection(address(adv), timeout=5)
            s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{\"t")
            time.sleep(0.05)
            s.close()
        time.sleep(0.3)
        still_serves(adv, canary_text)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


def test_disconnect_while_generating_frees_kv(adv: ServerHandle, canary_text: str) -> None:
    body = gen(max_new_tokens=200, temperature=0, ignore_eos=True)
    with httpx.Client(base_url=adv.url, timeout=0.3) as c, pytest.raises(httpx.ReadTimeout):
        c.post("/generate", json=body)
    still_serves(adv, canary_text)


# ---- request-scoped failures, queue, health ---------------------------------------------------


def test_a_request_whose_numbers_fail_fails_alone(adv: ServerHandle, canary_text: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A sampling row without a valid distribution: that request gets a 500 with an error id
    (no exception text); requests running with it finish normally; the loop lives on."""
    import torch

    from workbench import sampler

    real = sampler.process_probs

    def poisoned(logits: torch.Tensor, sp: wb.SamplingParams) -> torch.Tensor:
        p = real(logits, sp)
        return torch.full_like(p, float("nan")) if sp.temperature == 0.123 else p

    monkeypatch.setattr(sampler, "process_probs", poisoned)
    good: dict[str, Any] = {}

    def normal() -> None:
        good["r"] = httpx.post(adv.url + "/generate", json={**CANARY, "sampling_params": {
            **CANARY["sampling_params"], "max_new_tokens": 40}}, timeout=60)

    t = threading.Thread(target=normal)
    t.start()
    bad = httpx.post(adv.url + "/generate", json=gen(temperature=0.123, max_new_tokens=30),
                     timeout=60)
    t.join(60)
    assert bad.status_code == 500, bad.text
    msg = bad.json()["error"]["message"]
    assert "no valid distribution" in msg and "error id" in msg and "Traceback" not in msg
    assert good["r"].status_code == 200
    assert good["r"].json()["text"].startswith(canary_text)
    assert adv.loop.error is None and httpx.get(adv.url + "/health").status_code == 200
    monkeypatch.undo()
    still_serves(adv, canary_text)


def test_full_queue_answers_503_with_retry_after(adv: ServerHandle, canary_text: str) -> None:
    saved = adv.loop.max_pending
    adv.loop.max_pending = 1
    try:
        async def burst() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=adv.url, timeout=60) as c:
                return list(await asyncio.gather(*[c.post("/generate", json=gen(
                    max_new_tokens=30, temperature=0, ignore_eos=True)) for _ in range(6)]))

        rs = asyncio.run(burst())
    finally:
        adv.loop.max_pending = saved
    codes = sorted(r.status_code for r in rs)
    assert 200 in codes and 503 in codes and set(codes) <= {200, 503}, codes
    full = next(r for r in rs if r.status_code == 503)
    assert int(full.headers["retry-after"]) >= 1
    still_serves(adv, canary_text)


def test_health_reports_the_heartbeat(client: httpx.Client, adv: ServerHandle,
                                      canary_text: str) -> None:
    r = client.get("/health")
    assert r.status_code == 200
    loop = r.json()["loop"]
    assert loop["alive"] is True and loop["since_beat_s"] < LIMITS.health_step_s
    assert loop["busy_s"] >= 0
    still_serves(adv, canary_text)


def test_health_turns_red_while_a_step_hangs(adv: ServerHandle, canary_text: str) -> None:
    """A step stuck longer than health_step_s: /health 503 (HTTP itself is fine), then 200
    again once the step ends. The step is held until the test has seen the 503 (at most
    DEADLINE_S), so the verdict does not hang on how fast a busy machine polls."""
    hung, released = threading.Event(), threading.Event()

    def slow_once(event: object) -> None:
        if not hung.is_set():
            hung.set()
            released.wait(DEADLINE_S)

    handle = adv.call(lambda e: e.hooks.register(slow_once, ["StepTiming"]))
    try:
        t = threading.Thread(target=httpx.post, args=(adv.url + "/generate",),
                             kwargs={"json": CANARY, "timeout": 60})
        t.start()
        assert hung.wait(DEADLINE_S)
        codes = []
        deadline = time.monotonic() + DEADLINE_S
        while time.monotonic() < deadline and 503 not in codes:
            codes.append(httpx.get(adv.url + "/health", timeout=DEADLINE_S).status_code)
            time.sleep(0.1)
        released.set()
        assert 503 in codes, codes
        t.join(60)
    finally:
        released.set()
        adv.call(lambda e: e.hooks.unregister(handle))
    assert httpx.get(adv.url + "/health").status_code == 200
    still_serves(adv, canary_text)


# ---- stops ------------------------------------------------------------------------------------


def test_stop_strings_lossless_trimmed_and_matched(adv: ServerHandle, canary_text: str,
                                                   reference_engine: wb.Engine) -> None:
    """Greedy with stop strings over HTTP (speculative) == the engine without speculation."""
    for prompt in TEXT_PROMPTS[:4]:
        free = reference_engine.generate([prompt], wb.SamplingParams(max_new_tokens=24,
                                                                     ignore_eos=True))[0]
        stop = free.text[len(free.text) // 2:][:2] or "\n"
        sp = wb.SamplingParams(max_new_tokens=24, ignore_eos=True, stop=(stop,))
        base = reference_engine.generate([prompt], sp)[0]
        r = httpx.post(adv.url + "/generate", timeout=60, json={"text": prompt, "sampling_params": {
            "max_new_tokens": 24, "temperature": 0, "ignore_eos": True, "stop": [stop]}})
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["output_ids"] == base.token_ids and out["text"] == base.text
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
        assert stop not in out["text"]
        kept = httpx.post(adv.url + "/generate", timeout=60, json={
            "text": prompt, "sampling_params": {"max_new_tokens": 24, "temperature": 0,
                                                "ignore_eos": True, "stop": [stop],
                                                "no_stop_trim": True}}).json()
        assert kept["output_ids"] == base.token_ids and stop in kept["text"]
    still_serves(adv, canary_text)


def test_stream_with_stop_never_shows_it(adv: ServerHandle, canary_text: str) -> None:
    plain = httpx.post(adv.url + "/generate", json=CANARY, timeout=60).json()["text"]
    stop = plain[3:5]
    body = {"text": CANARY["text"], "stream": True,
            "sampling_params": {**CANARY["sampling_params"], "stop": [stop]}}
    with httpx.stream("POST", adv.url + "/generate", json=body, timeout=60) as r:
        events = [json.loads(line[5:]) for line in r.iter_lines()
                  if line.startswith("data:") and line[5:].strip() != "[DONE]"]
    assert all(stop not in e["text"] for e in events)
    assert events[-1]["text"] == plain[: plain.find(stop)]
    assert events[-1]["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    still_serves(adv, canary_text)


# ---- burst --------------------------------------------------------------------------------------


def test_200_concurrent_burst(keyed: ServerHandle) -> None:
    """200 requests at once (against the default limits: this test's client shares the
    server's process and GIL, so under load it may open a connection long before it writes
    to it, which a 1-second read deadline would rightly drop)."""
    prompts = TEXT_PROMPTS
    refs = {}
    for p in prompts:
        r = httpx.post(keyed.url + "/generate", json={**CANARY, "text": p}, headers=KEY,
                       timeout=60)
        refs[p] = r.json()["text"]

    async def burst() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=250, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=keyed.url, timeout=120, limits=limits,
                                     headers=KEY) as c:
            return list(await asyncio.gather(*[
                c.post("/generate", json={**CANARY, "text": prompts[i % len(prompts)]})
                for i in range(200)]))

    rs = asyncio.run(burst())
    for i, r in enumerate(rs):
        assert r.status_code == 200, (i, r.text)
        assert r.json()["text"] == refs[prompts[i % len(prompts)]], i
    assert keyed.wait_idle(60) and keyed.kv_usage()["used_blocks"] == 0
    r = httpx.post(keyed.url + "/generate", json=CANARY, headers=KEY, timeout=60)
    assert r.json()["text"] == refs[CANARY["text"]]  # the canary prompt is TEXT_PROMPTS[0]


# ---- auth ----------------------------------------------------------------------------------------


KEY = {"Authorization": "Bearer s3cret"}


@pytest.fixture(scope="module")
def keyed(micro_target: Path, random_head: Path) -> Iterator[ServerHandle]:
    """A second server: default limits and an API key."""
    with serving(micro_target, random_head, ServeLimits(api_key="s3cret")) as handle:
        yield handle


AUTH = "Authorization"
AUTH_CASES: dict[str, tuple[list[tuple[str, str]], int]] = {
    "no key": ([], 401),
    "wrong key": ([(AUTH, "Bearer nope")], 401),
    "not bearer": ([(AUTH, "Basic s3cret")], 401),
    "no scheme": ([(AUTH, "s3cret")], 401),
    "key case differs": ([(AUTH, "Bearer S3CRET")], 401),
    "right key": ([(AUTH, "Bearer s3cret")], 200),
    # RFC 7235 §2.1: the scheme is case-insensitive; RFC 6750 §2.1: 1*SP before the token
    "scheme lower case": ([(AUTH, "bearer s3cret")], 200),
    "scheme upper case": ([(AUTH, "BEARER s3cret")], 200),
    "two spaces": ([(AUTH, "Bearer  s3cret")], 200),
    # several credentials are ambiguous: refused whatever their order (RFC 6750 §3.1)
    "wrong then right": ([(AUTH, "Bearer nope"), (AUTH, "Bearer s3cret")], 400),
    "right then wrong": ([(AUTH, "Bearer s3cret"), (AUTH, "Bearer nope")], 400),
    "right twice": ([(AUTH, "Bearer s3cret"), (AUTH, "Bearer s3cret")], 400),
}


@pytest.mark.parametrize("name", sorted(AUTH_CASES))
def test_api_key(name: str, keyed: ServerHandle) -> None:
    headers, status = AUTH_CASES[name]
    key = KEY
    before = httpx.post(keyed.url + "/generate", json=CANARY, headers=key, timeout=60).json()
    r = httpx.post(keyed.url + "/generate", json=CANARY, headers=headers, timeout=60)
    assert r.status_code == status, r.text
    if status != 200:
        assert r.headers["www-authenticate"].startswith("Bearer")
        assert r.json()["error"]["field"] == "authorization"
        assert httpx.get(keyed.url + "/v1/models", headers=headers).status_code == status
    assert httpx.get(keyed.url + "/health").status_code == 200  # probes need no key
    after = httpx.post(keyed.url + "/generate", json=CANARY, headers=key, timeout=60).json()
    assert after["text"] == before["text"]


# ---- the CLI -------------------------------------------------------------------------------------

FATAL_SCRIPT = """
import sys
import workbench.faults as faults
import workbench.serve.server as srv
real = srv.make_loop
def make_loop(*a, **k):
    faults._active.add("step:verify")  # armed after init: the first speculative step fails
    return real(*a, **k)
srv.make_loop = make_loop
from workbench.__main__ import main
sys.exit(main(sys.argv[1:]))
"""


def test_cli_exits_nonzero_when_the_engine_loop_dies(micro_target: Path,
                                                     random_head: Path) -> None:
    cmd = [sys.executable, "-c", FATAL_SCRIPT, "serve", "--model", str(micro_target), "--draft",
           str(random_head), "--num-steps", "3", "--topk", "2", "--num-draft-tokens", "6",
           "--port", "0"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        url = wait_banner(proc.stderr.readline)
        r = httpx.post(url + "/generate", json=CANARY, timeout=60)
        assert r.status_code == 500 and "error id" in r.json()["error"]["message"]
        assert proc.wait(60) == 1  # a supervisor sees the failure and restarts it
        rest = proc.stderr.read()
        assert "engine loop failed" in rest and "InjectedFault" in rest
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def wait_banner(readline: Callable[[], str]) -> str:
    for _ in range(10_000):
        line = readline()
        if not line:
            break
        m = re.search(r"serving .* on (http://\S+)", line)
        if m:
            return m.group(1)
    raise AssertionError("no banner")


@pytest.mark.parametrize("argv,match", [
    (["--port", "99999"], "--port: must be in 0..65535"),
    (["--max-model-len", "-5"], "EngineConfig.max_model_len"),
    (["--device", "gpu"], "EngineConfig.device"),
    (["--dtype", "int8"], "EngineConfig.dtype"),
    (["--kv-budget-tokens", "0"], "EngineConfig.kv_budget_tokens"),
    (["--draft", "x", "--policy", "threshold"], "--threshold: required"),
    (["--policy", "never"], "--policy/--threshold: need --draft"),
    (["--max-body-bytes", "0"], "ServeLimits.max_body_bytes"),
    (["--read-timeout", "-1"], "ServeLimits.read_timeout_s"),
])
def test_cli_flags_are_validated_like_the_api(argv: list[str], match: str) -> None:
    """Refused before any model loads: one line naming the flag, exit status 1."""
    from workbench.__main__ import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        status = main(["serve", "--model", "/nonexistent", *argv])
    assert status == 1, err.getvalue()
    assert match in err.getvalue() and "Traceback" not in err.getvalue(), err.getvalue()


@pytest.mark.parametrize("host,key,warned", [("0.0.0.0", None, True), ("0.0.0.0", "k", False),
                                             ("127.0.0.1", None, False)])
def test_exposed_bind_without_a_key_warns(host: str, key: str | None, warned: bool,
                                          caplog: pytest.LogCaptureFixture,
                                          tmp_path: Path) -> None:
    """Checked before the model loads (here it does not exist: exit 1 after the warning)."""
    from workbench.__main__ import main

    argv = ["serve", "--model", str(tmp_path / "missing"), "--host", host, "--port", "0"]
    with caplog.at_level(logging.WARNING), contextlib.redirect_stderr(io.StringIO()):
        assert main(argv + (["--api-key", key] if key else [])) == 1
    assert any("without --api-key" in r.getMessage() for r in caplog.records) == warned
