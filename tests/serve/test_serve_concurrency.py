"""Many concurrent streaming clients, disconnects that abort and free KV, a failing engine."""

from __future__ import annotations

import json
import random
import threading
from pathlib import Path

import httpx
import pytest
from helpers import id_prompts
from serve.serving import TEXT_PROMPTS, serving, sse_json

import workbench as wb

N_OK = 8  # tokens for requests that run to completion
N_LONG = 64  # tokens for requests whose client disconnects part-way


def aborted(server) -> int:
    return server.loop.finished_total.get("abort", 0)


def test_stream_disconnect_aborts_and_frees_kv(server) -> None:
    before = aborted(server)
    body = {"text": TEXT_PROMPTS[0], "stream": True,
            "sampling_params": {"max_new_tokens": 200, "temperature": 0, "ignore_eos": True}}
    with httpx.Client(base_url=server.url, timeout=30) as c, \
            c.stream("POST", "/generate", json=body) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]  # a few chunks, then hang up
        assert any(line.startswith("data:") for line in got)
    assert server.wait_idle(30)
    assert aborted(server) == before + 1
    assert server.kv_usage()["used_blocks"] == 0


def test_non_streaming_disconnect_aborts_and_frees_kv(server) -> None:
    before = aborted(server)
    body = {"text": TEXT_PROMPTS[1],
            "sampling_params": {"max_new_tokens": 200, "temperature": 0, "ignore_eos": True}}
    with httpx.Client(base_url=server.url, timeout=0.3) as c, pytest.raises(httpx.ReadTimeout):
        c.post("/generate", json=body)
    assert server.wait_idle(30)
    assert aborted(server) == before + 1
    assert server.kv_usage()["used_blocks"] == 0


def test_64_concurrent_streams_with_random_disconnects(server, solo) -> None:
    prompts: list[str | list[int]] = TEXT_PROMPTS + id_prompts(8, seed=1, lo=2, hi=24)
    refs = [solo(p, N_OK) for p in prompts]
    rng = random.Random(0)
    plan = [(i % len(prompts), rng.random() < 0.5, rng.randrange(1, 4)) for i in range(64)]
    results: dict[int, object] = {}
    aborted_before = aborted(server)

    def client(i: int) -> None:
        p, drop, after = plan[i]
        prompt = prompts[p]
        key = "text" if isinstance(prompt, str) else "input_ids"
        body = {key: prompt, "stream": True, "sampling_params": {
            "max_new_tokens": N_LONG if drop else N_OK, "temperature": 0, "ignore_eos": True}}
        try:
            with httpx.Client(base_url=server.url, timeout=120) as c, \
                    c.stream("POST", "/generate", json=body) as r:
                if r.status_code != 200:
                    results[i] = f"HTTP {r.status_code}"
                    return
                if drop:
                    seen = 0
                    for line in r.iter_lines():
                        seen += line.startswith("data:")
                        if seen >= after:
                            break  # leaving the block closes the connection mid-stream
                    results[i] = "dropped"
                else:
                    results[i] = sse_json(r.iter_lines())[-1]
        except httpx.HTTPError as e:
            results[i] = repr(e)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(64)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert all(not t.is_alive() for t in threads), "a client hung"
    for i, (p, drop, _) in enumerate(plan):
        if drop:
            assert results[i] == "dropped", (i, results[i])
            continue
        last = results[i]
        assert isinstance(last, dict), (i, last)
        assert last["output_ids"] == refs[p].token_ids, i
        assert last["text"] == refs[p].text, i
        assert last["meta_info"]["finish_reason"]["type"] == "length"
    assert server.wait_idle(60), "engine did not drain"
    assert server.kv_usage()["used_blocks"] == 0
    assert server.loop.num_running == 0
    assert aborted(server) - aborted_before == sum(drop for _, drop, _ in plan)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_engine_failure_fails_requests_and_turns_unhealthy(micro_target: Path,
                                                           random_head: Path) -> None:
    with serving(micro_target, random_head) as h, httpx.Client(base_url=h.url, timeout=30) as c:
        assert c.get("/health").status_code == 200
        with wb.faults.inject("step:verify"):
            r = c.post("/generate", json={"text": "a", "sampling_params": {
                "max_new_tokens": 4, "temperature": 0}})
        assert r.status_code == 500
        # 5xx bodies name an error id (logged with the details), never the exception text
        message = r.json()["error"]["message"]
        assert "error id" in message and "step:verify" not in message, message
        assert "injected fault at step:verify" in h.loop.error
        health = c.get("/health")
        assert health.status_code == 503 and health.headers["retry-after"]
        assert f"error id {h.loop.error_id}" in health.json()["error"]["message"]
        again = c.post("/generate", json={"text": "a"})
        assert again.status_code == 503, again.text
        assert json.loads(c.get("/v1/models").text)["data"]  # the front end still answers
