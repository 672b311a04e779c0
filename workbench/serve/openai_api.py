"""OpenAI routes of ``workbench serve``: ``/v1/completions`` and ``/v1/chat/completions``.

What the ``openai`` SDK and lm-eval-harness's ``local-completions`` send works:

- ``/v1/completions``: a prompt (text or token ids) or a list of them, ``n`` samples each
  (choice ``i * n + j``; with a ``seed``, sample j uses ``seed + j``), ``logprobs`` (the k most
  likely alternatives per token, 0-20) with ``echo`` (the prompt and its logprobs first, the
  prompt's first token ``None``: it has no context; ``max_tokens: 0`` scores the prompt
  alone), ``stream`` with ``stream_options.include_usage`` (a last chunk with ``usage`` and
  no choices); a prompt plus an explicit ``max_tokens`` over the context is a 400 naming both
  numbers (:func:`check_context`);
- ``/v1/chat/completions``: text messages rendered with the tokenizer's own chat template
  (``tokenizer_config.json``); a model whose tokenizer has none gets a 400 naming
  ``messages`` and the missing template. ``logprobs: true`` + ``top_logprobs``, ``n``,
  streaming (``chat.completion.chunk``: the role first, then content deltas) and usage.

Logprobs are the engine's (:class:`~workbench.core.LogprobParams`): the target's logits, the
verify logits under speculation, so they equal the baseline's.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from jinja2 import TemplateError

from workbench.core import LogprobParams, RequestOutput, TopLogprobs
from workbench.serve.frontend import (
    AbortingStream,
    AsyncSink,
    ServeState,
    check_failed,
    note,
)
from workbench.serve.loop import Chunk, Ticket
from workbench.serve.openai_protocol import OpenAIRequest, parse_chat, parse_completion
from workbench.serve.protocol import HTTPError, ParsedRequest
from workbench.serve.responses import openai_finish_reason, sse
from workbench.serve.web import FastAPI, Request, Response


class _Choice:
    """One admitted sample: its ticket, sink and prompt token count."""

    def __init__(self, index: int, ticket: Ticket, sink: AsyncSink, prompt_tokens: int) -> None:
        self.index = index
        self.ticket = ticket
        self.sink = sink
        self.prompt_tokens = prompt_tokens


def _token_text(tokenizer: Any) -> Callable[[int], str]:
    cache: dict[int, str] = {}

    def text(tok: int) -> str:
        if tok not in cache:
            cache[tok] = tokenizer.decode([tok]) if tokenizer is not None else str(tok)
        return cache[tok]
    return text


def completion_logprobs(out: RequestOutput, tok_text: Callable[[int], str], echo: bool,
                        offset0: int, first_output: int = 0,
                        with_prompt: bool | None = None) -> dict[str, Any]:
    """OpenAI's legacy ``logprobs`` object of a completion choice: ``tokens``,
    ``token_logprobs``, ``top_logprobs`` (``{token text: logprob}`` per position) and
    ``text_offset`` (characters from ``offset0``); with ``echo`` the prompt's tokens come
    first. Output tokens from index ``first_output`` on (streaming sends the rest later)."""
    tokens: list[str] = []
    lps: list[float | None] = []
    tops: list[TopLogprobs | None] = []  # rows of (token id, logprob), as the engine gives
    ids: list[int] = []

    def top(row: TopLogprobs | None) -> dict[str, float] | None:
        if row is None:
            return None
        d: dict[str, float] = {}
        for t, v in row:
            d.setdefault(tok_text(t), v)
        return d

    if echo if with_prompt is None else with_prompt:
        ids += out.prompt_ids
        lps += list(out.input_logprobs or [None] * len(out.prompt_ids))
        tops += list(out.input_top_logprobs or [[]] * len(out.prompt_ids))
    new = out.token_ids[first_output:]
    ids += new
    lps += list((out.output_logprobs or [])[first_output:first_output + len(new)])
    tops += list((out.output_top_logprobs or [[]] * len(out.token_ids))[first_output:])
    offsets, pos = [], offset0
    for t in ids:
        s = tok_text(t)
        tokens.append(s)
        offsets.append(pos)
        pos += len(s)
    return {"tokens": tokens, "token_logprobs": lps,
            "top_logprobs": [top(r) if r is not None else None for r in tops],
            "text_offset": offsets}


def chat_logprobs(out: RequestOutput, tok_text: Callable[[int], str],
                  first_output: int = 0) -> dict[str, Any]:
    """OpenAI chat's ``logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""
    def item(t: int, v: float) -> dict[str, Any]:
        s = tok_text(t)
        return {"token": s, "logprob": v, "bytes": list(s.encode("utf-8"))}

    tops = out.output_top_logprobs
    content = []
    for i, (t, v) in enumerate(zip(out.token_ids, out.output_logprobs or [], strict=False)):
        if i < first_output:
            continue
        row = tops[i] if tops is not None and i < len(tops) else []
        content.append({**item(t, v), "top_logprobs": [item(a, b) for a, b in row]})
    return {"content": content}


def check_context(prompt_tokens: int, max_tokens: int, field: str, max_model_len: int) -> None:
    """A prompt plus the budget the client asked for must fit the context (OpenAI and vLLM
    answer 400; the engine would clip the output silently)."""
    if prompt_tokens + max_tokens > max_model_len:
        raise HTTPError(f"{field}: the prompt's {prompt_tokens} tokens + {field} {max_tokens} = "
                        f"{prompt_tokens + max_tokens} tokens is more than the model's context "
                        f"(max_model_len {max_model_len}); lower {field} or shorten the prompt",
                        field)


def _delta(sent: dict[int, str], index: int, text: str) -> str:
    """The text choice ``index`` has not been sent yet (cumulative ``text``; all of it if the
    text sent before is no longer its prefix); records ``text`` as sent."""
    prev = sent.get(index, "")
    sent[index] = text
    return text[len(prev):] if text.startswith(prev) else text


def add_openai_routes(app: FastAPI, st: ServeState, name: str,
                      body_of: Callable[[Any], Any]) -> None:
    """Register /v1/completions and /v1/chat/completions on ``app`` (``st``: the server's
    shared state: tokenizer pool, admission, the engine loop; ``body_of``: its bounded JSON
    body reader)."""
    loop = st.loop
    engine = loop.engine

    async def admit_all(request: Any, req: OpenAIRequest, prompts: list[Any]) -> list[_Choice]:
        """Admit every choice (prompt i, sample j) or none: a refused one aborts the rest."""
        lp = None
        if req.logprobs is not None:
            lp = LogprobParams(top_k=req.logprobs, start=0 if req.echo else None)
        lp_field = "top_logprobs" if req.prompt_field == "messages" else "logprobs"
        choices: list[_Choice] = []
        try:
            for i, p in enumerate(prompts):
                field = f"{req.prompt_field}[{i}]" if len(prompts) > 1 else req.prompt_field
                if req.max_tokens_field is not None:
                    p = await st.tokenize(p, field)
                    check_context(len(p), req.sampling.max_new_tokens, req.max_tokens_field,
                                  st.max_model_len)
                for j in range(req.n):
                    parsed = ParsedRequest(p, req.choice_sampling(j), req.stream, field,
                                           logprobs=lp, fanout=len(prompts) * req.n,
                                           logprobs_field=lp_field)
                    ticket, sink, adm = await st.admit(parsed, request, i * req.n + j)
                    choices.append(_Choice(i * req.n + j, ticket, sink, adm.prompt_tokens))
        except BaseException:
            for c in choices:
                loop.abort(c.ticket)
            raise
        return choices

    def abort_all(choices: list[_Choice]) -> Callable[[], None]:
        def abort() -> None:
            for c in choices:
                loop.abort(c.ticket)
        return abort

    async def merged(choices: list[_Choice]) -> AsyncIterator[tuple[_Choice, Chunk]]:
        """Every choice's streamed chunks as they come (partial UTF-8 held back)."""
        q: asyncio.Queue[tuple[_Choice, Chunk] | None] = asyncio.Queue()

        async def pump(c: _Choice) -> None:
            try:
                async for chunk in st.chunks(c.ticket, c.sink):
                    await q.put((c, chunk))
            finally:
                await q.put(None)

        tasks = [asyncio.ensure_future(pump(c)) for c in choices]
        try:
            live = len(tasks)
            while live:
                item = await q.get()
                if item is None:
                    live -= 1
                    continue
                yield item
        finally:
            for t in tasks:
                t.cancel()

    def usage(req: OpenAIRequest, choices: list[_Choice], completion_tokens: int,
              ) -> dict[str, int]:
        # each prompt counts once, however many samples it has (as OpenAI counts)
        prompt_tokens = sum(c.prompt_tokens for c in choices if c.index % req.n == 0)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

    async def reply(request: Any, req: OpenAIRequest, choices: list[_Choice],
                    head: dict[str, Any], shape: Callable[[_Choice, Chunk, RequestOutput],
                                                          dict[str, Any]]) -> Any:
        """The non-streaming answer: ``head`` (id, object, created, model), every choice's
        final chunk as ``shape`` makes it, usage; 499 if the client went away first."""
        got = await st.finals(request, [(c.ticket, c.sink) for c in choices])
        if got is None:
            return Response(status_code=499)
        for chunk in got:
            check_failed(chunk)

        def build() -> dict[str, Any]:
            assert got is not None
            out_choices = []
            for c, chunk in zip(choices, got, strict=True):
                assert chunk.output is not None
                out_choices.append({"index": c.index, **shape(c, chunk, chunk.output),
                                    "finish_reason": openai_finish_reason(chunk.finish_reason)})
            return {**head, "choices": out_choices,
                    "usage": usage(req, choices, sum(len(g.token_ids) for g in got))}

        if req.logprobs is None:
            return build()
        # log-probability tables are built and serialized off the event loop
        return Response(await st.encode(build), media_type="application/json")

    def usage_event(req: OpenAIRequest, choices: list[_Choice], head: dict[str, Any],
                    done_toks: dict[int, int]) -> bytes:
        """``stream_options.include_usage``: a last chunk with usage and no choices."""
        return sse({**head, "choices": [], "usage": usage(req, choices, sum(done_toks.values()))})

    def chunk_usage(req: OpenAIRequest, c: _Choice, tokens: int) -> dict[str, Any]:
        """``continuous_usage_stats`` (vLLM's): every chunk's usage, its choice's prompt and
        the tokens generated for it so far; {} otherwise."""
        if not req.continuous_usage:
            return {}
        return {"usage": {"prompt_tokens": c.prompt_tokens, "completion_tokens": tokens,
                          "total_tokens": c.prompt_tokens + tokens}}

    def check_model(req: OpenAIRequest) -> None:
        """The ``model`` a client names must be the one served (vLLM's rule: 404), or absent:
        answers, usage and benchmark records carry the name the client sent, so a name that
        was never served must not come back on an answer."""
        if req.model is not None and req.model != name:
            raise HTTPError(f"model: the model {req.model!r} does not exist; this server serves "
                            f"{name!r} (GET /v1/models)", "model", 404)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        req = parse_completion(await body_of(request))
        check_model(req)
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
                "created": int(time.time()), "model": req.model or name}
        tok_text = _token_text(engine.tokenizer)
        choices = await admit_all(request, req, req.prompts)

        def prompt_text(out: RequestOutput, i: int) -> str:
            p = req.prompts[i // req.n]
            if isinstance(p, str):
                return p
            return engine.tokenizer.decode(out.prompt_ids) if engine.tokenizer else ""

        if not req.stream:
            def choice(c: _Choice, chunk: Chunk, out: RequestOutput) -> dict[str, Any]:
                text = prompt_text(out, c.index) if req.echo else ""
                lp = None
                if req.logprobs is not None:
                    lp = completion_logprobs(out, tok_text, req.echo,
                                             0 if req.echo else len(prompt_text(out, c.index)))
                return {"text": text + chunk.text, "logprobs": lp}

            return await reply(request, req, choices, head, choice)

        async def events() -> AsyncIterator[bytes]:
            sent_text: dict[int, str] = {}
            sent_toks: dict[int, int] = {}
            done_toks: dict[int, int] = {}
            async for c, chunk in merged(choices):
                out = chunk.output
                first = c.index not in sent_text
                delta = _delta(sent_text, c.index, chunk.text)
                text = prompt_text(out, c.index) if first and req.echo and out else ""
                if not (delta or text or chunk.finished):
                    continue
                lp = None
                if req.logprobs is not None and out is not None:
                    k = sent_toks.get(c.index, 0)
                    lp = completion_logprobs(out, tok_text, req.echo, 0, first_output=k,
                                             with_prompt=first and req.echo)
                    sent_toks[c.index] = len(out.token_ids)
                if chunk.finished:
                    done_toks[c.index] = len(chunk.token_ids)
                note(c.index, chunk)
                yield sse({**head, "choices": [{
                    "index": c.index, "text": text + delta, "logprobs": lp,
                    "finish_reason": openai_finish_reason(chunk.finish_reason)
                    if chunk.finished else None}], **chunk_usage(req, c, len(chunk.token_ids))})
            if req.include_usage:
                yield usage_event(req, choices, head, done_toks)
            yield sse("[DONE]")

        return AbortingStream(events(), abort_all(choices))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        req = parse_chat(await body_of(request))
        check_model(req)
        tokenizer = engine.tokenizer
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise HTTPError(f"messages: the model {name!r} has no chat template (no "
                            "chat_template in its tokenizer_config.json), so its messages "
                            "cannot be rendered; send a prompt to /v1/completions instead",
                            "messages")
        messages = req.prompts[0]
        chars = sum(len(m["content"]) for m in messages)
        if chars > st.max_prompt_chars:
            raise HTTPError(f"messages: {chars} characters is longer than this server accepts "
                            f"({st.max_prompt_chars})", "messages")

        def render() -> list[int]:
            try:
                text = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                     tokenize=False)
            except TemplateError as e:  # the template's raise_exception: a client error
                raise HTTPError(f"messages: the chat template refuses these messages: {e}",
                                "messages") from None
            return list(tokenizer.encode(text, add_special_tokens=False))

        ids = await asyncio.get_running_loop().run_in_executor(st.tokenizer_pool, render)
        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
                "created": int(time.time()), "model": req.model or name}
        tok_text = _token_text(tokenizer)
        choices = await admit_all(request, req, [ids])

        if not req.stream:
            def message(c: _Choice, chunk: Chunk, out: RequestOutput) -> dict[str, Any]:
                lp = None if req.logprobs is None else chat_logprobs(out, tok_text)
                return {"message": {"role": "assistant", "content": chunk.text}, "logprobs": lp}

            return await reply(request, req, choices, head, message)

        head["object"] = "chat.completion.chunk"

        def event(c: _Choice, delta: dict[str, Any], finish: str | None,
                  lp: dict[str, Any] | None = None, tokens: int = 0) -> bytes:
            return sse({**head, "choices": [{"index": c.index, "delta": delta, "logprobs": lp,
                                             "finish_reason": finish}],
                        **chunk_usage(req, c, tokens)})

        async def events() -> AsyncIterator[bytes]:
            for c in choices:
                yield event(c, {"role": "assistant", "content": ""}, None)
            sent_text: dict[int, str] = {}
            sent_toks: dict[int, int] = {}
            done_toks: dict[int, int] = {}
            async for c, chunk in merged(choices):
                delta = _delta(sent_text, c.index, chunk.text)
                if not (delta or chunk.finished):
                    continue
                lp = None
                if req.logprobs is not None and chunk.output is not None:
                    lp = chat_logprobs(chunk.output, tok_text, sent_toks.get(c.index, 0))
                    sent_toks[c.index] = len(chunk.output.token_ids)
                if chunk.finished:
                    done_toks[c.index] = len(chunk.token_ids)
                note(c.index, chunk)
                yield event(c, {"content": delta} if delta else {},
                            openai_finish_reason(chunk.finish_reason) if chunk.finished
                            else None, lp, len(chunk.token_ids))
            if req.include_usage:
                yield usage_event(req, choices, head, done_toks)
            yield sse("[DONE]")

        return AbortingStream(events(), abort_all(choices))
