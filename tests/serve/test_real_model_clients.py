"""Real clients, unchanged, against ``workbench serve`` on the real pair: SmolLM2-135M-Instruct
(``data/models/smollm2-135m-instruct``, fetched by ``make real-model``) with its EAGLE-3 head
(``data/models/smollm2-eagle3``), speculating. The ``openai`` SDK's chat (plain and streamed),
LangChain's ``ChatOpenAI`` and SGLang's frontend language (``gen`` with a stop, a multi-turn
chat) — the chat rendered by the model's own template.

Lossless: every served greedy answer equals the engine's own greedy output for the same
templated prompt, with the head (the server's speculative path) and without it (plain
decoding), both run on the server's engine between its steps.

One server for the module. Skipped when the model is not in the user cache; without the head
(not shipped yet) the server runs the model alone and the tests that need the head skip, saying
so. ``WORKBENCH_REAL_TARGET`` / ``WORKBENCH_REAL_DRAFT`` point the module at another copy of the
pair (e.g. a head checkpoint while it trains).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from serve.test_clients import check_generates, middle

import workbench as wb
from workbench.serve.server import ServerHandle, start_server

ROOT = Path(__file__).resolve().parents[2]
TARGET = Path(os.environ.get("WORKBENCH_REAL_TARGET",
                             ROOT / "data" / "models" / "smollm2-135m-instruct"))
DRAFT = Path(os.environ.get("WORKBENCH_REAL_DRAFT", ROOT / "data" / "models" / "smollm2-eagle3"))
NAME = TARGET.name  # the name `workbench serve` gives the model: its folder's
SPEC = wb.SpecConfig(num_steps=5, topk=4, num_draft_tokens=16)
N = 16  # tokens per answer: short, the module stays well under a minute of decoding
MESSAGES = [{"role": "user", "content": "Write a Python function that checks if a number "
                                        "is prime."}]
NO_HEAD = f"the real model's EAGLE-3 head is not shipped yet ({DRAFT} has no config.json)"


def target_available() -> str | None:
    """Why the real model cannot load here (None when it can)."""
    if (TARGET / "config.json").is_file():  # a converted model folder
        return None
    from workbench.models.fetch import POINTER, Pointer, is_fetched

    if not (TARGET / POINTER).is_file():
        return f"{TARGET} is neither a model folder nor a pointer folder"
    if not is_fetched(Pointer.read(TARGET)):
        return "the real model is not in the user cache: run `make real-model`"
    return None


@dataclass
class Real:
    handle: ServerHandle
    spec: wb.SpecConfig | None  # None: served without a head
    texts: dict[tuple, str] = field(default_factory=dict)  # greedy references, by request

    def require_head(self) -> None:
        if self.spec is None:
            pytest.skip(NO_HEAD)


@pytest.fixture(scope="module")
def real() -> Iterator[Real]:
    why = target_available()
    if why is not None:
        pytest.skip(why)
    head = DRAFT if (DRAFT / "config.json").is_file() else None
    # dense GEMMs and torch's thread count: no init-time timing (half a minute on a busy box);
    # what the clients get back does not depend on either
    engine = wb.Engine.from_pretrained(TARGET, draft=head, config=wb.EngineConfig(
        kv_budget_tokens=4096, max_model_len=1024, gemm="dense", contention="off"))
    spec = SPEC if head is not None else None
    engine.set_spec(spec)
    handle = start_server(engine, "127.0.0.1", 0, name=NAME)
    try:
        yield Real(handle, spec)
    finally:
        handle.stop()
        engine.close()


def greedy(real: Real, prompt: str | list[int], n: int, **sp: Any) -> str:
    """The engine's own greedy text for ``prompt``: without the head (plain decoding) and, when
    there is one, with it — the two must agree before a served answer is compared with them."""
    key = (prompt if isinstance(prompt, str) else tuple(prompt), n, tuple(sorted(sp.items())))
    if key not in real.texts:
        params = wb.SamplingParams(max_new_tokens=n, temperature=0.0, **sp)
        plain = real.handle.call(lambda e: e.generate([prompt], params)[0])
        if real.spec is not None:
            spec = real.handle.call(lambda e: e.generate([prompt], params, spec=real.spec)[0])
            assert spec.token_ids == plain.token_ids, "speculation changed the greedy output"
        real.texts[key] = plain.text
    return real.texts[key]


def chat_ids(h: ServerHandle, messages: list[dict[str, str]]) -> list[int]:
    tok = h.engine.tokenizer
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tok.encode(text, add_special_tokens=False))


def test_the_chat_template_is_the_models(real: Real) -> None:
    """The template the server renders with is SmolLM2's own (ChatML with its default system
    prompt), read from the model."""
    tok = real.handle.engine.tokenizer
    text = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>system\n") and "SmolLM" in text
    assert text.endswith("<|im_start|>user\n" + MESSAGES[0]["content"]
                         + "<|im_end|>\n<|im_start|>assistant\n")


def test_openai_chat_is_lossless(real: Real) -> None:
    import openai

    h = real.handle
    ids = chat_ids(h, MESSAGES)
    want = greedy(real, ids, N)
    c = openai.OpenAI(base_url=h.url + "/v1", api_key="unused", max_retries=0)
    r = c.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=N, temperature=0)
    assert r.choices[0].message.content == want
    assert "def " in want  # the model answers the question: a sensible reply, not noise
    assert r.usage.prompt_tokens == len(ids)
    chunks = list(c.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=N,
                                            temperature=0, stream=True))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == want


def test_langchain_chat_is_lossless(real: Real) -> None:
    from langchain_openai import ChatOpenAI

    h = real.handle
    messages = [{"role": "system", "content": "You answer in one short sentence."},
                {"role": "user", "content": "What is the capital of France?"}]
    want = greedy(real, chat_ids(h, messages), N)
    chat = ChatOpenAI(base_url=h.url + "/v1", api_key="unused", model=NAME, temperature=0,
                      max_tokens=N, max_retries=0)
    pairs = [(m["role"], m["content"]) for m in messages]
    assert chat.invoke(pairs).content == want
    assert "".join(str(part.content) for part in chat.stream(pairs)) == want


@pytest.fixture()
def frontend(real: Real, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Any, list]]:
    """``sgl.RuntimeEndpoint(url)`` and the list its HTTP calls are recorded in."""
    import sglang as sgl
    from sglang.lang.backend import runtime_endpoint as rt

    calls: list[tuple[str, Any, Any]] = []
    http_request = rt.http_request

    def recording(url: str, **kw: Any) -> Any:
        res = http_request(url, **kw)
        calls.append((url, kw.get("json"), None if kw.get("stream") else res.json()))
        return res

    monkeypatch.setattr(rt, "http_request", recording)
    yield sgl.RuntimeEndpoint(real.handle.url), calls


def test_sglang_frontend_gen_with_a_stop(real: Real, frontend) -> None:
    """``gen`` with a stop that fires mid-answer, on the model's templated prompt: the served
    text and ids are the engine's greedy ones for that text, budget and stop."""
    import sglang as sgl

    backend, calls = frontend
    h = real.handle
    tok = h.engine.tokenizer
    prompt = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    stop = middle(greedy(real, prompt, N))
    want = greedy(real, prompt, N, stop=(stop,))

    @sgl.function
    def program(s: Any) -> None:
        s += prompt
        s += sgl.gen("answer", max_tokens=N, stop=stop)

    st = program.run(backend=backend, temperature=0)
    assert st["answer"] == want
    assert st.get_meta_info("answer")["finish_reason"] == {"type": "stop", "matched": stop}
    assert check_generates(h, calls) == 1


def test_sglang_frontend_multi_turn(real: Real, frontend) -> None:
    """Two user/assistant turns through the frontend's chat roles: each reply is the engine's
    greedy continuation of the whole conversation so far."""
    import sglang as sgl

    backend, calls = frontend

    @sgl.function
    def program(s: Any) -> None:
        s += sgl.user("Name a prime number.")
        s += sgl.assistant(sgl.gen("first", max_tokens=8))
        s += sgl.user("And a larger one?")
        s += sgl.assistant(sgl.gen("second", max_tokens=8))

    st = program.run(backend=backend, temperature=0)
    st.sync()
    gens = [(b, a) for u, b, a in calls if u.endswith("/generate") and a is not None]
    assert len(gens) == 2
    assert gens[1][0]["text"].startswith(gens[0][0]["text"] + st["first"])
    assert check_generates(real.handle, calls) == 2
    for body, answer in gens:
        assert answer["text"] == greedy(real, body["text"], 8)


def test_the_head_drafts_accepted_tokens(real: Real) -> None:
    """With the head, the server speculates and the target accepts some of its drafts
    (SGLang's per-request counters on /generate)."""
    import httpx

    real.require_head()
    h = real.handle
    text = h.engine.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True,
                                                  tokenize=False)
    r = httpx.post(h.url + "/generate", timeout=120, json={
        "text": text, "sampling_params": {"max_new_tokens": N, "temperature": 0}})
    assert r.status_code == 200, r.text
    meta = r.json()["meta_info"]
    assert meta["spec_verify_ct"] > 0 and meta["spec_num_correct_drafts"] > 0
    assert meta["spec_accept_length"] > 1
    assert r.json()["text"] == greedy(real, text, N)
