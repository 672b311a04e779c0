"""The native server over real HTTP on loopback: /generate, /v1/completions, /metrics, /health,
/server_info; outputs equal engine.generate (greedy)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import id_prompts
from serve.serving import SPEC, TEXT_PROMPTS, parse_metrics, sse_json

from workbench.remote.sglang import sglang_accept_lengths

N = 10


@pytest.mark.parametrize("prompt", [TEXT_PROMPTS[0], TEXT_PROMPTS[1],
                                    id_prompts(2, lo=2, hi=24)[1]])
def test_generate_equals_engine(http, solo, prompt) -> None:
    key = "text" if isinstance(prompt, str) else "input_ids"
    r = http.post("/generate", json={key: prompt, "sampling_params": {
        "max_new_tokens": N, "temperature": 0, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    body = r.json()
    ref = solo(prompt, N)
    assert body["output_ids"] == ref.token_ids
    assert body["text"] == ref.text
    meta = body["meta_info"]
    assert meta["prompt_tokens"] == len(ref.prompt_ids)
    assert meta["completion_tokens"] == N
    assert meta["finish_reason"] == {"type": "length", "length": N}
    # SGLang's rounds: the verify steps and the plain steps of the speculating engine
    assert meta["spec_verify_ct"] == len(sglang_accept_lengths(ref.metrics))
    assert ref.metrics.verify_ct > 0
    assert meta["spec_accept_length"] == pytest.approx(N / meta["spec_verify_ct"])
    assert meta["e2e_latency"] > 0 and isinstance(meta["id"], str)


def test_generate_stream_equals_engine(http, solo) -> None:
    prompt = TEXT_PROMPTS[2]
    body = {"text": prompt, "stream": True, "rid": "req-1",
            "sampling_params": {"max_new_tokens": N, "temperature": 0, "ignore_eos": True}}
    with http.stream("POST", "/generate", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        chunks = sse_json(r.iter_lines())
    ref = solo(prompt, N)
    assert len(chunks) >= 2
    # cumulative: each chunk extends the previous one
    for a, b in zip(chunks, chunks[1:], strict=False):
        assert b["output_ids"][: len(a["output_ids"])] == a["output_ids"]
        assert b["text"].startswith(a["text"])
        assert a["meta_info"]["finish_reason"] is None
    last = chunks[-1]
    assert last["output_ids"] == ref.token_ids and last["text"] == ref.text
    assert last["meta_info"]["id"] == "req-1"
    assert last["meta_info"]["finish_reason"]["type"] == "length"
    assert last["meta_info"]["spec_verify_ct"] == len(sglang_accept_lengths(ref.metrics))


def test_openai_completions(http, solo) -> None:
    prompt = TEXT_PROMPTS[3]
    ref = solo(prompt, N)
    req = {"model": "model", "prompt": prompt, "max_tokens": N, "temperature": 0,
           "ignore_eos": True}
    r = http.post("/v1/completions", json=req)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["model"] == "model"
    assert body["choices"][0]["text"] == ref.text
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": len(ref.prompt_ids), "completion_tokens": N,
                             "total_tokens": len(ref.prompt_ids) + N}
    stream_req = {**req, "stream": True, "stream_options": {"include_usage": True}}
    with http.stream("POST", "/v1/completions", json=stream_req) as r:
        chunks = sse_json(r.iter_lines())
    deltas = [c["choices"][0]["text"] for c in chunks if c["choices"]]
    assert "".join(deltas) == ref.text
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == N
    assert http.get("/v1/models").json()["data"][0]["id"]


def test_health_and_server_info(http, server) -> None:
    assert http.get("/health").status_code == 200
    info = http.get("/server_info").json()
    assert info["speculative_algorithm"] == "EAGLE3"
    assert (info["speculative_num_steps"], info["speculative_eagle_topk"],
            info["speculative_num_draft_tokens"]) == (SPEC.num_steps, SPEC.topk,
                                                      SPEC.num_draft_tokens)
    assert Path(info["model_path"]).name == "model" and info["draft_model_path"]
    assert info["engine_config"]["kv_budget_tokens"] == 8192
    assert info["kv"]["total_blocks"] > 0
    assert http.get("/get_server_info").json()["internal_states"][0]["avg_spec_accept_length"] >= 1
    assert http.get("/nope").status_code == 404


@pytest.mark.parametrize(("kind", "extra"), [
    ("greedy", {"temperature": 0}), ("sampled", {"temperature": 0.8}),
    ("logprobs", {"temperature": 0})])
def test_server_info_step_profile_counts_steps_by_batch_kind(http, kind, extra) -> None:
    """/server_info's step_profile: the steps of a request's batch are counted under its kind,
    with their tokens, wall time and the loop thread's CPU time (never more than the wall)."""
    before = http.get("/server_info").json()["step_profile"]
    body = {"text": TEXT_PROMPTS[2], "sampling_params": {"max_new_tokens": N, "ignore_eos": True,
                                                          **extra}}
    if kind == "logprobs":
        body["return_logprob"] = True
    assert http.post("/generate", json=body).status_code == 200
    after = http.get("/server_info").json()["step_profile"]
    d = {k: after[kind][k] - before[kind][k] for k in after[kind]}
    assert d["steps"] >= 1 and d["requests"] >= d["steps"]
    assert d["tokens"] >= N - 1  # the first token comes from the prefill step
    assert 0 < d["cpu_s"] <= d["wall_s"] + 0.01 * d["steps"]  # clock granularity
    others = [k for k in after if k != kind]
    assert all(after[k]["steps"] == before[k]["steps"] for k in others), (before, after)


NAMES = ["sglang:spec_accept_length", "sglang:spec_accept_rate", "sglang:num_running_reqs",
         "sglang:num_queue_reqs", "sglang:spec_num_steps", "sglang:spec_verify_calls_total",
         "sglang:generation_tokens_total", "sglang:prompt_tokens_total",
         "vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
         "vllm:spec_decode_num_accepted_tokens_total",
         "vllm:spec_decode_num_accepted_tokens_per_pos_total", "workbench:kv_used_blocks"]


def test_metrics(http) -> None:
    before = parse_metrics(http.get("/metrics").text)
    r = http.post("/generate", json={"input_ids": [5, 6, 7], "sampling_params": {
        "max_new_tokens": 4, "temperature": 0, "ignore_eos": True}})
    assert r.status_code == 200
    resp = http.get("/metrics")
    assert resp.headers["content-type"].startswith("text/plain")
    after = parse_metrics(resp.text)
    for name in NAMES:
        assert any(k == name or k.startswith(name + "{") for k in after), name
    for i in range(SPEC.num_steps):
        assert f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{position="{i}"}}' in after
    assert after["sglang:generation_tokens_total"] - before["sglang:generation_tokens_total"] == 4
    assert after["sglang:prompt_tokens_total"] - before["sglang:prompt_tokens_total"] == 3
    assert after["vllm:spec_decode_num_drafts_total"] > before["vllm:spec_decode_num_drafts_total"]
    assert after["sglang:spec_accept_length"] >= 1.0
    assert 0.0 <= after["sglang:spec_accept_rate"] <= 1.0
    assert after["workbench:kv_used_blocks"] == 0 and after["sglang:num_running_reqs"] == 0
    assert after["sglang:num_queue_reqs"] == 0 and after["sglang:spec_num_steps"] == SPEC.num_steps
    assert after["sglang:spec_verify_calls_total"] == after["vllm:spec_decode_num_drafts_total"]


def test_cli_init_failure_exits_nonzero_naming_the_stage(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "workbench", "serve", "--model",
                           str(tmp_path / "missing"), "--port", "0"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "load_config" in proc.stderr, proc.stderr[-2000:]


def test_cli_serves_and_stops_on_sigint(micro_target: Path, random_head: Path, solo) -> None:
    import signal

    import httpx

    cmd = [sys.executable, "-m", "workbench", "serve", "--model", str(micro_target), "--draft",
           str(random_head), "--num-steps", str(SPEC.num_steps), "--topk", str(SPEC.topk),
           "--num-draft-tokens", str(SPEC.num_draft_tokens), "--port", "0"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    try:
        url = None
        assert proc.stderr is not None
        for line in proc.stderr:  # the banner comes only once the engine is complete
            m = re.search(r"serving .* on (http://\S+)", line)
            if m:
                url = m.group(1)
                break
        assert url, "no banner"
        r = httpx.post(url + "/generate", timeout=60, json={
            "text": TEXT_PROMPTS[4], "sampling_params": {"max_new_tokens": N, "temperature": 0,
                                                         "ignore_eos": True}})
        assert r.json()["output_ids"] == solo(TEXT_PROMPTS[4], N).token_ids
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_sglang_latency_metrics(http, server) -> None:
    """SGLang's TTFT / inter-token / end-to-end histograms (names, labels, buckets) and its
    gen_throughput, token_usage and cache_hit_rate gauges."""
    from workbench.serve.sglang_metrics import E2E_BUCKETS, ITL_BUCKETS, TTFT_BUCKETS

    ttft, itl, e2e = ("sglang:time_to_first_token_seconds", "sglang:inter_token_latency_seconds",
                      "sglang:e2e_request_latency_seconds")
    before = parse_metrics(http.get("/metrics").text)
    r = http.post("/generate", json={"input_ids": [5, 6, 7], "sampling_params": {
        "max_new_tokens": 6, "temperature": 0, "ignore_eos": True}})
    assert r.status_code == 200
    with http.stream("POST", "/generate", json={"input_ids": [8, 9], "stream": True,
                                                "sampling_params": {"max_new_tokens": 3}}) as s:
        sse_json(s.iter_lines())
    assert server.wait_idle()
    text = http.get("/metrics").text
    after = parse_metrics(text)
    assert "# TYPE sglang:time_to_first_token_seconds histogram" in text
    for name, buckets, label in ((ttft, TTFT_BUCKETS, 'is_streaming="false",'),
                                 (e2e, E2E_BUCKETS, 'is_streaming="false",'),
                                 (itl, ITL_BUCKETS, "")):
        les = [float(k.split('le="')[1].rstrip('"}')) for k in after
               if k.startswith(f"{name}_bucket{{{label}le=")]
        assert les == [*map(float, buckets), float("inf")], name
        count = f"{name}_count" + (f"{{{label.rstrip(',')}}}" if label else "")
        assert after[count] == after[f'{name}_bucket{{{label}le="+Inf"}}']

    def grew(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert grew(f'{ttft}_count{{is_streaming="false"}}') == 1
    assert grew(f'{ttft}_count{{is_streaming="true"}}') == 1
    assert grew(f'{e2e}_count{{is_streaming="false"}}') == 1
    assert grew(f"{itl}_count") == 5 + 2  # every output token after each request's first
    assert grew(f"{itl}_sum") > 0 and grew(f'{e2e}_sum{{is_streaming="false"}}') > 0
    assert after["sglang:gen_throughput"] > 0
    assert after["sglang:token_usage"] == 0.0 and after["sglang:cache_hit_rate"] == 0.0
