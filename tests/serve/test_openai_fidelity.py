"""OpenAI fields as OpenAI and vLLM take them: ``logit_bias`` (lossless with speculation: the
engine's own biased output), ``stream_options`` only with ``stream: true``, vLLM's
``continuous_usage_stats``, harmless fields accepted and ignored, the model-name rule (404
for a model not served), constrained decoding refused naming what was asked for. Hostile
cases are followed by the canary (the same text as before, all KV free)."""

from __future__ import annotations

import httpx
import pytest
from serve.serving import SPEC, TEXT_PROMPTS, sse_json, still_serves

import workbench as wb
from workbench.serve.server import ServerHandle

N = 8


@pytest.fixture(scope="module")
def adv(server: ServerHandle) -> ServerHandle:
    """The session server (speculating, served as "model")."""
    return server


def completion(**kw: object) -> dict:
    return {"model": "model", "prompt": TEXT_PROMPTS[3], "max_tokens": N, "temperature": 0,
            "ignore_eos": True, **kw}


VOCAB_OVER = str(1 << 20)  # beyond the micro model's vocabulary
REFUSED: dict[str, tuple[str, dict, int, str]] = {
    "stream_options without stream": (
        "/v1/completions", completion(stream_options={"include_usage": True}), 400,
        "stream_options"),
    "stream_options with stream false": (
        "/v1/completions", completion(stream=False, stream_options={"include_usage": True}),
        400, "stream_options"),
    "continuous_usage_stats not a bool": (
        "/v1/completions", completion(stream=True, stream_options={
            "include_usage": True, "continuous_usage_stats": "yes"}), 400,
        "stream_options.continuous_usage_stats"),
    "logit_bias a list": ("/v1/completions", completion(logit_bias=[1, 2]), 400, "logit_bias"),
    "logit_bias key not an id": ("/v1/completions", completion(logit_bias={"abc": 1}), 400,
                                 "logit_bias"),
    "logit_bias negative id": ("/v1/completions", completion(logit_bias={"-1": 1}), 400,
                               "logit_bias"),
    "logit_bias over 100": ("/v1/completions", completion(logit_bias={"5": 100.5}), 400,
                            "logit_bias"),
    "logit_bias not a number": ("/v1/completions", completion(logit_bias={"5": "up"}), 400,
                                "logit_bias"),
    "logit_bias beyond the vocabulary": (
        "/v1/completions", completion(logit_bias={VOCAB_OVER: 1}), 400, "logit_bias"),
    "sglang logit_bias beyond the vocabulary": (
        "/generate", {"text": "x", "sampling_params": {"logit_bias": {VOCAB_OVER: 1.0}}}, 400,
        "sampling_params.logit_bias"),
    "metadata not an object": ("/v1/completions", completion(metadata="tag"), 400, "metadata"),
    "store not a bool": ("/v1/completions", completion(store="yes"), 400, "store"),
    "unknown field": ("/v1/completions", completion(temprature=0.5), 400, "temprature"),
    "model not served": ("/v1/completions", completion(model="gpt-4o"), 404, "model"),
    "chat model not served": (
        "/v1/chat/completions", {"model": "other", "messages": [{"role": "user",
                                                                 "content": "hi"}]}, 404,
        "model"),
    "json_schema": ("/generate", {"text": "x", "sampling_params": {"json_schema": "{}"}}, 400,
                    "sampling_params.json_schema"),
    "regex": ("/generate", {"text": "x", "sampling_params": {"regex": "[ab]+"}}, 400,
              "sampling_params.regex"),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refused(name: str, adv: ServerHandle, canary_text: str) -> None:
    path, body, status, field = REFUSED[name]
    r = httpx.post(adv.url + path, json=body, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["field"] == field, err
    assert err["message"].startswith(field), err
    still_serves(adv, canary_text)


def test_sgl_gen_dtype_message_names_the_dtype(adv: ServerHandle, canary_text: str) -> None:
    """SGLang's frontend turns ``sgl.gen(dtype=int)`` into a regex the user never wrote: the
    refusal names the dtype, not that pattern."""
    from sglang.lang.ir import REGEX_FLOAT, REGEX_INT

    for regex, dtype in ((REGEX_INT, "int"), (REGEX_FLOAT, "float")):
        r = httpx.post(adv.url + "/generate", json={"text": "n =", "sampling_params": {
            "regex": regex, "max_new_tokens": 4}}, timeout=60)
        assert r.status_code == 400, r.text
        msg = r.json()["error"]["message"]
        assert f"sgl.gen(dtype={dtype})" in msg and regex not in msg, msg
    still_serves(adv, canary_text)


IGNORED = {"metadata": {"run": "a", "team": "b"}, "store": True, "service_tier": "auto",
           "user": "u-1", "prompt_cache_key": "k", "safety_identifier": "s"}


def test_harmless_fields_are_accepted_and_ignored(adv: ServerHandle, canary_text: str,
                                                  solo) -> None:
    ref = solo(TEXT_PROMPTS[3], N).text
    r = httpx.post(adv.url + "/v1/completions", json=completion(**IGNORED), timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == ref
    assert r.json()["model"] == "model"
    r = httpx.post(adv.url + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **IGNORED},
        timeout=60)
    assert r.status_code == 200, r.text
    still_serves(adv, canary_text)


def test_logit_bias_equals_the_engine(adv: ServerHandle, canary_text: str, solo,
                                      reference_engine: wb.Engine) -> None:
    """The served answer under a bias is the engine's own biased greedy output (speculating
    server, plain reference), streamed or not; the bias changes it."""
    free = solo(TEXT_PROMPTS[3], N)
    bias = {str(free.token_ids[0]): -100, "7": 4.5}
    ref = reference_engine.generate([TEXT_PROMPTS[3]], wb.SamplingParams(
        max_new_tokens=N, ignore_eos=True,
        logit_bias=tuple((int(k), float(v)) for k, v in bias.items())), spec=None)[0]
    assert ref.token_ids[0] != free.token_ids[0]
    r = httpx.post(adv.url + "/v1/completions", json=completion(logit_bias=bias), timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == ref.text
    with httpx.stream("POST", adv.url + "/v1/completions",
                      json=completion(logit_bias=bias, stream=True), timeout=60) as s:
        events = sse_json(s.iter_lines())
    assert "".join(e["choices"][0]["text"] for e in events) == ref.text
    g = httpx.post(adv.url + "/generate", json={"text": TEXT_PROMPTS[3], "sampling_params": {
        "max_new_tokens": N, "temperature": 0, "ignore_eos": True, "logit_bias": bias}},
        timeout=60)
    assert g.status_code == 200 and g.json()["output_ids"] == ref.token_ids, g.text
    assert SPEC.num_draft_tokens and adv.engine.spec is not None  # verification applied it
    still_serves(adv, canary_text)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("continuous", [True, False])
def test_continuous_usage_stats(path: str, continuous: bool, adv: ServerHandle,
                                canary_text: str) -> None:
    """vLLM's rule: with include_usage and continuous_usage_stats every chunk carries usage
    (its choice's tokens so far); the last chunk carries the totals either way."""
    body = completion(stream=True, n=2, seed=3, temperature=0.8,
                      stream_options={"include_usage": True, "continuous_usage_stats":
                                      continuous})
    if path.endswith("chat/completions"):
        body = {k: v for k, v in body.items() if k != "prompt"}
        body["messages"] = [{"role": "user", "content": "def f(x):"}]
    with httpx.stream("POST", adv.url + path, json=body, timeout=60) as s:
        events = sse_json(s.iter_lines())
    *chunks, last = events
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 2 * N
    if not continuous:
        assert all("usage" not in e or e["usage"] is None for e in chunks)
    else:
        seen: dict[int, int] = {}
        for e in chunks:
            u, i = e["usage"], e["choices"][0]["index"]
            assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
            assert u["completion_tokens"] >= seen.get(i, 0)
            seen[i] = u["completion_tokens"]
        assert seen == {0: N, 1: N}
        assert last["usage"]["prompt_tokens"] == chunks[-1]["usage"]["prompt_tokens"]
    still_serves(adv, canary_text)



@pytest.mark.filterwarnings("ignore:Error in stream_executor")  # the frontend reports it so
def test_sgl_gen_dtype_int_through_the_frontend(adv: ServerHandle, canary_text: str) -> None:
    """The real frontend: ``sgl.gen(dtype=int)`` fails with the message that names the dtype."""
    import sglang as sgl

    @sgl.function
    def program(s: object) -> None:
        s += "n = "  # type: ignore[operator]
        s += sgl.gen("n", max_tokens=4, dtype=int)  # type: ignore[operator]

    st = program.run(backend=sgl.RuntimeEndpoint(adv.url), temperature=0)
    err = st.error()
    assert err is not None and "sgl.gen(dtype=int)" in str(err), err
    assert r"[0-9]" not in str(err), err
    still_serves(adv, canary_text)


def test_tokenizer_info(adv: ServerHandle, canary_text: str) -> None:
    """vLLM's /tokenizer_info (SGLang 0.5.23 serves none): the tokenizer's own settings."""
    tok = adv.engine.tokenizer
    r = httpx.get(adv.url + "/tokenizer_info", timeout=60)
    assert r.status_code == 200, r.text
    info = r.json()
    assert info["tokenizer_class"] == type(tok).__name__
    assert info["eos_token"] == str(tok.eos_token)
    assert info["model_max_length"] == tok.model_max_length
    assert info.get("chat_template") == (tok.chat_template or None)
    assert "vocab_file" not in info
    still_serves(adv, canary_text)
