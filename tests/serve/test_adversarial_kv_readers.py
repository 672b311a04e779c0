"""Adversarial catalogue, KV follows readers (issue 53): a stream whose client does not read
is held (backpressure.py) and, when a waiting request does not fit the KV pool, gives its KV
back (recompute preemption: it re-prefills its prompt and output once its client reads again),
so the waiting request starts at once instead of waiting for the write timeout; the held
stream's answer is still exactly its solo output, greedy and seeded sampling alike.

The issue's case, scaled to the micro model: two never-read log-probability streams of long
prompts hold 30 of the pool's 32 pages; a normal request needs 7."""
from __future__ import annotations

import json
import random
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from serve.serving import SPEC
from serve.test_adversarial_backpressure import dechunk, read_all

import workbench as wb
from workbench.serve.server import ServeLimits, ServerHandle, start_server

LIMITS = ServeLimits(write_timeout_s=60.0, max_logprob_entries=8 << 20)
CONFIG = wb.EngineConfig(kv_budget_tokens=512, max_model_len=256)  # 32 pages of 16 tokens
RNG = random.Random(53)
HELD = [[RNG.randrange(1, 299) for _ in range(220)] for _ in range(2)]
NORMAL = [RNG.randrange(1, 299) for _ in range(100)]
SAMPLING = [wb.SamplingParams(max_new_tokens=30, temperature=0.0, ignore_eos=True),
            wb.SamplingParams(max_new_tokens=30, temperature=0.8, seed=7, ignore_eos=True)]
NORMAL_SAMPLING = wb.SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)


def wire(sp: wb.SamplingParams) -> dict[str, Any]:
    out: dict[str, Any] = {"max_new_tokens": sp.max_new_tokens, "temperature": sp.temperature,
                           "ignore_eos": True}
    return out if sp.seed is None else {**out, "seed": sp.seed}


@pytest.fixture(scope="module")
def refs_and_server(micro_target: Path, random_head: Path,
                    ) -> Iterator[tuple[list[wb.RequestOutput], ServerHandle]]:
    engine = wb.Engine.from_pretrained(micro_target, draft=random_head, config=CONFIG)
    engine.set_spec(SPEC)
    try:
        refs = [engine.generate([p], sp, spec=SPEC)[0] for p, sp in
                [*zip(HELD, SAMPLING, strict=True), (NORMAL, NORMAL_SAMPLING)]]
        handle = start_server(engine, "127.0.0.1", 0, limits=LIMITS)
        try:
            yield refs, handle
        finally:
            handle.stop()
    finally:
        engine.close()


def unread_stream(adv: ServerHandle, prompt: list[int], sp: wb.SamplingParams) -> socket.socket:
    body = json.dumps({"input_ids": prompt, "stream": True, "return_logprob": True,
                       "top_logprobs_num": 5, "logprob_start_len": 0,
                       "sampling_params": wire(sp)}).encode()
    host, port = adv.url.removeprefix("http://").rsplit(":", 1)
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect((host, int(port)))
    s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    return s


def final_event(s: socket.socket) -> dict[str, Any]:
    try:
        raw = read_all(s)
    finally:
        s.close()
    events = [line[6:] for line in dechunk(raw).split(b"\n") if line.startswith(b"data: ")]
    assert events[-1] == b"[DONE]"
    return dict(json.loads(events[-2]))


def test_a_waiting_request_takes_the_kv_of_streams_nobody_reads(
        refs_and_server: tuple[list[wb.RequestOutput], ServerHandle]) -> None:
    refs, adv = refs_and_server
    socks = [unread_stream(adv, p, sp) for p, sp in zip(HELD, SAMPLING, strict=True)]
    try:
        deadline = time.monotonic() + 60
        while len(adv.loop.backpressure.held) < 2:
            assert time.monotonic() < deadline, "the streams were never held"
            time.sleep(0.02)
        usage = adv.kv_usage()
        need = -(-(len(NORMAL) + 1) // CONFIG.page_size)
        assert usage["used_blocks"] + need > usage["total_blocks"], usage  # it does not fit
        t0 = time.monotonic()
        r = httpx.post(adv.url + "/generate", timeout=60, json={
            "input_ids": NORMAL, "sampling_params": wire(NORMAL_SAMPLING)})
        took = time.monotonic() - t0
        assert r.status_code == 200, r.text
        assert r.json()["output_ids"] == refs[2].token_ids
        assert took < 2.0, f"the waiting request took {took:.1f} s"
        finals = [final_event(s) for s in socks]  # the clients read again: resumed, lossless
    finally:
        for s in socks:
            s.close()
    for got, want in zip(finals, refs[:2], strict=True):
        assert got["output_ids"] == want.token_ids
        assert got["meta_info"]["finish_reason"]["type"] == "length"
    assert adv.wait_idle(30) and adv.kv_usage()["used_blocks"] == 0


def test_the_scheduler_evicts_held_requests_only_when_that_makes_room() -> None:
    """Scheduler level: held requests are preempted newest first and only as many as the
    waiting request needs, never when even all of them would not make it fit; a preempted held
    request is skipped by admission until released, then admitted first."""
    import torch

    from workbench.core import Request, Status
    from workbench.engine.kv_cache import KVPool
    from workbench.engine.scheduler import Scheduler

    pool = KVPool(12, 4, layers=1, kv_heads=1, head_dim=2, dtype=torch.float32, device="cpu")
    s = Scheduler(pool, max_batch_size=8, max_prefill_tokens=64)

    def req(rid: int, n: int) -> Request:
        return Request(rid=rid, prompt_ids=list(range(1, n + 1)), sampling=wb.SamplingParams())

    a, b, c = req(0, 11), req(1, 11), req(2, 11)  # 3 pages each (prompt + 1)
    for r in (a, b, c):
        s.add(r)
    for r, _, end in s.schedule().prefill:
        r.kv_len = end
        r.tokens.append(0)
    assert pool.used_blocks == 9
    a.held = b.held = True
    big = req(3, 40)  # 11 pages: more than the free 3 + the held 6
    s.add(big)
    s.schedule()
    assert big.status is Status.WAITING and a.blocks and b.blocks  # nothing preempted
    s.finish(big)
    small = req(4, 19)  # 5 pages: b (the newest held) gives its 3, a keeps its KV
    s.add(small)
    s.schedule()
    assert small.status is Status.RUNNING and b.status is Status.WAITING and not b.blocks
    assert a.status is Status.RUNNING and a.blocks and list(s.waiting) == [b]
    s.finish(c)
    s.schedule()
    assert b.status is Status.WAITING  # held: it waits for its client, whatever the room
    b.held = False
    s.schedule()
    assert b.status is Status.RUNNING and b.prefill_target == len(b.tokens) - 1
