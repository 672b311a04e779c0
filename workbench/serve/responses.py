"""Response shapes: SGLang ``/generate``'s ``meta_info`` (finish reason, speculation counts,
logprobs), OpenAI's finish reasons, and server-sent events."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from workbench.core import RequestOutput
from workbench.remote.sglang import sglang_spec_meta


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


def meta_info(rid: str, prompt_tokens: int, token_ids: list[int], finish: str | None,
              e2e_latency: float, error: str | None = None,
              matched: int | str | None = None, output: RequestOutput | None = None,
              num_draft_tokens: int = 0) -> dict[str, Any]:
    """SGLang 0.5.23 ``meta_info`` of one (possibly partial) response. Always: id,
    finish_reason, prompt_tokens, completion_tokens, cached_tokens (0: no prefix cache here),
    reasoning_tokens, weight_version, num_retractions (preemptions); once finished e2e_latency
    and, when the request had rounds as SGLang counts them (its verify steps and the plain
    steps a speculating engine took), SGLang's speculation fields for those rounds
    (:func:`workbench.remote.sglang.sglang_spec_meta`, the one definition the remote client
    reads back; ``num_draft_tokens``: the engine's N when the request finished, 0 when it was
    not speculating). Streamed chunks carry no spec fields, as upstream."""
    n = len(token_ids)
    met = output.metrics if output is not None else None
    d: dict[str, Any] = {
        "id": rid, "finish_reason": sglang_finish_reason(finish, token_ids, error, matched),
        "prompt_tokens": prompt_tokens, "weight_version": "default",
        "num_retractions": met.preemptions if met is not None else 0,
        "reasoning_tokens": 0, "completion_tokens": n, "cached_tokens": 0}
    if finish:
        d["e2e_latency"] = e2e_latency
        if met is not None and num_draft_tokens > 0:
            d.update(sglang_spec_meta(met, n, num_draft_tokens))
    return d


LogprobEntry = list[Any]  # [logprob | None, token_id, text | None] (SGLang's tuple, as JSON)


def sglang_logprobs(output: RequestOutput, decode: Callable[[int], str] | None,
                    first_output: int = 0) -> dict[str, Any]:
    """SGLang's logprob fields of ``meta_info`` (``return_logprob``): input_token_logprobs,
    output_token_logprobs (``[logprob, token_id, text or None]`` each; text with
    ``return_text_in_logprobs``, i.e. ``decode`` given), with ``top_logprobs_num`` also
    input_top_logprobs / output_top_logprobs (per position a list of such entries, None for the
    first prompt token, which has no context). Output rows from ``first_output`` on (an
    incremental stream sends each once; the prompt's rows always, as SGLang)."""
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
                                  zip((output.output_logprobs or [])[first_output:],
                                      output.token_ids[first_output:], strict=False)],
    }
    d["output_token_logprobs_length"] = len(d["output_token_logprobs"])
    if output.output_top_logprobs is not None:
        d["input_top_logprobs"] = tops(output.input_top_logprobs)
        d["output_top_logprobs"] = tops(output.output_top_logprobs[first_output:])
    return d


def openai_finish_reason(reason: str | None) -> str | None:
    """OpenAI's finish_reason strings; aborts and errors keep their own name."""
    return reason or None


def json_bytes(payload: Any) -> bytes:
    """A JSON answer's body, as Starlette's JSONResponse writes it."""
    return json.dumps(payload, ensure_ascii=False, allow_nan=False, indent=None,
                      separators=(",", ":")).encode()


def sse(payload: dict[str, Any] | str) -> bytes:
    """One server-sent event: ``data: <json>\\n\\n`` (or ``data: [DONE]\\n\\n``)."""
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n".encode()
