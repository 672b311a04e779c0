"""Bad requests get HTTP 400 naming the field, and the server keeps serving."""

from __future__ import annotations

import json

import pytest

OK = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2, "temperature": 0}}


def still_serves(http) -> None:
    r = http.post("/generate", json=OK)
    assert r.status_code == 200, r.text
    assert len(r.json()["output_ids"]) <= 2


def sp(**kw: object) -> dict:
    return {"text": "def f(", "sampling_params": {"max_new_tokens": 2, **kw}}


GENERATE_CASES = {
    "malformed json": (b'{"text": "a", ', "body"),
    "not an object": (b'["text"]', "body"),
    "not utf-8": (b"\xff\xfe{", "body"),
    "unknown field": ({"text": "a", "prompt": "b"}, "prompt"),
    "unknown sampling field": (sp(beam_width=4), "sampling_params.beam_width"),
    "unsupported penalty": (sp(frequency_penalty=0.5), "sampling_params.frequency_penalty"),
    "text wrong type": ({"text": 5}, "text"),
    "input_ids wrong type": ({"input_ids": ["a", "b"]}, "input_ids"),
    "input_ids negative": ({"input_ids": [1, -2]}, "input_ids"),
    "token outside vocab": ({"input_ids": [1, 10**6]}, "input_ids"),
    "batch with a non-text item": ({"text": ["a", 5]}, "text[1]"),
    "both prompts": ({"text": "a", "input_ids": [1]}, "text"),
    "no prompt": ({"sampling_params": {"max_new_tokens": 2}}, "text"),
    "empty text": ({"text": ""}, "text"),
    "empty input_ids": ({"input_ids": []}, "input_ids"),
    "huge input_ids": ({"input_ids": [7] * 5000}, "input_ids"),
    "huge text": ({"text": "def f(x):\n    return x\n" * 2000}, "text"),
    "stream wrong type": ({"text": "a", "stream": "yes"}, "stream"),
    "sampling_params wrong type": ({"text": "a", "sampling_params": [1]}, "sampling_params"),
    "max_new_tokens string": (sp(max_new_tokens="8"), "sampling_params.max_new_tokens"),
    "max_new_tokens float": (sp(max_new_tokens=8.0), "sampling_params.max_new_tokens"),
    "max_new_tokens negative": (sp(max_new_tokens=-1), "sampling_params.max_new_tokens"),
    "temperature string": (sp(temperature="hot"), "sampling_params.temperature"),
    "temperature negative": (sp(temperature=-0.5), "sampling_params.temperature"),
    "top_p out of range": (sp(top_p=1.5), "sampling_params.top_p"),
    "top_k below -1": (sp(top_k=-3), "sampling_params.top_k"),
    "min_p bool": (sp(min_p=True), "sampling_params.min_p"),
    "stop wrong type": (sp(stop=[1, 2]), "sampling_params.stop"),
    "stop_token_ids wrong type": (sp(stop_token_ids="0"), "sampling_params.stop_token_ids"),
    "ignore_eos wrong type": (sp(ignore_eos=1), "sampling_params.ignore_eos"),
    "seed wrong type": (sp(seed="s"), "sampling_params.seed"),
    "return_logprob wrong type": ({"text": "a", "return_logprob": "yes"}, "return_logprob"),
    "top_logprobs_num negative": ({"text": "a", "return_logprob": True,
                                   "top_logprobs_num": -1}, "top_logprobs_num"),
    "logprob_start_len past the prompt": ({"input_ids": [1, 2], "return_logprob": True,
                                           "logprob_start_len": 5}, "logprob_start_len"),
    "lora_path set": ({"text": "a", "lora_path": "adapter"}, "lora_path"),
    "custom_logit_processor set": ({"text": "a", "custom_logit_processor": "x"},
                                   "custom_logit_processor"),
    "return_routed_experts true": ({"text": "a", "return_routed_experts": True},
                                   "return_routed_experts"),
}


@pytest.mark.parametrize("case", sorted(GENERATE_CASES))
def test_generate_bad_request(http, case: str) -> None:
    body, field = GENERATE_CASES[case]
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = http.post("/generate", **kw)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["field"] == field
    assert err["message"].startswith(field), err["message"]
    still_serves(http)


def test_bad_streaming_request_is_a_400_not_a_stream(http) -> None:
    r = http.post("/generate", json={"input_ids": [7] * 5000, "stream": True})
    assert r.status_code == 400 and r.json()["error"]["field"] == "input_ids"
    still_serves(http)


COMPLETION_CASES = {
    "malformed json": (b"{", "body"),
    "unknown field": ({"prompt": "a", "max_new_tokens": 3}, "max_new_tokens"),
    "no prompt": ({"max_tokens": 3}, "prompt"),
    "empty prompt": ({"prompt": ""}, "prompt"),
    "mixed batch": ({"prompt": ["a", [1, 2]]}, "prompt"),
    "empty prompt in a batch": ({"prompt": ["a", ""]}, "prompt[1]"),
    "prompt wrong type": ({"prompt": 3.5}, "prompt"),
    "huge prompt": ({"prompt": list(range(1, 290)) * 20}, "prompt"),
    "max_tokens negative": ({"prompt": "a", "max_tokens": -4}, "max_tokens"),
    "max_tokens zero": ({"prompt": "a", "max_tokens": 0}, "max_tokens"),
    "max_tokens string": ({"prompt": "a", "max_tokens": "4"}, "max_tokens"),
    "temperature wrong type": ({"prompt": "a", "temperature": [0]}, "temperature"),
    "n zero": ({"prompt": "a", "n": 0}, "n"),
    "echo wrong type": ({"prompt": "a", "echo": 1}, "echo"),
    "logprobs too many": ({"prompt": "a", "logprobs": 99}, "logprobs"),
    "model wrong type": ({"prompt": "a", "model": 3}, "model"),
    "stream_options unknown": ({"prompt": "a", "stream": True, "stream_options": {"x": 1}},
                               "stream_options.x"),
}


@pytest.mark.parametrize("case", sorted(COMPLETION_CASES))
def test_completions_bad_request(http, case: str) -> None:
    body, field = COMPLETION_CASES[case]
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = http.post("/v1/completions", **kw)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["field"] == field and err["message"].startswith(field), err
    still_serves(http)


def test_defaults_and_upstream_no_ops_are_accepted(http) -> None:
    """What stock SGLang/OpenAI clients send at default values must not be rejected."""
    body = {"text": "a", "sampling_params": {"max_new_tokens": 2, "top_k": -1,
                                             "frequency_penalty": 0.0, "n": 1,
                                             "skip_special_tokens": True, "stop": None}}
    assert http.post("/generate", json=body).status_code == 200
    body = {"prompt": ["a"], "max_tokens": 2, "n": 1, "logprobs": None, "echo": False,
            "presence_penalty": 0, "user": "u", "stream": False}
    assert http.post("/v1/completions", json=body).status_code == 200
    # what SGLang 0.5.23's bench_serving sends with every request
    body = {"text": "a", "sampling_params": {"max_new_tokens": 2, "temperature": 0.0,
                                             "ignore_eos": True}, "stream": False,
            "lora_path": None, "return_logprob": False, "return_routed_experts": False,
            "logprob_start_len": -1}
    assert http.post("/generate", json=body).status_code == 200
    assert json.loads(http.get("/health").text)["status"] == "ok"
