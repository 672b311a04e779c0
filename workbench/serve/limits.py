"""What one client may cost the server (:class:`ServeLimits`), and where each bound is enforced
before the engine thread sees a request:

- :class:`LimitsGuard` (ASGI middleware, every route): the API key (``Authorization: Bearer``;
  /health exempt) and a 413 for a Content-Length over ``max_body_bytes``, before any of the body
  is read; :func:`read_json_body` counts a chunked body while reading it;
- :func:`uvicorn_config`: uvicorn's ``limit_concurrency``, keep-alive timeout and header bound,
  with :func:`bounded_h11`'s read deadline (slowloris, a Content-Length larger than the body);
- the prompt bound and the waiting bound are checked at admission
  (:class:`workbench.serve.frontend.ServeState`).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from dataclasses import dataclass
from typing import Any

from workbench.core import LogprobParams
from workbench.errors import ConfigError
from workbench.serve.protocol import HTTPError, parse_json_object
from workbench.serve.web import H11Protocol, JSONResponse, h11, uvicorn

log = logging.getLogger(__name__)

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
    # log-probability entries (a token's own + its alternatives, per position) one answer may
    # send in all, streamed chunks included (:func:`logprob_entries`)
    max_logprob_entries: int = 1 << 20
    # SGLang's --incremental-streaming-output: /generate streams send only what is new
    incremental_streaming: bool = False

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_waiting", "limit_concurrency", "max_header_bytes",
                     "retry_after_s", "max_logprob_entries"):
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


class LimitsGuard:
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
            await send_json(send, 401, HTTPError(
                "authorization: missing or wrong API key (send 'Authorization: Bearer <key>')",
                "authorization", 401).body(), [(b"www-authenticate", b"Bearer")])
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
    return parse_json_object(b"".join(chunks))


def uvicorn_config(app: Any, limits: ServeLimits, log_level: str) -> uvicorn.Config:
    """uvicorn settings enforcing ``limits`` (connections, timeouts, header size)."""
    return uvicorn.Config(app, log_level=log_level, lifespan="off", timeout_graceful_shutdown=5,
                          http=bounded_h11(limits.read_timeout_s),
                          limit_concurrency=limits.limit_concurrency,
                          timeout_keep_alive=limits.keep_alive_s,  # type: ignore[arg-type]
                          h11_max_incomplete_event_size=limits.max_header_bytes)

