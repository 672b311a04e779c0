"""Request validation: SGLang ``/generate`` bodies, and the checks every request parser shares.

Parsing is strict and names the offending field: malformed JSON, wrong types, unknown fields,
non-positive token budgets and empty prompts raise :class:`HTTPError` (→ HTTP 400 with
``{"error": {"message", "field", "type", "code"}}``). Checks that need the tokenizer or the model
(prompt too long, token id outside the vocabulary) happen in the engine thread at admission and
come back as the same 400 (:func:`admission_error`), with the engine's ``prompt`` field renamed
to the request's own field. OpenAI bodies: :mod:`workbench.serve.openai_protocol`; response
shapes: :mod:`workbench.serve.responses`.

Defaults follow the upstream servers, not ``wb.SamplingParams``: SGLang ``/generate`` samples at
temperature 1.0 for up to 128 new tokens (OpenAI: :mod:`~workbench.serve.openai_protocol`).
Send ``temperature: 0`` for greedy decoding.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from workbench.config import SamplingParams
from workbench.core import LogprobParams
from workbench.errors import RequestError, WorkbenchError

SGLANG_DEFAULT_MAX_NEW_TOKENS = 128
# Most alternatives per position a /generate request may ask for (``top_logprobs_num``;
# SGLang clips to the vocabulary, vLLM refuses above its ``max_logprobs``): above it a 400,
# not a silent clip. The log-probability budget (limits.py) still bounds the whole answer.
MAX_TOP_LOGPROBS_NUM = 1024


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
    fanout: int = 1  # choices of the HTTP request it belongs to (OpenAI: prompts x n)
    cumulative: bool = False  # a stream whose every chunk repeats the whole answer so far
    logprobs_field: str | None = None  # the field a log-probability budget error names
    bias_field: str = "logit_bias"  # the field an out-of-vocabulary logit_bias error names


# ---- primitive checks -----------------------------------------------------------------------


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object, or HTTPError(field="body")."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise HTTPError(f"body: malformed JSON ({e})", "body") from None
    except RecursionError:
        raise HTTPError("body: JSON nested too deeply", "body") from None
    except ValueError as e:  # an integer longer than Python converts (sys.int_info)
        raise HTTPError(f"body: a number in the JSON is out of range ({e})", "body") from None
    if not isinstance(body, dict):
        raise HTTPError(f"body: expected a JSON object, got {type(body).__name__}", "body")
    return body


def type_name(v: Any) -> str:
    return "null" if v is None else type(v).__name__


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)
            and math.isfinite(float(v)))


def expect_int(v: Any, field: str, lo: int | None = None) -> int:
    if not is_int(v):
        raise HTTPError(f"{field}: expected an integer, got {type_name(v)} {v!r}", field)
    if lo is not None and v < lo:
        raise HTTPError(f"{field}: must be >= {lo}, got {v}", field)
    return int(v)


def expect_number(v: Any, field: str) -> float:
    if not is_number(v):
        raise HTTPError(f"{field}: expected a finite number, got {type_name(v)} {v!r}", field)
    return float(v)


def expect_bool(v: Any, field: str) -> bool:
    if not isinstance(v, bool):
        raise HTTPError(f"{field}: expected true or false, got {type_name(v)} {v!r}", field)
    return v


# What one request's stop strings may cost (the automaton that matches them is built per
# request; a stream holds back up to the longest one per chunk: engine/stops.py)
MAX_STOP_STRINGS = 128
MAX_STOP_CHARS = 4096  # all of a request's stop strings together


def stop_strings(v: Any, field: str) -> tuple[str, ...]:
    if v is None:
        return ()
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not all(isinstance(s, str) and s for s in items):
        raise HTTPError(f"{field}: expected a non-empty string or a list of them, got "
                        f"{type_name(v)}", field)
    if len(items) > MAX_STOP_STRINGS:
        raise HTTPError(f"{field}: at most {MAX_STOP_STRINGS} stop strings per request, got "
                        f"{len(items)}", field)
    total = sum(len(s) for s in items)
    if total > MAX_STOP_CHARS:
        raise HTTPError(f"{field}: the stop strings have {total} characters in all; at most "
                        f"{MAX_STOP_CHARS} per request", field)
    for s in items:
        check_utf8(s, field)
    return tuple(items)


def stop_patterns(v: Any, field: str) -> tuple[str, ...]:
    """``stop_regex``: a pattern or a list of them (null or [] for none); the patterns
    themselves are checked by SamplingParams (RE2 syntax, count and size bounds)."""
    if v is None:
        return ()
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not all(isinstance(s, str) and s for s in items):
        raise HTTPError(f"{field}: expected a non-empty pattern or a list of them, got "
                        f"{type_name(v)}", field)
    for s in items:
        check_utf8(s, field)
    return tuple(items)


def logit_bias(v: Any, field: str) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``logit_bias``: ``{"<token id>": bias}``, each bias a number in [-100, 100]
    (token ids beyond the vocabulary are refused at admission, naming ``field``)."""
    if v is None:
        return ()
    if not isinstance(v, dict):
        raise HTTPError(f"{field}: expected an object mapping token ids to biases, got "
                        f"{type_name(v)}", field)
    out = []
    for k, b in v.items():
        f = f"{field}[{k!r}]"
        if not (isinstance(k, str) and k.isascii() and k.isdigit()) or len(k) > 12:
            raise HTTPError(f"{f}: keys are token ids (decimal integers >= 0), got {k!r}", field)
        if not is_number(b) or not -100 <= b <= 100:
            raise HTTPError(f"{f}: a bias is a number in [-100, 100], got {b!r}", field)
        out.append((int(k), float(b)))
    return tuple(out)


# The regular expressions SGLang's frontend sends for sgl.gen(dtype=...) (sglang/lang/ir.py)
SGLANG_DTYPE_REGEX = {r"[-+]?[0-9]+[ \n]*": "int", r"[-+]?[0-9]*\.?[0-9]+[ \n]*": "float",
                      r"(True|False)": "bool", r"\"[\w\d\s]*\"": "str"}
CONSTRAINTS = ("regex", "json_schema", "ebnf", "structural_tag")


def check_no_constraint(sp: Mapping[str, Any], prefix: str) -> None:
    """Constrained decoding is not offered: a 400 that names what the client asked for (for
    ``sgl.gen(dtype=...)``, the dtype, not the pattern its frontend made of it)."""
    for key in CONSTRAINTS:
        v = sp.get(key)
        if v is None:
            continue
        dtype = SGLANG_DTYPE_REGEX.get(v) if key == "regex" and isinstance(v, str) else None
        if dtype is not None:
            raise HTTPError(f"{prefix}{key}: sgl.gen(dtype={dtype}) asks for constrained "
                            f"decoding (output of type {dtype}), which this server does not "
                            "offer; generate without dtype and parse the text (stop or "
                            "stop_regex end it where you choose)", prefix + key)
        raise HTTPError(f"{prefix}{key}: constrained decoding ({', '.join(CONSTRAINTS)}) is not "
                        "offered by this server; use stop or stop_regex to end the output",
                        prefix + key)


def check_utf8(s: str, field: str) -> None:
    """JSON may carry lone surrogates ("\\ud800"): not text we can tokenize or return."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise HTTPError(f"{field}: not valid Unicode text (lone surrogate at index {e.start})",
                        field) from None


def token_id_list(v: Any, field: str, allow_empty: bool = False) -> list[int]:
    if not isinstance(v, list) or not all(is_int(t) for t in v):
        raise HTTPError(f"{field}: expected a list of integer token ids, got {type_name(v)}",
                        field)
    if not v and not allow_empty:
        raise HTTPError(f"{field}: empty prompt", field)
    if any(t < 0 for t in v):
        raise HTTPError(f"{field}: token ids must be >= 0", field)
    return list(v)


def check_fields(d: Mapping[str, Any], known: set[str] | frozenset[str], where: str) -> None:
    unknown = sorted(set(d) - set(known))
    if unknown:
        field = f"{where}.{unknown[0]}" if where else unknown[0]
        raise HTTPError(f"{field}: unknown field(s) {unknown}; known: {sorted(known)}", field)


def check_no_op(d: Mapping[str, Any], key: str, default: Any, field: str) -> None:
    """Fields upstream clients send routinely: accepted at their default value only."""
    if key in d and d[key] is not None and d[key] != default:
        raise HTTPError(f"{field}: only {default!r} is supported, got {d[key]!r}", field)


def build_sampling(kw: dict[str, Any], prefix: str, rename: Callable[[str], str]) -> SamplingParams:
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
                             "stop_token_ids", "stop_regex", "ignore_eos", "no_stop_trim",
                             "seed", "sampling_seed", "logit_bias"})
# SGLang sampling params accepted at their default value only.
SGLANG_NO_OPS: dict[str, Any] = {
    "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
    "min_new_tokens": 0, "n": 1, "skip_special_tokens": True,
    "spaces_between_special_tokens": True, "custom_params": None, "stream_interval": None,
}
# refused with a message naming what was asked for (check_no_constraint)
SGLANG_CONSTRAINTS = frozenset(CONSTRAINTS)


def parse_generate(body: dict[str, Any]) -> ParsedRequest:
    """Validate an SGLang ``/generate`` body (one prompt per request)."""
    check_fields(body, GENERATE_FIELDS | set(GENERATE_NO_OPS), "")
    for key, default in GENERATE_NO_OPS.items():
        check_no_op(body, key, default, key)
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
            raise HTTPError(f"text: expected a string, got {type_name(body['text'])}", field)
        if not body["text"]:
            raise HTTPError("text: empty prompt", field)
        check_utf8(body["text"], field)
        prompt = body["text"]
    else:
        field = "input_ids"
        ids = body["input_ids"]
        if isinstance(ids, list) and ids and all(isinstance(x, list) for x in ids):
            raise HTTPError("input_ids: batched prompts are not supported; send one request "
                            "per prompt", field)
        prompt = token_id_list(ids, field)
    stream = expect_bool(body.get("stream", False), "stream")
    rid = body.get("rid")
    if rid is not None and not isinstance(rid, str):
        raise HTTPError(f"rid: expected a string, got {type_name(rid)}", "rid")
    for key in ("log_metrics", "no_logs"):
        if body.get(key) is not None:
            expect_bool(body[key], key)
    if body.get("received_time") is not None:
        expect_number(body["received_time"], "received_time")
    logprobs, text_in = _sglang_logprobs(body)
    sp = body.get("sampling_params")
    if sp is None:
        sp = {}
    if not isinstance(sp, dict):
        raise HTTPError(f"sampling_params: expected an object, got {type_name(sp)}",
                        "sampling_params")
    sampling = parse_sglang_sampling(sp)
    if stream and sampling.max_new_tokens == 0:
        raise HTTPError("sampling_params.max_new_tokens: 0 (prefill only) produces no tokens to "
                        "stream; send stream: false", "sampling_params.max_new_tokens")
    return ParsedRequest(prompt, sampling, stream, field, rid,
                         logprobs=logprobs, return_text_in_logprobs=text_in,
                         bias_field="sampling_params.logit_bias")


def _sglang_logprobs(body: dict[str, Any]) -> tuple[LogprobParams | None, bool]:
    """``return_logprob`` (+ ``top_logprobs_num``, ``logprob_start_len``): SGLang's semantics,
    start -1 (its default) = output tokens only. Without return_logprob the other two are
    ignored, as upstream."""
    want = expect_bool(body["return_logprob"], "return_logprob") \
        if body.get("return_logprob") is not None else False
    text_in = expect_bool(body["return_text_in_logprobs"], "return_text_in_logprobs") \
        if body.get("return_text_in_logprobs") is not None else False
    start = -1
    if body.get("logprob_start_len") is not None:
        start = expect_int(body["logprob_start_len"], "logprob_start_len", lo=-1)
    top = 0
    if body.get("top_logprobs_num") is not None:
        top = expect_int(body["top_logprobs_num"], "top_logprobs_num", lo=0)
        if top > MAX_TOP_LOGPROBS_NUM:
            raise HTTPError(f"top_logprobs_num: at most {MAX_TOP_LOGPROBS_NUM} alternatives per "
                            f"position, got {top}", "top_logprobs_num")
    if not want:
        return None, text_in
    return LogprobParams(top_k=top, start=None if start == -1 else start), text_in


def parse_sglang_sampling(sp: dict[str, Any]) -> SamplingParams:
    """SGLang ``sampling_params`` → SamplingParams (``top_k: -1`` means off, as upstream)."""
    p = "sampling_params."
    check_fields(sp, SGLANG_SAMPLING | set(SGLANG_NO_OPS) | SGLANG_CONSTRAINTS, "sampling_params")
    for key, default in SGLANG_NO_OPS.items():
        check_no_op(sp, key, default, p + key)
    check_no_constraint(sp, p)
    kw: dict[str, Any] = {"temperature": 1.0,
                          "max_new_tokens": SGLANG_DEFAULT_MAX_NEW_TOKENS}
    if sp.get("max_new_tokens") is not None:
        kw["max_new_tokens"] = expect_int(sp["max_new_tokens"], p + "max_new_tokens", lo=0)
    for key in ("temperature", "top_p", "min_p"):
        if sp.get(key) is not None:
            kw[key] = expect_number(sp[key], p + key)
    if sp.get("top_k") is not None:
        k = expect_int(sp["top_k"], p + "top_k", lo=-1)
        kw["top_k"] = 0 if k == -1 else k
    if "stop" in sp:
        kw["stop"] = stop_strings(sp["stop"], p + "stop")
    if "stop_regex" in sp:  # SGLang's frontend always sends it (an empty list when unused)
        kw["stop_regex"] = stop_patterns(sp["stop_regex"], p + "stop_regex")
    if sp.get("stop_token_ids") is not None:
        kw["stop_token_ids"] = tuple(token_id_list(sp["stop_token_ids"], p + "stop_token_ids",
                                                allow_empty=True))
    if sp.get("ignore_eos") is not None:
        kw["ignore_eos"] = expect_bool(sp["ignore_eos"], p + "ignore_eos")
    if sp.get("no_stop_trim") is not None:
        kw["no_stop_trim"] = expect_bool(sp["no_stop_trim"], p + "no_stop_trim")
    for key in ("seed", "sampling_seed"):
        if sp.get(key) is not None:
            kw["seed"] = expect_int(sp[key], p + key)
    if sp.get("logit_bias") is not None:
        kw["logit_bias"] = logit_bias(sp["logit_bias"], p + "logit_bias")
    return build_sampling(kw, p, lambda name: p + name)


# ---- admission ------------------------------------------------------------------------------


def admission_error(message: str, prompt_field: str) -> HTTPError:
    """An engine RequestError at admission → 400 naming the request's own field."""
    name, sep, rest = message.partition(": ")
    if sep and name == "prompt":
        return HTTPError(f"{prompt_field}: {rest}", prompt_field)
    if sep and name.isidentifier():
        return HTTPError(message, name)
    return HTTPError(message, None)

