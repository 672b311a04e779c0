"""SGLang 0.5.23's batched ``/generate``: a list of prompts in ``text`` (or of token-id lists in
``input_ids``) is a batch, answered as SGLang answers one.

A batch body is split into one ``/generate`` body per item (:func:`split_generate`), each then
validated as a single request (:func:`~workbench.serve.protocol.parse_generate`), with errors
naming the item (``text[3]``, ``sampling_params[3].temperature``). Per item, as upstream
(``GenerateReqInput.normalize_batch_and_arguments``):

- ``sampling_params``: one object for every item, or a list with one per item;
- ``rid``: none (each item gets its own id), a string (item i is ``"<rid>_<i>"``) or a list of
  one string per item;
- ``return_logprob``, ``logprob_start_len``, ``top_logprobs_num``: one value for every item or a
  list with one per item; every other field holds for the whole batch.

The answer: without ``stream`` a JSON list with one ``{"text", "output_ids", "meta_info"}`` per
item, in order; with ``stream`` server-sent events, each one item's cumulative state with its
``"index"`` in the batch, as the items progress, then ``data: [DONE]``.

Bounds: at most :data:`MAX_GENERATE_BATCH` items per request (checked before any item is
parsed), and no more than the server can hold at once (``max_batch_size + max_waiting``, checked
by the route); either is a 400 naming ``text``/``input_ids``. A batch is admitted whole or not
at all.
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from workbench.serve.frontend import AbortingStream, AsyncSink, ServeState, check_failed, note
from workbench.serve.loop import Chunk, Ticket
from workbench.serve.protocol import HTTPError, ParsedRequest, parse_generate, type_name
from workbench.serve.responses import sse
from workbench.serve.sglang_admin import LiveRids
from workbench.serve.web import Response

BodyFor = Callable[[Any, ParsedRequest, str, int, float], Callable[[Chunk], dict[str, Any]]]

MAX_GENERATE_BATCH = 1024
# Fields a batch may give per item (a list with one value per item) or once for all.
PER_ITEM = ("return_logprob", "logprob_start_len", "top_logprobs_num")


def batch_size(body: dict[str, Any]) -> tuple[str, int] | None:
    """``(prompt field, number of items)`` when ``body`` is a batch, else None (one prompt, or
    a body :func:`~workbench.serve.protocol.parse_generate` will refuse)."""
    text, ids = body.get("text"), body.get("input_ids")
    if text is not None and ids is not None:
        return None  # parse_generate names the conflict
    if isinstance(text, list):
        return "text", len(text)
    if isinstance(ids, list) and ids and isinstance(ids[0], list):
        return "input_ids", len(ids)
    return None


def split_generate(body: dict[str, Any]) -> list[tuple[dict[str, Any], dict[str, str]]] | None:
    """A batch body → one single-prompt body per item, each with the renames that turn its
    error fields into the batch's (``text`` → ``text[i]``); None when ``body`` holds one
    prompt."""
    found = batch_size(body)
    if found is None:
        return None
    field, n = found
    if n == 0:
        raise HTTPError(f"{field}: empty batch (no prompts)", field)
    if n > MAX_GENERATE_BATCH:
        raise HTTPError(f"{field}: a batch of {n} prompts is more than one request may hold "
                        f"({MAX_GENERATE_BATCH}); split it", field)
    prompts = body[field]
    sp = body.get("sampling_params")
    sps = _per_item(sp, n, "sampling_params", dict) if isinstance(sp, list) else None
    rid = body.get("rid")
    rids: list[Any]
    if rid is None:
        rids = [None] * n
    elif isinstance(rid, str):
        rids = [f"{rid}_{i}" for i in range(n)]
    else:
        rids = _per_item(rid, n, "rid", str)
    lists = {k: _per_item(body[k], n, k, None) for k in PER_ITEM if isinstance(body.get(k), list)}
    items = []
    for i in range(n):
        item = dict(body)
        item[field] = prompts[i]
        item["rid"] = rids[i]
        renames = {field: f"{field}[{i}]", "rid": f"rid[{i}]" if isinstance(rid, list)
                   else "rid"}
        if sps is not None:
            item["sampling_params"] = sps[i]
            renames["sampling_params"] = f"sampling_params[{i}]"
        for k, values in lists.items():
            item[k] = values[i]
            renames[k] = f"{k}[{i}]"
        items.append((item, renames))
    return items


def _per_item(v: list[Any], n: int, field: str, kind: type | None) -> list[Any]:
    if len(v) != n:
        raise HTTPError(f"{field}: {len(v)} values for a batch of {n} prompts (give one value "
                        "for all, or one per prompt)", field)
    if kind is not None:
        for i, x in enumerate(v):
            if not isinstance(x, kind):
                raise HTTPError(f"{field}[{i}]: expected {kind.__name__}, got {type_name(x)}",
                                f"{field}[{i}]")
    return v


def relabel(e: HTTPError, renames: dict[str, str]) -> HTTPError:
    """``e`` (raised for one item's body) with its field named as the batch names it."""
    if e.field is None:
        return e
    head, dot, rest = e.field.partition(".")
    new = renames.get(head)
    if new is None:
        return e
    field = new + dot + rest
    message = e.message
    if message.startswith(e.field):
        message = field + message[len(e.field):]
    return HTTPError(message, field, e.status)


def parse_items(items: list[tuple[dict[str, Any], dict[str, str]]]) -> list[ParsedRequest]:
    """Each item's body validated as one request; errors name the item."""
    out = []
    for body, renames in items:
        try:
            parsed = parse_generate(body)
        except HTTPError as e:
            raise relabel(e, renames) from None
        prompt_field = renames["text" if "text" in renames else "input_ids"]
        out.append(dataclasses.replace(parsed, prompt_field=prompt_field))
    return out


async def generate_batch(request: Any, st: ServeState, live: LiveRids,
                         items: list[tuple[dict[str, Any], dict[str, str]]], t0: float,
                         body_for: BodyFor, batch: str | None = None) -> Any:
    """Answer a batched ``/generate`` (module doc): admit every item or none, then a JSON list
    or one event stream. ``batch``: the one rid the body gave (its items' ids are
    ``"<batch>_<i>"``; ``/abort_request`` with it aborts them)."""
    loop = st.loop
    field = "text" if "text" in items[0][1] else "input_ids"
    cap = loop.fanout_cap  # a batch's items count against the share of several-choice requests
    if cap is not None and len(items) > cap:
        raise HTTPError(f"{field}: a batch of {len(items)} prompts is more than this server "
                        f"holds at once ({cap} requests queued or running); split it", field)
    # the log-probability budget counts every item, and a batch's stream repeats (cumulative)
    parsed = [dataclasses.replace(p, fanout=len(items), cumulative=p.stream)
              for p in parse_items(items)]
    rids = [p.rid or uuid.uuid4().hex for p in parsed]
    live.check_free(rids)
    admitted: list[tuple[Ticket, AsyncSink, int]] = []
    try:
        for i, p in enumerate(parsed):
            ticket, sink, adm = await st.admit(p, request, i)
            admitted.append((ticket, sink, adm.prompt_tokens))
    except BaseException:
        for ticket, _, _ in admitted:
            loop.abort(ticket)
        raise
    live.add(rids, [t for t, _, _ in admitted], loop.abort, batch)
    bodies = [body_for(loop.engine, p, rid, n, t0)
              for p, rid, (_, _, n) in zip(parsed, rids, admitted, strict=True)]

    def release() -> None:
        if batch is not None:
            live.remove_batch(batch, rids)
        for rid, (ticket, _, _) in zip(rids, admitted, strict=True):
            live.remove(rid, ticket)
            loop.abort(ticket)

    if not parsed[0].stream:
        try:
            got = await st.finals(request, [(t, s) for t, s, _ in admitted])
        finally:
            release()
        if got is None:
            return Response(status_code=499)
        for c in got:
            check_failed(c)
        if all(p.logprobs is None for p in parsed):
            return [body(c) for body, c in zip(bodies, got, strict=True)]
        done = got  # log-probability tables are built and serialized off the event loop
        return Response(await st.encode(lambda: [body(c) for body, c in
                                                 zip(bodies, done, strict=True)]),
                        media_type="application/json")

    async def events() -> AsyncIterator[bytes]:
        try:
            async for i, c in merged(st, [(t, s) for t, s, _ in admitted]):
                note(i, c)
                yield sse({**bodies[i](c), "index": i})
            yield sse("[DONE]")
        finally:
            release()

    return AbortingStream(events(), release)


async def merged(st: ServeState, pairs: list[tuple[Ticket, AsyncSink]],
                 ) -> AsyncIterator[tuple[int, Chunk]]:
    """Every request's streamed chunks as they come, with its index in ``pairs``."""
    q: asyncio.Queue[tuple[int, Chunk] | None] = asyncio.Queue()

    async def pump(i: int, ticket: Ticket, sink: AsyncSink) -> None:
        try:
            async for chunk in st.chunks(ticket, sink):
                await q.put((i, chunk))
        finally:
            await q.put(None)

    tasks = [asyncio.ensure_future(pump(i, t, s)) for i, (t, s) in enumerate(pairs)]
    try:
        running = len(tasks)
        while running:
            item = await q.get()
            if item is None:
                running -= 1
                continue
            yield item
    finally:
        for task in tasks:
            task.cancel()
