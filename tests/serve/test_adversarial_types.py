"""Adversarial catalogue, field types and sizes (issue 53): every chat field a client sends is
checked for its type and size before anything else reads it — a 400 naming the field, never a
500 or a silent acceptance — and ``top_logprobs_num`` above its documented cap is refused, not
clipped (OpenAI and vLLM refuse above theirs)."""
from __future__ import annotations

from typing import Any

import httpx
import pytest

from workbench.serve.openai_protocol import MAX_NAME_CHARS, parse_chat
from workbench.serve.protocol import MAX_TOP_LOGPROBS_NUM, HTTPError, parse_generate
from workbench.serve.server import ServerHandle
from workbench.serve.sglang_batch import parse_items, split_generate


def chat(*messages: dict[str, Any], **body: Any) -> dict[str, Any]:
    return {"messages": list(messages), **body}


BAD_CHAT = [
    (chat({"role": ["user"], "content": "hi"}), "messages[0].role"),
    (chat({"role": {"user": 1}, "content": "hi"}), "messages[0].role"),
    (chat({"role": 5, "content": "hi"}), "messages[0].role"),
    (chat({"role": "robot", "content": "hi"}), "messages[0].role"),
    (chat({"role": "user", "content": "hi", "name": 5}), "messages[0].name"),
    (chat({"role": "user", "content": "hi", "name": ["a"]}), "messages[0].name"),
    (chat({"role": "user", "content": "hi", "name": "x" * (MAX_NAME_CHARS + 1)}),
     "messages[0].name"),
    (chat({"role": "user", "content": "hi", "name": "x" * 100_000}), "messages[0].name"),
    (chat({"role": "user", "content": "hi", "name": ""}), "messages[0].name"),
    (chat({"role": "user", "content": 5}), "messages[0].content"),
    (chat({"role": "user", "content": {"type": "text", "text": "hi"}}), "messages[0].content"),
    (chat({"role": "user", "content": ["hi"]}), "messages[0].content[0]"),
    (chat({"role": "user", "content": [{"type": "text", "text": 5}]}),
     "messages[0].content[0].text"),
    (chat({"role": "user", "content": [{"type": ["text"], "text": "a"}]}),
     "messages[0].content[0].type"),
    (chat({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}),
     "messages[0].content[0].type"),
    (chat({"role": "user", "content": [{"type": "text", "text": "a", "extra": 1}]}),
     "messages[0].content[0].extra"),
    (chat({"role": "tool", "content": "42", "tool_call_id": 5}), "messages[0].tool_call_id"),
    (chat({"role": "assistant", "content": "a", "tool_calls": "x"}), "messages[0].tool_calls"),
    (chat({"role": "user", "content": "hi"}, tools=[{"type": "function"}]), "tools"),
    (chat({"role": "user", "content": "hi"}, tools="x"), "tools"),
    (chat({"role": "user", "content": "hi"}, tool_choice=["none"]), "tool_choice"),
    (chat({"role": "user", "content": "hi"}, tool_choice={"type": "function"}), "tool_choice"),
    (chat({"role": "user", "content": "hi"}, parallel_tool_calls="yes"), "parallel_tool_calls"),
]


@pytest.mark.parametrize(("body", "field"), BAD_CHAT, ids=[f for _, f in BAD_CHAT])
def test_a_wrong_typed_or_oversized_chat_field_is_named(body: dict[str, Any], field: str) -> None:
    with pytest.raises(HTTPError) as e:
        parse_chat(body)
    assert e.value.field == field and e.value.status == 400, e.value


def test_well_typed_chat_fields_pass() -> None:
    got = parse_chat(chat({"role": "system", "content": "be brief", "name": "x" * MAX_NAME_CHARS},
                          {"role": "user", "content": [{"type": "text", "text": "a"},
                                                       {"type": "text", "text": "b"}]},
                          tool_choice="none"))
    assert got.prompts == [[{"role": "system", "content": "be brief"},
                            {"role": "user", "content": "ab"}]]


def generate(top: Any) -> dict[str, Any]:
    return {"input_ids": [1, 2, 3], "return_logprob": True, "top_logprobs_num": top}


def test_top_logprobs_num_above_the_cap_is_refused() -> None:
    assert parse_generate(generate(MAX_TOP_LOGPROBS_NUM)).logprobs.top_k == MAX_TOP_LOGPROBS_NUM
    for top in (MAX_TOP_LOGPROBS_NUM + 1, 10**30):
        with pytest.raises(HTTPError) as e:
            parse_generate(generate(top))
        assert e.value.field == "top_logprobs_num"
    batch = split_generate({**generate([1, 10**30]), "input_ids": [[1, 2], [3, 4]]})
    assert batch is not None
    with pytest.raises(HTTPError) as e:
        parse_items(batch)
    assert e.value.field == "top_logprobs_num[1]"


def test_the_server_answers_400_not_500(server: ServerHandle) -> None:
    for body, field in BAD_CHAT[:3]:
        r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["field"] == field, r.text
    r = httpx.post(server.url + "/generate", json=generate([10**30]), timeout=30)
    assert r.status_code == 400 and r.json()["error"]["field"] == "top_logprobs_num", r.text
