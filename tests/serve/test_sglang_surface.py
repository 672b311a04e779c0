"""SGLang 0.5.23's serving surface beyond one prompt per /generate, over real HTTP: /model_info
(and /get_model_info), /get_server_info, /flush_cache, /abort_request, batched /generate (text and
token-id lists, per-item sampling params and rids, streaming), and max_new_tokens 0 (prefill
only: input logprobs equal a dense forward's). Outputs equal the engine's own greedy output."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
from helpers import id_prompts
from serve.serving import TEXT_PROMPTS, sse_json

import workbench as wb

N = 8


def greedy_sp(n: int = N) -> dict:
    return {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}


def test_model_info_has_sglang_fields(http, server) -> None:
    for route in ("/model_info", "/get_model_info"):
        r = http.get(route)
        assert r.status_code == 200, r.text
        info = r.json()
        assert info["model_path"] == str(server.engine.model_path)
        assert info["tokenizer_path"] == str(Path(server.engine.model_path).resolve())
        assert info["is_generation"] is True and info["weight_version"] == "default"
        assert info["architectures"] == ["LlamaForCausalLM"] and info["model_type"] == "llama"
        assert {"served_model_name", "preferred_sampling_params", "load_format",
                "reasoning_parser", "tool_call_parser", "disaggregation_mode",
                "has_image_understanding", "has_audio_understanding"} <= set(info)
    a, b = http.get("/server_info").json(), http.get("/get_server_info").json()
    assert a["model_path"] == b["model_path"] and "internal_states" in b


def test_flush_cache_when_idle(http, server) -> None:
    assert server.wait_idle()
    for method in ("GET", "POST"):
        r = http.request(method, "/flush_cache")
        assert r.status_code == 200 and r.text.startswith("Cache flushed.")
    assert http.post("/flush_cache?timeout=5").status_code == 200


def test_flush_cache_refused_while_requests_run(http, server) -> None:
    """As upstream: nothing is flushed while requests are live (after waiting up to
    ``timeout``); once they finish it flushes."""
    got: dict[str, object] = {}

    def run() -> None:
        got["r"] = http.post("/generate", json={"text": "a", "sampling_params": {
            "max_new_tokens": 240, "ignore_eos": True}})

    t = threading.Thread(target=run)
    t.start()
    deadline = time.monotonic() + 30
    while server.loop.num_running < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    r = http.post("/flush_cache")
    assert r.status_code == 400 and "not flushed" in r.text
    assert http.post("/flush_cache?timeout=60").status_code == 200  # waits for the request
    t.join(60)
    assert got["r"].status_code == 200


def test_health_generate(http, server) -> None:
    assert server.wait_idle()
    before = server.loop.requests_total
    assert http.get("/health_generate").status_code == 200
    assert server.loop.requests_total == before + 1  # idle: it generated a token
    assert server.wait_idle() and server.kv_usage()["used_blocks"] == 0


def test_batch_of_texts_equals_the_engine(http, solo) -> None:
    prompts = TEXT_PROMPTS[:3]
    r = http.post("/generate", json={"text": prompts, "sampling_params": greedy_sp(),
                                     "rid": "b"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert isinstance(body, list) and len(body) == 3
    for i, (p, item) in enumerate(zip(prompts, body, strict=True)):
        ref = solo(p, N)
        assert item["output_ids"] == ref.token_ids and item["text"] == ref.text
        assert item["meta_info"]["id"] == f"b_{i}"
        assert item["meta_info"]["prompt_tokens"] == len(ref.prompt_ids)


def test_batch_per_item_params_and_ids(http, solo) -> None:
    prompts = id_prompts(2, seed=5, lo=2, hi=24)
    r = http.post("/generate", json={
        "input_ids": prompts, "rid": ["x", "y"],
        "sampling_params": [greedy_sp(3), greedy_sp(5)],
        "return_logprob": [False, True]})
    assert r.status_code == 200, r.text
    a, b = r.json()
    assert a["output_ids"] == solo(prompts[0], 3).token_ids
    assert b["output_ids"] == solo(prompts[1], 5).token_ids
    assert (a["meta_info"]["id"], b["meta_info"]["id"]) == ("x", "y")
    assert "output_token_logprobs" not in a["meta_info"]
    assert len(b["meta_info"]["output_token_logprobs"]) == 5


def test_batch_stream_has_indices(http, solo) -> None:
    prompts = [TEXT_PROMPTS[4], TEXT_PROMPTS[5]]
    with http.stream("POST", "/generate", json={"text": prompts, "stream": True,
                                                "sampling_params": greedy_sp()}) as r:
        assert r.status_code == 200
        events = sse_json(r.iter_lines())
    last: dict[int, dict] = {}
    for e in events:
        i = e["index"]
        if i in last:  # cumulative per item
            assert e["output_ids"][: len(last[i]["output_ids"])] == last[i]["output_ids"]
        last[i] = e
    assert sorted(last) == [0, 1]
    for i, p in enumerate(prompts):
        assert last[i]["output_ids"] == solo(p, N).token_ids
        assert last[i]["meta_info"]["finish_reason"]["type"] == "length"


@pytest.mark.parametrize(("body", "field"), [
    ({"text": []}, "text"),
    ({"text": ["a", 3]}, "text[1]"),
    ({"text": ["a", ""]}, "text[1]"),
    ({"input_ids": [[1, 2], [-1]]}, "input_ids[1]"),
    ({"text": ["a", "b"], "sampling_params": [{}]}, "sampling_params"),
    ({"text": ["a", "b"], "sampling_params": [{}, {"temperature": -1}]},
     "sampling_params[1].temperature"),
    ({"text": ["a", "b"], "rid": ["same", "same"]}, "rid"),
    ({"text": ["a", "b"], "rid": ["x"]}, "rid"),
    ({"text": ["a", "b"], "return_logprob": [True]}, "return_logprob"),
    ({"text": ["a", "b"], "top_logprobs_num": [1, -1]}, "top_logprobs_num[1]"),
])
def test_bad_batches_name_the_field(http, body, field) -> None:
    r = http.post("/generate", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["field"] == field


def test_prefill_only_scores_the_prompt(http, server) -> None:
    engine: wb.Engine = server.engine
    text = TEXT_PROMPTS[0] + " return x"
    r = http.post("/generate", json={"text": text, "return_logprob": True,
                                     "logprob_start_len": 0, "return_text_in_logprobs": True,
                                     "sampling_params": {"max_new_tokens": 0}})
    assert r.status_code == 200, r.text
    meta = r.json()["meta_info"]
    assert r.json()["output_ids"] == [] and r.json()["text"] == ""
    assert meta["finish_reason"] == {"type": "length", "length": 0}
    assert meta["completion_tokens"] == 0 and meta["output_token_logprobs"] == []
    ids = engine.tokenizer.encode(text)
    got = meta["input_token_logprobs"]
    assert [e[1] for e in got] == ids and got[0][0] is None
    assert got[1][2] == engine.tokenizer.decode([ids[1]])
    with torch.inference_mode():
        logits, _ = engine.runner.target.forward_dense(torch.tensor([ids]))
    lp = torch.log_softmax(logits[0].float(), -1)
    want = [lp[p, ids[p + 1]].item() for p in range(len(ids) - 1)]
    assert [e[0] for e in got[1:]] == pytest.approx(want, abs=1e-4)
    assert server.wait_idle() and server.kv_usage()["used_blocks"] == 0


def test_abort_request_by_batch_rid(http, server) -> None:
    got: dict[str, object] = {}

    def run() -> None:
        got["r"] = http.post("/generate", json={
            "text": ["a", "b"], "rid": "abortme",
            "sampling_params": {"max_new_tokens": 240, "ignore_eos": True}})

    t = threading.Thread(target=run)
    t.start()
    deadline = time.monotonic() + 30
    while server.loop.num_running < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert http.post("/abort_request", json={"rid": "abortme"}).status_code == 200
    t.join(60)
    r = got["r"]
    assert r.status_code == 200, r.text
    assert [b["meta_info"]["finish_reason"]["type"] for b in r.json()] == ["abort", "abort"]
    assert server.wait_idle() and server.kv_usage()["used_blocks"] == 0
    # an empty rid without abort_all aborts nothing; a wrong type is named
    assert http.post("/abort_request", json={"rid": ""}).status_code == 200
    assert http.post("/abort_request", json={"rid": 3}).json()["error"]["field"] == "rid"


def test_abort_all(http, server) -> None:
    got: dict[str, object] = {}

    def run() -> None:
        got["r"] = http.post("/v1/completions", json={"prompt": "a", "max_tokens": 240,
                                                      "ignore_eos": True})

    t = threading.Thread(target=run)
    t.start()
    deadline = time.monotonic() + 30
    while server.loop.num_running < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert http.post("/abort_request", json={"abort_all": True}).status_code == 200
    t.join(60)
    assert got["r"].json()["choices"][0]["finish_reason"] == "abort"
    assert server.wait_idle()


def test_stop_regex_equals_the_engine(http, server, reference_engine) -> None:
    """stop_regex over /generate (plain and streamed) stops where the engine stops with the
    same pattern; finish_reason.matched is the pattern, as upstream."""
    import dataclasses

    from serve.serving import SPEC, greedy

    prompt = TEXT_PROMPTS[0]
    free = reference_engine.generate([prompt], greedy(24), spec=SPEC)[0]
    text = reference_engine.tokenizer.decode(free.token_ids)
    a, b = text[len(text) // 2 : len(text) // 2 + 2]
    pattern = f"[{a}][{b}]".replace("\\", "\\\\") if a.isalnum() and b.isalnum() else \
        "".join(f"\\x{{{ord(c):x}}}" for c in (a, b))
    sp = dataclasses.replace(greedy(24), stop_regex=(pattern,))
    ref = reference_engine.generate([prompt], sp, spec=SPEC)[0]
    assert ref.finish_reason == "stop" and len(ref.token_ids) < 24
    body = {"text": prompt, "sampling_params": {**greedy_sp(24), "stop_regex": pattern,
                                                "stop": [], "stop_token_ids": []}}
    r = http.post("/generate", json=body)
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["output_ids"] == ref.token_ids and got["text"] == ref.text
    assert got["meta_info"]["finish_reason"] == {"type": "stop", "matched": pattern}
    with http.stream("POST", "/generate", json={**body, "stream": True}) as s:
        events = sse_json(s.iter_lines())
    assert events[-1]["output_ids"] == ref.token_ids and events[-1]["text"] == ref.text
    r = http.post("/generate", json={"text": prompt, "sampling_params": {
        "stop_regex": "(?=x)"}})
    assert r.status_code == 400 and r.json()["error"]["field"] == "sampling_params.stop_regex"


def test_a_rid_in_use_is_refused_and_frees_nothing_of_the_other(http, server, solo) -> None:
    """Two live requests may not share a rid (abort_request could not tell them apart): the
    second is a 400 naming rid, admitted or not, and the first finishes untouched."""
    got: dict[str, object] = {}
    body = {"text": TEXT_PROMPTS[1], "rid": "dup",
            "sampling_params": {"max_new_tokens": 200, "temperature": 0, "ignore_eos": True}}

    def run() -> None:
        got["r"] = http.post("/generate", json=body)

    t = threading.Thread(target=run)
    t.start()
    deadline = time.monotonic() + 30
    while server.loop.num_running < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    for second in (body, {**body, "text": ["a", "b"], "rid": ["x", "dup"]}):
        r = http.post("/generate", json=second)
        assert r.status_code == 400 and r.json()["error"]["field"] == "rid", r.text
    t.join(60)
    first = got["r"]
    assert first.status_code == 200 and first.json()["output_ids"] == \
        solo(TEXT_PROMPTS[1], 200).token_ids
    assert server.wait_idle() and server.kv_usage()["used_blocks"] == 0


def test_rids_taken_during_admission_abort_the_newcomers() -> None:
    """The race the route cannot see up front: a rid taken while a request was being
    admitted. Registration is all or none and aborts the newcomers' tickets."""
    from workbench.serve.protocol import HTTPError
    from workbench.serve.sglang_admin import LiveRids

    live = LiveRids()
    old, new1, new2 = object(), object(), object()
    live.add(["a"], [old], lambda t: None)  # type: ignore[list-item]
    aborted: list[object] = []
    with pytest.raises(HTTPError) as e:
        live.add(["b", "a"], [new1, new2], aborted.append)  # type: ignore[list-item]
    assert e.value.field == "rid" and aborted == [new1, new2]
    assert live.matching("a") == [old] and live.matching("") == []
