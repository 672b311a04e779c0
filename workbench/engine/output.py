"""Token output: appending a step's tokens under the stop rules, log-probabilities, finishing.

:class:`OutputProcessor` is the one place a request's tokens grow (``append_tokens``, applying
stop ids / EOS, stop strings, max_new_tokens and the context length after every token) and the
one place a request finishes (``finish``: KV freed, RequestFinished traced). It also fails a
single request on request-scoped numeric errors (``bad_logits``) and builds the public
:class:`~workbench.core.RequestOutput` snapshot.
"""

from __future__ import annotations

import math
import time
from typing import Any, NamedTuple

import torch

from workbench import faults
from workbench.core import Request, RequestOutput, StepOutput, TopLogprobs
from workbench.engine.scheduler import Scheduler
from workbench.engine.stops import ScanState, advance, text_stops
from workbench.trace import events as ev
from workbench.trace.tracer import Dispatcher


class Cut(NamedTuple):
    """Where :meth:`OutputProcessor.append_tokens` stops in a block of new tokens."""

    keep: int  # tokens appended
    reason: ev.FinishReason | None  # "stop" / "length" (the request finishes), or None
    matched: int | str | None  # the stop id or string that matched ("stop")
    scan: ScanState | None = None  # the text scan after the tokens it fed (None: no text stops)


class OutputProcessor:
    """Tokens in, outputs out. ``tokenizer``, ``eos_ids`` and ``max_model_len`` are set by the
    engine's init stages; ``scheduler`` once the KV pool exists."""

    def __init__(self, stats: Any, trace: Dispatcher) -> None:
        self.stats = stats  # EngineStats: generated_tokens
        self.trace = trace
        self.tokenizer: Any = None
        self.eos_ids: set[int] = set()
        self.max_model_len = 0
        self.scheduler: Scheduler | None = None
        self.row_errors: dict[int, str] = {}  # rid → request-scoped sampling failure this step

    def room(self, r: Request) -> int:
        """How many more tokens ``r`` may emit (max_new_tokens, context length)."""
        return min(r.sampling.max_new_tokens - (len(r.tokens) - len(r.prompt_ids)),
                   self.max_model_len - len(r.tokens))

    def cut(self, r: Request, new: list[int]) -> Cut:
        """How many of ``new`` :meth:`append_tokens` keeps (it stops after a stop id / EOS, a
        completed text stop, max_new_tokens or the context length, checked after each
        token), why it stops and the matched stop; ``r`` is not changed. Text stops are
        scanned incrementally (:mod:`workbench.engine.stops`): only each token's new text."""
        sp = r.sampling
        stops = set(sp.stop_token_ids) | (set() if sp.ignore_eos else self.eos_ids)
        tstops = text_stops(sp) if self.tokenizer is not None else ()
        room = self.room(r)
        base = len(r.prompt_ids)
        n_out = len(r.tokens) - base

        def ids(a: int, b: int) -> list[int]:  # output ids [a, b) of the output + ``new``
            if a >= n_out:
                return new[a - n_out : b - n_out]
            return r.tokens[base + a : base + min(b, n_out)] + new[: max(0, b - n_out)]

        scan: ScanState | None = None
        if tstops:
            scan = r.stop_scan if r.stop_scan is not None else ScanState.start(tstops)
            while scan.n < n_out:  # tokens appended without a scan (none in the engine)
                scan, _ = advance(self.tokenizer, tstops, scan, ids)
        for j, tok in enumerate(new, 1):
            if tok in stops:
                return Cut(j, "stop", tok, scan)
            if scan is not None:
                scan, hit = advance(self.tokenizer, tstops, scan, ids)
                if hit is not None:
                    return Cut(j, "stop", hit.stop, scan)
            if j >= room:  # max_new_tokens or the context length reached
                return Cut(j, "length", None, scan)
        return Cut(len(new), None, None, scan)

    def append_tokens(self, r: Request, new: list[int], from_draft: list[bool],
                      outputs: dict[int, StepOutput], cut: Cut | None = None) -> int:
        """Append tokens under the stop rules (:meth:`cut`, or ``cut`` when the caller already
        asked): a block of accepted draft tokens ends exactly where plain decoding of the same
        tokens would (lossless stops). Returns how many tokens it appended."""
        now = time.perf_counter()
        if r.metrics.first_token is None:
            r.metrics.first_token = now
        n, reason, matched, scan = cut if cut is not None else self.cut(r, new)
        kept = new[:n]
        if scan is not None:
            r.stop_scan = scan
        r.tokens.extend(kept)
        if reason == "stop":
            r.matched_stop = matched
        r.emitted_from_draft.extend(from_draft[: len(kept)])
        r.metrics.token_times.extend([now] * len(kept))
        self.stats.generated_tokens += len(kept)
        prev = outputs.get(r.rid)
        delta = (prev.new_token_ids if prev else []) + kept
        if reason is not None:
            self.finish(r, reason)
        outputs[r.rid] = StepOutput(r.rid, delta, r.finished, r.finish_reason, r.error)
        return n

    def bad_logits(self, r: Request, logits: torch.Tensor, outputs: dict[int, StepOutput],
                   finite: bool | None = None) -> bool:
        """Request-scoped numeric failures fail this request only; the others continue: a row
        of its logits is not a distribution (a NaN or +inf logit, or no finite one: its
        maximum is not finite; -inf alone is probability 0), or its sampling found no valid
        distribution (``row_errors``). ``finite``: the caller already knows whether every
        row's maximum is finite (the greedy verify's argmax read it), so no pass here."""
        sampling_error = self.row_errors.pop(r.rid, None)
        if sampling_error is not None:
            self.fail_request(r, f"request {r.rid}: {sampling_error}", outputs)
            return True
        if finite is None:
            # A finite sum means every logit is finite (a NaN or inf would make it NaN or inf);
            # only a non-finite sum (or a huge finite overflow) pays for the rows' maxima.
            finite = math.isfinite(float(logits.sum())) or \
                bool(torch.isfinite(logits.amax(-1)).all())
        if faults.active(f"step:nan_logits@{r.rid}") or not finite:
            self.fail_request(r, f"request {r.rid}: non-finite logits at position {r.kv_len}",
                              outputs)
            return True
        return False

    def fail_request(self, r: Request, error: str, outputs: dict[int, StepOutput]) -> None:
        r.error = error
        self.finish(r, "error")
        outputs[r.rid] = StepOutput(r.rid, [], True, "error", r.error)

    def finish(self, r: Request, reason: ev.FinishReason) -> None:
        assert self.scheduler is not None
        r.finish_reason = reason
        r.metrics.finished = time.perf_counter()
        self.scheduler.finish(r)
        if self.trace.wants(ev.RequestFinished):
            m = r.metrics
            self.trace.emit(ev.RequestFinished(
                t=time.perf_counter(), rid=r.rid, reason=reason, prompt_len=len(r.prompt_ids),
                output_len=len(r.output_ids), verify_ct=m.verify_ct,
                accept_lengths=list(m.accept_lengths), ttft_s=m.ttft if m.ttft else 0.0,
                e2e_s=m.e2e or 0.0, error=r.error or ""))

    # -- log-probabilities -------------------------------------------------------------------
    def add_output_logprobs(self, r: Request, rows: torch.Tensor) -> None:
        """Log-probabilities of the tokens the last ``append_tokens`` appended (it may have
        stopped early): row j of ``rows`` is the target's logits that produced its j-th token."""
        out = r.output_ids
        k = len(out) - len(r.output_logprobs)
        if k <= 0:
            return
        sp = r.sampling
        t = 1.0 if sp.greedy or sp.temperature <= 0 else float(sp.temperature)
        lp = torch.log_softmax(rows[:k].float() / t, dim=-1)
        toks = torch.tensor(out[len(out) - k:], device=lp.device)
        r.output_logprobs.extend(lp.gather(1, toks[:, None])[:, 0].tolist())
        assert r.logprobs is not None
        if r.logprobs.top_k:
            r.output_top_logprobs.extend(top_logprobs(lp, r.logprobs.top_k))

    def add_input_logprobs(self, r: Request, s: int, e: int, hidden: torch.Tensor,
                           logits_of: Any) -> None:
        """Prompt tokens' log-probabilities from a prefill chunk covering positions [s, e):
        position p's raw logits (``logits_of(hidden rows)``) score the token at p + 1 (from
        ``logprobs.start`` on). A re-prefill after preemption finds its positions done and adds
        nothing."""
        assert r.logprobs is not None and r.logprobs.start is not None
        start, n_prompt = r.logprobs.start, len(r.prompt_ids)
        # token index j = p + 1 is next in line when j - start == len(input_logprobs)
        first = start + len(r.input_logprobs) - 1
        lo, hi = max(s, first), min(e, n_prompt - 1)
        if lo >= hi:
            return
        lp = torch.log_softmax(logits_of(hidden[lo - s : hi - s]).float(), dim=-1)
        toks = torch.tensor(r.prompt_ids[lo + 1 : hi + 1], device=lp.device)
        r.input_logprobs.extend(lp.gather(1, toks[:, None])[:, 0].tolist())
        if r.logprobs.top_k:
            r.input_top_logprobs.extend(top_logprobs(lp, r.logprobs.top_k))

    # -- the public snapshot -----------------------------------------------------------------
    def request_output(self, req: Request, text: bool, lossless: bool) -> RequestOutput:
        text_s = self.text_of(req) if self.tokenizer is not None and text else ""
        lp = req.logprobs
        return RequestOutput(rid=req.rid, prompt_ids=req.prompt_ids,
                             token_ids=list(req.output_ids), text=text_s,
                             finish_reason=req.finish_reason or "",
                             metrics=req.metrics, error=req.error, lossless=lossless,
                             from_draft=list(req.emitted_from_draft),
                             matched_stop=req.matched_stop,
                             output_logprobs=None if lp is None else list(req.output_logprobs),
                             output_top_logprobs=None if lp is None or not lp.top_k else
                             list(req.output_top_logprobs),
                             input_logprobs=None if lp is None or lp.start is None else
                             list(req.input_logprobs),
                             input_top_logprobs=None if lp is None or lp.start is None or
                             not lp.top_k else list(req.input_top_logprobs),
                             logprob_start=None if lp is None else lp.start)

    def text_of(self, req: Request) -> str:
        """The request's output text, its matched stop trimmed (see ``Engine.output``); with
        ``no_stop_trim`` the text ends right after a matched stop string (as SGLang), not with
        the rest of the token that completed it."""
        ids, m = req.output_ids, req.matched_stop
        stopped = req.finish_reason == "stop" and m is not None
        keep = req.sampling.no_stop_trim
        if stopped and not keep and isinstance(m, int) and ids:
            ids = ids[:-1]
        text = self.tokenizer.decode(ids)
        if stopped and isinstance(m, str):
            pos = text.find(m)
            if pos != -1:  # cut before the stop string, or (no_stop_trim) right after it
                text = text[: pos + len(m)] if keep else text[:pos]
        return text


def top_logprobs(lp: torch.Tensor, k: int) -> list[TopLogprobs]:
    """Each row's ``k`` most likely tokens as (token id, logprob), most likely first."""
    vals, ids = lp.topk(min(k, lp.shape[-1]), dim=-1)
    return [list(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), vals.tolist(),
                                                          strict=True)]
