"""Real clients, unchanged, against ``workbench serve`` on the shipped pair (wb-target with its
EAGLE-3 head, speculating): SGLang's frontend language (``sgl.function`` programs through
``sgl.RuntimeEndpoint``: ``gen`` with stop / stop_regex / streaming, ``select``, ``fork``,
multi-turn chat), LangChain (``ChatOpenAI`` and the ``OpenAI`` completion LLM), LiteLLM (chat and
text completion), the ``openai`` SDK's chat (the shipped chat template), and lm-eval-harness's
``local-completions`` scoring a small local task, whose per-sample loglikelihoods must equal
lm-eval's own ``hf`` model on the same checkpoint.

Every generated text is checked against the engine's own greedy output for the same prompt and
stops (the engine the server runs, called between its steps). The frontend's HTTP calls are
recorded (its ``http_request`` wrapped, not changed) so each ``/generate`` it sends is checked
too.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import workbench as wb
from workbench.serve.server import ServerHandle, start_server

ROOT = Path(__file__).resolve().parents[2]
TARGET = ROOT / "data" / "models" / "wb-target"
DRAFT = ROOT / "data" / "models" / "wb-eagle3"
SPEC = wb.SpecConfig(num_steps=3, topk=2, num_draft_tokens=6)
MESSAGES = [{"role": "system", "content": "You write Python."},
            {"role": "user", "content": "parse a path"}]
N = 12


@pytest.fixture(scope="module")
def shipped() -> Iterator[ServerHandle]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    engine = wb.Engine.from_pretrained(TARGET, draft=DRAFT,
                                       config=wb.EngineConfig(kv_budget_tokens=16384))
    engine.set_spec(SPEC)
    handle = start_server(engine, name="wb-target")
    try:
        yield handle
    finally:
        handle.stop()
        engine.close()


def reference(h: ServerHandle, prompt: str | list[int], n: int, **sp: Any) -> wb.RequestOutput:
    """The engine's own greedy output (run on the engine thread, between steps)."""
    params = wb.SamplingParams(max_new_tokens=n, temperature=0.0, **sp)
    return h.call(lambda e: e.generate([prompt], params)[0])


def chat_ids(h: ServerHandle, messages: list[dict[str, str]]) -> list[int]:
    tok = h.engine.tokenizer
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tok.encode(text, add_special_tokens=False))


def middle(text: str, k: int = 2) -> str:
    """``k`` characters from the middle of ``text`` (a stop that fires mid-generation)."""
    mid = len(text) // 2
    return text[mid : mid + k]


# ---- the shipped chat template, through every chat client ------------------------------------


def test_shipped_models_have_a_chat_template() -> None:
    from transformers import AutoTokenizer

    from workbench.train.target import CHAT_TEMPLATE

    for name in ("wb-target", "wb-assistant"):
        cfg = json.loads((ROOT / "data" / "models" / name / "tokenizer_config.json").read_text())
        assert cfg["chat_template"] == CHAT_TEMPLATE
        assert "## Chat template" in (ROOT / "data" / "models" / name / "README.md").read_text()
    tok = AutoTokenizer.from_pretrained(TARGET)
    convo = [*MESSAGES, {"role": "assistant", "content": "def f(p):\n    return p"},
             {"role": "user", "content": "two\nlines"}]
    text = tok.apply_chat_template(convo, add_generation_prompt=True, tokenize=False)
    assert text == ("# system: You write Python.\n# user: parse a path\n# assistant:\n"
                    "def f(p):\n    return p\n# user: two\n# lines\n# assistant:\n")
    # a reply appended renders as the generation prompt followed by the reply
    head = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    full = tok.apply_chat_template([*MESSAGES, {"role": "assistant", "content": "x = 1"}],
                                   tokenize=False)
    assert full == head + "x = 1\n"


def test_openai_chat_on_the_shipped_pair(shipped: ServerHandle) -> None:
    import openai

    ref = reference(shipped, chat_ids(shipped, MESSAGES), N)
    c = openai.OpenAI(base_url=shipped.url + "/v1", api_key="unused", max_retries=0)
    r = c.chat.completions.create(model="wb-target", messages=MESSAGES, max_tokens=N,
                                  temperature=0)
    assert r.choices[0].message.content == ref.text
    assert r.usage.prompt_tokens == len(ref.prompt_ids)
    chunks = list(c.chat.completions.create(model="wb-target", messages=MESSAGES, max_tokens=N,
                                            temperature=0, stream=True))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == ref.text


def test_langchain_chat_and_completion_llm(shipped: ServerHandle) -> None:
    from langchain_openai import ChatOpenAI, OpenAI

    ref = reference(shipped, chat_ids(shipped, MESSAGES), N)
    chat = ChatOpenAI(base_url=shipped.url + "/v1", api_key="unused", model="wb-target",
                      temperature=0, max_tokens=N, max_retries=0)
    got = chat.invoke([("system", MESSAGES[0]["content"]), ("user", MESSAGES[1]["content"])])
    assert got.content == ref.text
    streamed = "".join(str(part.content) for part in chat.stream(
        [("system", MESSAGES[0]["content"]), ("user", MESSAGES[1]["content"])]))
    assert streamed == ref.text
    prompt = "def parse(path):\n"
    llm = OpenAI(base_url=shipped.url + "/v1", api_key="unused", model="wb-target",
                 temperature=0, max_tokens=N, max_retries=0)
    assert llm.invoke(prompt) == reference(shipped, prompt, N).text


@pytest.fixture()
def litellm_owned(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """``litellm`` with what it would keep for the life of the process owned by the test and
    closed after it: the HTTP connections (its clients are cached process-wide, so their
    keep-alive sockets used to outlive the run: tests/leaks.py) and the event loop its service
    logger asks ``asyncio.get_event_loop()`` for (a fresh thread's one is made and never closed).
    """
    import asyncio

    import httpx

    os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"  # no price-list download at import
    import litellm

    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    with httpx.Client() as session:
        monkeypatch.setattr(litellm, "client_session", session)  # litellm's own setting
        try:
            yield litellm
        finally:
            litellm.in_memory_llm_clients_cache.flush_cache()  # clients over the closed session
            asyncio.set_event_loop(None)
            loop.close()


def test_litellm_chat_and_text_completion(shipped: ServerHandle, litellm_owned: Any) -> None:
    litellm = litellm_owned
    kw = {"model": "openai/wb-target", "api_base": shipped.url + "/v1", "api_key": "unused",
          "temperature": 0, "max_tokens": N}
    r = litellm.completion(messages=MESSAGES, **kw)
    assert r.choices[0].message.content == reference(shipped, chat_ids(shipped, MESSAGES),
                                                     N).text
    prompt = "import os\n"
    r = litellm.text_completion(prompt=prompt, **kw)
    assert r.choices[0].text == reference(shipped, prompt, N).text


# ---- SGLang's frontend language ---------------------------------------------------------------


@pytest.fixture()
def frontend(shipped: ServerHandle, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Any, list]]:
    """``sgl.RuntimeEndpoint(url)`` and the list its HTTP calls are recorded in."""
    import sglang as sgl
    from sglang.lang.backend import runtime_endpoint as rt

    calls: list[tuple[str, Any, Any]] = []
    real = rt.http_request

    def recording(url: str, **kw: Any) -> Any:
        res = real(url, **kw)
        calls.append((url, kw.get("json"), None if kw.get("stream") else res.json()))
        return res

    monkeypatch.setattr(rt, "http_request", recording)
    yield sgl.RuntimeEndpoint(shipped.url), calls


def _strings(v: Any) -> tuple[str, ...]:
    return (v,) if isinstance(v, str) else tuple(v or ())


def check_generates(h: ServerHandle, calls: list) -> int:
    """Every single-prompt /generate the frontend sent that asked for tokens answered the
    engine's own greedy output for that text, budget and stops. Returns how many."""
    n = 0
    for url, body, answer in calls:
        sp = (body or {}).get("sampling_params", {})
        if not url.endswith("/generate") or answer is None or \
                not isinstance(body.get("text"), str) or not sp.get("max_new_tokens"):
            continue
        assert sp["temperature"] == 0
        ref = reference(h, body["text"], sp["max_new_tokens"], stop=_strings(sp.get("stop")),
                        stop_regex=_strings(sp.get("stop_regex")))
        assert answer["text"] == ref.text and answer["output_ids"] == ref.token_ids, body
        n += 1
    return n


def test_frontend_gen_with_stop_stop_regex_and_streaming(shipped: ServerHandle,
                                                         frontend) -> None:
    import sglang as sgl

    backend, calls = frontend
    prompt = "class Stack:\n    def push(self, item):\n"
    free_a = reference(shipped, prompt, 24).text
    stop = middle(free_a)
    a = reference(shipped, prompt, 24, stop=(stop,))
    assert a.finish_reason == "stop"
    free_b = reference(shipped, prompt + a.text, 24).text
    pattern = "".join(f"\\x{{{ord(c):x}}}" for c in middle(free_b))  # e.g. \x{20}\x{3d}
    pattern = f"(?:{pattern}|@@@@)"
    b = reference(shipped, prompt + a.text, 24, stop_regex=(pattern,))
    assert b.finish_reason == "stop"

    @sgl.function
    def program(s: Any, prompt: str) -> None:
        s += prompt
        s += sgl.gen("a", max_tokens=24, stop=stop)
        s += sgl.gen("b", max_tokens=24, stop_regex=pattern)

    st = program.run(prompt=prompt, backend=backend, temperature=0)
    assert (st["a"], st["b"]) == (a.text, b.text)
    assert st.text() == prompt + a.text + b.text
    assert st.get_meta_info("a")["finish_reason"] == {"type": "stop", "matched": stop}
    assert st.get_meta_info("b")["finish_reason"] == {"type": "stop", "matched": pattern}
    assert check_generates(shipped, calls) == 2
    # streamed: the same text, piece by piece
    st = program.run(prompt=prompt, backend=backend, temperature=0, stream=True)
    pieces = list(st.text_iter())
    assert len(pieces) > 2 and "".join(pieces) == prompt + a.text + b.text
    assert (st["a"], st["b"]) == (a.text, b.text)


def test_frontend_select_scores_every_choice(shipped: ServerHandle, frontend) -> None:
    """select: a prefill-only request (max_new_tokens 0), then one batch of the prompt + each
    choice scored from logprob_start_len (input logprobs, no output); the decision is the
    choice with the best normalized logprob, each logprob the engine's own."""
    import sglang as sgl

    from workbench.core import LogprobParams

    backend, calls = frontend
    head = "import os\nimport sys\n\n\ndef main():\n    path ="
    choices = [" os.getcwd()", " sys.argv[1]", " None"]

    @sgl.function
    def program(s: Any) -> None:
        s += head
        s += sgl.select("pick", choices=choices)

    st = program.run(backend=backend, temperature=0)
    st.sync()
    meta = st.get_meta_info("pick")
    scores = meta["normalized_prompt_logprobs"]
    assert st["pick"] == choices[scores.index(max(scores))]
    batch = [b for u, b, _ in calls if u.endswith("/generate") and isinstance(b["text"], list)]
    assert len(batch) == 1 and batch[0]["sampling_params"]["max_new_tokens"] == 0
    start = batch[0]["logprob_start_len"]
    zero = wb.SamplingParams(max_new_tokens=0)

    def score(engine: wb.Engine, text: str) -> wb.RequestOutput:
        rid = engine.add_request(text, zero, logprobs=LogprobParams(start=start))
        while not engine.requests[rid].finished:
            engine.step()
        return engine.release(rid)

    for c, got in zip(choices, meta["input_token_logprobs"], strict=True):
        out = shipped.call(lambda e, c=c: score(e, head + c))
        want = list(zip(out.input_logprobs, out.prompt_ids[start:], strict=True))
        assert [g[1] for g in got] == [t for _, t in want][-len(got):]
        assert [g[0] for g in got] == pytest.approx([v for v, _ in want][-len(got):], abs=1e-4)
        assert out.token_ids == []
    assert all(m == [] for m in meta["output_token_logprobs"])


def test_frontend_fork(shipped: ServerHandle, frontend) -> None:
    import sglang as sgl

    backend, calls = frontend
    head = "class Node:\n"
    tails = ["    def __init__(self", "    def __repr__(self"]

    @sgl.function
    def program(s: Any) -> None:
        s += head
        forks = s.fork(len(tails))
        for f, tail in zip(forks, tails, strict=True):
            f += tail
            f += sgl.gen("m", max_tokens=12, stop="\n")
        s += "# " + " | ".join(f["m"] for f in forks)

    st = program.run(backend=backend, temperature=0)
    refs = [reference(shipped, head + t, 12, stop=("\n",)).text for t in tails]
    assert st.text() == head + "# " + " | ".join(refs)
    assert check_generates(shipped, calls) == 2


def test_frontend_multi_turn_state(shipped: ServerHandle, frontend) -> None:
    """Two user/assistant turns with the frontend's own chat template: each reply is the
    engine's greedy continuation of the whole conversation so far."""
    import sglang as sgl

    backend, calls = frontend

    @sgl.function
    def program(s: Any) -> None:
        s += sgl.system("You write Python.")
        s += sgl.user("def parse(path):")
        s += sgl.assistant(sgl.gen("first", max_tokens=10))
        s += sgl.user("now the loop")
        s += sgl.assistant(sgl.gen("second", max_tokens=10))

    st = program.run(backend=backend, temperature=0)
    st.sync()  # the program runs on the frontend's own thread
    gens = [(b, a) for u, b, a in calls if u.endswith("/generate") and a is not None]
    assert len(gens) == 2
    assert gens[1][0]["text"].startswith(gens[0][0]["text"] + st["first"])
    assert [m["role"] for m in st.messages()] == ["system", "user", "assistant", "user",
                                                  "assistant"]
    assert check_generates(shipped, calls) == 2
    assert (gens[0][1]["text"], gens[1][1]["text"]) == (st["first"], st["second"])


# ---- lm-eval-harness: local-completions against workbench serve == its own hf model -----------

DOCS = [
    {"context": "def add(a, b):\n    return", "choices": [" a + b", " a - b", " None"], "label": 0},
    {"context": "import os\nimport", "choices": [" sys", " re", " json"], "label": 0},
    {"context": "for i in range(", "choices": ["10):", "len(xs)):", "n):"], "label": 1},
    {"context": "class Stack:\n    def __init__(self):\n        self.",
     "choices": ["items = []", "x = 0", "pop()"], "label": 0},
]


def _task(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "data.jsonl").write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (folder / "wb_tiny.yaml").write_text(
        "task: wb_tiny\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {folder / 'data.jsonl'}\ntest_split: test\noutput_type: multiple_choice\n"
        'doc_to_text: "{{context}}"\ndoc_to_choice: "{{choices}}"\n'
        'doc_to_target: "{{label}}"\ntarget_delimiter: ""\nmetric_list:\n  - metric: acc\n')
    return folder


def test_lm_eval_local_completions_equals_hf(shipped: ServerHandle, tmp_path: Path) -> None:
    import lm_eval
    from lm_eval.tasks import TaskManager

    tm = TaskManager(include_path=str(_task(tmp_path / "task")))

    def loglikelihoods(model: str, args: str) -> list[list[float]]:
        res = lm_eval.simple_evaluate(model=model, model_args=args, tasks=["wb_tiny"],
                                      task_manager=tm, log_samples=True)
        samples = sorted(res["samples"]["wb_tiny"], key=lambda s: s["doc_id"])
        return [[r[0][0] for r in s["resps"]] for s in samples]

    served = loglikelihoods("local-completions", (
        f"model=wb-target,base_url={shipped.url}/v1/completions,tokenizer_backend=huggingface,"
        f"tokenizer={TARGET},num_concurrent=1,max_retries=1"))
    hf = loglikelihoods("hf", f"pretrained={TARGET},dtype=float32,device=cpu")
    assert len(served) == len(hf) == len(DOCS)
    for a, b in zip(served, hf, strict=True):
        assert len(a) == len(b) == 3
        assert a == pytest.approx(b, abs=1e-4)
