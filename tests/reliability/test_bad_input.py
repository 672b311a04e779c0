"""The bad-input catalogue: one table of wrong inputs across the Python API, the CLI and HTTP,
each with the error it must produce — the type (or exit code / status) and a message naming
the field. After an API case the engine is left exactly as it was (same spec, nothing queued,
no KV held) and still serves; after an HTTP case the server still serves.

CLI cases call ``workbench.__main__.main`` in-process; an exception escaping it is what
``python -m workbench`` reports as a traceback with exit status 1 (checked once for real by
``test_cli_exception_exits_non_zero_in_a_subprocess``).
"""

from __future__ import annotations

import contextlib
import functools
import io
import math
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers import make_engine
from reliability import kit

import workbench as wb
from workbench.__main__ import main


class Ctx:
    """What the cases run against; engines and the server start on first use."""

    def __init__(self, target: Path, head: Path) -> None:
        self.target, self.head = target, head

    @functools.cached_property
    def engine(self) -> wb.Engine:
        """A server-style engine: speculation set on the engine itself."""
        e = make_engine(self.target, self.head, kit.CONFIG)
        e.set_spec(kit.SPEC)
        return e

    @functools.cached_property
    def plain(self) -> wb.Engine:
        return make_engine(self.target, None, kit.CONFIG)

    @functools.cached_property
    def server(self) -> Any:
        from workbench.serve.server import start_server

        return start_server(make_engine(self.target, None, kit.CONFIG), port=0)

    def close(self) -> None:
        if "server" in self.__dict__:
            self.server.stop()
            self.server.engine.close()
        for name in ("engine", "plain"):
            if name in self.__dict__:
                self.__dict__[name].close()


@dataclass(frozen=True)
class Case:
    """``call(ctx)`` for the API, argv for the CLI, (path, body) for HTTP.

    ``expect``: the exception type (API), exit status (CLI) or HTTP status; ``match``: a regex
    the message must contain (the field's name, at least); ``field``: HTTP's error.field."""

    surface: str
    call: Any
    expect: Any
    match: str
    field: str | None = None


def api(call: Callable[[Ctx], object], expect: type[BaseException], match: str) -> Case:
    return Case("api", call, expect, match)


def cli(argv: Callable[[Ctx], list[str]], status: int, match: str) -> Case:
    return Case("cli", argv, status, match)


def http(path: str, body: object, field: str, status: int = 400) -> Case:
    return Case("http", (path, body), status, "^" + field.replace(".", r"\."), field)


SP = wb.SamplingParams
SC = wb.SpecConfig
EC = wb.EngineConfig


def _running_rid(c: Ctx) -> int:
    return c.engine.add_request([1, 2, 3], kit.greedy(4))


def _release_running(c: Ctx) -> None:
    rid = _running_rid(c)
    try:
        c.engine.release(rid)
    finally:
        c.engine.abort(rid)


def _ids_gen(c: Ctx) -> list[str]:
    return ["generate", "--model", str(c.target), "--prompt", "def f("]


def _without_chat_template(engine: wb.Engine, fn: Callable[[], object]) -> object:
    """``fn()`` with the engine's tokenizer stripped of its chat template (train-target writes
    one into the workbench's own models; a user model may have none)."""
    tok = engine.tokenizer
    saved, tok.chat_template = tok.chat_template, None
    try:
        return fn()
    finally:
        tok.chat_template = saved


CASES: dict[str, Case] = {
    # -- SamplingParams ------------------------------------------------------------------------
    "sampling temperature negative": api(lambda c: SP(temperature=-0.1), wb.RequestError,
                                         "^temperature: must be >= 0"),
    "sampling temperature nan": api(lambda c: SP(temperature=math.nan), wb.RequestError,
                                    "^temperature"),
    "sampling top_p zero": api(lambda c: SP(top_p=0.0), wb.RequestError, r"^top_p: .*\(0, 1\]"),
    "sampling top_k negative": api(lambda c: SP(top_k=-1), wb.RequestError, "^top_k"),
    "sampling min_p one": api(lambda c: SP(min_p=1.0), wb.RequestError, r"^min_p: .*\[0, 1\)"),
    "sampling max_new_tokens negative": api(lambda c: SP(max_new_tokens=-1), wb.RequestError,
                                            "^max_new_tokens: must be an integer >= 0"),
    "sampling max_new_tokens bool": api(lambda c: SP(max_new_tokens=True), wb.RequestError,
                                        "^max_new_tokens"),
    "sampling seed string": api(lambda c: SP(seed="7"), wb.RequestError,  # type: ignore[arg-type]
                                "^seed: must be an integer"),
    "sampling empty stop string": api(lambda c: SP(stop=("",)), wb.RequestError, "^stop:"),
    "sampling unknown field": api(lambda c: SP.from_dict({"beam_width": 4}), wb.RequestError,
                                  r"unknown field\(s\) \['beam_width'\]"),
    # -- SpecConfig ----------------------------------------------------------------------------
    "spec num_steps zero": api(lambda c: SC(num_steps=0), wb.ConfigError,
                               "^SpecConfig.num_steps: must be >= 1"),
    "spec topk zero": api(lambda c: SC(topk=0), wb.ConfigError, "^SpecConfig.topk"),
    "spec num_draft_tokens one": api(lambda c: SC(num_draft_tokens=1), wb.ConfigError,
                                     "^SpecConfig.num_draft_tokens: must be >= 2"),
    "spec chain with a tree budget": api(lambda c: SC(num_steps=3, topk=1, num_draft_tokens=8),
                                         wb.ConfigError, "topk=1 \\(chain\\) forces"),
    "spec tree budget too large": api(lambda c: SC(num_steps=2, topk=2, num_draft_tokens=10),
                                      wb.ConfigError, "^SpecConfig.num_draft_tokens: 10 >"),
    "spec draft_state": api(lambda c: SC(draft_state="hot"),  # type: ignore[arg-type]
                            wb.ConfigError, "^SpecConfig.draft_state"),
    "spec catchup_window": api(lambda c: SC(catchup_window=0), wb.ConfigError,
                               "^SpecConfig.catchup_window"),
    "spec catchup_window bool": api(lambda c: SC(catchup_window=True), wb.ConfigError,
                                    "^SpecConfig.catchup_window"),
    "spec simulate_accept_length": api(lambda c: SC(simulate_accept_length=0.5), wb.ConfigError,
                                       "^SpecConfig.simulate_accept_length"),
    # -- EngineConfig and engine construction --------------------------------------------------
    "engine dtype": api(lambda c: EC(dtype="int8"), wb.ConfigError, "^EngineConfig.dtype"),
    "engine max_batch_size zero": api(lambda c: EC(max_batch_size=0), wb.ConfigError,
                                      "^EngineConfig.max_batch_size: must be a positive"),
    "engine kv below one page": api(lambda c: EC(kv_budget_tokens=8), wb.ConfigError,
                                    "^EngineConfig.kv_budget_tokens: smaller than one page"),
    "engine page_size string": api(lambda c: EC(page_size="16"),  # type: ignore[arg-type]
                                   wb.ConfigError, "^EngineConfig.page_size"),
    "engine missing model": api(lambda c: wb.Engine.from_pretrained("/nonexistent/model"),
                                wb.EngineInitError, "stage 'load_config'"),
    "engine missing draft": api(lambda c: wb.Engine.from_pretrained(
        c.target, draft="/nonexistent/head", config=kit.CONFIG), wb.EngineInitError,
        "stage 'load_draft'"),
    "engine unknown device": api(lambda c: wb.Engine.from_pretrained(
        c.target, config=EC(device="nonsense", self_check=False)), wb.ConfigError,
        "^EngineConfig.device: 'nonsense' is not a torch device"),
    # -- prompts and requests ------------------------------------------------------------------
    "prompt empty ids": api(lambda c: c.engine.add_request([]), wb.RequestError,
                            "^prompt: empty prompt"),
    "prompt empty text": api(lambda c: c.engine.add_request(""), wb.RequestError,
                             "^prompt: empty prompt"),
    "prompt id outside vocab": api(lambda c: c.engine.add_request([1, 300]), wb.RequestError,
                                   r"^prompt: token id 300 outside the vocabulary \[0, 300\)"),
    "prompt negative id": api(lambda c: c.engine.add_request([-1]), wb.RequestError,
                              "^prompt: token id -1 outside"),
    "prompt float id": api(lambda c: c.engine.add_request([1, 2.5]),  # type: ignore[list-item]
                           wb.RequestError, "^prompt: token ids must be integers, got 2.5"),
    "prompt bool id": api(lambda c: c.engine.add_request([True, 2]), wb.RequestError,
                          "^prompt: token ids must be integers, got True"),
    "prompt chat without template": api(
        lambda c: _without_chat_template(c.engine, lambda: c.engine.add_request(
            [{"role": "user", "content": "hi"}])), wb.RequestError,
        "^prompt: chat messages given but the tokenizer has no chat template"),
    "prompt longer than the context": api(
        lambda c: c.engine.add_request([1] * c.engine.max_model_len), wb.RequestError,
        "^prompt: 256 tokens does not fit the context"),
    "sampling not SamplingParams": api(
        lambda c: c.engine.add_request([1, 2], {"temperature": 0}),  # type: ignore[arg-type]
        wb.RequestError, "^sampling: expected SamplingParams, got dict"),
    "release unknown rid": api(lambda c: c.engine.release(10**9), wb.RequestError,
                               "^rid: unknown request"),
    "release running rid": api(_release_running, wb.RequestError, "^rid: .* is still running"),
    # -- generate / stream ---------------------------------------------------------------------
    "generate params count": api(lambda c: c.engine.generate([[1], [2]], [kit.greedy(2)]),
                                 wb.RequestError, "^sampling: 1 params for 2 prompts"),
    "generate bad prompt mid-batch": api(
        lambda c: c.engine.generate([[1, 2], [], [3]], kit.greedy(2), spec=kit.SPEC),
        wb.RequestError, "^prompt: empty prompt"),
    "generate spec without a draft": api(lambda c: c.plain.generate([[1]], spec=kit.SPEC),
                                         wb.ConfigError, "^spec: this engine has no draft"),
    "stream bad prompt": api(lambda c: list(c.engine.stream([0, 300])), wb.RequestError,
                             "^prompt: token id 300"),
    # -- policies and fault points -------------------------------------------------------------
    "policy RandomFlip p": api(lambda c: wb.RandomFlip(p=1.5), wb.ConfigError,
                               r"^RandomFlip.p: must be in \[0, 1\]"),
    "policy RandomFlip shape": api(lambda c: wb.RandomFlip(shapes=[(0, 1, 2)]), wb.ConfigError,
                                   "^RandomFlip.shapes"),
    "policy BatchThreshold negative": api(lambda c: wb.BatchThreshold(-1), wb.ConfigError,
                                          "^BatchThreshold.n: must be an integer >= 0"),
    "policy StepTable empty": api(lambda c: wb.StepTable({}), wb.ConfigError,
                                  "^StepTable.tiers"),
    "sampling temperature bool": api(lambda c: SP(temperature=True), wb.RequestError,
                                     "^temperature: must be a number"),
    "sampling top_k bool": api(lambda c: SP(top_k=False), wb.RequestError, "^top_k"),
    "policy StepTable gap": api(lambda c: wb.StepTable({(2, None): None}), wb.ConfigError,
                                "^StepTable.tiers: gap"),
    "fault point unknown": api(lambda c: wb.faults.inject("init:bogus").__enter__(), ValueError,
                               "unknown point 'init:bogus'"),
    # -- CLI -----------------------------------------------------------------------------------
    "cli unknown command": cli(lambda c: ["frobnicate"], 2, "invalid choice: 'frobnicate'"),
    "cli generate without prompt": cli(lambda c: ["generate"], 2,
                                       "the following arguments are required: --prompt"),
    "cli max-new-tokens not int": cli(lambda c: ["generate", "--prompt", "x",
                                                 "--max-new-tokens", "abc"], 2,
                                      "argument --max-new-tokens: invalid int value: 'abc'"),
    "cli bench unknown": cli(lambda c: ["bench", "nope"], 2, "invalid choice: 'nope'"),
    "cli bench spec shape": cli(lambda c: ["bench", "peers", "--spec", "5,x,16"], 1,
                                "ConfigError: --spec: expected three integers"),
    "cli bench spec too many nodes": cli(lambda c: ["bench", "threshold", "--spec", "2,2,9"], 1,
                                         "ConfigError: --spec 2,2,9: SpecConfig.num_draft_tokens"),
    "cli bench shapes tau": cli(lambda c: ["bench", "shapes", "--tau", "9"], 1,
                                "ConfigError: bench shapes: --tau 9 not in"),
    "cli bench levels": cli(lambda c: ["bench", "concurrency", "--levels", "1,0"], 1,
                            "ConfigError: --levels: concurrency levels must be >= 1"),
    "cli bench levels not int": cli(lambda c: ["bench", "threshold", "--levels", "1,two"], 1,
                                    "ConfigError: --levels: expected comma-separated"),
    "cli serve port not int": cli(lambda c: ["serve", "--port", "http"], 2,
                                  "argument --port: invalid int value"),
    "cli missing model": cli(lambda c: ["generate", "--model", "/nonexistent/model",
                                        "--prompt", "x"], 1,
                             "EngineInitError: .*stage 'load_config'"),
    "cli dtype": cli(lambda c: _ids_gen(c) + ["--dtype", "int8"], 1,
                     "ConfigError: EngineConfig.dtype"),
    "cli temperature negative": cli(lambda c: _ids_gen(c) + ["--temperature", "-1"], 1,
                                    "RequestError: temperature: must be >= 0"),
    "cli top-p above one": cli(lambda c: _ids_gen(c) + ["--top-p", "2"], 1,
                               "RequestError: top_p"),
    "cli num-steps zero": cli(lambda c: _ids_gen(c) + ["--draft", str(c.head),
                                                       "--num-steps", "0"], 1,
                              "ConfigError: SpecConfig.num_steps"),
    # -- HTTP ----------------------------------------------------------------------------------
    "http malformed json": http("/generate", b'{"text": ', "body"),
    "http empty text": http("/generate", {"text": ""}, "text"),
    "http ids outside vocab": http("/generate", {"input_ids": [1, 10**6]}, "input_ids"),
    "http temperature negative": http("/generate", {"text": "a", "sampling_params": {
        "temperature": -1}}, "sampling_params.temperature"),
    "http top_p above one": http("/generate", {"text": "a", "sampling_params": {"top_p": 2}},
                                 "sampling_params.top_p"),
    "http unknown sampling field": http("/generate", {"text": "a", "sampling_params": {
        "beam_width": 4}}, "sampling_params.beam_width"),
    "http max_new_tokens negative": http("/generate", {"text": "a", "sampling_params": {
        "max_new_tokens": -1}}, "sampling_params.max_new_tokens"),
    "http prompt too long": http("/generate", {"input_ids": [7] * 300}, "input_ids"),
    "http completions no prompt": http("/v1/completions", {"max_tokens": 3}, "prompt"),
    "http completions max_tokens negative": http("/v1/completions", {
        "prompt": "a", "max_tokens": -1}, "max_tokens"),
    "http completions temperature string": http("/v1/completions", {
        "prompt": "a", "temperature": "hot"}, "temperature"),
}


@pytest.fixture(scope="module")
def ctx(micro_target: Path, head: Path) -> Iterator[Ctx]:
    c = Ctx(micro_target, head)
    yield c
    c.close()


def test_catalogue_size() -> None:
    surfaces = [c.surface for c in CASES.values()]
    assert len(CASES) >= 25
    assert min(surfaces.count(s) for s in ("api", "cli", "http")) >= 5


def run_cli(argv: list[str]) -> tuple[int, str]:
    """(exit status, stderr) as ``python -m workbench`` would give them."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            status = main(argv)
        except SystemExit as e:  # argparse
            status = e.code if isinstance(e.code, int) else 1
        except Exception as e:  # noqa: BLE001 (as the interpreter: traceback, exit 1)
            status = 1
            err.write(f"Traceback (escaped main)\n{type(e).__name__}: {e}\n")
    return status, err.getvalue()


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_input(name: str, ctx: Ctx) -> None:
    case = CASES[name]
    if case.surface == "api":
        with pytest.raises(case.expect, match=case.match):
            case.call(ctx)
        if "engine" in ctx.__dict__:
            # the refused input left no trace: same spec, nothing queued, no KV, still serves
            e = ctx.engine
            assert e.spec is kit.SPEC
            assert not e.has_unfinished() and kit.kv_used(e) == 0
            assert len(e.generate([[4, 5, 6]], kit.greedy(2), spec=kit.SPEC)[0].token_ids) == 2
    elif case.surface == "cli":
        status, err = run_cli(case.call(ctx))
        assert status == case.expect, err
        assert re.search(case.match, err), err
        # a user's mistake is one line naming it, not a traceback
        assert "Traceback" not in err, err
    else:
        path, body = case.call
        with httpx.Client(base_url=ctx.server.url, timeout=60) as client:
            kw = {"content": body} if isinstance(body, bytes) else {"json": body}
            r = client.post(path, **kw)
            assert r.status_code == case.expect, r.text
            error = r.json()["error"]
            assert error["field"] == case.field
            assert re.search(case.match, error["message"]), error
            ok = client.post("/generate", json={"input_ids": [1, 2, 3], "sampling_params": {
                "max_new_tokens": 2, "temperature": 0}})
            assert ok.status_code == 200, ok.text


def test_cli_exception_exits_non_zero_in_a_subprocess() -> None:
    r = subprocess.run([sys.executable, "-m", "workbench", "generate", "--model",
                        "/nonexistent/model", "--prompt", "x"], capture_output=True, text=True,
                       timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 1
    assert "EngineInitError" in r.stderr and "stage 'load_config'" in r.stderr
