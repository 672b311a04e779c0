"""Connection hygiene under uvicorn's h11 protocol (:func:`guarded_h11`): what one socket may
hold, whatever its client does or does not do.

- Nagle off: TCP_NODELAY on every accepted connection (asyncio sets it only for sockets created
  with ``proto=IPPROTO_TCP``; without it a reused connection waited ~40 ms per answer).
- Read deadlines: a connection that sends nothing closes after ``keep_alive_s`` (as an idle
  keep-alive one does); once a request starts, its head and body must arrive within
  ``read_timeout_s`` (slowloris, a Content-Length larger than the body).
- The head bound: a request head over ``max_header_bytes`` → 431 naming ``headers`` (h11's own
  bound only applies while a head is incomplete, so one arriving whole passed at any size),
  every head of the connection, pipelined ones too (:meth:`handle_events`).
- A write timeout: an answer whose unsent bytes make no progress for ``write_timeout_s`` (a
  client that never reads), streamed or not, is dropped, and its buffer with it (nginx's
  ``send_timeout``); the allocator then gives its free pages back to the system
  (:func:`return_memory`), so the process's memory comes back after a stalled large answer.
- Idle sockets never deny service: open connections are bounded by ``max_connections`` apart
  from the request limit; at the bound the longest-idle connection is closed to make room (one
  without a request in progress), so /health and real requests always get a socket.
- A refusal the client can read: an answer sent before the request body was read (413) or a
  refused head closes by lingering (RFC 9112 §9.6): the server half-closes and reads and
  discards what the client still sends (at most ``LINGER_BYTES``, until the read deadline)
  instead of closing at once, which would reset the connection before the client read the
  answer.
- What the client has not read (:meth:`unread_bytes`): the answer's bytes still in uvicorn's
  buffer and in the kernel's send queue (sent, not acknowledged), for backpressure; a request
  handler finds its connection in :data:`CONNECTION`.
"""

from __future__ import annotations

import contextvars
import ctypes
import ctypes.util
import fcntl
import json
import logging
import socket
import struct
import termios
import time
from typing import Any

from workbench.serve.web import H11Protocol, h11

log = logging.getLogger(__name__)

LINGER_BYTES = 64 << 20  # discarded after a refusal before the connection is dropped anyway
# the connection whose bytes started the current request (set before uvicorn starts its task)
CONNECTION: contextvars.ContextVar[Any] = contextvars.ContextVar("workbench_connection",
                                                                 default=None)


_LIBC: Any = None
_trimming = False


def return_memory(loop: Any) -> None:
    """glibc keeps freed heap memory for reuse (a dropped 25 MB answer's pages stay in the
    process): ``malloc_trim(0)`` on a worker thread gives the free pages back, at most one at
    a time. Elsewhere than glibc there is nothing to call (said once in the log)."""
    global _LIBC, _trimming
    if _LIBC is None:
        name = ctypes.util.find_library("c")
        lib = ctypes.CDLL(name) if name else None
        _LIBC = lib if lib is not None and hasattr(lib, "malloc_trim") else False
        if not _LIBC:
            log.info("no malloc_trim in this C library: freed memory stays with the allocator")
    if not _LIBC or _trimming:
        return
    _trimming = True

    def trim() -> None:
        global _trimming
        try:
            _LIBC.malloc_trim(0)
        finally:
            _trimming = False

    loop.run_in_executor(None, trim)


class GuardedTransport:
    """The connection's transport as uvicorn sees it: ``write`` arms the write timeout and
    ``close`` lingers when the client may still be sending (everything else passes through)."""

    def __init__(self, transport: Any, proto: Any) -> None:
        self._t = transport
        self._p = proto

    def __getattr__(self, name: str) -> Any:
        return getattr(self._t, name)

    def write(self, data: Any) -> None:
        self._t.write(data)
        self._p.watch_write()

    def close(self) -> None:
        self._p.close_connection()

    def is_closing(self) -> bool:
        return bool(self._p.lingering or self._t.is_closing())


def guarded_h11(limits: Any) -> type[H11Protocol]:
    """uvicorn's h11 protocol with the module doc's bounds, for ``limits``
    (:class:`~workbench.serve.limits.ServeLimits`)."""
    read_s, idle_s = limits.read_timeout_s, limits.keep_alive_s
    write_s, head_max = limits.write_timeout_s, limits.max_header_bytes
    max_conns = limits.max_connections

    class GuardedH11Protocol(H11Protocol):
        _timer: Any = None
        _write_timer: Any = None
        _linger_timer: Any = None
        lingering = False
        _lingered = 0
        _head: bytearray
        _last_active = 0.0
        _unsent = 0
        _progress_at = 0.0
        request_arrival = 0.0  # perf_counter when the current request's first bytes were read

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            self._raw = transport
            self._head = bytearray()
            self._last_active = time.perf_counter()
            sock = transport.get_extra_info("socket")
            if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            super().connection_made(GuardedTransport(transport, self))  # type: ignore[arg-type]
            self._arm(idle_s, "sent nothing")
            if len(self.connections) > max_conns:
                self._make_room()

        # -- the connection bound ------------------------------------------------------------
        def idle(self) -> bool:
            """No request in progress and nothing left to send."""
            return (self.conn.their_state is h11.IDLE and not self.lingering
                    and not self._raw.is_closing()
                    and (self.cycle is None or self.cycle.response_complete)
                    and self._raw.get_write_buffer_size() == 0)

        def _make_room(self) -> None:
            idle: list[Any] = [p for p in self.connections if p is not self
                               and isinstance(p, GuardedH11Protocol) and p.idle()]
            victim: Any = min(idle, key=lambda p: p._last_active, default=self)
            log.info("%d connections open (bound %d): closing an idle one", len(self.connections),
                     max_conns)
            victim._raw.close()

        # -- reading ---------------------------------------------------------------------------
        def _arm(self, timeout: float, what: str) -> None:
            self._disarm()
            self._timer = self.loop.call_later(timeout, self._read_timed_out, timeout, what)

        def _disarm(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

        def unread_bytes(self) -> int:
            """Bytes of answers the client has not read: uvicorn's buffer + the kernel's
            send queue (any thread may ask; 0 once closed)."""
            sock = self._raw.get_extra_info("socket")
            if sock is None or self._raw.is_closing() or sock.fileno() < 0:
                return 0
            try:
                queued = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0" * 4)
            except OSError:  # closed meanwhile: nothing more will be read
                return 0
            return int(self._raw.get_write_buffer_size()) + struct.unpack("i", queued)[0]

        def data_received(self, data: bytes) -> None:
            self._last_active = time.perf_counter()
            CONNECTION.set(self)  # the request task uvicorn starts below copies this context
            if self.lingering:
                self._lingered += len(data)
                if self._lingered > LINGER_BYTES:
                    self._raw.abort()
                return
            if self.conn.their_state is h11.IDLE:
                if not self._head:
                    self._arm(read_s, "request not received")  # a request starts
                    self.request_arrival = self._last_active  # its latency counts from here
                start = max(len(self._head) - 3, 0)
                self._head += data
                end = self._head.find(b"\r\n\r\n", start)
                if (len(self._head) if end == -1 else end + 4) > head_max:
                    self._refuse_head()
                    return
            super().data_received(data)
            state = self.conn.their_state
            if state is not h11.IDLE:
                self._head = bytearray()
                if state is not h11.SEND_BODY:
                    self._disarm()  # the whole request is in

        def handle_events(self) -> None:
            """Every head h11 is about to read is held to the bound first: a pipelined one,
            buffered behind the previous request, never passed through :meth:`data_received`'s
            check (h11 reads it once that request's answer is complete)."""
            if self.conn.their_state is h11.IDLE and not self.lingering:
                buf = self.conn.trailing_data[0]
                end = buf.find(b"\r\n\r\n")
                if (len(buf) if end == -1 else end + 4) > head_max:
                    self._refuse_head()
                    return
            super().handle_events()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self.conn.their_state is h11.IDLE and not self.lingering:
                self._head = bytearray()

        def _read_timed_out(self, timeout: float, what: str) -> None:
            self._timer = None
            if self.conn.their_state in (h11.IDLE, h11.SEND_BODY) and not self.lingering \
                    and not self._raw.is_closing():
                who = f"{self.client[0]}:{self.client[1]}" if self.client else "a client"
                log.info("dropping %s: %s within %.0f s", who, what, timeout)
                self._raw.close()

        def _refuse_head(self) -> None:
            body = json.dumps({"error": {
                "message": f"headers: the request head is larger than this server accepts "
                           f"({head_max} bytes)", "field": "headers",
                "type": "invalid_request_error", "code": 431}}).encode()
            self._raw.write(b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
                            b"content-type: application/json\r\nconnection: close\r\n"
                            b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            self._linger()

        # -- closing ---------------------------------------------------------------------------
        def close_connection(self) -> None:
            """uvicorn closes the connection: linger if the client may still be sending."""
            if self.lingering:
                return
            if self.conn.their_state is h11.SEND_BODY:  # answered before the body was read
                self._linger()
            else:
                self._raw.close()

        def _linger(self) -> None:
            self.lingering = True
            self._disarm()
            self._raw.resume_reading()
            if self._raw.can_write_eof():
                self._raw.write_eof()  # the answer, then FIN; reading goes on
            self._linger_timer = self.loop.call_later(read_s, self._raw.close)

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            for t in (self._write_timer, self._linger_timer):
                if t is not None:
                    t.cancel()
            super().connection_lost(exc)

        # -- writing ---------------------------------------------------------------------------
        def watch_write(self) -> None:
            """Armed by every write while bytes stay unread (:meth:`unread_bytes`: a held
            stream writes nothing more while its bytes wait in the kernel): no progress for
            ``write_s`` → the connection is dropped with what it holds."""
            if self._write_timer is None and self.unread_bytes() > 0:
                self._unsent = self.unread_bytes()
                self._progress_at = time.monotonic()
                self._write_timer = self.loop.call_later(min(1.0, write_s / 4), self._check_write)

        def _check_write(self) -> None:
            self._write_timer = None
            unsent = self.unread_bytes()
            if unsent == 0:
                return
            now = time.monotonic()
            if unsent < self._unsent:
                self._unsent, self._progress_at = unsent, now
            elif now - self._progress_at > write_s:
                who = f"{self.client[0]}:{self.client[1]}" if self.client else "a client"
                log.info("dropping %s: %d bytes unsent and none taken for %.0f s", who, unsent,
                         write_s)
                self._raw.abort()
                return_memory(self.loop)
                return
            self._write_timer = self.loop.call_later(min(1.0, write_s / 4), self._check_write)

    return GuardedH11Protocol
