"""Adversarial catalogue, per-request budgets: what one request may make the server do or send
is bounded before any work starts, and every client error is a 4xx naming the field.

Each case is one of the failures a hostile sweep found (issue 25) with its bound:

1. ``top_logprobs_num`` × positions (× chunks for a cumulative stream) over
   ``max_logprob_entries`` → 400 naming the field before the engine sees the request; the
   incremental streaming option (SGLang's) sends each output row once; big answers are
   serialized off the event loop (/health answers meanwhile);
2. stop strings: more than 128, or more than 4,096 characters in all → 400 naming
   ``sampling_params.stop`` / ``stop`` (matching cost per token: tests/engine/test_stops.py);
6. a 5,000-digit integer, ``n=2`` with seed 2**64 − 1, a chat template's ``raise_exception``
   → 400 naming ``body`` / ``seed`` / ``messages`` (they were 500s with a traceback);
7. ``no_stop_trim``: the text ends right after the stop string (as SGLang);
9. the API key from ``--api-key-file`` or ``WORKBENCH_API_KEY`` (not the process list).
"""

from __future__ import annotations

import argparse
import json
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from serve.serving import CANARY, serving, still_serves, with_chat_template

import workbench as wb
from workbench.config import SEED_MAX
from workbench.errors import ConfigError
from workbench.serve import frontend
from workbench.serve.protocol import MAX_STOP_CHARS, MAX_STOP_STRINGS
from workbench.serve.server import ServeLimits, ServerHandle, api_key_from_args

ENTRIES = 20_000
LIMITS = ServeLimits(max_logprob_entries=ENTRIES, read_timeout_s=5.0, keep_alive_s=2.0)
RAISING_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'system' %}"
                    "{{ raise_exception('system messages are not supported') }}{% endif %}"
                    "<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>")


@pytest.fixture(scope="module")
def adv(micro_target: Path, random_head: Path, tmp_path_factory: pytest.TempPathFactory,
        ) -> Iterator[ServerHandle]:
    """The micro model with a chat template that refuses system messages."""
    folder = with_chat_template(micro_target, tmp_path_factory.mktemp("raising_chat") / "model",
                                RAISING_TEMPLATE)
    with serving(folder, random_head, LIMITS) as handle:
        yield handle


def refused(adv: ServerHandle, path: str, body: Any, field: str, status: int = 400) -> str:
    """``body`` is refused with ``status`` naming ``field``, and the engine never saw it."""
    before = adv.loop.requests_total
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(adv.url + path, content=content, timeout=60,
                   headers={"content-type": "application/json"})
    assert r.status_code == status, r.text[:500]
    err = r.json()["error"]
    assert err["field"] == field, err
    assert err["message"].startswith(field), err
    assert adv.loop.requests_total == before
    return str(err["message"])


def gen(**kw: Any) -> dict[str, Any]:
    sp = kw.pop("sampling_params", {})
    return {"text": "def f(", "sampling_params": {"max_new_tokens": 4, **sp}, **kw}


# ---- 1. response size ----------------------------------------------------------------------


def test_top_logprobs_over_the_budget_is_refused_before_work(adv: ServerHandle,
                                                             canary_text: str) -> None:
    """The 514 MB case: every alternative for every prompt position. Refused, naming the
    field, before any work; the bound is alternatives (at most the vocabulary: 300 here) x
    positions (prompt from logprob_start_len + max_new_tokens): 301 x 104 > 20,000."""
    msg = refused(adv, "/generate", gen(return_logprob=True, top_logprobs_num=1024,
                                        logprob_start_len=0,
                                        sampling_params={"max_new_tokens": 100}),
                  "top_logprobs_num")
    assert str(ENTRIES) in msg
    # the same request within the budget is answered, with exactly that many alternatives
    r = httpx.post(adv.url + "/generate", timeout=60, json=gen(
        return_logprob=True, top_logprobs_num=50, logprob_start_len=0))
    assert r.status_code == 200, r.text[:500]
    meta = r.json()["meta_info"]
    assert all(len(row) == 50 for row in meta["output_top_logprobs"])
    still_serves(adv, canary_text)


def test_a_cumulative_stream_counts_every_chunk(adv: ServerHandle, canary_text: str) -> None:
    """A stream repeats the tables in every chunk (SGLang's default), so 40 alternatives x 64
    tokens is within the budget answered whole but not streamed: 41 x 64 x 65 / 2 > 20,000."""
    body = gen(return_logprob=True, top_logprobs_num=40,
               sampling_params={"max_new_tokens": 64, "temperature": 0})
    assert httpx.post(adv.url + "/generate", json=body, timeout=60).status_code == 200
    msg = refused(adv, "/generate", {**body, "stream": True}, "top_logprobs_num")
    assert "incremental" in msg
    # OpenAI: n choices count together (16 x 21 alternatives x (prompt + 64 tokens))
    refused(adv, "/v1/completions", {"prompt": "def f(", "n": 16, "logprobs": 20, "echo": True,
                                     "max_tokens": 64}, "logprobs")
    still_serves(adv, canary_text)


def test_incremental_streaming_sends_each_row_once(micro_target: Path, random_head: Path) -> None:
    """SGLang's --incremental-streaming-output: each chunk carries only the new text, ids and
    output log-probability rows; joined they equal the whole answer."""
    limits = ServeLimits(max_logprob_entries=ENTRIES, incremental_streaming=True)
    body = {"text": "def parse(path):", "return_logprob": True, "top_logprobs_num": 3,
            "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}}
    with serving(micro_target, random_head, limits) as h:
        whole = httpx.post(h.url + "/generate", json=body, timeout=60).json()
        with httpx.stream("POST", h.url + "/generate", json={**body, "stream": True},
                          timeout=60) as r:
            events = [json.loads(line[5:]) for line in r.iter_lines()
                      if line.startswith("data:") and line[5:].strip() != "[DONE]"]
    assert len(events) > 1
    assert "".join(e["text"] for e in events) == whole["text"]
    assert sum((e["output_ids"] for e in events), []) == whole["output_ids"]
    rows = sum((e["meta_info"]["output_top_logprobs"] for e in events), [])
    assert rows == whole["meta_info"]["output_top_logprobs"]
    assert events[-1]["meta_info"]["completion_tokens"] == len(whole["output_ids"])


def test_big_answers_are_serialized_off_the_event_loop(adv: ServerHandle, canary_text: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Answers of ~20,000 entries are built and serialized on the encoder threads, never on the
    event loop (built there, /health waited 41 s in the 514 MB case), and /health keeps
    answering meanwhile. What is checked is where the work runs, not how fast: a latency bound
    would measure whatever else the machine runs."""
    where: list[str] = []
    real = frontend.json_bytes

    def spy(obj: Any) -> bytes:
        where.append(threading.current_thread().name)
        return real(obj)

    monkeypatch.setattr(frontend, "json_bytes", spy)
    body = gen(return_logprob=True, top_logprobs_num=200, logprob_start_len=0,
               sampling_params={"max_new_tokens": 48, "temperature": 0, "ignore_eos": True},
               text="def parse(path):\n    with open(path) as f:\n")
    done = threading.Event()
    statuses: list[int] = []
    sizes: list[int] = []

    def big() -> None:
        with httpx.Client(timeout=120) as c:
            for _ in range(3):
                r = c.post(adv.url + "/generate", json=body)
                statuses.append(r.status_code)
                sizes.append(len(r.content))
        done.set()

    th = threading.Thread(target=big)
    th.start()
    health: list[int] = []
    with httpx.Client(timeout=120) as c:
        while not done.is_set():
            health.append(c.get(adv.url + "/health").status_code)
            time.sleep(0.01)
    th.join()
    assert statuses == [200, 200, 200] and min(sizes) > 100_000
    assert len(where) == 3 and all(name.startswith("workbench-encode") for name in where), where
    assert health and set(health) == {200}
    still_serves(adv, canary_text)


# ---- 2. stop strings ---------------------------------------------------------------------------


@pytest.mark.parametrize("stops,why", [
    ([f"x{i}" for i in range(MAX_STOP_STRINGS + 1)], "at most"),
    (["a" * (MAX_STOP_CHARS // 2 + 1)] * 2, "characters"),
    (["z" * 10_000] * 800, "at most"),  # the case that took everyone's latency 0.31 → 13 s
])
def test_stop_strings_over_the_bound_are_refused(stops: list[str], why: str, adv: ServerHandle,
                                                 canary_text: str) -> None:
    msg = refused(adv, "/generate", gen(sampling_params={"stop": stops}),
                  "sampling_params.stop")
    assert why in msg
    refused(adv, "/v1/completions", {"prompt": "def f(", "max_tokens": 4, "stop": stops},
            "stop")
    still_serves(adv, canary_text)


def test_stop_strings_at_the_bound_are_served(adv: ServerHandle, canary_text: str) -> None:
    stops = [f"q{i:05d}" + "w" * (MAX_STOP_CHARS // MAX_STOP_STRINGS - 6)
             for i in range(MAX_STOP_STRINGS)]
    assert sum(map(len, stops)) <= MAX_STOP_CHARS
    r = httpx.post(adv.url + "/generate", timeout=60, json={
        **CANARY, "sampling_params": {**CANARY["sampling_params"], "stop": stops}})
    assert r.status_code == 200 and r.json()["text"] == canary_text
    still_serves(adv, canary_text)


# ---- 6. client errors are 4xx ------------------------------------------------------------------


def test_huge_integer_is_a_400_naming_the_body(adv: ServerHandle, canary_text: str) -> None:
    raw = b'{"text": "a", "sampling_params": {"max_new_tokens": ' + b"9" * 5000 + b"}}"
    refused(adv, "/generate", raw, "body")
    raw = b'{"prompt": "a", "seed": ' + b"1" * 5000 + b"}"
    refused(adv, "/v1/completions", raw, "body")
    still_serves(adv, canary_text)


def test_seed_overflowing_with_n_is_a_400_naming_seed(adv: ServerHandle,
                                                      canary_text: str) -> None:
    refused(adv, "/v1/completions", {"prompt": "a", "n": 2, "seed": SEED_MAX, "max_tokens": 2},
            "seed")
    refused(adv, "/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}],
                                          "n": 3, "seed": SEED_MAX - 1}, "seed")
    r = httpx.post(adv.url + "/v1/completions", timeout=60, json={
        "prompt": "a", "n": 2, "seed": SEED_MAX - 1, "max_tokens": 2})
    assert r.status_code == 200, r.text
    still_serves(adv, canary_text)


def test_chat_template_refusal_is_a_400_naming_messages(adv: ServerHandle,
                                                        canary_text: str) -> None:
    msg = refused(adv, "/v1/chat/completions", {"messages": [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]},
        "messages")
    assert "system messages are not supported" in msg
    r = httpx.post(adv.url + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert r.status_code == 200, r.text
    # the engine's own chat path (Python API) says the same as a RequestError
    with pytest.raises(wb.RequestError, match="^prompt: the chat template refuses"):
        adv.call(lambda e: e.tokenize([{"role": "system", "content": "x"}], "prompt"))
    still_serves(adv, canary_text)


# ---- 7. no_stop_trim -----------------------------------------------------------------------


def test_no_stop_trim_ends_right_after_the_stop(adv: ServerHandle, canary_text: str) -> None:
    stop = canary_text[3:5]
    sp = {**CANARY["sampling_params"], "stop": [stop]}
    cut = httpx.post(adv.url + "/generate", json={**CANARY, "sampling_params": sp},
                     timeout=60).json()
    kept = httpx.post(adv.url + "/generate", timeout=60, json={
        **CANARY, "sampling_params": {**sp, "no_stop_trim": True}}).json()
    assert kept["output_ids"] == cut["output_ids"]
    assert cut["text"] == canary_text[: canary_text.find(stop)]
    assert kept["text"] == cut["text"] + stop  # SGLang: not the rest of the stop's token


# ---- 9. the API key off the command line -----------------------------------------------------


def ns(**kw: Any) -> argparse.Namespace:
    return argparse.Namespace(**{"api_key": None, "api_key_file": None, **kw})


def test_api_key_from_a_file_or_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.delenv("WORKBENCH_API_KEY", raising=False)
    assert api_key_from_args(ns()) is None
    f = tmp_path / "key"
    f.write_text("s3cret\n")
    f.chmod(0o600)  # a key file others may read is refused (test_adversarial_keys.py)
    assert api_key_from_args(ns(api_key_file=str(f))) == "s3cret"
    monkeypatch.setenv("WORKBENCH_API_KEY", "from-env")
    assert api_key_from_args(ns()) == "from-env"
    assert api_key_from_args(ns(api_key_file=str(f))) == "s3cret"  # the flag wins
    with caplog.at_level(logging.WARNING):
        assert api_key_from_args(ns(api_key="k")) == "k"
    assert any("/proc" in r.getMessage() for r in caplog.records)
    with pytest.raises(ConfigError, match="^--api-key/--api-key-file"):
        api_key_from_args(ns(api_key="k", api_key_file=str(f)))
    with pytest.raises(ConfigError, match="^--api-key-file: cannot read"):
        api_key_from_args(ns(api_key_file=str(tmp_path / "missing")))
    (tmp_path / "empty").write_text("\n")
    (tmp_path / "empty").chmod(0o600)
    with pytest.raises(ConfigError, match="^--api-key-file: .* blank"):
        api_key_from_args(ns(api_key_file=str(tmp_path / "empty")))


def test_a_server_keyed_from_the_environment(micro_target: Path, random_head: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORKBENCH_API_KEY", "env-key")
    limits = ServeLimits(api_key=api_key_from_args(ns()))
    with serving(micro_target, random_head, limits) as h:
        assert httpx.post(h.url + "/generate", json=CANARY, timeout=60).status_code == 401
        ok = httpx.post(h.url + "/generate", json=CANARY, timeout=60,
                        headers={"Authorization": "Bearer env-key"})
        assert ok.status_code == 200, ok.text
