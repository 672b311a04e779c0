"""The asyncio side of the server: what the route handlers share.

One :class:`~workbench.serve.loop.EngineLoop` thread owns the engine; the handlers only enqueue
commands and await answers. :class:`ServeState` tokenizes off both threads, admits a request
(503 while too many are outstanding, 400 naming the field when the engine refuses it), and
awaits its final chunk (:meth:`ServeState.final`; None when the client went away, which aborts
the request and frees its KV) or its streamed chunks (:meth:`ServeState.chunks`;
:class:`AbortingStream` aborts however a stream ends); a client that goes away while its
request still waits for a batch slot is noticed there too (:meth:`ServeState.admit`: the
request leaves the queue). A failed request's engine error never
reaches the client as exception text (:func:`public_chunk`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from starlette.requests import ClientDisconnect

from workbench.errors import RequestError
from workbench.sampler import bias_problem
from workbench.serve.connections import CONNECTION
from workbench.serve.latency import CLOCK
from workbench.serve.limits import ServeLimits, logprob_entries
from workbench.serve.loop import (
    Admitted,
    Chunk,
    EngineLoop,
    LoopClosed,
    QueueFull,
    Rejected,
    Ticket,
)
from workbench.serve.protocol import HTTPError, ParsedRequest, admission_error
from workbench.serve.responses import json_bytes, sse
from workbench.serve.web import StreamingResponse

log = logging.getLogger(__name__)
T = TypeVar("T")


def error_id() -> str:
    return uuid.uuid4().hex[:12]


class AsyncSink:
    """Receives the loop thread's messages on this event loop's queue. For the loop thread's
    backpressure: :meth:`unread`, messages sent and not taken from the queue yet, and
    :meth:`unread_bytes`, bytes the request's client has not read (0 without a connection)."""

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._conn = CONNECTION.get()  # the request's connection (connections.py)
        self.queue: asyncio.Queue[object] = asyncio.Queue()
        self._sent = 0  # written by the loop thread only
        self._arrived = 0  # written by the event loop only

    def put(self, item: object) -> None:
        self._sent += 1  # before it can arrive
        try:
            self._loop.call_soon_threadsafe(self._arrive, item)
        except RuntimeError:
            pass  # the event loop is closed: the server stopped and nobody is listening

    def _arrive(self, item: object) -> None:
        self.queue.put_nowait(item)
        self._arrived += 1

    def unread_bytes(self) -> int:
        return 0 if self._conn is None else int(self._conn.unread_bytes())

    def unread(self) -> int:
        # sent but not arrived yet (the event loop is behind) + arrived and not taken
        return self._sent - self._arrived + self.queue.qsize()


class ServeState:
    """What the route handlers share."""

    def __init__(self, loop: EngineLoop, name: str, limits: ServeLimits) -> None:
        self.loop = loop
        self.name = name
        self.limits = limits
        self.max_model_len = int(loop.engine.max_model_len)
        self.max_prompt_chars = limits.prompt_chars(self.max_model_len)
        mc = loop.engine.model_config
        assert mc is not None  # a built engine has loaded its model config
        self.vocab_size = int(mc.vocab_size)
        # tokenization never runs on the engine thread (nor on the event loop)
        self.tokenizer_pool = ThreadPoolExecutor(1, thread_name_prefix="workbench-tokenize")
        # nor does building and serializing a big answer (log-probability tables)
        self.encode_pool = ThreadPoolExecutor(2, thread_name_prefix="workbench-encode")

    async def encode(self, make: Callable[[], Any], event: bool = False) -> bytes:
        """``make()`` as a JSON body (``event``: one server-sent event), built and serialized
        on an encoder thread, so a big answer never holds the event loop (/health and every
        other connection keep being served meanwhile)."""
        def run() -> bytes:
            obj = make()
            return sse(obj) if event else json_bytes(obj)

        return await asyncio.get_running_loop().run_in_executor(self.encode_pool, run)

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
            raise HTTPError(loop_down(self.loop), None, 503) from None
        try:
            return await asyncio.wrap_future(fut)
        except LoopClosed:
            raise HTTPError(loop_down(self.loop), None, 503) from None

    async def admit(self, parsed: ParsedRequest, request: Any = None, index: int = 0,
                    ) -> tuple[Ticket, AsyncSink, Admitted]:
        """Submit ``parsed`` and wait until the engine has it. With ``request`` (the HTTP
        request, body read), a client that goes away while its request still waits for a
        batch slot aborts it there (it leaves the queue) and raises ClientDisconnect.
        ``index``: the choice of the HTTP request it is (its latencies: :data:`CLOCK`)."""
        sink = AsyncSink()
        if self.loop.max_pending is not None and self.loop.num_pending >= self.loop.max_pending:
            raise HTTPError(f"server: {self.loop.num_pending} requests are queued or running; "
                            "retry later", None, 503)  # before paying for tokenization
        why = bias_problem(parsed.sampling, self.vocab_size)
        if why is not None:
            raise HTTPError(why.replace("logit_bias", parsed.bias_field, 1), parsed.bias_field)
        prompt = await self.tokenize(parsed.prompt, parsed.prompt_field)
        self.check_budget(parsed, len(prompt) if isinstance(prompt, list) else 0)
        try:
            ticket = self.loop.submit(prompt, parsed.sampling, sink, parsed.stream,
                                      logprobs=parsed.logprobs,
                                      share="fanout" if parsed.fanout > 1 else "single",
                                      group=request if parsed.fanout > 1 else None)
        except QueueFull as e:
            raise HTTPError(str(e), None, 503) from None
        except LoopClosed:
            raise HTTPError(loop_down(self.loop), None, 503) from None
        try:
            first = await self._first(ticket, sink, request)
        except asyncio.CancelledError:
            self.loop.abort(ticket)
            raise
        if isinstance(first, Rejected):
            if first.status == 503:
                raise HTTPError(loop_down(self.loop), None, 503)
            if first.status != 400:
                raise HTTPError(f"server: {first.message}", None, first.status)
            raise admission_error(first.message, parsed.prompt_field)
        assert isinstance(first, Admitted)
        clock = CLOCK.get()
        if clock is not None:
            clock.admitted(index, parsed.stream)
        return ticket, sink, first

    async def _first(self, ticket: Ticket, sink: AsyncSink, request: Any) -> object:
        """The loop's first answer on ``sink`` (Admitted or Rejected); the client's disconnect
        while it waits aborts ``ticket`` and raises ClientDisconnect."""
        if request is None:
            return await sink.queue.get()
        got = asyncio.ensure_future(sink.queue.get())
        watcher = asyncio.ensure_future(disconnected(request))
        try:
            done, _ = await asyncio.wait({got, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not got.done():
                got.cancel()
        if got in done:
            return got.result()
        self.loop.abort(ticket)  # still queued: it leaves the queue (or is aborted at once)
        raise ClientDisconnect()

    def check_budget(self, parsed: ParsedRequest, prompt_len: int) -> None:
        """A 400 naming the field before any work when the answer's log-probability tables
        would exceed ``max_logprob_entries`` (every choice of the HTTP request counted)."""
        lp = parsed.logprobs
        if lp is None:
            return
        max_new = max(min(parsed.sampling.max_new_tokens, self.max_model_len - prompt_len), 0)
        mode = "none" if not parsed.stream else (
            "incremental" if not parsed.cumulative else "cumulative")
        entries = parsed.fanout * logprob_entries(lp, prompt_len, max_new, self.vocab_size,
                                                  mode)
        limit = self.limits.max_logprob_entries
        if entries <= limit:
            return
        field = parsed.logprobs_field or ("top_logprobs_num" if lp.top_k else
                                          "logprob_start_len" if lp.start is not None else
                                          "return_logprob")
        how = {"cumulative": "a stream repeating the tables in every chunk (the server's "
                             "incremental streaming sends each row once)",
               "incremental": "a stream (the prompt's table is repeated in every chunk)",
               "none": "the answer"}[mode]
        per = 1 + min(lp.top_k, self.vocab_size)
        raise HTTPError(f"{field}: {entries} log-probability entries ({per} per position, "
                        f"{how}) is more than this server sends for one request ({limit}); "
                        "ask for fewer alternatives, positions or tokens", field)

    async def final(self, request: Any, ticket: Ticket, sink: AsyncSink) -> Chunk | None:
        """The final chunk, or None if the client disconnected first (request aborted)."""
        got = await self.finals(request, [(ticket, sink)])
        return None if got is None else got[0]

    async def finals(self, request: Any, pairs: Sequence[tuple[Ticket, AsyncSink]],
                     ) -> list[Chunk] | None:
        """Every (ticket, sink)'s final chunk, in order, or None if the client disconnected
        first; every ticket is aborted on the way out (a no-op for finished ones)."""
        async def one(sink: AsyncSink) -> Chunk:
            while True:
                item = await sink.queue.get()
                if isinstance(item, Chunk) and item.finished:
                    return public_chunk(item)

        watcher = asyncio.ensure_future(disconnected(request))
        gathered = asyncio.ensure_future(asyncio.gather(*(one(sink) for _, sink in pairs)))
        racers: set[asyncio.Future[Any]] = {gathered, watcher}
        try:
            done, _ = await asyncio.wait(racers, return_when=asyncio.FIRST_COMPLETED)
            if gathered not in done:
                gathered.cancel()
                return None
            got = list(gathered.result())
            clock = CLOCK.get()
            if clock is not None:
                for i, c in enumerate(got):
                    m = c.output.metrics if c.output is not None else None
                    if m is not None:
                        clock.engine_times(i, m.first_token, m.token_times)
            return got
        finally:
            watcher.cancel()
            for ticket, _ in pairs:
                self.loop.abort(ticket)

    async def chunks(self, ticket: Ticket, sink: AsyncSink) -> AsyncIterator[Chunk]:
        """Streamed chunks; partial UTF-8 (text ending in U+FFFD) waits for the next step."""
        try:
            while True:
                item = await sink.queue.get()
                if not isinstance(item, Chunk):
                    continue
                if item.finished:
                    yield public_chunk(item)
                    return
                if not item.text.endswith("\ufffd"):
                    yield item
        finally:
            self.loop.abort(ticket)


def note(index: int, chunk: Chunk) -> None:
    """The streamed body write about to happen carries ``chunk`` of choice ``index`` (its
    latencies are observed when the write completes: :mod:`workbench.serve.latency`)."""
    clock = CLOCK.get()
    if clock is not None:
        clock.note(index, len(chunk.token_ids))


async def disconnected(request: Any) -> None:
    """Returns when the client goes away (the body has been read already)."""
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


def loop_down(loop: EngineLoop) -> str:
    """The 503 message once the engine loop stopped: no exception text, the logged error id."""
    if loop.error_id is not None:
        return f"server: the engine loop failed (error id {loop.error_id}; see the server log)"
    return "server: the engine loop is stopped"


def public_chunk(c: Chunk) -> Chunk:
    """A failed request's chunk as a client may see it. The engine's own request-scoped
    messages (non-finite logits, no valid sampling distribution) are kept; an engine failure's
    exception text is replaced by an error id, logged with the details."""
    if c.finish_reason != "error":
        return c
    eid = error_id()
    log.error("request failed (error id %s): %s", eid, c.error)
    msg = f"the engine failed (error id {eid}; see the server log)" if c.internal or \
        not c.error else f"{c.error} (error id {eid})"
    return dataclasses.replace(c, error=msg)


def check_failed(c: Chunk) -> None:
    if c.finish_reason == "error":
        raise HTTPError(f"request failed: {c.error or 'engine error'}", None, 500)



class AbortingStream(StreamingResponse):
    """A streamed response (server-sent events) that calls ``abort`` however the stream ends:
    finished, client gone, or failed."""

    def __init__(self, body: AsyncIterator[bytes], abort: Callable[[], None]) -> None:
        super().__init__(body, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})
        self._abort = abort

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._abort()
