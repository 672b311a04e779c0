"""SGLang-compatible HTTP server around one :class:`workbench.Engine`.

Endpoints:

- ``POST /generate`` — SGLang: ``{"text" | "input_ids", "sampling_params", "stream", "rid"}`` →
  ``{"text", "output_ids", "meta_info": {"id", "prompt_tokens", "completion_tokens",
  "finish_reason", "spec_verify_ct", "spec_accept_length", "e2e_latency"}}``; with
  ``stream: true`` server-sent events ``data: {...}\\n\\n`` with cumulative ``text`` and
  ``output_ids``, ending ``data: [DONE]``.
- ``POST /v1/completions`` — OpenAI completions (``model, prompt, max_tokens, temperature, top_p,
  stream, stop, seed``; extensions ``top_k, min_p, ignore_eos, stop_token_ids``), with ``usage``.
- ``GET /health`` (200, or 503 once the engine failed), ``GET /server_info`` (also
  ``/get_server_info``: model paths, spec and engine config, KV usage), ``GET /metrics``
  (Prometheus text, see :mod:`workbench.serve.metrics`), ``GET /v1/models``.

Concurrency: one :class:`~workbench.serve.loop.EngineLoop` thread owns the engine; the asyncio
front end only enqueues commands and awaits answers. A client that disconnects (stream or not)
aborts its request, which frees its KV at once. Bad requests get HTTP 400
``{"error": {"message", "field", ...}}`` naming the field, and the server keeps serving.

Use :func:`start_server` from tests and notebooks (uvicorn on a thread; ``port=0`` picks a free
port) and ``python -m workbench serve`` (:func:`main`) from a shell.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import socket
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, TypeVar

from workbench.serve.loop import Admitted, Chunk, EngineLoop, LoopClosed, Rejected, Ticket
from workbench.serve.metrics import render, snapshot
from workbench.serve.protocol import (
    HTTPError,
    ParsedRequest,
    admission_error,
    meta_info,
    openai_finish_reason,
    parse_completion,
    parse_generate,
    parse_json_object,
    sse,
)

try:
    import uvicorn
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("the server needs the serve extra: pip install -e '.[serve]' "
                      f"(fastapi, uvicorn, httpx): {e}") from e

log = logging.getLogger(__name__)
T = TypeVar("T")


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
        # what SGLang's bench_serving reads for the server-wide accept length
        "internal_states": [{"avg_spec_accept_length": engine.stats.accept_length}],
    }


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

    def __init__(self, loop: EngineLoop, name: str) -> None:
        self.loop = loop
        self.name = name

    async def call(self, fn: Callable[[Any], T]) -> T:
        try:
            fut = self.loop.call(fn)
        except LoopClosed as e:
            raise HTTPError(f"server: {e}", None, 503) from None
        try:
            return await asyncio.wrap_future(fut)
        except LoopClosed as e:
            raise HTTPError(f"server: {e}", None, 503) from None

    async def admit(self, parsed: ParsedRequest) -> tuple[Ticket, _AsyncSink, Admitted]:
        sink = _AsyncSink()
        try:
            ticket = self.loop.submit(parsed.prompt, parsed.sampling, sink, parsed.stream)
        except LoopClosed as e:
            raise HTTPError(f"server: {e}", None, 503) from None
        try:
            first = await sink.queue.get()
        except asyncio.CancelledError:
            self.loop.abort(ticket)
            raise
        if isinstance(first, Rejected):
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
                    return item
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
                    yield item
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


def _check_failed(c: Chunk) -> None:
    if c.finish_reason == "error":
        raise HTTPError(f"request failed: {c.error or 'engine error'}", None, 500)


def build_app(loop: EngineLoop, name: str = "workbench") -> FastAPI:
    """The FastAPI application serving ``loop``'s engine under the model name ``name``."""
    st = _State(loop, name)
    app = FastAPI(title="workbench", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.workbench = st

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
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def _starlette_error(request: Any, exc: Any) -> Any:
        return JSONResponse(HTTPError(str(exc.detail), None, exc.status_code).body(),
                            status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _internal_error(request: Any, exc: Exception) -> Any:
        # Starlette re-raises after this handler runs, so the traceback is logged as well.
        log.error("%s %s failed: %r", request.method, request.url.path, exc)
        return JSONResponse(HTTPError(f"internal error: {type(exc).__name__}: {exc}", None,
                                      500).body(), status_code=500)

    async def body_of(request: Any) -> dict[str, Any]:
        return parse_json_object(await request.body())

    @app.get("/health")
    async def health() -> Any:
        if loop.error is not None or not loop.alive:
            raise HTTPError(f"server: {loop.error or 'engine loop is stopped'}", None, 503)
        return {"status": "ok"}

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def info() -> Any:
        return await st.call(lambda e: server_info(e, name))

    @app.get("/metrics")
    async def metrics() -> Any:
        snap, npos = await st.call(lambda e: (snapshot(e, loop), _num_positions(e)))
        return PlainTextResponse(render(snap, npos), media_type="text/plain; version=0.0.4")

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

        def body(c: Chunk) -> dict[str, Any]:
            return {"text": c.text, "output_ids": c.token_ids,
                    "meta_info": meta_info(rid, adm.prompt_tokens, c.token_ids, c.finish_reason,
                                           c.verify_ct, time.perf_counter() - t0, c.error)}

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

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        parsed = parse_completion(await body_of(request))
        cid = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        model = parsed.model or name
        ticket, sink, adm = await st.admit(parsed)

        def usage(c: Chunk) -> dict[str, int]:
            n = len(c.token_ids)
            return {"prompt_tokens": adm.prompt_tokens, "completion_tokens": n,
                    "total_tokens": adm.prompt_tokens + n}

        def response(text: str, finish: str | None, **more: Any) -> dict[str, Any]:
            return {"id": cid, "object": "text_completion", "created": created, "model": model,
                    "choices": [{"index": 0, "text": text, "logprobs": None,
                                 "finish_reason": openai_finish_reason(finish)}], **more}

        if not parsed.stream:
            c = await st.final(request, ticket, sink)
            if c is None:
                return Response(status_code=499)
            _check_failed(c)
            return response(c.text, c.finish_reason, usage=usage(c))

        async def events() -> AsyncIterator[bytes]:
            sent = ""
            last: Chunk | None = None
            async for c in st.chunks(ticket, sink):
                delta = c.text[len(sent):] if c.text.startswith(sent) else c.text
                sent, last = c.text, c
                if delta or c.finished:
                    yield sse(response(delta, c.finish_reason if c.finished else None))
            if parsed.include_usage and last is not None:
                yield sse({"id": cid, "object": "text_completion", "created": created,
                           "model": model, "choices": [], "usage": usage(last)})
            yield sse("[DONE]")

        return EngineStream(events(), ticket)

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


def start_server(engine: Any, host: str = "127.0.0.1", port: int = 0, *,
                 name: str | None = None, log_level: str = "warning",
                 startup_timeout: float = 30.0) -> ServerHandle:
    """Serve ``engine`` (spec as set on it) on ``host:port`` from background threads.

    ``port=0`` picks a free port; the handle's ``url`` says which. The engine must not be used
    from any other thread until :meth:`ServerHandle.stop` returns.
    """
    sock = bind_socket(host, port)
    loop = EngineLoop(engine).start()
    try:
        app = build_app(loop, name or _served_name(engine))
        config = uvicorn.Config(app, log_level=log_level, lifespan="off",
                                timeout_graceful_shutdown=5)
        server = uvicorn.Server(config)
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


def main(ns: argparse.Namespace) -> int:
    """``python -m workbench serve``: build the engine (all-or-nothing), then serve until Ctrl-C.

    Exit status 1 with the failing init stage named on stderr if the engine cannot be built;
    2 if the address cannot be bound. Nothing is served before the engine is complete.
    """
    import workbench as wb

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        sock = bind_socket(ns.host, ns.port)
    except OSError as e:
        print(f"serve: cannot listen on {ns.host}:{ns.port}: {e}", file=sys.stderr)
        return 2
    config = wb.EngineConfig(device=getattr(ns, "device", "cpu"),
                             dtype=getattr(ns, "dtype", "float32"))
    try:
        engine = wb.Engine.from_pretrained(ns.model, draft=ns.draft, config=config)
    except wb.EngineInitError as e:
        sock.close()
        print(f"serve: engine init failed at stage {e.stage!r}: {e.cause}", file=sys.stderr)
        return 1
    try:
        if ns.draft is not None:
            engine.set_spec(wb.SpecConfig(num_steps=ns.num_steps, topk=ns.topk,
                                          num_draft_tokens=ns.num_draft_tokens))
    except wb.ConfigError as e:
        sock.close()
        engine.close()
        print(f"serve: {e}", file=sys.stderr)
        return 1
    loop = EngineLoop(engine).start()
    name = _served_name(engine)
    server = uvicorn.Server(uvicorn.Config(build_app(loop, name), log_level="info",
                                           lifespan="off", timeout_graceful_shutdown=5))
    spec = engine.spec
    what = "baseline" if spec is None else (f"EAGLE-3 S={spec.num_steps} K={spec.topk} "
                                            f"N={spec.num_draft_tokens}")
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
