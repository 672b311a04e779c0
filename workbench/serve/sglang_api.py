"""SGLang-native routes of ``workbench serve``: ``/generate``, ``/health``, ``/server_info``
(also ``/get_server_info``), ``/metrics`` and ``/v1/models``; the control routes
(``/model_info``, ``/health_generate``, ``/flush_cache``, ``/abort_request``):
:mod:`workbench.serve.sglang_admin`.

``POST /generate`` takes SGLang 0.5.23's body (:func:`~workbench.serve.protocol.parse_generate`)
and answers ``{"text", "output_ids", "meta_info"}``, ``meta_info`` as SGLang shapes it
(:func:`~workbench.serve.responses.meta_info`; logprobs:
:func:`~workbench.serve.responses.sglang_logprobs`); with ``stream: true`` server-sent events
``data: {...}\\n\\n`` with cumulative ``text`` and ``output_ids``, ending ``data: [DONE]``.
``sampling_params.max_new_tokens: 0`` runs the prompt only (its logprobs with
``return_logprob``; no output). A list of prompts is a batch: :mod:`workbench.serve.sglang_batch`.
"""

from __future__ import annotations

import dataclasses
import functools
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from workbench.serve.frontend import (
    AbortingStream,
    ServeState,
    check_failed,
    loop_down,
    note,
)
from workbench.serve.loop import Chunk
from workbench.serve.metrics import render, snapshot
from workbench.serve.protocol import HTTPError, ParsedRequest, parse_generate
from workbench.serve.responses import meta_info, sglang_logprobs, sse
from workbench.serve.sglang_admin import LiveRids, add_admin_routes
from workbench.serve.sglang_batch import generate_batch, split_generate
from workbench.serve.web import FastAPI, PlainTextResponse, Request, Response

if TYPE_CHECKING:
    from workbench.engine.engine import Engine

# ---- engine-side views (run on the loop thread) ------------------------------------------------


def server_info(engine: Engine, name: str) -> dict[str, Any]:
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


def _token_decoder(engine: Engine) -> Callable[[int], str] | None:
    """One token id → its text (``return_text_in_logprobs``); None without a tokenizer."""
    tok = engine.tokenizer
    return None if tok is None else (lambda t: tok.decode([t]))


# ---- routes ------------------------------------------------------------------------------------


def add_sglang_routes(app: FastAPI, st: ServeState,
                      body_of: Callable[[Any], Any]) -> None:
    """Register SGLang's routes on ``app`` (``st``: the server's shared state; ``body_of``: its
    bounded JSON body reader)."""
    loop, name, limits = st.loop, st.name, st.limits
    live = LiveRids()
    add_admin_routes(app, st, body_of, live)

    @app.get("/health")
    async def health() -> Any:
        """200 while the engine loop is alive and no step or command has run longer than
        ``health_step_s``; 503 otherwise. The body reports the loop's heartbeat."""
        if loop.error is not None or not loop.alive:
            raise HTTPError(loop_down(loop), None, 503)
        beat = loop.heartbeat()
        if beat["busy_s"] > limits.health_step_s:
            raise HTTPError(f"server: the engine loop has been busy for {beat['busy_s']:.1f} s "
                            f"(bound {limits.health_step_s:g} s)", None, 503)
        return {"status": "ok", "loop": beat}

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def info() -> Any:
        return await st.call(lambda e: {**server_info(e, name),
                                        "step_profile": loop.profile.snapshot(),
                                        "latency_buckets": loop.metrics.describe(),
                                        "backpressure": loop.backpressure.snapshot()})

    @app.get("/metrics")
    async def metrics() -> Any:
        snap, hists = await st.call(lambda e: (snapshot(e, loop), loop.metrics.render(name)))
        return PlainTextResponse(render(snap, snap["sglang:spec_num_steps"], name) + hists,
                                 media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> Any:
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0,
                                            "owned_by": "workbench"}]}

    @app.post("/generate")
    async def generate(request: Request) -> Any:
        t0 = time.perf_counter()
        raw = await body_of(request)
        items = split_generate(raw)
        if items is not None:
            batch = raw.get("rid") if isinstance(raw.get("rid"), str) else None
            return await generate_batch(request, st, live, items, t0, response_body, batch)
        parsed = parse_generate(raw)
        incremental = parsed.stream and limits.incremental_streaming
        if parsed.stream and not incremental:
            parsed = dataclasses.replace(parsed, cumulative=True)
        rid = parsed.rid or uuid.uuid4().hex
        live.check_free([rid])
        ticket, sink, adm = await st.admit(parsed, request)
        live.add([rid], [ticket], loop.abort)
        body = response_body(loop.engine, parsed, rid, adm.prompt_tokens, t0)

        if not parsed.stream:
            try:
                c = await st.final(request, ticket, sink)
            finally:
                live.remove(rid, ticket)
            if c is None:
                return Response(status_code=499)
            check_failed(c)
            if parsed.logprobs is None:
                return body(c)
            done = c  # a big answer is built and serialized off the event loop
            return Response(await st.encode(lambda: body(done)), media_type="application/json")

        async def events() -> AsyncIterator[bytes]:
            try:
                sent_ids, sent_text = 0, ""
                async for c in st.chunks(ticket, sink):
                    make = functools.partial(body, c, *((sent_ids, sent_text) if incremental
                                                        else (0, "")))
                    note(0, c)
                    # log-probability tables are built and serialized off the event loop
                    yield sse(make()) if parsed.logprobs is None else \
                        await st.encode(make, True)
                    sent_ids, sent_text = len(c.token_ids), c.text
                yield sse("[DONE]")
            finally:
                live.remove(rid, ticket)

        def abort() -> None:
            live.remove(rid, ticket)
            loop.abort(ticket)

        return AbortingStream(events(), abort)


def response_body(engine: Engine, parsed: ParsedRequest, rid: str, prompt_tokens: int,
                  t0: float) -> Callable[..., dict[str, Any]]:
    """Chunk → SGLang's ``{"text", "output_ids", "meta_info"}`` for the request ``parsed``
    (id ``rid``, received at ``t0``). ``body(c, sent_ids, sent_text)``: only what is new
    since ``sent_ids`` tokens and ``sent_text`` were sent (SGLang's
    --incremental-streaming-output: text, output_ids and the output log-probability rows)."""
    decode = _token_decoder(engine) if parsed.return_text_in_logprobs else None

    def body(c: Chunk, sent_ids: int = 0, sent_text: str = "") -> dict[str, Any]:
        meta = meta_info(rid, prompt_tokens, c.token_ids, c.finish_reason,
                         time.perf_counter() - t0, c.error, c.matched_stop, c.output,
                         c.num_draft_tokens)
        if parsed.logprobs is not None and c.output is not None:
            meta.update(sglang_logprobs(c.output, decode, sent_ids))
        return {"text": c.text[len(sent_text):], "output_ids": c.token_ids[sent_ids:],
                "meta_info": meta}

    return body
