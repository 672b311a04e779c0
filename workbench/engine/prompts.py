"""Prompts → token ids (text, token ids or chat messages), with errors that name the field."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from workbench.errors import RequestError

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
        return list(tokenizer.apply_chat_template(items, add_generation_prompt=True,
                                                  tokenize=True))
    if not items:
        raise RequestError(f"{field}: empty prompt")
    for t in items:
        if not isinstance(t, int) or isinstance(t, bool):
            raise RequestError(f"{field}: token ids must be integers, got {t!r}")
        if not 0 <= t < vocab_size:
            raise RequestError(f"{field}: token id {t} outside the vocabulary [0, {vocab_size})")
    return items
