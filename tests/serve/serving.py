"""Serving test kit: a live server on loopback around a micro engine (EAGLE-3 random head, spec
on), solo greedy reference outputs from a second engine, SSE helpers.

The fixtures are re-exported by tests/serve/conftest.py and tests/remote/conftest.py (each
directory then gets its own session server); test modules import the helpers from here.

The adversarial catalogues (tests/serve/test_adversarial_*.py) each define a module-scoped
``adv`` server with their own limits; ``canary_text`` and :func:`still_serves` check that it
still answers a normal request (``CANARY``) exactly as before."""

from __future__ import annotations

import contextlib
import json
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from helpers import make_engine

import workbench as wb
from workbench.serve.server import ServeLimits, ServerHandle, start_server

SPEC = wb.SpecConfig(num_steps=3, topk=2, num_draft_tokens=6)
ENGINE_CONFIG = wb.EngineConfig(kv_budget_tokens=8192, max_model_len=256)
CANARY = {"text": "def parse(path):", "sampling_params": {"max_new_tokens": 8, "temperature": 0,
                                                          "ignore_eos": True}}
TEXT_PROMPTS = ["def parse(path):", "import os\n", "class Node:", "    return ", "for i in range(",
                "# a comment\n", "x = [", "while True:"]


def greedy(max_new_tokens: int) -> wb.SamplingParams:
    return wb.SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)


def sse_payloads(lines: Iterator[str]) -> list[str]:
    """The ``data:`` payloads of an SSE response, ``[DONE]`` included."""
    return [line[5:].strip() for line in lines if line.startswith("data:")]


def sse_json(lines: Iterator[str]) -> list[dict]:
    payloads = sse_payloads(lines)
    assert payloads and payloads[-1] == "[DONE]", payloads[-3:]
    return [json.loads(p) for p in payloads[:-1]]


def with_chat_template(target: Path, folder: Path, template: str | None) -> Path:
    """A copy of the model folder ``target`` at ``folder`` whose tokenizer_config.json has
    ``template`` as its chat template, or none (``template`` None: ``target`` must have one)."""
    shutil.copytree(target, folder)
    cfg_path = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    if template is None:
        assert cfg.pop("chat_template")  # train-target writes one
    else:
        cfg["chat_template"] = template
    cfg_path.write_text(json.dumps(cfg))
    return folder


def still_serves(adv: ServerHandle, canary_text: str) -> None:
    """The server answers a normal request with the same text as before, and frees all KV."""
    r = httpx.post(adv.url + "/generate", json=CANARY, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["text"] == canary_text
    assert adv.wait_idle(30)
    assert adv.kv_usage()["used_blocks"] == 0


@contextlib.contextmanager
def serving(target: Path, head: Path, limits: ServeLimits | None = None,
            spec: wb.SpecConfig = SPEC) -> Iterator[ServerHandle]:
    """A live server on loopback around a fresh micro engine (``make_engine`` with
    ``ENGINE_CONFIG``) with ``spec`` on; stopped and its engine closed on exit."""
    engine = make_engine(target, head, ENGINE_CONFIG)
    engine.set_spec(spec)
    handle = start_server(engine, "127.0.0.1", 0, limits=limits)
    try:
        yield handle
    finally:
        handle.stop()
        engine.close()


METRIC_LINE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[a-z_]+="[^"]*"(?:,[a-z_]+="[^"]*")*\})?'
                         r' (\S+)$')


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text → {"name{labels}": value}; every non-comment line must parse and belong
    to a # TYPE'd metric (a histogram's _bucket/_sum/_count lines to the histogram); SGLang's
    model_name label (on every sglang: series) is checked and left out of the key."""
    out: dict[str, float] = {}
    types: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            types[name] = kind
            continue
        if not line or line.startswith("#"):
            continue
        m = METRIC_LINE.match(line)
        assert m, f"unparseable metrics line {line!r}"
        name = m.group(1)
        base = re.sub(r"_(bucket|sum|count)$", "", name)
        assert name in types or types.get(base) == "histogram", f"{name} has no # TYPE line"
        labels = m.group(2) or ""
        if labels.startswith("{model_name="):  # SGLang's label on every sglang: series
            first, _, rest = labels[1:-1].partition(",")
            assert first == 'model_name="model"', labels
            labels = "{" + rest + "}" if rest else ""
        out[name + labels] = float(m.group(3))
    return out


@pytest.fixture(scope="module")
def canary_text(adv: ServerHandle) -> str:
    """``CANARY``'s text from the requesting module's ``adv`` server (once per module)."""
    r = httpx.post(adv.url + "/generate", json=CANARY, timeout=60)
    assert r.status_code == 200, r.text
    return str(r.json()["text"])


@pytest.fixture(scope="session")
def reference_engine(micro_target: Path, random_head: Path) -> Iterator[wb.Engine]:
    with make_engine(micro_target, random_head, ENGINE_CONFIG) as e:
        yield e


@pytest.fixture(scope="session")
def solo(reference_engine: wb.Engine) -> Callable[[str | list[int], int], wb.RequestOutput]:
    """``solo(prompt, n)``: the greedy output of ``prompt`` run alone (same spec), cached."""
    cache: dict[tuple, wb.RequestOutput] = {}

    def run(prompt: str | list[int], n: int) -> wb.RequestOutput:
        key = (prompt if isinstance(prompt, str) else tuple(prompt), n)
        if key not in cache:
            cache[key] = reference_engine.generate([prompt], greedy(n), spec=SPEC)[0]
        return cache[key]

    return run


@pytest.fixture(scope="session")
def server(micro_target: Path, random_head: Path) -> Iterator[ServerHandle]:
    with serving(micro_target, random_head) as handle:
        yield handle


@pytest.fixture()
def http(server: ServerHandle) -> Iterator:
    import httpx

    with httpx.Client(base_url=server.url, timeout=60.0) as c:
        yield c
