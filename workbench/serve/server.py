"""SGLang-compatible HTTP server around one :class:`workbench.Engine`.

Endpoints:

- ``POST /generate`` — SGLang 0.5.23: ``{"text" | "input_ids", "sampling_params", "stream",
  "rid", "return_logprob", "top_logprobs_num", "logprob_start_len", "return_text_in_logprobs"}``
  (the other fields its clients send are accepted at their neutral values:
  :data:`~workbench.serve.protocol.GENERATE_NO_OPS`) → ``{"text", "output_ids", "meta_info"}``,
  meta_info as SGLang shapes it; streamed as server-sent events: :mod:`workbench.serve.sglang_api`.
- ``POST /v1/completions``, ``POST /v1/chat/completions`` — OpenAI (batched prompts, ``n``,
  ``logprobs``/``echo``, chat templates, ``stream_options.include_usage``):
  :mod:`workbench.serve.openai_api`.
- ``GET /health`` (200, or 503 once the engine failed), ``GET /server_info`` (also
  ``/get_server_info``: model paths, spec and engine config, KV usage), ``GET /metrics``
  (Prometheus text, see :mod:`workbench.serve.metrics`; latency histograms timed from
  arrival: :mod:`workbench.serve.latency`), ``GET /v1/models``
  (:mod:`workbench.serve.sglang_api`), ``GET /tokenizer_info`` (vLLM's:
  :mod:`workbench.serve.sglang_admin`).

Concurrency: one :class:`~workbench.serve.loop.EngineLoop` thread owns the engine; the asyncio
front end (:mod:`workbench.serve.frontend`) only enqueues commands and awaits answers. A client
that disconnects (stream or not) aborts its request, which frees its KV at once. Bad requests get
HTTP 400 ``{"error": {"message", "field", ...}}`` naming the field, and the server keeps serving.

Limits (:class:`~workbench.serve.limits.ServeLimits`), all enforced before the engine thread sees
a request: a body larger than ``max_body_bytes`` → 413 (from its Content-Length, before reading
it); a text prompt longer than ``max_prompt_chars`` → 400; prompts are tokenized on a worker
thread, never on the engine thread; more than ``max_batch_size + max_waiting`` requests queued or
running → 503 with Retry-After; ``limit_concurrency`` requests in progress → 503 (never /health);
connection hygiene (:mod:`workbench.serve.connections`): ``max_connections`` open sockets apart
from the request bound (the longest-idle one makes room), a request whose head and body do not
arrive within ``read_timeout_s`` is dropped, a connection with no request closes after
``keep_alive_s``, an answer nobody reads for ``write_timeout_s`` is dropped, heads over
``max_header_bytes`` get 431, an early refusal (413) closes by lingering so the client reads it,
and Nagle is off on every connection. ``api_key``
requires exactly one ``Authorization: Bearer <key>`` header (the scheme in any case) on
every route but /health. 5xx bodies never carry
exception text: they name an error id, logged with the details. /health is red (503) when the
engine loop died or a step has run longer than ``health_step_s``; ``workbench serve`` exits
non-zero when the engine loop dies, so a supervisor restarts it.

Use :func:`start_server` from tests and notebooks (uvicorn on a thread; ``port=0`` picks a free
port) and ``python -m workbench serve`` (:func:`main`) from a shell.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from workbench.errors import ConfigError
from workbench.serve.api_keys import API_KEY_ENV, api_key_from_args  # noqa: F401 (re-exported)
from workbench.serve.frontend import ServeState, error_id
from workbench.serve.limits import LimitsGuard, ServeLimits, read_json_body, uvicorn_config
from workbench.serve.loop import EngineLoop
from workbench.serve.openai_api import add_openai_routes
from workbench.serve.protocol import HTTPError
from workbench.serve.sglang_api import add_sglang_routes
from workbench.serve.sglang_metrics import ServeMetrics
from workbench.serve.web import (
    ClientDisconnect,
    FastAPI,
    JSONResponse,
    Response,
    StarletteHTTPException,
    uvicorn,
)

if TYPE_CHECKING:
    from workbench.engine.engine import Engine

# ServeLimits and uvicorn_config are part of this module's API (tests, notebooks, the CLI)
__all__ = ["ServeLimits", "ServerHandle", "bind_socket", "build_app", "limits_from_args", "main",
           "make_loop", "spec_from_args", "start_server", "uvicorn_config"]

log = logging.getLogger(__name__)
T = TypeVar("T")


def build_app(loop: EngineLoop, name: str = "workbench",
              limits: ServeLimits | None = None) -> FastAPI:
    """The FastAPI application serving ``loop``'s engine under the model name ``name``: error
    handlers, :class:`~workbench.serve.limits.LimitsGuard`, SGLang's routes and OpenAI's."""
    limits = limits or ServeLimits()
    st = ServeState(loop, name, limits)
    app = FastAPI(title="workbench", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.workbench = st
    app.add_middleware(LimitsGuard, limits=limits, metrics=loop.metrics)

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
        eid = error_id()
        log.error("%s %s failed (error id %s): %r", request.method, request.url.path, eid, exc)
        return JSONResponse(HTTPError(f"internal error (error id {eid}; see the server log)",
                                      None, 500).body(), status_code=500)

    async def body_of(request: Any) -> dict[str, Any]:
        return await read_json_body(request, limits)

    add_sglang_routes(app, st, body_of)
    add_openai_routes(app, st, name, body_of)
    return app


# ---- running it ------------------------------------------------------------------------------


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket (``port=0``: the OS picks a free port)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto IPPROTO_TCP: asyncio then sets TCP_NODELAY on every accepted connection (with
    # proto 0 it does not, and a reused connection waited ~40 ms for Nagle per answer)
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
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


def _served_name(engine: Engine) -> str:
    return Path(str(engine.model_path)).name or "workbench"


def make_loop(engine: Engine, limits: ServeLimits,
              on_fatal: Callable[[str], None] | None = None) -> EngineLoop:
    """The engine loop with the waiting bound: max_batch_size running + ``max_waiting``."""
    return EngineLoop(engine, max_pending=engine.config.max_batch_size + limits.max_waiting,
                      max_running=engine.config.max_batch_size,
                      on_fatal=on_fatal, metrics=ServeMetrics(limits.latency_buckets))


def start_server(engine: Engine, host: str = "127.0.0.1", port: int = 0, *,
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
                       health_step_s=ns.health_step_timeout, api_key=api_key_from_args(ns),
                       max_logprob_entries=ns.max_logprob_entries,
                       max_connections=ns.max_connections, write_timeout_s=ns.write_timeout,
                       incremental_streaming=ns.incremental_streaming_output,
                       latency_buckets=ns.latency_buckets)


def spec_from_args(ns: argparse.Namespace) -> Any:
    """``serve --draft`` flags → SpecConfig with the named policy (ConfigError if invalid)."""
    import workbench as wb
    from workbench.policy import policies as pol

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
