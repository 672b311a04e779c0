"""SGLang on the 8-GPU box: the launch (re-exported from :mod:`workbench.remote.launch`), a
health wait, and an HTTP client that returns the engine's output shapes and emits the engine's
trace events.

What the client reads from SGLang 0.5.23 (``meta_info`` of a finished ``/generate`` response):
``spec_verify_ct`` (verify rounds), ``spec_correct_drafts_histogram[k]`` (rounds with k correct
drafts: per-round accept length k + 1, bonus included) and ``completion_tokens``. Under adaptive
speculation a steps-0 (plain) round is a verify round with 0 correct drafts: SGLang counts it in
``spec_verify_ct`` and ``histogram[0]``. The client keeps SGLang's counting, and
:func:`sglang_accept_lengths` puts an engine run on the same counting (the plain steps of a
speculating engine as accept length 1), so τ means the same thing on both sides. It is the one
definition of those rounds: ``workbench serve`` builds its ``meta_info`` speculation fields from
it (:func:`sglang_spec_meta`), so it sends what SGLang would send for the same rounds, and
reading them back (:func:`round_accept_lengths`) gives the same rounds.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from workbench.config import SamplingParams, SpecConfig
from workbench.core import RequestMetrics, RequestOutput
from workbench.errors import ConfigError, RequestError, RequestFailed
from workbench.policy.policies import BatchThreshold, StepTable
from workbench.remote.launch import (
    DEFAULT_SPEC,
    SIMULATE_ACC_LEN_ENV,
    LaunchPlan,
    launch_command,
    launch_plan,
)
from workbench.trace import events as ev
from workbench.trace.tracer import NULL_TRACER

__all__ = ["DEFAULT_SPEC", "SIMULATE_ACC_LEN_ENV", "LaunchPlan", "SGLangClient",
           "accept_lengths_from_histogram", "approx_accept_lengths", "launch_command",
           "correct_drafts_histogram", "launch_plan", "round_accept_lengths",
           "sglang_accept_lengths", "sglang_sampling_params", "sglang_spec_meta",
           "wait_healthy"]


def wait_healthy(url: str, timeout: float = 900.0, interval: float = 2.0,
                 proc: Any = None) -> float:
    """Poll ``GET {url}/health`` until it answers 200; returns the seconds waited.

    ``proc`` (a ``subprocess.Popen``): fail fast with its exit code if the server process dies.
    Raises TimeoutError after ``timeout`` seconds.
    """
    import httpx

    t0 = time.monotonic()
    last = "no answer"
    with httpx.Client(timeout=min(interval * 5, 30.0)) as client:
        while True:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"server process exited with code {proc.returncode} before "
                                   f"{url} became healthy")
            try:
                r = client.get(url.rstrip("/") + "/health")
                if r.status_code == 200:
                    return time.monotonic() - t0
                last = f"HTTP {r.status_code}: {r.text[:200]}"
            except httpx.TransportError as e:
                last = f"{type(e).__name__}: {e}"
            if time.monotonic() - t0 > timeout:
                raise TimeoutError(f"{url} not healthy after {timeout:.0f} s (last: {last})")
            time.sleep(interval)


# ---- client ----------------------------------------------------------------------------------


def sglang_sampling_params(sp: SamplingParams) -> dict[str, Any]:
    """SamplingParams → SGLang ``sampling_params`` (only non-default fields beyond the budget and
    temperature, so older servers that do not know a field never see it)."""
    d: dict[str, Any] = {"max_new_tokens": sp.max_new_tokens, "temperature": sp.temperature}
    if sp.top_p != 1.0:
        d["top_p"] = sp.top_p
    if sp.top_k:
        d["top_k"] = sp.top_k
    if sp.min_p:
        d["min_p"] = sp.min_p
    if sp.stop:
        d["stop"] = list(sp.stop)
    if sp.stop_regex:
        d["stop_regex"] = list(sp.stop_regex)
    if sp.stop_token_ids:
        d["stop_token_ids"] = list(sp.stop_token_ids)
    if sp.ignore_eos:
        d["ignore_eos"] = True
    if sp.seed is not None:
        d["sampling_seed"] = sp.seed
    return d


def approx_accept_lengths(completion_tokens: int, verify_ct: int) -> list[int]:
    """Per-round τ when only the mean is known: ``verify_ct`` integers summing to
    ``completion_tokens`` (mean = ``spec_accept_length``), spread as evenly as possible. Used
    for servers that send no ``spec_correct_drafts_histogram`` (older SGLang, ``workbench
    serve``); the per-round spread is then an approximation."""
    if verify_ct <= 0:
        return []
    q, r = divmod(completion_tokens, verify_ct)
    return [q + 1] * r + [q] * (verify_ct - r)


def accept_lengths_from_histogram(histogram: Sequence[int]) -> list[int]:
    """SGLang's ``spec_correct_drafts_histogram`` → per-round accept lengths (k correct drafts
    → k + 1 tokens, the bonus included), in histogram order. ``histogram[0]`` includes the
    steps-0 (plain) rounds of an adaptive launch, each of accept length 1."""
    out: list[int] = []
    for k, count in enumerate(histogram):
        if not isinstance(count, int) or count < 0:
            raise RequestFailed(f"spec_correct_drafts_histogram[{k}]: expected a count >= 0, "
                                f"got {count!r}")
        out += [k + 1] * count
    return out


def round_accept_lengths(meta: dict[str, Any]) -> list[int]:
    """Per-round accept lengths of one finished SGLang request (``meta_info``): exact from the
    histogram when present (it sums to ``spec_verify_ct``), else :func:`approx_accept_lengths`."""
    verify_ct = int(meta.get("spec_verify_ct") or 0)
    hist = meta.get("spec_correct_drafts_histogram")
    if hist:
        lengths = accept_lengths_from_histogram(hist)
        if verify_ct and len(lengths) != verify_ct:
            raise RequestFailed(f"spec_correct_drafts_histogram: {len(lengths)} rounds but "
                                f"spec_verify_ct={verify_ct}")
        return lengths
    return approx_accept_lengths(int(meta.get("completion_tokens") or 0), verify_ct)


def sglang_accept_lengths(metrics: RequestMetrics) -> list[int]:
    """An engine request's rounds counted as SGLang counts them: each verify step (its accept
    length) and each plain decode step the engine took while speculating
    (``spec_plain_steps``: policy off, one token left) as a round of accept length 1, as
    SGLang's steps-0 rounds under adaptive speculation land in ``spec_verify_ct`` and
    ``histogram[0]``. A baseline engine's plain steps are no rounds (SGLang without speculation
    counts none). Compare its mean with a box run's τ.

    A verify round's SGLang accept length is its correct drafts + 1
    (``RequestMetrics.correct_drafts``): the same as the tokens it emitted, except a last
    block cut inside its drafts by a stop or max_new_tokens, which SGLang files under the
    drafts it kept (upstream files it under the whole block; we keep the meta equal to the
    server's accepted-token counters: docs/DESIGN.md "Which count is which")."""
    if len(metrics.correct_drafts) != len(metrics.accept_lengths):
        raise ValueError(f"RequestMetrics.correct_drafts: {len(metrics.correct_drafts)} entries "
                         f"for {len(metrics.accept_lengths)} verify steps (accept_lengths); "
                         "one per verify step")
    return [c + 1 for c in metrics.correct_drafts] + [1] * metrics.spec_plain_steps


def correct_drafts_histogram(accept_lengths: Sequence[int]) -> list[int]:
    """SGLang's ``spec_correct_drafts_histogram`` of rounds with these accept lengths: h[k] =
    rounds with k correct drafts (accept length k + 1), as long as the largest k seen + 1;
    sums to the number of rounds. Inverse: :func:`accept_lengths_from_histogram`."""
    h: list[int] = []
    for a in accept_lengths:
        k = a - 1
        h.extend([0] * (k + 1 - len(h)))
        h[k] += 1
    return h


def sglang_spec_meta(metrics: RequestMetrics, completion_tokens: int,
                     num_draft_tokens: int) -> dict[str, Any]:
    """The speculation fields SGLang 0.5.23 puts in a finished request's ``meta_info``
    (``TokenizerManager``'s spec metrics) for the rounds :func:`sglang_accept_lengths` counts
    (``{}`` without rounds): ``spec_verify_ct`` (rounds), ``spec_accept_length`` =
    completion_tokens / spec_verify_ct (the prefill's token in the numerator),
    ``spec_num_correct_drafts`` (bonus excluded), ``spec_num_proposed_drafts`` =
    spec_verify_ct × (``num_draft_tokens`` − 1) (SGLang's formula: a steps-0 round proposes
    N − 1 too), ``spec_accept_rate`` = correct / proposed and
    ``spec_correct_drafts_histogram`` (sums to spec_verify_ct). ``num_draft_tokens``: the
    engine's N (SpecConfig.num_draft_tokens), as SGLang reads its launch value."""
    rounds = sglang_accept_lengths(metrics)
    verify_ct = len(rounds)
    if verify_ct == 0:
        return {}
    d: dict[str, Any] = {}
    proposed = verify_ct * (num_draft_tokens - 1)
    correct = sum(rounds) - verify_ct
    if proposed > 0:
        d["spec_accept_rate"] = correct / proposed
        d["spec_accept_length"] = completion_tokens / verify_ct
        d["spec_num_correct_drafts"] = correct
        d["spec_num_proposed_drafts"] = proposed
        d["spec_verify_ct"] = verify_ct
    d["spec_correct_drafts_histogram"] = correct_drafts_histogram(rounds)
    return d


def _finish_type(fr: Any) -> str:
    if isinstance(fr, dict):
        return str(fr.get("type") or "")
    return "" if fr is None else str(fr)


def _event_reason(reason: str) -> ev.FinishReason:
    if reason in ("stop", "length", "abort", "error"):
        return reason  # type: ignore[return-value]
    return "abort"


class SGLangClient:
    """Talks to an SGLang (or ``python -m workbench serve``) server like ``engine.generate``.

    ``generate`` returns :class:`~workbench.core.RequestOutput` objects (token_ids, text,
    finish_reason, metrics with ``verify_ct`` and per-round ``accept_lengths`` from
    ``meta_info``, SGLang's counting: module doc) and, when a tracer is set
    (``wb.trace(client)`` works), emits ``RequestAdmitted`` and ``RequestFinished`` events like
    the engine does. Requests run
    concurrently on up to ``max_concurrency`` threads. ``stream=True`` (default) measures TTFT
    and per-token times from the streamed chunks.
    """

    def __init__(self, url: str, timeout: float = 600.0, max_concurrency: int = 64,
                 stream: bool = True) -> None:
        import httpx

        self.url = url.rstrip("/")
        self.timeout = timeout
        self.max_concurrency = max_concurrency
        self.stream = stream
        limits = httpx.Limits(max_connections=max(max_concurrency, 1) + 4,
                              max_keepalive_connections=max(max_concurrency, 1))
        self._http = httpx.Client(base_url=self.url, timeout=timeout, limits=limits)
        self._tracer: Any = NULL_TRACER
        self._trace_lock = threading.Lock()
        self._rids = itertools.count()

    # -- tracer (the engine's interface, so wb.trace(client) works) --------------------------
    @property
    def tracer(self) -> Any:
        return self._tracer

    def set_tracer(self, tracer: Any) -> None:
        self._tracer = NULL_TRACER if tracer is None else tracer

    def _emit(self, event: ev.Event) -> None:
        tracer = self._tracer
        if tracer.enabled:
            with self._trace_lock:
                tracer.emit(event)

    # -- server -----------------------------------------------------------------------------
    def health(self) -> bool:
        import httpx

        try:
            return self._http.get("/health", timeout=10.0).status_code == 200
        except httpx.TransportError:
            return False

    def server_info(self) -> dict[str, Any]:
        """``/server_info`` (newer SGLang and workbench) or ``/get_server_info`` (older)."""
        r = self._http.get("/server_info")
        if r.status_code == 404:
            r = self._http.get("/get_server_info")
        r.raise_for_status()
        return r.json()

    def speculation_mode(self) -> str:
        """What the server really runs, from ``/server_info``: ``"none"``, ``"static"`` or
        ``"adaptive"`` (``speculative_adaptive`` is the *resolved* value: SGLang turns it off
        with only a warning when it cannot run adaptive, e.g. topk != 1)."""
        info = self.server_info()
        if info.get("speculative_algorithm") in (None, "", "NONE"):
            return "none"
        return "adaptive" if info.get("speculative_adaptive") else "static"

    def _check_spec(self, spec: SpecConfig) -> None:
        info = self.server_info()
        if info.get("speculative_algorithm") in (None, "", "NONE"):
            raise ConfigError("spec: the server was launched without speculative decoding")
        tiered = isinstance(spec.policy, (BatchThreshold, StepTable))
        if tiered and "speculative_adaptive" not in info:
            raise ConfigError(
                f"spec.policy: {spec.policy!r} runs upstream as adaptive speculation, but "
                "/server_info has no speculative_adaptive: this server cannot run adaptive "
                "tiers (SGLang >= 0.5.23 launched with --speculative-adaptive can); this would "
                "not be a threshold experiment")
        if tiered and not info["speculative_adaptive"]:
            raise ConfigError(
                f"spec.policy: {spec.policy!r} runs upstream as adaptive speculation, but "
                "/server_info says speculative_adaptive=False: SGLang fell back to static "
                "speculation (topk != 1, attention DP, … turn it off with only a warning) and "
                "speculates at every batch size; this would not be a threshold experiment")
        checks = (("topk", "speculative_eagle_topk"),) if tiered else (
            ("num_steps", "speculative_num_steps"), ("topk", "speculative_eagle_topk"),
            ("num_draft_tokens", "speculative_num_draft_tokens"))
        for name, key in checks:
            have = info.get(key)
            want = 1 if tiered and name == "topk" else getattr(spec, name)
            if have is not None and have != want:
                raise ConfigError(f"spec.{name}: server runs {key}={have}, asked for "
                                  f"{want}; spec is fixed at launch in SGLang")

    # -- generation --------------------------------------------------------------------------
    def generate(self, prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 spec: SpecConfig | None = None, progress: bool = False,
                 ) -> list[RequestOutput]:
        """Run prompts on the server, concurrently; outputs in prompt order.

        ``spec``: speculation is fixed when an SGLang server launches, so ``spec`` is checked
        against ``/server_info`` (ConfigError on a mismatch) rather than applied; ``None`` uses
        whatever the server runs. A ``BatchThreshold`` / ``StepTable`` spec also needs the
        server's resolved ``speculative_adaptive`` to be true: ConfigError when SGLang fell
        back to static speculation. A 400 raises RequestError naming the field; other failures
        raise RequestFailed.
        """
        plist: list[str | Sequence[int]]
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            plist = [prompts]  # type: ignore[list-item]
        else:
            plist = list(prompts)  # type: ignore[arg-type]
        if isinstance(sampling_params, Sequence):
            sps = list(sampling_params)
        else:
            sps = [sampling_params or SamplingParams()] * len(plist)
        if len(sps) != len(plist):
            raise RequestError(f"sampling: {len(sps)} params for {len(plist)} prompts")
        if spec is not None:
            self._check_spec(spec)
        if not plist:
            return []
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(plist), desc="sglang", unit="req")
        workers = max(1, min(self.max_concurrency, len(plist)))
        with ThreadPoolExecutor(workers, thread_name_prefix="sglang-client") as pool:
            futs = [pool.submit(self._one, p, s) for p, s in zip(plist, sps, strict=True)]
            if bar is not None:
                for f in futs:
                    f.add_done_callback(lambda _: bar.update(1))
            outs = [f.result() for f in futs]
        if bar is not None:
            bar.close()
        return outs

    def _one(self, prompt: str | Sequence[int], sp: SamplingParams) -> RequestOutput:
        rid = next(self._rids)
        body: dict[str, Any] = {"sampling_params": sglang_sampling_params(sp),
                                "stream": self.stream}
        if isinstance(prompt, str):
            body["text"] = prompt
            prompt_ids: list[int] = []
        else:
            items = list(prompt)
            if items and not all(isinstance(t, int) for t in items):
                raise RequestError("prompt: chat messages are not supported by /generate; "
                                   "apply the chat template first")
            body["input_ids"] = prompt_ids = items
        m = RequestMetrics(arrival=time.perf_counter())
        admitted = False

        def admit(meta: dict[str, Any]) -> None:
            nonlocal admitted
            if not admitted:
                admitted = True
                self._emit(ev.RequestAdmitted(
                    t=m.arrival, rid=rid, prompt_len=int(meta.get("prompt_tokens") or
                                                         len(prompt_ids)),
                    max_new_tokens=sp.max_new_tokens, temperature=float(sp.temperature)))

        if self.stream:
            last = self._stream(body, m, admit)
        else:
            r = self._http.post("/generate", json=body)
            _raise_for(r)
            last = r.json()
            m.finished = time.perf_counter()
            admit(last.get("meta_info") or {})
        meta = last.get("meta_info") or {}
        ids = list(last.get("output_ids") or [])
        n = int(meta.get("completion_tokens") or len(ids))
        m.verify_ct = int(meta.get("spec_verify_ct") or 0)
        m.accept_lengths = round_accept_lengths(meta)
        m.correct_drafts = [a - 1 for a in m.accept_lengths]
        reason = _finish_type(meta.get("finish_reason"))
        error = None
        if reason in ("abort", "error") and isinstance(meta.get("finish_reason"), dict):
            error = str(meta["finish_reason"].get("message") or reason)
        out = RequestOutput(rid=rid, prompt_ids=prompt_ids, token_ids=ids,
                            text=str(last.get("text") or ""), finish_reason=reason, metrics=m,
                            error=error)
        self._emit(ev.RequestFinished(
            t=m.finished or time.perf_counter(), rid=rid, reason=_event_reason(reason),
            prompt_len=int(meta.get("prompt_tokens") or len(prompt_ids)), output_len=n,
            verify_ct=m.verify_ct, accept_lengths=list(m.accept_lengths),
            ttft_s=m.ttft or 0.0, e2e_s=m.e2e or 0.0, error=error or ""))
        return out

    def _stream(self, body: dict[str, Any], m: RequestMetrics, admit: Any) -> dict[str, Any]:
        last: dict[str, Any] | None = None
        seen = 0
        with self._http.stream("POST", "/generate", json=body) as r:
            if r.status_code != 200:
                r.read()
                _raise_for(r)
            for data in iter_sse(r.iter_lines()):
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                now = time.perf_counter()
                if "error" in chunk and "text" not in chunk:
                    raise RequestFailed(f"server: {chunk['error']}")
                admit(chunk.get("meta_info") or {})
                # SGLang streams cumulative text/output_ids by default (no
                # --incremental-streaming-output); completion_tokens counts either way.
                ids = chunk.get("output_ids")
                meta = chunk.get("meta_info") or {}
                count = int(meta.get("completion_tokens") or
                            (len(ids) if isinstance(ids, list) else 0))
                if count > seen:
                    if m.first_token is None:
                        m.first_token = now
                    m.token_times.extend([now] * (count - seen))
                    seen = count
                last = chunk
        m.finished = time.perf_counter()
        if last is None:
            raise RequestFailed("server: stream ended without a chunk")
        return last

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> SGLangClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"SGLangClient({self.url!r})"


def iter_sse(lines: Iterator[str]) -> Iterator[str]:
    """The ``data:`` payloads of a server-sent event stream."""
    for line in lines:
        if line.startswith("data:"):
            yield line[5:].strip()


def _raise_for(r: Any) -> None:
    if r.status_code == 200:
        return
    try:
        err = r.json().get("error", {})
        msg = err.get("message") if isinstance(err, dict) else str(err)
    except (ValueError, AttributeError):
        msg = None
    msg = msg or r.text[:500] or f"HTTP {r.status_code}"
    if r.status_code == 400:
        raise RequestError(msg)
    raise RequestFailed(f"HTTP {r.status_code}: {msg}")
