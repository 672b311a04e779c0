"""Request parsing and response shapes: SGLang ``/generate`` and OpenAI ``/v1/completions``.

Parsing is strict and names the offending field: malformed JSON, wrong types, unknown fields,
non-positive token budgets and empty prompts raise :class:`HTTPError` (→ HTTP 400 with
``{"error": {"message", "field", "type", "code"}}``). Checks that need the tokenizer or the model
(prompt too long, token id outside the vocabulary) happen in the engine thread at admission and
come back as the same 400, with the engine's ``prompt`` field renamed to the request's own field.

Defaults follow the upstream servers, not ``wb.SamplingParams``: SGLang ``/generate`` samples at
temperature 1.0 for up to 128 new tokens; OpenAI ``/v1/completions`` at temperature 1.0 for up to
16 tokens. Send ``temperature: 0`` for greedy decoding.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from workbench.config import SamplingParams
from workbench.core import LogprobParams, RequestOutput
from workbench.errors import RequestError, WorkbenchError

SGLANG_DEFAULT_MAX_NEW_TOKENS = 128
OPENAI_DEFAULT_MAX_TOKENS = 16


class HTTPError(WorkbenchError):
    """An error the server answers with ``status``; ``field`` names what was wrong (or None)."""

    def __init__(self, message: str, field: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.field = field
        self.status = status

    def body(self) -> dict[str, Any]:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "field": self.field, "type": kind,
                          "code": self.status}}


@dataclass(frozen=True)
class ParsedRequest:
    """One validated generation request.

    ``prompt`` is text or token ids; ``prompt_field`` is the request field it came from (errors
    the engine raises about the prompt are reported under that name).
    """

    prompt: str | list[int]
    sampling: SamplingParams
    stream: bool
    prompt_field: str
    rid: str | None = None
    include_usage: bool = False
    model: str | None = None
    logprobs: LogprobParams | None = None  # return_logprob / OpenAI logprobs
    return_text_in_logprobs: bool = False


# ---- primitive checks -----------------------------------------------------------------------


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object, or HTTPError(field="body")."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise HTTPError(f"body: malformed JSON ({e})", "body") from None
    except RecursionError:
        raise HTTPError("body: JSON nested too deeply", "body") from None
    if not isinstance(body, dict):
        raise HTTPError(f"body: expected a JSON object, got {type(body).__name__}", "body")
    return body


def _type_name(v: Any) -> str:
    return "null" if v is None else type(v).__name__


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)
            and math.isfinite(float(v)))


def _int(v: Any, field: str, lo: int | None = None) -> int:
    if not _is_int(v):
        raise HTTPError(f"{field}: expected an integer, got {_type_name(v)} {v!r}", field)
    if lo is not None and v < lo:
        raise HTTPError(f"{field}: must be >= {lo}, got {v}", field)
    return int(v)


def _number(v: Any, field: str) -> float:
    if not _is_number(v):
        raise HTTPError(f"{field}: expected a finite number, got {_type_name(v)} {v!r}", field)
    return float(v)


def _bool(v: Any, field: str) -> bool:
    if not isinstance(v, bool):
        raise HTTPError(f"{field}: expected true or false, got {_type_name(v)} {v!r}", field)
    return v


def _stop(v: Any, field: str) -> tuple[str, ...]:
    if v is None:
        return ()
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not all(isinstance(s, str) and s for s in items):
        raise HTTPError(f"{field}: expected a non-empty string or a list of them, got {v!r}",
                        field)
    for s in items:
        _utf8(s, field)
    return tuple(items)


def _utf8(s: str, field: str) -> None:
    """JSON may carry lone surrogates ("\\ud800"): not text we can tokenize or return."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise HTTPError(f"{field}: not valid Unicode text (lone surrogate at index {e.start})",
                        field) from None


def _token_ids(v: Any, field: str, allow_empty: bool = False) -> list[int]:
    if not isinstance(v, list) or not all(_is_int(t) for t in v):
        raise HTTPError(f"{field}: expected a list of integer token ids, got {_type_name(v)}",
                        field)
    if not v and not allow_empty:
        raise HTTPError(f"{field}: empty prompt", field)
    if any(t < 0 for t in v):
        raise HTTPError(f"{field}: token ids must be >= 0", field)
    return list(v)


def _check_fields(d: Mapping[str, Any], known: set[str] | frozenset[str], where: str) -> None:
    unknown = sorted(set(d) - set(known))
    if unknown:
        field = f"{where}.{unknown[0]}" if where else unknown[0]
        raise HTTPError(f"{field}: unknown field(s) {unknown}; known: {sorted(known)}", field)


def _no_op(d: Mapping[str, Any], key: str, default: Any, field: str) -> None:
    """Fields upstream clients send routinely: accepted at their default value only."""
    if key in d and d[key] is not None and d[key] != default:
        raise HTTPError(f"{field}: only {default!r} is supported, got {d[key]!r}", field)


def _sampling(kw: dict[str, Any], prefix: str, rename: Callable[[str], str]) -> SamplingParams:
    """Build SamplingParams; its RequestError ("name: message") is re-labelled with our field."""
    try:
        return SamplingParams(**kw)
    except RequestError as e:
        name, _, msg = str(e).partition(": ")
        field = rename(name) if name in kw else prefix.rstrip(".") or None
        raise HTTPError(f"{field}: {msg or e}", field) from None


# ---- SGLang /generate -------------------------------------------------------------------------

GENERATE_FIELDS = frozenset({"text", "input_ids", "sampling_params", "stream", "rid",
                             "return_logprob", "logprob_start_len", "top_logprobs_num",
                             "return_text_in_logprobs",
                             # accepted with any value, no effect here
                             "log_metrics", "no_logs", "received_time"})
# Fields SGLang 0.5.23's GenerateReqInput has (its clients send several of them routinely, e.g.
# bench_serving: lora_path null, return_routed_experts false): accepted at their neutral value
# only; anything else is a 400 naming the field.
GENERATE_NO_OPS: dict[str, Any] = {
    "lora_path": None, "lora_id": None, "return_routed_experts": False,
    "routed_experts_start_len": 0, "custom_logit_processor": None, "return_hidden_states": False,
    "token_ids_logprob": None, "return_sampling_mask": False, "sampling_logprobs_mode": None,
    "return_flat_raw_top_logprobs": False, "return_flat_raw_output_top_logprobs": False,
    "return_indexer_topk": False, "input_embeds": None, "image_data": None, "video_data": None,
    "audio_data": None, "modalities": None, "session_id": None, "session_params": None,
    "bootstrap_host": None, "bootstrap_port": None, "bootstrap_room": None,
    "bootstrap_pair_key": None, "data_parallel_rank": None, "routed_dp_rank": None,
    "priority": None, "extra_key": None, "custom_labels": None, "return_bytes": False,
    "return_entropy": False, "return_prompt_token_ids": False, "background": False,
    "require_reasoning": False, "max_thinking_tokens": None, "conversation_id": None,
    "routing_key": None, "cache_salt": None, "external_trace_header": None, "watermark": None,
}
# SGLang sampling params we implement (seed: also SGLang's ``sampling_seed``).
SGLANG_SAMPLING = frozenset({"max_new_tokens", "temperature", "top_p", "top_k", "min_p", "stop",
                             "stop_token_ids", "ignore_eos", "no_stop_trim", "seed",
                             "sampling_seed"})
# SGLang sampling params accepted at their default value only.
SGLANG_NO_OPS: dict[str, Any] = {
    "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
    "min_new_tokens": 0, "n": 1, "skip_special_tokens": True,
    "spaces_between_special_tokens": True, "json_schema": None, "regex": None, "ebnf": None,
    "structural_tag": None, "logit_bias": None, "custom_params": None, "stream_interval": None,
}


def parse_generate(body: dict[str, Any]) -> ParsedRequest:
    """Validate an SGLang ``/generate`` body (one prompt per request)."""
    _check_fields(body, GENERATE_FIELDS | set(GENERATE_NO_OPS), "")
    for key, default in GENERATE_NO_OPS.items():
        _no_op(body, key, default, key)
    has_text, has_ids = body.get("text") is not None, body.get("input_ids") is not None
    if has_text == has_ids:
        raise HTTPError("text: give exactly one of text or input_ids", "text")
    prompt: str | list[int]
    if has_text:
        field = "text"
        if isinstance(body["text"], list):
            raise HTTPError("text: batched prompts are not supported; send one request per "
                            "prompt", field)
        if not isinstance(body["text"], str):
            raise HTTPError(f"text: expected a string, got {_type_name(body['text'])}", field)
        if not body["text"]:
            raise HTTPError("text: empty prompt", field)
        _utf8(body["text"], field)
        prompt = body["text"]
    else:
        field = "input_ids"
        ids = body["input_ids"]
        if isinstance(ids, list) and ids and all(isinstance(x, list) for x in ids):
            raise HTTPError("input_ids: batched prompts are not supported; send one request "
                            "per prompt", field)
        prompt = _token_ids(ids, field)
    stream = _bool(body.get("stream", False), "stream")
    rid = body.get("rid")
    if rid is not None and not isinstance(rid, str):
        raise HTTPError(f"rid: expected a string, got {_type_name(rid)}", "rid")
    for key in ("log_metrics", "no_logs"):
        if body.get(key) is not None:
            _bool(body[key], key)
    if body.get("received_time") is not None:
        _number(body["received_time"], "received_time")
    logprobs, text_in = _sglang_logprobs(body)
    sp = body.get("sampling_params")
    if sp is None:
        sp = {}
    if not isinstance(sp, dict):
        raise HTTPError(f"sampling_params: expected an object, got {_type_name(sp)}",
                        "sampling_params")
    return ParsedRequest(prompt, parse_sglang_sampling(sp), stream, field, rid,
                         logprobs=logprobs, return_text_in_logprobs=text_in)


def _sglang_logprobs(body: dict[str, Any]) -> tuple[LogprobParams | None, bool]:
    """``return_logprob`` (+ ``top_logprobs_num``, ``logprob_start_len``): SGLang's semantics,
    start -1 (its default) = output tokens only. Without return_logprob the other two are
    ignored, as upstream."""
    want = _bool(body["return_logprob"], "return_logprob") \
        if body.get("return_logprob") is not None else False
    text_in = _bool(body["return_text_in_logprobs"], "return_text_in_logprobs") \
        if body.get("return_text_in_logprobs") is not None else False
    start = -1
    if body.get("logprob_start_len") is not None:
        start = _int(body["logprob_start_len"], "logprob_start_len", lo=-1)
    top = 0
    if body.get("top_logprobs_num") is not None:
        top = _int(body["top_logprobs_num"], "top_logprobs_num", lo=0)
    if not want:
        return None, text_in
    return LogprobParams(top_k=top, start=None if start == -1 else start), text_in


def parse_sglang_sampling(sp: dict[str, Any]) -> SamplingParams:
    """SGLang ``sampling_params`` → SamplingParams (``top_k: -1`` means off, as upstream)."""
    p = "sampling_params."
    _check_fields(sp, SGLANG_SAMPLING | set(SGLANG_NO_OPS), "sampling_params")
    for key, default in SGLANG_NO_OPS.items():
        _no_op(sp, key, default, p + key)
    kw: dict[str, Any] = {"temperature": 1.0,
                          "max_new_tokens": SGLANG_DEFAULT_MAX_NEW_TOKENS}
    if sp.get("max_new_tokens") is not None:
        kw["max_new_tokens"] = _int(sp["max_new_tokens"], p + "max_new_tokens", lo=1)
    for key in ("temperature", "top_p", "min_p"):
        if sp.get(key) is not None:
            kw[key] = _number(sp[key], p + key)
    if sp.get("top_k") is not None:
        k = _int(sp["top_k"], p + "top_k", lo=-1)
        kw["top_k"] = 0 if k == -1 else k
    if "stop" in sp:
        kw["stop"] = _stop(sp["stop"], p + "stop")
    if sp.get("stop_token_ids") is not None:
        kw["stop_token_ids"] = tuple(_token_ids(sp["stop_token_ids"], p + "stop_token_ids",
                                                allow_empty=True))
    if sp.get("ignore_eos") is not None:
        kw["ignore_eos"] = _bool(sp["ignore_eos"], p + "ignore_eos")
    if sp.get("no_stop_trim") is not None:
        kw["no_stop_trim"] = _bool(sp["no_stop_trim"], p + "no_stop_trim")
    for key in ("seed", "sampling_seed"):
        if sp.get(key) is not None:
            kw["seed"] = _int(sp[key], p + key)
    return _sampling(kw, p, lambda name: p + name)


# ---- OpenAI /v1/completions and /v1/chat/completions ------------------------------------------

# Most top-logprobs per position an OpenAI request may ask for (the legacy API allows 5, chat
# 20; vLLM and SGLang allow more: 20 keeps responses bounded).
MAX_TOP_LOGPROBS = 20
MAX_CHOICES = 16  # n, and prompts x n, per request

COMPLETIONS_FIELDS = frozenset({"model", "prompt", "max_tokens", "temperature", "top_p", "stream",
                                "stop", "seed", "stream_options", "user", "n", "echo",
                                "logprobs",
                                # extensions (SGLang and vLLM accept them too)
                                "top_k", "min_p", "ignore_eos", "stop_token_ids"})
COMPLETIONS_NO_OPS: dict[str, Any] = {"best_of": 1, "presence_penalty": 0.0,
                                      "frequency_penalty": 0.0, "suffix": None, "logit_bias": {}}
CHAT_FIELDS = frozenset({"model", "messages", "max_tokens", "max_completion_tokens",
                         "temperature", "top_p", "stream", "stop", "seed", "stream_options",
                         "user", "n", "logprobs", "top_logprobs",
                         "top_k", "min_p", "ignore_eos", "stop_token_ids"})
CHAT_NO_OPS: dict[str, Any] = {"presence_penalty": 0.0, "frequency_penalty": 0.0,
                               "logit_bias": {}, "tools": None, "tool_choice": "none",
                               "parallel_tool_calls": None, "response_format": None,
                               "functions": None, "function_call": None,
                               "reasoning_effort": None, "service_tier": None, "store": False,
                               "metadata": None, "modalities": None, "audio": None,
                               "prediction": None, "web_search_options": None}
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


@dataclass(frozen=True)
class OpenAIRequest:
    """A validated ``/v1/completions`` or ``/v1/chat/completions`` body.

    ``prompts``: completions' prompts (text or token ids; a list of prompts is a batch), or for
    chat one list of ``{"role", "content"}`` messages (text content). Choice ``i * n + j`` is
    prompt i's j-th sample (``seed + j`` when a seed is given, so the n samples differ).
    ``logprobs``: top alternatives per token (completions ``logprobs``, chat ``top_logprobs``),
    None when not asked for; ``echo``: the prompt and its logprobs come first (completions)."""

    prompts: list[Any]
    sampling: SamplingParams
    n: int
    stream: bool
    include_usage: bool
    model: str | None
    logprobs: int | None
    echo: bool
    prompt_field: str

    def choice_sampling(self, j: int) -> SamplingParams:
        sp = self.sampling
        return sp if sp.seed is None or j == 0 else dataclasses.replace(sp, seed=sp.seed + j)


def _openai_sampling(body: dict[str, Any], max_tokens_field: str) -> SamplingParams:
    kw: dict[str, Any] = {"temperature": 1.0, "max_new_tokens": OPENAI_DEFAULT_MAX_TOKENS}
    if body.get(max_tokens_field) is not None:
        kw["max_new_tokens"] = _int(body[max_tokens_field], max_tokens_field, lo=1)
    for key in ("temperature", "top_p", "min_p"):
        if body.get(key) is not None:
            kw[key] = _number(body[key], key)
    if body.get("top_k") is not None:
        k = _int(body["top_k"], "top_k", lo=-1)
        kw["top_k"] = 0 if k == -1 else k
    if "stop" in body:
        kw["stop"] = _stop(body["stop"], "stop")
    if body.get("stop_token_ids") is not None:
        kw["stop_token_ids"] = tuple(_token_ids(body["stop_token_ids"], "stop_token_ids",
                                                allow_empty=True))
    if body.get("ignore_eos") is not None:
        kw["ignore_eos"] = _bool(body["ignore_eos"], "ignore_eos")
    if body.get("seed") is not None:
        kw["seed"] = _int(body["seed"], "seed")
    rename = {"max_new_tokens": max_tokens_field}
    return _sampling(kw, "", lambda name: rename.get(name, name))


def _openai_common(body: dict[str, Any]) -> tuple[str | None, bool, bool, int]:
    """model, stream, stream_options.include_usage, n."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise HTTPError(f"model: expected a string, got {_type_name(model)}", "model")
    stream = _bool(body.get("stream", False), "stream")
    include_usage = False
    so = body.get("stream_options")
    if so is not None:
        if not isinstance(so, dict):
            raise HTTPError("stream_options: expected an object", "stream_options")
        _check_fields(so, {"include_usage", "continuous_usage_stats"}, "stream_options")
        include_usage = _bool(so.get("include_usage", False), "stream_options.include_usage")
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise HTTPError("user: expected a string", "user")
    n = 1 if body.get("n") is None else _int(body["n"], "n", lo=1)
    if n > MAX_CHOICES:
        raise HTTPError(f"n: at most {MAX_CHOICES} choices per request, got {n}", "n")
    return model, stream, include_usage, n


def _one_prompt(raw: Any, field: str) -> str | list[int]:
    if isinstance(raw, str):
        if not raw:
            raise HTTPError(f"{field}: empty prompt", field)
        _utf8(raw, field)
        return raw
    return _token_ids(raw, field)


def parse_completion(body: dict[str, Any]) -> OpenAIRequest:
    """Validate an OpenAI ``/v1/completions`` body: a prompt (text or token ids) or a list of
    them, ``n`` samples each, ``logprobs`` (top alternatives, 0-20) and ``echo``."""
    _check_fields(body, COMPLETIONS_FIELDS | set(COMPLETIONS_NO_OPS), "")
    for key, default in COMPLETIONS_NO_OPS.items():
        _no_op(body, key, default, key)
    model, stream, include_usage, n = _openai_common(body)
    if "prompt" not in body or body["prompt"] is None:
        raise HTTPError("prompt: required", "prompt")
    raw = body["prompt"]
    prompts: list[str | list[int]]
    if isinstance(raw, list) and raw and (all(isinstance(x, str) for x in raw)
                                          or all(isinstance(x, list) for x in raw)):
        prompts = [_one_prompt(x, f"prompt[{i}]" if len(raw) > 1 else "prompt")
                   for i, x in enumerate(raw)]
    elif isinstance(raw, list) and raw and any(isinstance(x, (str, list)) for x in raw):
        raise HTTPError("prompt: a list of prompts must hold only strings or only token-id "
                        "lists", "prompt")
    else:
        prompts = [_one_prompt(raw, "prompt")]
    if len(prompts) * n > MAX_CHOICES:
        raise HTTPError(f"prompt: {len(prompts)} prompts x n={n} is more than {MAX_CHOICES} "
                        "choices per request", "prompt")
    echo = False if body.get("echo") is None else _bool(body["echo"], "echo")
    logprobs = None
    if body.get("logprobs") is not None:
        logprobs = _int(body["logprobs"], "logprobs", lo=0)
        if logprobs > MAX_TOP_LOGPROBS:
            raise HTTPError(f"logprobs: at most {MAX_TOP_LOGPROBS}, got {logprobs}", "logprobs")
    return OpenAIRequest(prompts, _openai_sampling(body, "max_tokens"), n, stream, include_usage,
                         model, logprobs, echo, "prompt")


def _chat_content(v: Any, field: str) -> str:
    if isinstance(v, str):
        _utf8(v, field)
        return v
    if isinstance(v, list):
        parts = []
        for i, part in enumerate(v):
            if not isinstance(part, dict) or part.get("type") != "text" or \
                    not isinstance(part.get("text"), str):
                raise HTTPError(f"{field}[{i}]: only text parts are supported "
                                '({"type": "text", "text": ...})', f"{field}[{i}]")
            _utf8(part["text"], f"{field}[{i}]")
            parts.append(part["text"])
        return "".join(parts)
    raise HTTPError(f"{field}: expected a string or a list of text parts, got "
                    f"{_type_name(v)}", field)


def parse_chat(body: dict[str, Any]) -> OpenAIRequest:
    """Validate an OpenAI ``/v1/chat/completions`` body (text messages; ``logprobs: true`` +
    ``top_logprobs``)."""
    _check_fields(body, CHAT_FIELDS | set(CHAT_NO_OPS), "")
    for key, default in CHAT_NO_OPS.items():
        if key == "tool_choice" and body.get(key) in ("none", "auto", None) and \
                not body.get("tools"):
            continue  # no tools: "auto" means none
        _no_op(body, key, default, key)
    model, stream, include_usage, n = _openai_common(body)
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise HTTPError("messages: expected a non-empty list of messages", "messages")
    messages = []
    for i, m in enumerate(msgs):
        f = f"messages[{i}]"
        if not isinstance(m, dict):
            raise HTTPError(f"{f}: expected an object", f)
        _check_fields(m, {"role", "content", "name"}, f)
        if m.get("role") not in CHAT_ROLES:
            raise HTTPError(f"{f}.role: expected one of {sorted(CHAT_ROLES)}, got "
                            f"{m.get('role')!r}", f"{f}.role")
        messages.append({"role": m["role"], "content": _chat_content(m.get("content"),
                                                                     f"{f}.content")})
    want = False if body.get("logprobs") is None else _bool(body["logprobs"], "logprobs")
    top = 0 if body.get("top_logprobs") is None else \
        _int(body["top_logprobs"], "top_logprobs", lo=0)
    if top > MAX_TOP_LOGPROBS:
        raise HTTPError(f"top_logprobs: at most {MAX_TOP_LOGPROBS}, got {top}", "top_logprobs")
    if top and not want:
        raise HTTPError("top_logprobs: needs logprobs: true", "top_logprobs")
    field = "max_completion_tokens" if body.get("max_completion_tokens") is not None \
        else "max_tokens"
    return OpenAIRequest([messages], _openai_sampling(body, field), n, stream, include_usage,
                         model, top if want else None, False, "messages")


def admission_error(message: str, prompt_field: str) -> HTTPError:
    """An engine RequestError at admission → 400 naming the request's own field."""
    name, sep, rest = message.partition(": ")
    if sep and name == "prompt":
        return HTTPError(f"{prompt_field}: {rest}", prompt_field)
    if sep and name.isidentifier():
        return HTTPError(message, name)
    return HTTPError(message, None)


# ---- response shapes --------------------------------------------------------------------------


def sglang_finish_reason(reason: str | None, token_ids: list[int], error: str | None = None,
                         matched: int | str | None = None) -> dict[str, Any] | None:
    """SGLang's ``meta_info.finish_reason`` object: ``{"type": "length", "length": n}``,
    ``{"type": "stop", "matched": id or string}`` (the stop token id, EOS included, or the stop
    string matched), ``{"type": "abort"|"error", "message": ...}``."""
    if not reason:
        return None
    if reason == "length":
        return {"type": "length", "length": len(token_ids)}
    if reason == "stop":
        if matched is None and token_ids:
            matched = token_ids[-1]
        return {"type": "stop", "matched": matched}
    if reason == "abort":
        return {"type": "abort", "message": error or "Aborted", "status_code": None,
                "err_type": None}
    return {"type": reason, "message": error or reason}


def spec_accept_length(completion_tokens: int, verify_ct: int) -> float:
    """SGLang's per-request τ = completion_tokens / spec_verify_ct (1.0 without verify steps)."""
    return completion_tokens / verify_ct if verify_ct else 1.0


def correct_drafts_histogram(accept_lengths: list[int]) -> list[int]:
    """SGLang's ``spec_correct_drafts_histogram``: h[k] = verify rounds with k correct drafts
    (accept length k + 1), as long as the largest k seen + 1; sums to ``spec_verify_ct``."""
    h: list[int] = []
    for a in accept_lengths:
        k = a - 1
        h.extend([0] * (k + 1 - len(h)))
        h[k] += 1
    return h


def meta_info(rid: str, prompt_tokens: int, token_ids: list[int], finish: str | None,
              verify_ct: int, e2e_latency: float, error: str | None = None,
              matched: int | str | None = None, output: RequestOutput | None = None,
              ) -> dict[str, Any]:
    """SGLang 0.5.23 ``meta_info`` of one (possibly partial) response. Always: id,
    finish_reason, prompt_tokens, completion_tokens, cached_tokens (0: no prefix cache here),
    reasoning_tokens, weight_version, num_retractions (preemptions); once finished e2e_latency
    and, when the request had verify rounds, spec_verify_ct, spec_accept_length
    (completion_tokens / spec_verify_ct, the prefill's token in the numerator as upstream),
    spec_accept_rate (correct / proposed drafts), spec_num_correct_drafts (bonus excluded),
    spec_num_proposed_drafts (drafted tree nodes, = verify_ct x (N - 1)) and
    spec_correct_drafts_histogram (:func:`correct_drafts_histogram`). Streamed chunks carry no
    spec fields, as upstream."""
    n = len(token_ids)
    met = output.metrics if output is not None else None
    d: dict[str, Any] = {
        "id": rid, "finish_reason": sglang_finish_reason(finish, token_ids, error, matched),
        "prompt_tokens": prompt_tokens, "weight_version": "default",
        "num_retractions": met.preemptions if met is not None else 0,
        "reasoning_tokens": 0, "completion_tokens": n, "cached_tokens": 0}
    if finish:
        d["e2e_latency"] = e2e_latency
        if verify_ct > 0:
            d["spec_verify_ct"] = verify_ct
            d["spec_accept_length"] = spec_accept_length(n, verify_ct)
            if met is not None:
                correct = sum(met.accept_lengths) - len(met.accept_lengths)
                proposed = met.drafted_tokens
                d["spec_accept_rate"] = correct / proposed if proposed else 0.0
                d["spec_num_correct_drafts"] = correct
                d["spec_num_proposed_drafts"] = proposed
                d["spec_correct_drafts_histogram"] = correct_drafts_histogram(
                    met.accept_lengths)
    return d


LogprobEntry = list[Any]  # [logprob | None, token_id, text | None] (SGLang's tuple, as JSON)


def sglang_logprobs(output: RequestOutput, decode: Callable[[int], str] | None,
                    ) -> dict[str, Any]:
    """SGLang's logprob fields of ``meta_info`` (``return_logprob``): input_token_logprobs,
    output_token_logprobs (``[logprob, token_id, text or None]`` each; text with
    ``return_text_in_logprobs``, i.e. ``decode`` given), with ``top_logprobs_num`` also
    input_top_logprobs / output_top_logprobs (per position a list of such entries, None for the
    first prompt token, which has no context)."""
    def entry(lp: float | None, tok: int) -> LogprobEntry:
        return [lp, tok, None if decode is None else decode(tok)]

    def tops(rows: list[Any] | None) -> list[Any]:
        return [None if row is None else [entry(v, t) for t, v in row] for row in rows or []]

    start = output.logprob_start
    prompt = output.prompt_ids[start:] if start is not None else []
    d: dict[str, Any] = {
        "input_token_logprobs": [entry(lp, t) for lp, t in
                                 zip(output.input_logprobs or [], prompt, strict=False)],
        "output_token_logprobs": [entry(lp, t) for lp, t in
                                  zip(output.output_logprobs or [], output.token_ids,
                                      strict=False)],
    }
    d["output_token_logprobs_length"] = len(d["output_token_logprobs"])
    if output.output_top_logprobs is not None:
        d["input_top_logprobs"] = tops(output.input_top_logprobs)
        d["output_top_logprobs"] = tops(output.output_top_logprobs)
    return d


def openai_finish_reason(reason: str | None) -> str | None:
    """OpenAI's finish_reason strings; aborts and errors keep their own name."""
    return reason or None


def sse(payload: dict[str, Any] | str) -> bytes:
    """One server-sent event: ``data: <json>\\n\\n`` (or ``data: [DONE]\\n\\n``)."""
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n".encode()
