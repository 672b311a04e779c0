"""What one client may cost the server (:class:`ServeLimits`), and where each bound is enforced
before the engine thread sees a request:

- :class:`LimitsGuard` (ASGI middleware, every route): requests in progress (503; /health
  exempt), the API key (``Authorization: Bearer``; /health exempt) and a 413 for a
  Content-Length over ``max_body_bytes``, before any of the body is read;
  :func:`read_json_body` counts a chunked body while reading it;
- :func:`uvicorn_config`: keep-alive, with :mod:`workbench.serve.connections` (read and write
  deadlines, the head bound, the connection bound apart from the request bound, TCP_NODELAY,
  lingering close after an early refusal);
- the prompt bound and the waiting bound are checked at admission
  (:class:`workbench.serve.frontend.ServeState`).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from dataclasses import dataclass
from typing import Any

from workbench.core import LogprobParams
from workbench.errors import ConfigError
from workbench.serve.connections import CONNECTION, guarded_h11
from workbench.serve.latency import CLOCK, RequestClock
from workbench.serve.protocol import HTTPError, parse_json_object
from workbench.serve.sglang_metrics import ServeMetrics
from workbench.serve.web import JSONResponse, uvicorn

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class ServeLimits:
    """What one client may cost the server (module doc). Validated like every config."""

    max_body_bytes: int = 8 << 20
    max_prompt_chars: int | None = None  # None: 32 characters per token of max_model_len
    max_waiting: int = 256  # requests queued beyond max_batch_size before 503 + Retry-After
    limit_concurrency: int = 1024  # requests in progress; beyond → 503 (never /health)
    max_connections: int = 4096  # open sockets; at the bound the longest-idle one is closed
    read_timeout_s: float = 30.0  # a request's head and body must arrive within this
    keep_alive_s: float = 5.0  # a connection with no request in progress closes after this
    write_timeout_s: float = 30.0  # an answer nobody reads for this long is dropped
    max_header_bytes: int = 64 << 10  # h11's bound on a request head
    health_step_s: float = 60.0  # /health is red while a step or command runs longer
    retry_after_s: int = 1
    api_key: str | None = None
    # log-probability entries (a token's own + its alternatives, per position) one answer may
    # send in all, streamed chunks included (:func:`logprob_entries`)
    max_logprob_entries: int = 1 << 20
    # SGLang's --incremental-streaming-output: /generate streams send only what is new
    incremental_streaming: bool = False
    # the latency histograms' buckets: SGLang's, or "fine" (finer low bounds; sglang_metrics)
    latency_buckets: str = "sglang"

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_waiting", "limit_concurrency", "max_header_bytes",
                     "retry_after_s", "max_logprob_entries", "max_connections"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"ServeLimits.{name}: must be an integer >= 1, got {v!r}")
        c = self.max_prompt_chars
        if c is not None and (not isinstance(c, int) or isinstance(c, bool) or c < 1):
            raise ConfigError(f"ServeLimits.max_prompt_chars: must be an integer >= 1 or None, "
                              f"got {c!r}")
        for name in ("read_timeout_s", "keep_alive_s", "health_step_s", "write_timeout_s"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 < v < 1e6:
                raise ConfigError(f"ServeLimits.{name}: must be a number of seconds > 0, "
                                  f"got {v!r}")
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key):
            raise ConfigError("ServeLimits.api_key: must be a non-empty string or None")
        if self.latency_buckets not in ("sglang", "fine"):
            raise ConfigError("ServeLimits.latency_buckets: 'sglang' or 'fine', got "
                              f"{self.latency_buckets!r}")
        if not isinstance(self.incremental_streaming, bool):
            raise ConfigError("ServeLimits.incremental_streaming: must be true or false, got "
                              f"{self.incremental_streaming!r}")

    def prompt_chars(self, max_model_len: int) -> int:
        return self.max_prompt_chars or 32 * max_model_len



def logprob_entries(lp: LogprobParams | None, prompt_len: int, max_new: int, vocab: int,
                    stream: str) -> int:
    """The most log-probability entries one answer can send: per position the token's own
    and ``top_k`` alternatives (at most the vocabulary), for the prompt from ``lp.start`` and
    up to ``max_new`` output tokens. ``stream``: ``"none"``; ``"cumulative"`` (SGLang's default:
    every chunk repeats the tables so far, one chunk per output token at most) or
    ``"incremental"`` (each chunk only its new output rows; the prompt's table is repeated in
    every chunk, as SGLang does)."""
    if lp is None:
        return 0
    per = 1 + min(lp.top_k, vocab)
    prompt_rows = 0 if lp.start is None else max(prompt_len - lp.start, 0)
    c = max_new
    if stream == "cumulative":
        rows = prompt_rows * c + c * (c + 1) // 2
    elif stream == "incremental":
        rows = prompt_rows * c + c
    else:
        rows = prompt_rows + c
    return per * rows


class LimitsGuard:
    """ASGI middleware in front of every route: the API key (``Authorization: Bearer``), a
    413 for a Content-Length over ``max_body_bytes`` before any of the body is read, and the
    bound on requests in progress (``limit_concurrency`` → 503 + Retry-After; /health is never
    refused, so a liveness probe sees a full server as alive)."""

    OPEN = ("/health",)  # liveness probes need no key (as SGLang) and are never refused

    def __init__(self, app: Any, limits: ServeLimits, metrics: ServeMetrics | None = None,
                 ) -> None:
        self.app = app
        self.limits = limits
        self.metrics = metrics  # the latency histograms each request's RequestClock observes
        self.key = None if limits.api_key is None else limits.api_key.encode()
        self.in_progress = 0

    def check_key(self, values: list[bytes]) -> HTTPError | None:
        """None when ``values`` (every ``Authorization`` header of the request) is exactly one
        ``Bearer <key>`` with the server's key. The scheme is matched case-insensitively (RFC
        7235 §2.1), one or more spaces before the credentials, the key exactly (RFC 6750 §2.1);
        several headers are ambiguous credentials → 400 (RFC 6750 §3.1 ``invalid_request``);
        a missing, other-scheme or wrong key → 401."""
        assert self.key is not None
        if len(values) > 1:
            return HTTPError(f"authorization: {len(values)} Authorization headers; send exactly "
                             "one ('Authorization: Bearer <key>')", "authorization", 400)
        scheme, _, cred = (values[0] if values else b"").partition(b" ")
        ok = scheme.lower() == b"bearer" and hmac.compare_digest(cred.lstrip(b" "), self.key)
        return None if ok else HTTPError(
            "authorization: missing or wrong API key (send 'Authorization: Bearer <key>')",
            "authorization", 401)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if scope["path"] in self.OPEN:
            await self.app(scope, receive, send)
            return
        if self.in_progress >= self.limits.limit_concurrency:
            await send_json(send, 503, HTTPError(
                f"server: {self.in_progress} requests in progress (the limit is "
                f"{self.limits.limit_concurrency}); retry later", None, 503).body(),
                [(b"retry-after", str(self.limits.retry_after_s).encode())])
            return
        self.in_progress += 1
        conn = CONNECTION.get()
        arrival = getattr(conn, "request_arrival", None) or time.perf_counter()
        clock = RequestClock(arrival, self.metrics) if self.metrics is not None else None
        CLOCK.set(clock)

        async def timed_send(msg: Any) -> None:
            await send(msg)
            if clock is not None and msg["type"] == "http.response.body":
                clock.written(time.perf_counter(), not msg.get("more_body", False))

        try:
            await self.guarded(scope, receive, timed_send)
        finally:
            self.in_progress -= 1
            if clock is not None:
                clock.close()

    async def guarded(self, scope: Any, receive: Any, send: Any) -> None:
        headers = dict(scope["headers"])
        if self.key is not None and scope["path"] not in self.OPEN:
            refusal = self.check_key([v for k, v in scope["headers"] if k == b"authorization"])
            if refusal is not None:
                await send_json(send, refusal.status, refusal.body(),
                                [(b"www-authenticate", b"Bearer" if refusal.status == 401 else
                                  b'Bearer error="invalid_request"')])
                return
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limits.max_body_bytes:
            await send_json(send, 413, too_large(self.limits).body(),
                            [(b"connection", b"close")])
            return
        await self.app(scope, receive, send)


def too_large(limits: ServeLimits) -> HTTPError:
    return HTTPError(f"body: larger than this server accepts ({limits.max_body_bytes} bytes)",
                     "body", 413)


async def send_json(send: Any, status: int, body: dict[str, Any],
                    headers: list[tuple[bytes, bytes]]) -> None:
    data = JSONResponse(body).body
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
        *headers]})
    await send({"type": "http.response.body", "body": data})


async def read_json_body(request: Any, limits: ServeLimits) -> dict[str, Any]:
    """The JSON body, read up to ``max_body_bytes`` (a chunked upload has no Content-Length for
    :class:`LimitsGuard` to check)."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limits.max_body_bytes:
            raise too_large(limits)
        chunks.append(chunk)
    raw = b"".join(chunks)
    if len(raw) <= PARSE_INLINE_BYTES:
        return parse_json_object(raw)
    # a big body (megabytes of JSON) is parsed on a worker thread, not on the event loop
    return await asyncio.get_running_loop().run_in_executor(None, parse_json_object, raw)


PARSE_INLINE_BYTES = 64 << 10


def uvicorn_config(app: Any, limits: ServeLimits, log_level: str) -> uvicorn.Config:
    """uvicorn settings enforcing ``limits``: connection hygiene
    (:func:`~workbench.serve.connections.guarded_h11`: timeouts, the head bound, the connection
    bound, TCP_NODELAY), keep-alive. uvicorn's own ``limit_concurrency`` is off: it counted
    idle sockets against requests (1,030 idle sockets made every request a 503);
    :class:`LimitsGuard` bounds requests in progress instead."""
    return uvicorn.Config(app, log_level=log_level, lifespan="off", timeout_graceful_shutdown=5,
                          http=guarded_h11(limits), limit_concurrency=None,
                          timeout_keep_alive=limits.keep_alive_s,  # type: ignore[arg-type]
                          h11_max_incomplete_event_size=limits.max_header_bytes)

