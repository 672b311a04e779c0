"""Request validation of OpenAI ``/v1/completions`` and ``/v1/chat/completions`` bodies.

Strict like :mod:`workbench.serve.protocol` (whose checks it uses): a wrong field is an
:class:`~workbench.serve.protocol.HTTPError` naming it. Defaults follow OpenAI's server, not
``wb.SamplingParams``: temperature 1.0 for up to 16 tokens; send ``temperature: 0`` for greedy.
``max_tokens: 0`` with ``echo: true`` scores the prompt without generating (OpenAI's legacy API
and vLLM); without ``echo`` it is a 400.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from workbench.config import SEED_MAX, SamplingParams
from workbench.serve.protocol import (
    HTTPError,
    build_sampling,
    check_fields,
    check_no_op,
    check_utf8,
    expect_bool,
    expect_int,
    expect_number,
    logit_bias,
    stop_patterns,
    stop_strings,
    token_id_list,
    type_name,
)

OPENAI_DEFAULT_MAX_TOKENS = 16
# Most top-logprobs per position an OpenAI request may ask for (the legacy API allows 5, chat
# 20; vLLM and SGLang allow more: 20 keeps responses bounded).
MAX_TOP_LOGPROBS = 20
MAX_CHOICES = 16  # n, and prompts x n, per request

# OpenAI fields that change nothing this server computes: accepted with a value of the type
# OpenAI documents, and ignored (vLLM ignores every field it does not use; unknown names are
# still a 400 here, so a misspelt sampling field never passes silently)
IGNORED: dict[str, tuple[type, ...]] = {
    "user": (str,), "metadata": (dict,), "store": (bool,), "service_tier": (str,),
    "prompt_cache_key": (str,), "safety_identifier": (str,)}
COMPLETIONS_FIELDS = frozenset({"model", "prompt", "max_tokens", "temperature", "top_p", "stream",
                                "stop", "seed", "stream_options", "n", "echo", "logprobs",
                                "logit_bias",
                                # extensions (SGLang and vLLM accept them too)
                                "top_k", "min_p", "ignore_eos", "stop_token_ids", "stop_regex"})
COMPLETIONS_NO_OPS: dict[str, Any] = {"best_of": 1, "presence_penalty": 0.0,
                                      "frequency_penalty": 0.0, "suffix": None}
CHAT_FIELDS = frozenset({"model", "messages", "max_tokens", "max_completion_tokens",
                         "temperature", "top_p", "stream", "stop", "seed", "stream_options",
                         "n", "logprobs", "top_logprobs", "logit_bias",
                         "top_k", "min_p", "ignore_eos", "stop_token_ids", "stop_regex"})
CHAT_NO_OPS: dict[str, Any] = {"presence_penalty": 0.0, "frequency_penalty": 0.0,
                               "tools": None, "tool_choice": "none",
                               "parallel_tool_calls": None, "response_format": None,
                               "functions": None, "function_call": None,
                               "reasoning_effort": None, "modalities": None, "audio": None,
                               "prediction": None, "web_search_options": None}
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
MAX_NAME_CHARS = 64  # a message's ``name`` (OpenAI's bound)


@dataclass(frozen=True)
class OpenAIRequest:
    """A validated ``/v1/completions`` or ``/v1/chat/completions`` body.

    ``prompts``: completions' prompts (text or token ids; a list of prompts is a batch), or for
    chat one list of ``{"role", "content"}`` messages (text content). Choice ``i * n + j`` is
    prompt i's j-th sample (``seed + j`` when a seed is given, so the n samples differ).
    ``logprobs``: top alternatives per token (completions ``logprobs``, chat ``top_logprobs``),
    None when not asked for; ``echo``: the prompt and its logprobs come first (completions).
    ``max_tokens_field``: the field that set the token budget (``max_tokens`` /
    ``max_completion_tokens``), None when the default applies: a prompt plus a budget the
    client set that overruns the context is a 400 naming both numbers (as OpenAI and vLLM), a
    default budget is clipped to the context."""

    prompts: list[Any]
    sampling: SamplingParams
    n: int
    stream: bool
    include_usage: bool
    model: str | None
    logprobs: int | None
    echo: bool
    prompt_field: str
    max_tokens_field: str | None = None
    continuous_usage: bool = False  # stream_options.continuous_usage_stats (vLLM's)

    def __post_init__(self) -> None:
        seed = self.sampling.seed
        if seed is not None and seed + self.n - 1 > SEED_MAX:
            raise HTTPError(f"seed: choice j samples with seed + j, so with n={self.n} the seed "
                            f"must be at most 2**64 - {self.n}, got {seed}", "seed")

    def choice_sampling(self, j: int) -> SamplingParams:
        sp = self.sampling
        return sp if sp.seed is None or j == 0 else dataclasses.replace(sp, seed=sp.seed + j)


def _openai_sampling(body: dict[str, Any], max_tokens_field: str,
                     min_tokens: int = 1) -> SamplingParams:
    kw: dict[str, Any] = {"temperature": 1.0, "max_new_tokens": OPENAI_DEFAULT_MAX_TOKENS}
    if body.get(max_tokens_field) is not None:
        kw["max_new_tokens"] = expect_int(body[max_tokens_field], max_tokens_field,
                                          lo=min_tokens)
    for key in ("temperature", "top_p", "min_p"):
        if body.get(key) is not None:
            kw[key] = expect_number(body[key], key)
    if body.get("top_k") is not None:
        k = expect_int(body["top_k"], "top_k", lo=-1)
        kw["top_k"] = 0 if k == -1 else k
    if "stop" in body:
        kw["stop"] = stop_strings(body["stop"], "stop")
    if "stop_regex" in body:  # SGLang's extension
        kw["stop_regex"] = stop_patterns(body["stop_regex"], "stop_regex")
    if body.get("stop_token_ids") is not None:
        kw["stop_token_ids"] = tuple(token_id_list(body["stop_token_ids"], "stop_token_ids",
                                                allow_empty=True))
    if body.get("ignore_eos") is not None:
        kw["ignore_eos"] = expect_bool(body["ignore_eos"], "ignore_eos")
    if body.get("seed") is not None:
        kw["seed"] = expect_int(body["seed"], "seed")
    if body.get("logit_bias") is not None:
        kw["logit_bias"] = logit_bias(body["logit_bias"], "logit_bias")
    rename = {"max_new_tokens": max_tokens_field}
    return build_sampling(kw, "", lambda name: rename.get(name, name))


def _openai_common(body: dict[str, Any]) -> tuple[str | None, bool, bool, bool, int]:
    """model, stream, stream_options.include_usage, its continuous_usage_stats, n.

    ``stream_options`` only with ``stream: true`` (OpenAI and vLLM answer 400 otherwise);
    ``continuous_usage_stats`` (vLLM's) puts usage in every chunk, with ``include_usage``
    only (as vLLM). The :data:`IGNORED` fields are checked for their type only."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise HTTPError(f"model: expected a string, got {type_name(model)}", "model")
    stream = expect_bool(body.get("stream", False), "stream")
    include_usage = continuous = False
    so = body.get("stream_options")
    if so is not None:
        if not stream:
            raise HTTPError("stream_options: only allowed with stream: true", "stream_options")
        if not isinstance(so, dict):
            raise HTTPError("stream_options: expected an object", "stream_options")
        check_fields(so, {"include_usage", "continuous_usage_stats"}, "stream_options")
        if so.get("include_usage") is not None:
            include_usage = expect_bool(so["include_usage"], "stream_options.include_usage")
        if so.get("continuous_usage_stats") is not None:
            continuous = include_usage and expect_bool(
                so["continuous_usage_stats"], "stream_options.continuous_usage_stats")
    for key, types in IGNORED.items():
        v = body.get(key)
        if v is not None and (not isinstance(v, types) or isinstance(v, bool) != (bool in types)):
            raise HTTPError(f"{key}: expected {' or '.join(t.__name__ for t in types)}, got "
                            f"{type_name(v)}", key)
    n = 1 if body.get("n") is None else expect_int(body["n"], "n", lo=1)
    if n > MAX_CHOICES:
        raise HTTPError(f"n: at most {MAX_CHOICES} choices per request, got {n}", "n")
    return model, stream, include_usage, continuous, n


def _one_prompt(raw: Any, field: str) -> str | list[int]:
    if isinstance(raw, str):
        if not raw:
            raise HTTPError(f"{field}: empty prompt", field)
        check_utf8(raw, field)
        return raw
    return token_id_list(raw, field)


def parse_completion(body: dict[str, Any]) -> OpenAIRequest:
    """Validate an OpenAI ``/v1/completions`` body: a prompt (text or token ids) or a list of
    them, ``n`` samples each, ``logprobs`` (top alternatives, 0-20) and ``echo``."""
    check_fields(body, COMPLETIONS_FIELDS | set(COMPLETIONS_NO_OPS) | set(IGNORED), "")
    for key, default in COMPLETIONS_NO_OPS.items():
        check_no_op(body, key, default, key)
    model, stream, include_usage, continuous, n = _openai_common(body)
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
    echo = False if body.get("echo") is None else expect_bool(body["echo"], "echo")
    logprobs = None
    if body.get("logprobs") is not None:
        logprobs = expect_int(body["logprobs"], "logprobs", lo=0)
        if logprobs > MAX_TOP_LOGPROBS:
            raise HTTPError(f"logprobs: at most {MAX_TOP_LOGPROBS}, got {logprobs}", "logprobs")
    sampling = _openai_sampling(body, "max_tokens", min_tokens=0)
    if sampling.max_new_tokens == 0 and not echo:
        raise HTTPError("max_tokens: 0 generates nothing; it scores the prompt only with "
                        "echo: true (with logprobs for the scores)", "max_tokens")
    return OpenAIRequest(prompts, sampling, n, stream, include_usage, model, logprobs, echo,
                         "prompt", "max_tokens" if body.get("max_tokens") is not None else None,
                         continuous)


def _chat_content(v: Any, field: str) -> str:
    if isinstance(v, str):
        check_utf8(v, field)
        return v
    if isinstance(v, list):
        parts = []
        for i, part in enumerate(v):
            f = f"{field}[{i}]"
            if not isinstance(part, dict):
                raise HTTPError(f'{f}: expected a text part ({{"type": "text", "text": ...}}), '
                                f"got {type_name(part)}", f)
            kind = part.get("type")
            if not isinstance(kind, str) or kind != "text":
                shown = repr(kind) if isinstance(kind, str) else type_name(kind)
                raise HTTPError(f"{f}.type: only text parts are supported, got {shown}",
                                f"{f}.type")
            check_fields(part, {"type", "text"}, f)
            if not isinstance(part.get("text"), str):
                raise HTTPError(f"{f}.text: expected a string, got {type_name(part.get('text'))}",
                                f"{f}.text")
            check_utf8(part["text"], f"{f}.text")
            parts.append(part["text"])
        return "".join(parts)
    raise HTTPError(f"{field}: expected a string or a list of text parts, got "
                    f"{type_name(v)}", field)


def _check_name(m: dict[str, Any], field: str) -> None:
    """A message's ``name`` (the participant's, which the template may not show): a non-empty
    string of at most :data:`MAX_NAME_CHARS` characters, as OpenAI."""
    name = m.get("name")
    if name is None:
        return
    if not isinstance(name, str):
        raise HTTPError(f"{field}: expected a string, got {type_name(name)}", field)
    if not 1 <= len(name) <= MAX_NAME_CHARS:
        raise HTTPError(f"{field}: 1 to {MAX_NAME_CHARS} characters, got {len(name)}", field)
    check_utf8(name, field)


def parse_chat(body: dict[str, Any]) -> OpenAIRequest:
    """Validate an OpenAI ``/v1/chat/completions`` body (text messages; ``logprobs: true`` +
    ``top_logprobs``)."""
    check_fields(body, CHAT_FIELDS | set(CHAT_NO_OPS) | set(IGNORED), "")
    for key, default in CHAT_NO_OPS.items():
        if key == "tool_choice" and body.get(key) in ("none", "auto", None) and \
                not body.get("tools"):
            continue  # no tools: "auto" means none
        check_no_op(body, key, default, key)
    model, stream, include_usage, continuous, n = _openai_common(body)
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise HTTPError("messages: expected a non-empty list of messages", "messages")
    messages = []
    for i, m in enumerate(msgs):
        f = f"messages[{i}]"
        if not isinstance(m, dict):
            raise HTTPError(f"{f}: expected an object", f)
        check_fields(m, {"role", "content", "name"}, f)
        role = m.get("role")
        if not isinstance(role, str) or role not in CHAT_ROLES:
            shown = repr(role) if isinstance(role, str) else type_name(role)
            raise HTTPError(f"{f}.role: expected one of {sorted(CHAT_ROLES)}, got {shown}",
                            f"{f}.role")
        _check_name(m, f"{f}.name")
        messages.append({"role": m["role"], "content": _chat_content(m.get("content"),
                                                                     f"{f}.content")})
    want = False if body.get("logprobs") is None else expect_bool(body["logprobs"], "logprobs")
    top = 0 if body.get("top_logprobs") is None else \
        expect_int(body["top_logprobs"], "top_logprobs", lo=0)
    if top > MAX_TOP_LOGPROBS:
        raise HTTPError(f"top_logprobs: at most {MAX_TOP_LOGPROBS}, got {top}", "top_logprobs")
    if top and not want:
        raise HTTPError("top_logprobs: needs logprobs: true", "top_logprobs")
    field = "max_completion_tokens" if body.get("max_completion_tokens") is not None \
        else "max_tokens"
    return OpenAIRequest([messages], _openai_sampling(body, field), n, stream, include_usage,
                         model, top if want else None, False, "messages",
                         field if body.get(field) is not None else None, continuous)
