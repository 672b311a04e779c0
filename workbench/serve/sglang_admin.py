"""SGLang 0.5.23's control routes, with its field names and shapes (read from the wheel's
``srt/entrypoints/http_server.py``):

- ``GET /model_info`` (also ``/get_model_info``, which ``sgl.RuntimeEndpoint`` calls in its
  constructor): ``model_path``, ``served_model_name``, ``tokenizer_path`` (what
  ``bench_serving`` loads when no ``--tokenizer`` is given), ``is_generation``,
  ``preferred_sampling_params``, ``weight_version``, ``load_format``, ``reasoning_parser``,
  ``tool_call_parser``, ``disaggregation_mode``, ``has_image_understanding``,
  ``has_audio_understanding``, ``model_type``, ``architectures``;
- ``GET|POST /flush_cache[?timeout=s]``: SGLang frees its prefix (radix) cache, and refuses
  (400) while requests are running or waiting after waiting up to ``timeout`` seconds for them
  (``bench_serving`` flushes after its warmup). The workbench keeps no prefix cache (a
  finished request's KV pages go back to the pool when it finishes), so nothing is held
  between requests: it answers 200 when the engine is idle (returning cached allocator memory
  to the device on CUDA) and 400 while requests are live, as upstream;
- ``GET /health_generate``: as upstream, proves the engine generates: while requests are
  running it answers 200 as soon as the engine loop is alive and stepping (upstream ignores the
  probe then); when idle it generates one token from token id 0 and answers 200, or 503 when
  the engine loop is down or the token fails;
- ``GET /tokenizer_info``: vLLM's route (SGLang 0.5.23 serves none): the tokenizer's settings
  (its ``init_kwargs`` without file paths, added tokens as their text), ``tokenizer_class``,
  ``chat_template`` (:func:`tokenizer_info`);
- ``POST /abort_request`` ``{"rid", "abort_all"}``: aborts the live ``/generate`` request whose
  id is ``rid``, or the items (``"<rid>_<i>"``) of the live batch that ``rid`` named, or every
  live request of any route with ``abort_all``; any other rid, a prefix of a live id included,
  aborts nothing (upstream's tokenizer manager returns unless the rid is live; its scheduler's
  prefix match only reaches a batch's items), and neither does an empty rid without
  ``abort_all`` (as upstream). 200 with an empty body; the aborted
  requests answer ``finish_reason {"type": "abort"}``.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from workbench.config import SamplingParams
from workbench.serve.frontend import ServeState, loop_down
from workbench.serve.loop import Ticket
from workbench.serve.protocol import (
    HTTPError,
    ParsedRequest,
    check_fields,
    expect_bool,
    type_name,
)
from workbench.serve.web import FastAPI, PlainTextResponse, Request, Response

if TYPE_CHECKING:
    from workbench.engine.engine import Engine

MAX_FLUSH_WAIT_S = 600.0


def model_info(engine: Engine, name: str) -> dict[str, Any]:
    """SGLang's ``/model_info`` for ``engine`` served as ``name``."""
    folder = Path(str(engine.model_path))
    cfg_path = folder / "config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
    has_tokenizer = engine.tokenizer is not None
    return {
        "model_path": str(folder),
        "served_model_name": name,
        # absolute: a client on this machine loads it whatever its working directory
        "tokenizer_path": str(folder.resolve()) if has_tokenizer else None,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": "default",
        "load_format": "auto",
        "reasoning_parser": None,
        "tool_call_parser": None,
        "disaggregation_mode": "null",
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "model_type": cfg.get("model_type"),
        "architectures": cfg.get("architectures"),
    }


def _plain_json(v: Any) -> Any:
    """A tokenizer setting as JSON: an added token as its text, containers item by item,
    anything else not JSON-native as its string."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, dict):
        return {str(k): _plain_json(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain_json(x) for x in v]
    content = getattr(v, "content", None)
    return content if isinstance(content, str) else str(v)


def tokenizer_info(engine: Engine) -> dict[str, Any] | None:
    """``GET /tokenizer_info`` as vLLM serves it (SGLang 0.5.23 has no such route): the
    tokenizer's settings (``init_kwargs`` without file paths), ``tokenizer_class`` and the
    chat template; None without a tokenizer."""
    tok = engine.tokenizer
    if tok is None:
        return None
    cfg = {k: v for k, v in dict(getattr(tok, "init_kwargs", None) or {}).items()
           if k not in ("vocab_file", "merges_file", "tokenizer_file")}
    out: dict[str, Any] = _plain_json(cfg)
    out["tokenizer_class"] = type(tok).__name__
    template = getattr(tok, "chat_template", None)
    if isinstance(template, str) and template:
        out["chat_template"] = template
    return out


def _flush(engine: Engine) -> str | None:
    """On the engine thread: None when flushed, else why not (requests are live)."""
    if engine.has_unfinished():
        return (f"Cache not flushed: {engine.num_running()} requests running and "
                f"{engine.num_waiting()} waiting (as SGLang, nothing is flushed while "
                "requests are live).\n")
    import torch

    if str(engine.config.device).startswith("cuda") and torch.cuda.is_available():
        torch.cuda.empty_cache()
    return None


class LiveRids:
    """The live ``/generate`` requests by their SGLang id (``meta_info.id``)."""

    def __init__(self) -> None:
        self._tickets: dict[str, Ticket] = {}
        self._batches: dict[str, list[str]] = {}  # a batch's rid → its items' live ids

    def add(self, rids: list[str], tickets: list[Ticket], abort: Callable[[Ticket], None],
            batch: str | None = None) -> None:
        """Register admitted requests under their ids, all or none: if an id was taken while
        they were being admitted (a concurrent request with the same rid), every one of them is
        aborted and the 400 names ``rid``. ``batch``: the rid a batched request named (its
        items are ``"<batch>_<i>"``), which then aborts them."""
        try:
            self.check_free(rids)
            if batch is not None and batch in self._batches:
                raise HTTPError(f"rid: {batch!r} is already in use by a live batch", "rid")
        except HTTPError:
            for t in tickets:
                abort(t)
            raise
        self._tickets.update(zip(rids, tickets, strict=True))
        if batch is not None:
            self._batches[batch] = list(rids)

    def check_free(self, rids: list[str]) -> None:
        if len(set(rids)) != len(rids):
            raise HTTPError("rid: the batch repeats a request id", "rid")
        for r in rids:
            if r in self._tickets:
                raise HTTPError(f"rid: {r!r} is already in use by a live request", "rid")

    def remove(self, rid: str, ticket: Ticket) -> None:
        if self._tickets.get(rid) is ticket:
            del self._tickets[rid]

    def remove_batch(self, batch: str, rids: list[str]) -> None:
        if self._batches.get(batch) == rids:
            del self._batches[batch]

    def matching(self, rid: str) -> list[Ticket]:
        """The live request with id ``rid``, or the live items of the batch ``rid`` named."""
        ids = [rid, *self._batches.get(rid, [])]
        return [t for r in ids if (t := self._tickets.get(r)) is not None]


def add_admin_routes(app: FastAPI, st: ServeState, body_of: Callable[[Any], Any],
                     live: LiveRids) -> None:
    """Register /model_info, /get_model_info, /tokenizer_info, /health_generate,
    /flush_cache and /abort_request on ``app``."""
    loop = st.loop
    info = model_info(loop.engine, st.name)  # fixed once the engine is built

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def get_model_info() -> Any:
        return info

    tok_info = tokenizer_info(loop.engine)

    @app.get("/tokenizer_info")
    async def get_tokenizer_info() -> Any:
        if tok_info is None:
            raise HTTPError("tokenizer: this model is served without a tokenizer", "tokenizer",
                            404)
        return tok_info

    @app.get("/health_generate")
    async def health_generate(request: Request) -> Any:
        if loop.error is not None or not loop.alive:
            raise HTTPError(loop_down(loop), None, 503)
        if loop.num_running > 0 and loop.heartbeat()["busy_s"] <= st.limits.health_step_s:
            return Response(status_code=200)  # busy and stepping: the probe is not needed
        probe = ParsedRequest([0], SamplingParams(max_new_tokens=1, temperature=0.0,
                                                  ignore_eos=True), False, "input_ids")
        ticket, sink, _ = await st.admit(probe, request)
        c = await st.final(request, ticket, sink)
        if c is None:
            return Response(status_code=499)
        if c.finish_reason != "length" or len(c.token_ids) != 1:
            raise HTTPError(f"server: the health probe did not generate ({c.finish_reason}: "
                            f"{c.error})", None, 503)
        return Response(status_code=200)

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache(request: Request) -> Any:
        raw = request.query_params.get("timeout", "0")
        try:
            timeout = float(raw)
        except ValueError:
            raise HTTPError(f"timeout: expected a number of seconds, got {raw!r}",
                            "timeout") from None
        if not 0 <= timeout <= MAX_FLUSH_WAIT_S:
            raise HTTPError(f"timeout: must be in [0, {MAX_FLUSH_WAIT_S}] seconds, got {raw}",
                            "timeout")
        deadline = time.monotonic() + timeout
        while True:
            why = await st.call(_flush)
            if why is None or time.monotonic() >= deadline:
                break
            await asyncio.sleep(0.05)
        if why is not None:
            return PlainTextResponse(why, status_code=400)
        return PlainTextResponse("Cache flushed.\nThe workbench keeps no prefix cache: no KV is "
                                 "held between requests.\n")

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Any:
        body = await body_of(request)
        check_fields(body, {"rid", "abort_all", "finished_reason", "abort_message",
                            "weight_versions"}, "")
        rid = body.get("rid")
        if rid is None:
            rid = ""
        if not isinstance(rid, str):
            raise HTTPError(f"rid: expected a string, got {type_name(rid)}", "rid")
        abort_all = False if body.get("abort_all") is None else \
            expect_bool(body["abort_all"], "abort_all")
        if abort_all:
            loop.abort_all()
        elif rid:
            for t in live.matching(rid):
                loop.abort(t)
        return Response(status_code=200)
