"""The ``openai`` SDK, unchanged, against ``workbench serve``: completions (plain, streaming with
include_usage, logprobs, echo, n=2, a list of prompts) and chat completions (a tokenizer given
a chat template of its own here; a model without one → a 400 naming it)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch
from serve.serving import TEXT_PROMPTS, serving, with_chat_template

import workbench as wb
from workbench.serve.server import ServerHandle

TOL = 1e-4
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture()
def client(server: ServerHandle) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def chat_server(micro_target: Path, random_head: Path,
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerHandle]:
    """The micro model with a chat template in its tokenizer_config.json."""
    folder = with_chat_template(micro_target, tmp_path_factory.mktemp("chat_model") / "model",
                                TEMPLATE)
    with serving(folder, random_head) as handle:
        yield handle


def _dense_logprobs(engine: wb.Engine, ids: list[int]) -> torch.Tensor:
    """Reference: log_softmax of one dense forward; row p scores the token at p + 1."""
    with torch.inference_mode():
        logits, _ = engine.runner.target.forward_dense(torch.tensor([ids]))
    return torch.log_softmax(logits[0].float(), -1)


def test_completion_matches_the_engine(client: openai.OpenAI, solo) -> None:
    r = client.completions.create(model="model", prompt=TEXT_PROMPTS[0], max_tokens=12,
                                  temperature=0, extra_body={"ignore_eos": True})
    ref = solo(TEXT_PROMPTS[0], 12)
    assert r.choices[0].text == ref.text and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 12
    assert r.usage.prompt_tokens == len(ref.prompt_ids)


def test_streaming_with_usage(client: openai.OpenAI, solo) -> None:
    chunks = list(client.completions.create(
        model="model", prompt=TEXT_PROMPTS[1], max_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == solo(TEXT_PROMPTS[1], 10).text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_logprobs_and_echo(client: openai.OpenAI, reference_engine: wb.Engine, solo) -> None:
    """lm-eval-harness local-completions: echo + logprobs scores the prompt."""
    prompt = TEXT_PROMPTS[2]
    ref = solo(prompt, 6)
    r = client.completions.create(model="model", prompt=prompt, max_tokens=6, temperature=0,
                                  logprobs=2, echo=True, extra_body={"ignore_eos": True})
    c = r.choices[0]
    assert c.text == prompt + ref.text
    ids = ref.prompt_ids + ref.token_ids
    lp = c.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    dense = _dense_logprobs(reference_engine, ids)
    want = dense[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    got = torch.tensor(lp.token_logprobs[1:])
    assert float((got - want).abs().max()) <= TOL  # prompt and (speculative) output alike
    assert all(len(t) <= 2 for t in lp.top_logprobs[1:])
    n = len(ref.prompt_ids)
    for t, v in zip(lp.top_logprobs[n:], lp.token_logprobs[n:], strict=True):
        assert max(t.values()) == pytest.approx(v, abs=TOL)  # greedy: the top token
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    # without echo: the completion's tokens only
    r = client.completions.create(model="model", prompt=prompt, max_tokens=6, temperature=0,
                                  logprobs=0, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert r.choices[0].text == ref.text and len(lp.token_logprobs) == 6
    assert float((torch.tensor(lp.token_logprobs) - want[n - 1:]).abs().max()) <= TOL


def test_generate_logprobs_equal_completions(server: ServerHandle, client: openai.OpenAI,
                                             http) -> None:
    """SGLang's return_logprob and OpenAI's logprobs are the same numbers."""
    prompt = TEXT_PROMPTS[3]
    body = {"text": prompt, "sampling_params": {"max_new_tokens": 5, "temperature": 0,
                                                "ignore_eos": True},
            "return_logprob": True, "top_logprobs_num": 2, "logprob_start_len": 0,
            "return_text_in_logprobs": True}
    meta = http.post("/generate", json=body).json()["meta_info"]
    r = client.completions.create(model="model", prompt=prompt, max_tokens=5, temperature=0,
                                  logprobs=2, echo=True, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    sg = [e[0] for e in meta["input_token_logprobs"] + meta["output_token_logprobs"]]
    assert sg[0] is None and lp.token_logprobs[0] is None
    assert torch.allclose(torch.tensor(sg[1:]), torch.tensor(lp.token_logprobs[1:]), atol=TOL)
    assert [e[2] for e in meta["output_token_logprobs"]] == lp.tokens[-5:]
    assert len(meta["output_top_logprobs"]) == 5 and meta["input_top_logprobs"][0] is None
    assert meta["output_token_logprobs_length"] == 5


def test_n_and_batched_prompts(client: openai.OpenAI, solo) -> None:
    prompts = TEXT_PROMPTS[4:6]
    r = client.completions.create(model="model", prompt=prompts, max_tokens=8, temperature=0,
                                  n=2, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    for c in r.choices:
        assert c.text == solo(prompts[c.index // 2], 8).text  # greedy: both samples alike
    refs = [solo(p, 8) for p in prompts]
    assert r.usage.prompt_tokens == sum(len(x.prompt_ids) for x in refs)
    assert r.usage.completion_tokens == 4 * 8
    # sampled, seeded: sample j uses seed + j, so the two samples differ and are reproducible
    kw = dict(model="model", prompt=TEXT_PROMPTS[6], max_tokens=16, temperature=1.0, n=2,
              seed=3, extra_body={"ignore_eos": True})
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert a.choices[0].text != a.choices[1].text
    # streamed: each choice's deltas add up to its text
    chunks = list(client.completions.create(**{**kw, "stream": True}))
    texts = {0: "", 1: ""}
    for ch in chunks:
        for c in ch.choices:
            texts[c.index] += c.text
    assert [texts[0], texts[1]] == [c.text for c in a.choices]


def test_chat_without_template_names_it(micro_target: Path, random_head: Path,
                                        tmp_path: Path) -> None:
    """A user model whose tokenizer has no chat template (the workbench's own models ship
    one): chat is a 400 naming messages and the missing template."""
    folder = with_chat_template(micro_target, tmp_path / "model", None)
    with serving(folder, random_head) as handle:
        client = openai.OpenAI(base_url=handle.url + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="model", max_tokens=4,
                                           messages=[{"role": "user", "content": "hi"}])
    err = e.value.body
    assert err["field"] == "messages" and "chat template" in err["message"]


def test_chat_completions(chat_server: ServerHandle) -> None:
    c = openai.OpenAI(base_url=chat_server.url + "/v1", api_key="unused", max_retries=0)
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": "def add(a, b):"}]
    r = c.chat.completions.create(model="model", messages=messages, max_tokens=8, temperature=0,
                                  logprobs=True, top_logprobs=2,
                                  extra_body={"ignore_eos": True})
    engine = chat_server.engine
    rendered = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                    tokenize=False)
    assert rendered == "<system>be brief\n<user>def add(a, b):\n<assistant>"
    # the same text through /v1/completions gives the same answer
    ref = c.completions.create(model="model", prompt=rendered, max_tokens=8, temperature=0,
                               extra_body={"ignore_eos": True})
    msg = r.choices[0].message
    assert msg.role == "assistant" and msg.content == ref.choices[0].text
    assert r.usage.prompt_tokens == ref.usage.prompt_tokens
    content = r.choices[0].logprobs.content
    assert len(content) == 8 and all(len(t.top_logprobs) == 2 for t in content)
    assert all(t.top_logprobs[0].logprob == pytest.approx(t.logprob, abs=TOL) for t in content)
    # streaming: the role first, then content deltas, then usage
    chunks = list(c.chat.completions.create(model="model", messages=messages, max_tokens=8,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == msg.content
    assert chunks[-1].usage.completion_tokens == 8
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"



def test_lm_eval_loglikelihood_payload(http, reference_engine: wb.Engine) -> None:
    """lm-eval-harness local-completions' loglikelihood request, as it sends it: token-id
    prompts in a batch, max_tokens 1, temperature 0, logprobs 1, echo; it sums
    token_logprobs[ctxlen:-1] and compares each with max(top_logprobs)."""
    seqs = [[12, 40, 41, 99, 7, 7, 15], [5, 6, 7, 8, 9]]
    ctxlens = [4, 2]
    r = http.post("/v1/completions", json={"model": "model", "prompt": seqs, "temperature": 0,
                                           "max_tokens": 1, "logprobs": 1, "seed": 1234,
                                           "echo": True})
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    for seq, ctxlen, c in zip(seqs, ctxlens, choices, strict=True):
        lp = c["logprobs"]
        assert len(lp["token_logprobs"]) == len(seq) + 1
        dense = _dense_logprobs(reference_engine, seq)
        want = dense[:-1].gather(1, torch.tensor(seq[1:])[:, None])[:, 0]
        got = sum(lp["token_logprobs"][ctxlen:-1])
        assert got == pytest.approx(float(want[ctxlen - 1:].sum()), abs=1e-3)
        for v, top in zip(lp["token_logprobs"][ctxlen:-1], lp["top_logprobs"][ctxlen:-1],
                          strict=True):
            assert v <= max(top.values()) + TOL


def test_echo_with_max_tokens_zero_scores_the_prompt(client: openai.OpenAI,
                                                     reference_engine: wb.Engine) -> None:
    """OpenAI's legacy API and vLLM: max_tokens 0 + echo returns the prompt and its scores."""
    prompt = TEXT_PROMPTS[6]
    r = client.completions.create(model="model", prompt=prompt, max_tokens=0, echo=True,
                                  logprobs=1, temperature=0)
    c = r.choices[0]
    assert c.text == prompt and c.finish_reason == "length"
    assert r.usage.completion_tokens == 0
    ids = reference_engine.tokenizer.encode(prompt)
    dense = _dense_logprobs(reference_engine, ids)
    want = dense[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    assert c.logprobs.token_logprobs[0] is None and len(c.logprobs.tokens) == len(ids)
    assert float((torch.tensor(c.logprobs.token_logprobs[1:]) - want).abs().max()) <= TOL
    chunks = list(client.completions.create(model="model", prompt=prompt, max_tokens=0,
                                            echo=True, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == prompt
    # without echo there is nothing to return: a 400 naming max_tokens
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="model", prompt=prompt, max_tokens=0)
    assert e.value.body["field"] == "max_tokens"


def test_prompt_plus_max_tokens_over_the_context_names_both(client: openai.OpenAI,
                                                            server: ServerHandle) -> None:
    ctx = server.engine.max_model_len
    prompt = list(range(1, 101))
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="model", prompt=prompt, max_tokens=ctx - 99)
    err = e.value.body
    assert err["field"] == "max_tokens"
    assert f"100 tokens + max_tokens {ctx - 99}" in err["message"] and str(ctx) in err["message"]
    # exactly the context fits; a default budget is clipped, not refused
    r = client.completions.create(model="model", prompt=prompt, max_tokens=ctx - 100,
                                  temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == ctx - 100
    long_prompt = list(range(1, ctx - 4))
    r = client.completions.create(model="model", prompt=long_prompt, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 5
