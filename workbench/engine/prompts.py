"""Prompts → token ids (text, token ids or chat messages) → requests; errors name the field."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from workbench.config import SamplingParams
from workbench.core import LogprobParams, Request
from workbench.errors import RequestError
from workbench.sampler import make_generator

Prompt = str | Sequence[int] | Sequence[dict[str, str]]


def tokenize(tokenizer: Any, vocab_size: int, prompt: Prompt, field: str = "prompt") -> list[int]:
    """Text, token ids or chat messages → token ids; RequestError naming ``field``."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise RequestError(f"{field}: text given but the model folder has no tokenizer")
        if not prompt:
            raise RequestError(f"{field}: empty prompt")
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as e:
            raise RequestError(f"{field}: not valid Unicode text (lone surrogate at index "
                               f"{e.start})") from None
        return list(tokenizer.encode(prompt, add_special_tokens=False))
    if not isinstance(prompt, Sequence) or isinstance(prompt, (bytes, bytearray)):
        raise RequestError(f"{field}: expected text, a list of token ids or a list of chat "
                           f"messages, got {type(prompt).__name__}")
    items = list(prompt)
    if items and all(isinstance(m, dict) for m in items):
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise RequestError(f"{field}: chat messages given but the tokenizer has no chat "
                               "template")
        from jinja2 import TemplateError

        try:
            # rendered, then encoded as the server's chat endpoint does (tokenize=True returns
            # a BatchEncoding in transformers 5, whose list is its keys)
            text = tokenizer.apply_chat_template(items, add_generation_prompt=True,
                                                 tokenize=False)
        except TemplateError as e:  # the template's raise_exception: these messages refused
            raise RequestError(f"{field}: the chat template refuses these messages: {e}"
                               ) from None
        return list(tokenizer.encode(text, add_special_tokens=False))
    if not items:
        raise RequestError(f"{field}: empty prompt")
    for t in items:
        if not isinstance(t, int) or isinstance(t, bool):
            raise RequestError(f"{field}: token ids must be integers, got {t!r}")
        if not 0 <= t < vocab_size:
            raise RequestError(f"{field}: token id {t} outside the vocabulary [0, {vocab_size})")
    return items  # type: ignore[return-value]  # every item checked to be an int above


def check_params(sampling: object, logprobs: object) -> SamplingParams:
    """The request's sampling parameters (default ones for None), type-checked with its
    log-probability parameters."""
    sp = sampling or SamplingParams()
    if not isinstance(sp, SamplingParams):
        raise RequestError(f"sampling: expected SamplingParams, got {type(sp).__name__}")
    if logprobs is not None and not isinstance(logprobs, LogprobParams):
        raise RequestError(f"logprobs: expected LogprobParams, got {type(logprobs).__name__}")
    return sp


def check_prompt(ids: list[int], logprobs: LogprobParams | None, max_model_len: int,
                 capacity: int) -> None:
    """A prompt the engine can run: inside the context and the KV pool (``capacity`` tokens)."""
    if logprobs is not None and logprobs.start is not None and logprobs.start > len(ids):
        raise RequestError(f"logprob_start_len: {logprobs.start} is beyond the prompt "
                           f"({len(ids)} tokens)")
    if len(ids) >= max_model_len:
        raise RequestError(f"prompt: {len(ids)} tokens does not fit the context "
                           f"(max_model_len {max_model_len})")
    if len(ids) + 1 > capacity:
        raise RequestError(f"prompt: {len(ids)} tokens exceeds the KV pool ({capacity} tokens)")


def new_request(rid: int, ids: list[int], sp: SamplingParams,
                logprobs: LogprobParams | None) -> Request:
    req = Request(rid=rid, prompt_ids=ids, sampling=sp, logprobs=logprobs)
    if logprobs is not None and logprobs.start == 0 and ids:
        req.input_logprobs.append(None)  # the first prompt token has no context
        req.input_top_logprobs.append(None)
    req.generator = make_generator(sp, fallback_seed=rid)
    return req


def prompt_batch(prompts: Prompt | Sequence[Prompt],
                 sampling: SamplingParams | Sequence[SamplingParams] | None
                 ) -> tuple[list[Prompt], list[SamplingParams | None]]:
    """``Engine.generate``'s arguments as one prompt list and one sampling list (checked)."""
    if isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts and
                                    isinstance(prompts[0], int)):
        prompts = [prompts]  # type: ignore[list-item,assignment]
    if not isinstance(prompts, Sequence) or isinstance(prompts, (bytes, bytearray)):
        raise RequestError(f"prompts: expected a prompt or a list of prompts, got "
                           f"{type(prompts).__name__}")
    plist = list(prompts)
    for i, p in enumerate(plist):
        if not isinstance(p, (str, Sequence)) or isinstance(p, (bytes, bytearray)):
            raise RequestError(f"prompts[{i}]: expected text, token ids or chat messages, "
                               f"got {type(p).__name__}")
    sps = list(sampling) if isinstance(sampling, Sequence) else [sampling] * len(plist)
    if len(sps) != len(plist):
        raise RequestError(f"sampling: {len(sps)} params for {len(plist)} prompts")
    return plist, sps  # type: ignore[return-value]
