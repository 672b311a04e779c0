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

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from workbench.config import SamplingParams
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
                             "return_logprob"})
# SGLang sampling params we implement (seed: also SGLang's ``sampling_seed``).
SGLANG_SAMPLING = frozenset({"max_new_tokens", "temperature", "top_p", "top_k", "min_p", "stop",
                             "stop_token_ids", "ignore_eos", "no_stop_trim", "seed",
                             "sampling_seed"})
# SGLang sampling params accepted at their default value only.
SGLANG_NO_OPS: dict[str, Any] = {
    "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
    "min_new_tokens": 0, "n": 1, "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
}


def parse_generate(body: dict[str, Any]) -> ParsedRequest:
    """Validate an SGLang ``/generate`` body (one prompt per request)."""
    _check_fields(body, GENERATE_FIELDS, "")
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
    if body.get("return_logprob") not in (None, False):
        raise HTTPError("return_logprob: logprobs are not supported", "return_logprob")
    sp = body.get("sampling_params")
    if sp is None:
        sp = {}
    if not isinstance(sp, dict):
        raise HTTPError(f"sampling_params: expected an object, got {_type_name(sp)}",
                        "sampling_params")
    return ParsedRequest(prompt, parse_sglang_sampling(sp), stream, field, rid)


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


# ---- OpenAI /v1/completions -------------------------------------------------------------------

COMPLETIONS_FIELDS = frozenset({"model", "prompt", "max_tokens", "temperature", "top_p", "stream",
                                "stop", "seed", "stream_options", "user",
                                # extensions (SGLang and vLLM accept them too)
                                "top_k", "min_p", "ignore_eos", "stop_token_ids"})
COMPLETIONS_NO_OPS: dict[str, Any] = {"n": 1, "best_of": 1, "echo": False, "logprobs": None,
                                      "presence_penalty": 0.0, "frequency_penalty": 0.0,
                                      "suffix": None, "logit_bias": {}}


def parse_completion(body: dict[str, Any]) -> ParsedRequest:
    """Validate an OpenAI ``/v1/completions`` body (one prompt; ``n`` = 1)."""
    _check_fields(body, COMPLETIONS_FIELDS | set(COMPLETIONS_NO_OPS), "")
    for key, default in COMPLETIONS_NO_OPS.items():
        _no_op(body, key, default, key)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise HTTPError(f"model: expected a string, got {_type_name(model)}", "model")
    if "prompt" not in body or body["prompt"] is None:
        raise HTTPError("prompt: required", "prompt")
    raw = body["prompt"]
    prompt: str | list[int]
    if isinstance(raw, list) and len(raw) == 1 and isinstance(raw[0], (str, list)):
        raw = raw[0]  # a batch of one
    if isinstance(raw, str):
        if not raw:
            raise HTTPError("prompt: empty prompt", "prompt")
        _utf8(raw, "prompt")
        prompt = raw
    elif isinstance(raw, list) and raw and all(isinstance(x, (str, list)) for x in raw):
        raise HTTPError("prompt: batched prompts are not supported; send one request per prompt",
                        "prompt")
    else:
        prompt = _token_ids(raw, "prompt")
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
    kw: dict[str, Any] = {"temperature": 1.0, "max_new_tokens": OPENAI_DEFAULT_MAX_TOKENS}
    if body.get("max_tokens") is not None:
        kw["max_new_tokens"] = _int(body["max_tokens"], "max_tokens", lo=1)
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
    rename = {"max_new_tokens": "max_tokens"}
    sampling = _sampling(kw, "", lambda name: rename.get(name, name))
    return ParsedRequest(prompt, sampling, stream, "prompt", None, include_usage, model)


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
    return {"type": reason, "message": error or reason}


def spec_accept_length(completion_tokens: int, verify_ct: int) -> float:
    """SGLang's per-request τ = completion_tokens / spec_verify_ct (1.0 without verify steps)."""
    return completion_tokens / verify_ct if verify_ct else 1.0


def meta_info(rid: str, prompt_tokens: int, token_ids: list[int], finish: str | None,
              verify_ct: int, e2e_latency: float, error: str | None = None,
              matched: int | str | None = None) -> dict[str, Any]:
    """SGLang ``meta_info`` of one (possibly partial) response."""
    n = len(token_ids)
    return {"id": rid, "prompt_tokens": prompt_tokens, "completion_tokens": n,
            "finish_reason": sglang_finish_reason(finish, token_ids, error, matched),
            "spec_verify_ct": verify_ct, "spec_accept_length": spec_accept_length(n, verify_ct),
            "e2e_latency": e2e_latency}


def openai_finish_reason(reason: str | None) -> str | None:
    """OpenAI's finish_reason strings; aborts and errors keep their own name."""
    return reason or None


def sse(payload: dict[str, Any] | str) -> bytes:
    """One server-sent event: ``data: <json>\\n\\n`` (or ``data: [DONE]\\n\\n``)."""
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n".encode()
