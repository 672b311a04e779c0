"""SGLang-compatible HTTP server around one :class:`workbench.Engine`.

Endpoints:

- ``POST /generate`` — SGLang 0.5.23: ``{"text" | "input_ids", "sampling_params", "stream",
  "rid", "return_logprob", "top_logprobs_num", "logprob_start_len", "return_text_in_logprobs"}``
  (the other fields its clients send are accepted at their neutral values:
  :data:`~workbench.serve.protocol.GENERATE_NO_OPS`) → ``{"text", "output_ids", "meta_info"}``,
  meta_info as SGLang shapes it (:func:`~workbench.serve.protocol.meta_info`; logprobs:
  :func:`~workbench.serve.protocol.sglang_logprobs`); with ``stream: true`` server-sent events
  ``data: {...}\\n\\n`` with cumulative ``text`` and ``output_ids``, ending ``data: [DONE]``.
- ``POST /v1/completions``, ``POST /v1/chat/completions`` — OpenAI (batched prompts, ``n``,
  ``logprobs``/``echo``, chat templates, ``stream_options.include_usage``):
  :mod:`workbench.serve.openai_api`.
- ``GET /health`` (200, or 503 once the engine failed), ``GET /server_info`` (also
  ``/get_server_info``: model paths, spec and engine config, KV usage), ``GET /metrics``
  (Prometheus text, see :mod:`workbench.serve.metrics`), ``GET /v1/models``.

Concurrency: one :class:`~workbench.serve.loop.EngineLoop` thread owns the engine; the asyncio
front end only enqueues commands and awaits answers. A client that disconnects (stream or not)
aborts its request, which frees its KV at once. Bad requests get HTTP 400
``{"error": {"message", "field", ...}}`` naming the field, and the server keeps serving.

Limits (:class:`ServeLimits`), all enforced before the engine thread sees a request: a body
larger than ``max_body_bytes`` → 413 (from its Content-Length, before reading it); a text prompt
longer than ``max_prompt_chars`` → 400; prompts are tokenized on a worker thread, never on the
engine thread; more than ``max_batch_size + max_waiting`` requests queued or running → 503 with
Retry-After; uvicorn's ``limit_concurrency`` caps connections; a request whose head and body do
not arrive within ``read_timeout_s`` (slowloris, a Content-Length larger than the body) is
dropped, and idle keep-alive connections close after ``keep_alive_s``. ``api_key`` requires
``Authorization: Bearer <key>`` on every route but /health. 5xx bodies never carry exception
text: they name an error id, logged with the details. /health is red (503) when the engine loop
died or a step has run longer than ``health_step_s``; ``workbench serve`` exits non-zero when
the engine loop dies, so a supervisor restarts it.

Use :func:`start_server` from tests and notebooks (uvicorn on a thread; ``port=0`` picks a free
port) and ``python -m workbench serve`` (:func:`main`) from a shell.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hmac
import ipaddress
import logging
import socket
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from workbench.errors import ConfigError, RequestError
from workbench.serve.loop import (
    Admitted,
    Chunk,
    EngineLoop,
    LoopClosed,
    QueueFull,
    Rejected,
    Ticket,
)
from workbench.serve.metrics import render, snapshot
from workbench.serve.protocol import (
    HTTPError,
    ParsedRequest,
    admission_error,
    meta_info,
    parse_generate,
    parse_json_object,
    sglang_logprobs,
    sse,
)

try:
    import h11
    import uvicorn
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException
    from starlette.requests import ClientDisconnect
    from uvicorn.protocols.http.h11_impl import H11Protocol
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("the server needs the serve extra: pip install -e '.[serve]' "
                      f"(fastapi, uvicorn, httpx): {e}") from e

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class ServeLimits:
    """What one client may cost the server (module doc). Validated like every config."""

    max_body_bytes: int = 8 << 20
    max_prompt_chars: int | None = None  # None: 32 characters per token of max_model_len
    max_waiting: int = 256  # requests queued beyond max_batch_size before 503 + Retry-After
    limit_concurrency: int = 1024  # open connections + tasks (uvicorn); beyond → 503
    read_timeout_s: float = 30.0  # a request's head and body must arrive within this
    keep_alive_s: float = 5.0  # an idle keep-alive connection closes after this
    max_header_bytes: int = 64 << 10  # h11's bound on a request head
    health_step_s: float = 60.0  # /health is red while a step or command runs longer
    retry_after_s: int = 1
    api_key: str | None = None

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_waiting", "limit_concurrency", "max_header_bytes",
                     "retry_after_s"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"ServeLimits.{name}: must be an integer >= 1, got {v!r}")
        c = self.max_prompt_chars
        if c is not None and (not isinstance(c, int) or isinstance(c, bool) or c < 1):
            raise ConfigError(f"ServeLimits.max_prompt_chars: must be an integer >= 1 or None, "
                              f"got {c!r}")
        for name in ("read_timeout_s", "keep_alive_s", "health_step_s"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 < v < 1e6:
                raise ConfigError(f"ServeLimits.{name}: must be a number of seconds > 0, "
                                  f"got {v!r}")
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key):
            raise ConfigError("ServeLimits.api_key: must be a non-empty string or None")

    def prompt_chars(self, max_model_len: int) -> int:
        return self.max_prompt_chars or 32 * max_model_len


def _error_id() -> str:
    return uuid.uuid4().hex[:12]


def bounded_h11(read_timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a read deadline: a request's head and body must arrive within
    ``read_timeout_s`` of the connection opening or of the request's first byte, or the
    connection is dropped (uvicorn 0.54 has no header or body read timeout of its own: a
    slowloris client or a Content-Length larger than the body would hold a connection forever).

    End of input from the client still closes the connection (uvicorn's behaviour): a client
    that half-closes its socket after the request gets no response, because at EOF it cannot be
    told apart from one that went away, and a client going away must abort its request (and
    free its KV) at once."""

    class BoundedH11Protocol(H11Protocol):
        _read_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def _arm(self) -> None:
            if self._read_timer is None:
                self._read_timer = self.loop.call_later(read_timeout_s, self._read_timed_out)

        def _disarm(self) -> None:
            if self._read_timer is not None:
                self._read_timer.cancel()
                self._read_timer = None

        def data_received(self, data: bytes) -> None:
            if self.conn.their_state is h11.IDLE:
                self._arm()  # a request starts (or a keep-alive connection sends the next)
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE and \
                    self.conn.their_state is not h11.SEND_BODY:
                self._disarm()  # the whole request is in

        def _read_timed_out(self) -> None:
            self._read_timer = None
            if self.conn.their_state in (h11.IDLE, h11.SEND_BODY) and \
                    not self.transport.is_closing():
                who = f"{self.client[0]}:{self.client[1]}" if self.client else "a client"
                log.info("dropping %s: request not received within %.0f s", who,
                         read_timeout_s)
                self.transport.close()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

    return BoundedH11Protocol


# ---- engine-side views (run on the loop thread) ------------------------------------------------


def server_info(engine: Any, name: str) -> dict[str, Any]:
    """Model paths, spec and engine config, KV usage; SGLang-style keys where they exist."""
    spec = engine.spec
    spec_d = None if spec is None else {
        "num_steps": spec.num_steps, "topk": spec.topk,
        "num_draft_tokens": spec.num_draft_tokens, "policy": repr(spec.policy),
        "draft_state": spec.draft_state, "simulate_accept_length": spec.simulate_accept_length,
        "lossless": spec.lossless}
    return {
        "served_model_name": name,
        "model_path": str(engine.model_path),
        "draft_model_path": None if engine.draft_path is None else str(engine.draft_path),
        "speculative_algorithm": None if spec is None else "EAGLE3",
        "speculative_num_steps": None if spec is None else spec.num_steps,
        "speculative_eagle_topk": None if spec is None else spec.topk,
        "speculative_num_draft_tokens": None if spec is None else spec.num_draft_tokens,
        "spec": spec_d,
        "baseline_only": bool(engine.baseline_only),
        "engine_config": dataclasses.asdict(engine.config),
        "max_model_len": engine.max_model_len,
        "kv": engine.kv_usage(),
        # what SGLang's bench_serving reads for the server-wide accept length (upstream sets it
        # only on a speculating server; so here)
        "internal_states": [{} if spec is None else
                            {"avg_spec_accept_length": engine.stats.accept_length}],
    }


def _token_decoder(engine: Any) -> Callable[[int], str] | None:
    """One token id → its text (``return_text_in_logprobs``); None without a tokenizer."""
    tok = engine.tokenizer
    return None if tok is None else (lambda t: tok.decode([t]))


def _num_positions(engine: Any) -> int:
    spec = engine.spec
    return 0 if spec is None else spec.num_steps


# ---- async side ------------------------------------------------------------------------------


class _AsyncSink:
    """Receives the loop thread's messages on this event loop's queue."""

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[object] = asyncio.Queue()

    def put(self, item: object) -> None:
        try:
            self._loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:
            pass  # the event loop is closed: the server stopped and nobody is listening


class _State:
    """What the route handlers share."""

    def __init__(self, loop: EngineLoop, name: str, limits: ServeLimits) -> None:
        self.loop = loop
        self.name = name
        self.limits = limits
        self.max_model_len = int(loop.engine.max_model_len)
        self.max_prompt_chars = limits.prompt_chars(self.max_model_len)
        # tokenization never runs on the engine thread (nor on the event loop)
        self.tokenizer_pool = ThreadPoolExecutor(1, thread_name_prefix="workbench-tokenize")

    async def tokenize(self, prompt: Any, field: str) -> Any:
        """Text or chat messages → token ids on the tokenizer thread, after the character
        bound; token ids pass through (the engine checks them at admission)."""
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return prompt
        chars = len(prompt) if isinstance(prompt, str) else sum(
            len(str(v)) for m in prompt if isinstance(m, dict) for v in m.values())
        if chars > self.max_prompt_chars:
            raise HTTPError(f"{field}: {chars} characters is longer than this server accepts "
                            f"({self.max_prompt_chars}; max_model_len {self.max_model_len} "
                            "tokens)", field)
        engine = self.loop.engine  # Engine.tokenize reads only the tokenizer and model config
        try:
            ids = await asyncio.get_running_loop().run_in_executor(
                self.tokenizer_pool, engine.tokenize, prompt, field)
        except RequestError as e:
            raise admission_error(str(e), field) from None
        if len(ids) >= self.max_model_len:
            raise HTTPError(f"{field}: {len(ids)} tokens does not fit the context "
                            f"(max_model_len {self.max_model_len})", field)
        return ids

    async def call(self, fn: Callable[[Any], T]) -> T:
        try:
            fut = self.loop.call(fn)
        except LoopClosed:
            raise HTTPError(_loop_down(self.loop), None, 503) from None
        try:
            return await asyncio.wrap_future(fut)
        except LoopClosed:
            raise HTTPError(_loop_down(self.loop), None, 503) from None

    async def admit(self, parsed: ParsedRequest) -> tuple[Ticket, _AsyncSink, Admitted]:
        sink = _AsyncSink()
        if self.loop.max_pending is not None and self.loop.num_pending >= self.loop.max_pending:
            raise HTTPError(f"server: {self.loop.num_pending} requests are queued or running; "
                            "retry later", None, 503)  # before paying for tokenization
        prompt = await self.tokenize(parsed.prompt, parsed.prompt_field)
        try:
            ticket = self.loop.submit(prompt, parsed.sampling, sink, parsed.stream,
                                      logprobs=parsed.logprobs)
        except QueueFull as e:
            raise HTTPError(str(e), None, 503) from None
        except LoopClosed:
            raise HTTPError(_loop_down(self.loop), None, 503) from None
        try:
            first = await sink.queue.get()
        except asyncio.CancelledError:
            self.loop.abort(ticket)
            raise
        if isinstance(first, Rejected):
            if first.status == 503:
                raise HTTPError(_loop_down(self.loop), None, 503)
            if first.status != 400:
                raise HTTPError(f"server: {first.message}", None, first.status)
            raise admission_error(first.message, parsed.prompt_field)
        assert isinstance(first, Admitted)
        return ticket, sink, first

    async def final(self, request: Any, ticket: Ticket, sink: _AsyncSink) -> Chunk | None:
        """The final chunk, or None if the client disconnected first (request aborted)."""
        watcher = asyncio.ensure_future(_disconnected(request))
        try:
            while True:
                getter = asyncio.ensure_future(sink.queue.get())
                done, _ = await asyncio.wait({getter, watcher},
                                             return_when=asyncio.FIRST_COMPLETED)
                if getter not in done:
                    getter.cancel()
                    return None
                item = getter.result()
                if isinstance(item, Chunk) and item.finished:
                    return _public(item)
        finally:
            watcher.cancel()
            self.loop.abort(ticket)  # no-op once finished

    async def chunks(self, ticket: Ticket, sink: _AsyncSink) -> AsyncIterator[Chunk]:
        """Streamed chunks; partial UTF-8 (text ending in U+FFFD) waits for the next step."""
        try:
            while True:
                item = await sink.queue.get()
                if not isinstance(item, Chunk):
                    continue
                if item.finished:
                    yield _public(item)
                    return
                if not item.text.endswith("\ufffd"):
                    yield item
        finally:
            self.loop.abort(ticket)


async def _disconnected(request: Any) -> None:
    """Returns when the client goes away (the body has been read already)."""
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


def _loop_down(loop: EngineLoop) -> str:
    """The 503 message once the engine loop stopped: no exception text, the logged error id."""
    if loop.error_id is not None:
        return f"server: the engine loop failed (error id {loop.error_id}; see the server log)"
    return "server: the engine loop is stopped"


def _public(c: Chunk) -> Chunk:
    """A failed request's chunk as a client may see it. The engine's own request-scoped
    messages (non-finite logits, no valid sampling distribution) are kept; an engine failure's
    exception text is replaced by an error id, logged with the details."""
    if c.finish_reason != "error":
        return c
    eid = _error_id()
    log.error("request failed (error id %s): %s", eid, c.error)
    msg = f"the engine failed (error id {eid}; see the server log)" if c.internal or \
        not c.error else f"{c.error} (error id {eid})"
    return dataclasses.replace(c, error=msg)


def _check_failed(c: Chunk) -> None:
    if c.finish_reason == "error":
        raise HTTPError(f"request failed: {c.error or 'engine error'}", None, 500)


class _Guard:
    """ASGI middleware in front of every route: the API key (``Authorization: Bearer``), and a
    413 for a Content-Length over ``max_body_bytes`` before any of the body is read."""

    OPEN = ("/health",)  # liveness probes need no key (as SGLang)

    def __init__(self, app: Any, limits: ServeLimits) -> None:
        self.app = app
        self.limits = limits
        self.key = None if limits.api_key is None else f"Bearer {limits.api_key}".encode()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        if self.key is not None and scope["path"] not in self.OPEN and not hmac.compare_digest(
                headers.get(b"authorization", b""), self.key):
            await _send_json(send, 401, HTTPError(
                "authorization: missing or wrong API key (send 'Authorization: Bearer <key>')",
                "authorization", 401).body(), [(b"www-authenticate", b"Bearer")])
            return
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limits.max_body_bytes:
            await _send_json(send, 413, _too_large(self.limits).body(),
                             [(b"connection", b"close")])
            return
        await self.app(scope, receive, send)


def _too_large(limits: ServeLimits) -> HTTPError:
    return HTTPError(f"body: larger than this server accepts ({limits.max_body_bytes} bytes)",
                     "body", 413)


async def _send_json(send: Any, status: int, body: dict[str, Any],
                     headers: list[tuple[bytes, bytes]]) -> None:
    data = JSONResponse(body).body
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
        *headers]})
    await send({"type": "http.response.body", "body": data})


def build_app(loop: EngineLoop, name: str = "workbench",
              limits: ServeLimits | None = None) -> FastAPI:
    """The FastAPI application serving ``loop``'s engine under the model name ``name``."""
    limits = limits or ServeLimits()
    st = _State(loop, name, limits)
    app = FastAPI(title="workbench", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.workbench = st
    app.add_middleware(_Guard, limits=limits)

    class EngineStream(StreamingResponse):
        """A streamed response that aborts its request however the stream ends."""

        def __init__(self, body: AsyncIterator[bytes], ticket: Ticket) -> None:
            super().__init__(body, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})
            self.ticket = ticket

        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            try:
                await super().__call__(scope, receive, send)
            finally:
                loop.abort(self.ticket)

    @app.exception_handler(HTTPError)
    async def _http_error(request: Any, exc: HTTPError) -> Any:
        if exc.status >= 500:
            log.warning("%s %s → %d: %s", request.method, request.url.path, exc.status,
                        exc.message)
        headers = {"Retry-After": str(limits.retry_after_s)} if exc.status == 503 else {}
        if exc.status == 413:
            headers["Connection"] = "close"  # the rest of the body is not read
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    @app.exception_handler(ClientDisconnect)
    async def _client_gone(request: Any, exc: Exception) -> Any:
        # the client went away while sending its body: nobody to answer, nothing to log loudly
        log.debug("%s %s: client disconnected during the upload", request.method,
                  request.url.path)
        return Response(status_code=499)

    @app.exception_handler(StarletteHTTPException)
    async def _starlette_error(request: Any, exc: Any) -> Any:
        return JSONResponse(HTTPError(str(exc.detail), None, exc.status_code).body(),
                            status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _internal_error(request: Any, exc: Exception) -> Any:
        # Starlette re-raises after this handler runs, so uvicorn logs the traceback as well;
        # the client sees an id to quote, never the exception text.
        eid = _error_id()
        log.error("%s %s failed (error id %s): %r", request.method, request.url.path, eid, exc)
        return JSONResponse(HTTPError(f"internal error (error id {eid}; see the server log)",
                                      None, 500).body(), status_code=500)

    async def body_of(request: Any) -> dict[str, Any]:
        """The JSON body, read up to ``max_body_bytes`` (a chunked upload has no
        Content-Length for _Guard to check)."""
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limits.max_body_bytes:
                raise _too_large(limits)
            chunks.append(chunk)
        return parse_json_object(b"".join(chunks))

    @app.get("/health")
    async def health() -> Any:
        """200 while the engine loop is alive and no step or command has run longer than
        ``health_step_s``; 503 otherwise. The body reports the loop's heartbeat."""
        if loop.error is not None or not loop.alive:
            raise HTTPError(_loop_down(loop), None, 503)
        beat = loop.heartbeat()
        if beat["busy_s"] > limits.health_step_s:
            raise HTTPError(f"server: the engine loop has been busy for {beat['busy_s']:.1f} s "
                            f"(bound {limits.health_step_s:g} s)", None, 503)
        return {"status": "ok", "loop": beat}

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def info() -> Any:
        return await st.call(lambda e: server_info(e, name))

    @app.get("/metrics")
    async def metrics() -> Any:
        snap, npos = await st.call(lambda e: (snapshot(e, loop), _num_positions(e)))
        return PlainTextResponse(render(snap, npos, name),
                                 media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> Any:
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0,
                                            "owned_by": "workbench"}]}

    @app.post("/generate")
    async def generate(request: Request) -> Any:
        t0 = time.perf_counter()
        parsed = parse_generate(await body_of(request))
        rid = parsed.rid or uuid.uuid4().hex
        ticket, sink, adm = await st.admit(parsed)

        decode = _token_decoder(loop.engine) if parsed.return_text_in_logprobs else None

        def body(c: Chunk) -> dict[str, Any]:
            meta = meta_info(rid, adm.prompt_tokens, c.token_ids, c.finish_reason, c.verify_ct,
                             time.perf_counter() - t0, c.error, c.matched_stop, c.output)
            if parsed.logprobs is not None and c.output is not None:
                meta.update(sglang_logprobs(c.output, decode))
            return {"text": c.text, "output_ids": c.token_ids, "meta_info": meta}

        if not parsed.stream:
            c = await st.final(request, ticket, sink)
            if c is None:
                return Response(status_code=499)
            _check_failed(c)
            return body(c)

        async def events() -> AsyncIterator[bytes]:
            async for c in st.chunks(ticket, sink):
                yield sse(body(c))
            yield sse("[DONE]")

        return EngineStream(events(), ticket)

    from workbench.serve.openai_api import add_openai_routes  # imports this module

    add_openai_routes(app, st, name, body_of)

    return app


# ---- running it ------------------------------------------------------------------------------


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket (``port=0``: the OS picks a free port)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def _url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class ServerHandle:
    """A server running on background threads (uvicorn + engine loop). Stop with :meth:`stop`
    (or use it as a context manager). It does not close the engine it was given."""

    def __init__(self, url: str, loop: EngineLoop, server: Any, thread: threading.Thread) -> None:
        self.url = url
        self.loop = loop
        self.server = server
        self.thread = thread

    @property
    def engine(self) -> Any:
        return self.loop.engine

    def call(self, fn: Callable[[Any], T], timeout: float = 60.0) -> T:
        """Run ``fn(engine)`` on the engine-loop thread and return its result."""
        return self.loop.call(fn).result(timeout)

    def kv_usage(self) -> dict[str, int]:
        return self.call(lambda e: e.kv_usage())

    def wait_idle(self, timeout: float = 60.0) -> bool:
        """Wait until no request is live and the engine holds no work; False on timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.loop.num_running == 0 and not self.call(lambda e: e.has_unfinished()):
                return True
            time.sleep(0.02)
        return False

    def stop(self, timeout: float = 30.0) -> None:
        """Abort live requests, stop the engine loop, then shut uvicorn down (idempotent)."""
        self.loop.stop(timeout)
        self.server.should_exit = True
        self.thread.join(timeout)
        if self.thread.is_alive():
            self.server.force_exit = True
            self.thread.join(timeout)

    def __enter__(self) -> ServerHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"ServerHandle({self.url!r}, running={self.thread.is_alive()})"


def _served_name(engine: Any) -> str:
    return Path(str(engine.model_path)).name or "workbench"


def uvicorn_config(app: Any, limits: ServeLimits, log_level: str) -> uvicorn.Config:
    """uvicorn settings enforcing ``limits`` (connections, timeouts, header size)."""
    return uvicorn.Config(app, log_level=log_level, lifespan="off", timeout_graceful_shutdown=5,
                          http=bounded_h11(limits.read_timeout_s),
                          limit_concurrency=limits.limit_concurrency,
                          timeout_keep_alive=limits.keep_alive_s,  # type: ignore[arg-type]
                          h11_max_incomplete_event_size=limits.max_header_bytes)


def make_loop(engine: Any, limits: ServeLimits,
              on_fatal: Callable[[str], None] | None = None) -> EngineLoop:
    """The engine loop with the waiting bound: max_batch_size running + ``max_waiting``."""
    return EngineLoop(engine, max_pending=engine.config.max_batch_size + limits.max_waiting,
                      on_fatal=on_fatal)


def start_server(engine: Any, host: str = "127.0.0.1", port: int = 0, *,
                 name: str | None = None, log_level: str = "warning",
                 startup_timeout: float = 30.0, limits: ServeLimits | None = None,
                 ) -> ServerHandle:
    """Serve ``engine`` (spec as set on it) on ``host:port`` from background threads.

    ``port=0`` picks a free port; the handle's ``url`` says which. The engine must not be used
    from any other thread until :meth:`ServerHandle.stop` returns. ``limits``: see
    :class:`ServeLimits` (defaults otherwise). If the engine loop dies, the server keeps
    answering (503) until stopped: the caller decides.
    """
    limits = limits or ServeLimits()
    sock = bind_socket(host, port)
    loop = make_loop(engine, limits).start()
    try:
        app = build_app(loop, name or _served_name(engine), limits)
        server = uvicorn.Server(uvicorn_config(app, limits, log_level))
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]},
                                  name="workbench-http", daemon=True)
        thread.start()
        deadline = time.monotonic() + startup_timeout
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                server.should_exit = True
                raise RuntimeError(f"HTTP server failed to start on {_url(sock)}")
            time.sleep(0.01)
    except BaseException:
        loop.stop()
        sock.close()
        raise
    return ServerHandle(_url(sock), loop, server, thread)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def limits_from_args(ns: argparse.Namespace) -> ServeLimits:
    """``serve`` flags → ServeLimits (ConfigError naming the flag's field)."""
    return ServeLimits(max_body_bytes=ns.max_body_bytes, max_prompt_chars=ns.max_prompt_chars,
                       max_waiting=ns.max_waiting, limit_concurrency=ns.limit_concurrency,
                       read_timeout_s=ns.read_timeout, keep_alive_s=ns.keep_alive_timeout,
                       health_step_s=ns.health_step_timeout, api_key=ns.api_key or None)


def spec_from_args(ns: argparse.Namespace) -> Any:
    """``serve --draft`` flags → SpecConfig with the named policy (ConfigError if invalid)."""
    import workbench as wb
    from workbench.speculative import policy as pol

    if ns.policy == "always":
        policy: Any = pol.Always()
    elif ns.policy == "never":
        policy = pol.Never()
    elif ns.policy == "threshold":
        if ns.threshold is None:
            raise ConfigError("--threshold: required with --policy threshold (speculate while "
                              "the decode batch is at most this size)")
        policy = pol.BatchThreshold(ns.threshold)
    else:
        raise ConfigError(f"--policy: {ns.policy!r} not in always/never/threshold")
    if ns.threshold is not None and ns.policy != "threshold":
        raise ConfigError("--threshold: only meaningful with --policy threshold")
    return wb.SpecConfig(num_steps=ns.num_steps, topk=ns.topk,
                         num_draft_tokens=ns.num_draft_tokens, policy=policy)


def main(ns: argparse.Namespace) -> int:
    """``python -m workbench serve``: build the engine (all-or-nothing), then serve until Ctrl-C.

    Every flag is validated (as the Python API validates it) before the model loads: a bad one
    prints one line naming it and exits 1. Exit status 1 with the failing init stage named on
    stderr if the engine cannot be built; 2 if the address cannot be bound; 1 if the engine loop
    dies while serving (the server stops instead of answering 503 forever, so a supervisor
    restarts it). Nothing is served before the engine is complete.
    """
    import workbench as wb

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    if not isinstance(ns.port, int) or not 0 <= ns.port <= 65535:
        raise ConfigError(f"--port: must be in 0..65535, got {ns.port}")
    limits = limits_from_args(ns)
    config = wb.EngineConfig(device=ns.device, dtype=ns.dtype,
                             max_batch_size=ns.max_batch_size,
                             kv_budget_tokens=ns.kv_budget_tokens,
                             max_model_len=ns.max_model_len)
    spec = spec_from_args(ns) if ns.draft is not None else None
    if ns.draft is None and (ns.policy != "always" or ns.threshold is not None):
        raise ConfigError("--policy/--threshold: need --draft (no speculation without one)")
    if limits.api_key is None and not _is_loopback(ns.host):
        log.warning("serving on %s without --api-key: anyone who can reach this address can "
                    "use the server", ns.host)
    try:
        sock = bind_socket(ns.host, ns.port)
    except OSError as e:
        print(f"serve: cannot listen on {ns.host}:{ns.port}: {e}", file=sys.stderr)
        return 2
    try:
        engine = wb.Engine.from_pretrained(ns.model, draft=ns.draft, config=config)
    except wb.EngineInitError as e:
        sock.close()
        print(f"serve: engine init failed at stage {e.stage!r}: {e.cause}", file=sys.stderr)
        return 1
    try:
        engine.set_spec(spec)
    except wb.ConfigError as e:
        sock.close()
        engine.close()
        print(f"serve: {e}", file=sys.stderr)
        return 1
    server: Any = None

    def on_fatal(error: str) -> None:
        log.critical("%s: stopping the server (exit status 1)", error)
        if server is not None:
            server.should_exit = True

    loop = make_loop(engine, limits, on_fatal).start()
    name = _served_name(engine)
    server = uvicorn.Server(uvicorn_config(build_app(loop, name, limits), limits, "info"))
    if loop.error is not None:  # died before the server existed
        server.should_exit = True
    what = "baseline" if spec is None else (f"EAGLE-3 S={spec.num_steps} K={spec.topk} "
                                            f"N={spec.num_draft_tokens} policy={ns.policy}")
    print(f"serving {name} ({what}) on {_url(sock)}", file=sys.stderr, flush=True)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        pass  # uvicorn shut down gracefully, then re-raised the Ctrl-C it captured
    finally:
        loop.stop()
        engine.close()
    if loop.error is not None:
        print(f"serve: {loop.error}", file=sys.stderr)
        return 1
    return 0
