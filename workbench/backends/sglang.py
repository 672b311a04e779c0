"""SGLang on the 8-GPU box: the launch command, a health wait, and an HTTP client that returns
the engine's output shapes and emits the engine's trace events.

Flag table (DESIGN.md §6) — what :func:`launch_plan` emits:

=========================================  =========================================
workbench                                  ``python -m sglang.launch_server``
=========================================  =========================================
``target``                                 ``--model-path T``
``draft`` (spec on)                        ``--speculative-algorithm EAGLE3``
                                           ``--speculative-draft-model-path D``
``SpecConfig.num_steps`` (S)               ``--speculative-num-steps S``
``SpecConfig.topk`` (K)                    ``--speculative-eagle-topk K``
``SpecConfig.num_draft_tokens`` (N)        ``--speculative-num-draft-tokens N``
``tp``                                     ``--tp 8``
``host`` / ``port``                        ``--host H --port P``
``**extra`` (``mem_fraction_static=0.8``)  ``--mem-fraction-static 0.8`` (True → bare flag;
                                           False/None → omitted; a list → several values)
``SpecConfig.simulate_accept_length`` a    environment ``SGLANG_SIMULATE_ACC_LEN=a``
=========================================  =========================================

Policies: ``Always()`` maps to the plain flags above. ``BatchThreshold(n)`` (stop drafting when
the decode batch exceeds n) has **no upstream SGLang flag**; upstream SGLang speculates at every
batch size. The plan therefore leaves it out and says so in ``LaunchPlan.notes`` — unless you run a
patched SGLang and name its option with ``threshold_flag=`` (for example
``"--speculative-disable-batch-threshold"``), in which case ``threshold_flag n`` is appended and the
note says the command needs that patch. ``Never()`` launches without speculation (upstream cannot
load a draft and leave it idle). Any other policy (e.g. a goodput controller) and
``draft_state="cold"`` are workbench-only and are noted, not emitted.
"""

from __future__ import annotations

import itertools
import json
import shlex
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from workbench.config import SamplingParams, SpecConfig
from workbench.core import RequestMetrics, RequestOutput
from workbench.errors import ConfigError, RequestError, RequestFailed
from workbench.spec.policy import Always, BatchThreshold, Never
from workbench.trace import events as ev
from workbench.trace.tracer import NULL_TRACER

DEFAULT_SPEC = SpecConfig(num_steps=5, topk=4, num_draft_tokens=16)
SIMULATE_ACC_LEN_ENV = "SGLANG_SIMULATE_ACC_LEN"


@dataclass(frozen=True)
class LaunchPlan:
    """A launch command, the environment it needs, and notes on what could not be mapped."""

    command: list[str]
    env: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def shell(self) -> str:
        """One shell line: ``ENV=... python -m sglang.launch_server ...``."""
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        return (env + " " if env else "") + shlex.join(self.command)


def _flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def _extra_flags(extra: dict[str, Any], taken: set[str]) -> list[str]:
    out: list[str] = []
    for key, value in extra.items():
        flag = _flag(key)
        if flag in taken:
            raise ConfigError(f"{key}: {flag} is set from launch_plan's own arguments")
        if value is None or value is False:
            continue
        if value is True:
            out.append(flag)
        elif isinstance(value, (list, tuple)):
            out += [flag, *(str(v) for v in value)]
        elif isinstance(value, dict):
            out += [flag, json.dumps(value)]
        else:
            out += [flag, str(value)]
    return out


def launch_plan(target: str, draft: str | None = None, tp: int = 8,
                spec: SpecConfig | None = None, host: str = "0.0.0.0", port: int = 30000, *,
                python: str = "python", threshold_flag: str | None = None,
                **extra: Any) -> LaunchPlan:
    """The SGLang launch for ``target`` (+ EAGLE-3 ``draft``) on ``tp`` GPUs (module doc).

    ``draft=None`` launches the baseline (``spec`` must then be None). With a draft, ``spec=None``
    means :data:`DEFAULT_SPEC` (S=5, K=4, N=16).
    """
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ConfigError(f"tp: must be a positive integer, got {tp!r}")
    if not isinstance(port, int) or not 0 < port < 65536:
        raise ConfigError(f"port: must be in 1..65535, got {port!r}")
    if draft is None and spec is not None:
        raise ConfigError("spec: given without a draft; pass draft= or spec=None for a baseline")
    cmd = [python, "-m", "sglang.launch_server", "--model-path", str(target)]
    env: dict[str, str] = {}
    notes: list[str] = []
    if draft is not None:
        spec = spec or DEFAULT_SPEC
        policy = spec.policy
        if isinstance(policy, Never):
            notes.append("policy Never(): launched without speculation; upstream SGLang cannot "
                         "load a draft and leave it idle, so this measures the plain baseline")
        else:
            cmd += ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path",
                    str(draft), "--speculative-num-steps", str(spec.num_steps),
                    "--speculative-eagle-topk", str(spec.topk),
                    "--speculative-num-draft-tokens", str(spec.num_draft_tokens)]
            if isinstance(policy, BatchThreshold):
                if threshold_flag:
                    cmd += [threshold_flag, str(policy.n)]
                    notes.append(f"policy BatchThreshold({policy.n}): emitted as "
                                 f"{threshold_flag} {policy.n}; this flag does not exist in "
                                 "upstream SGLang and needs the patched build")
                else:
                    notes.append(f"policy BatchThreshold({policy.n}): NOT applied. Upstream "
                                 "SGLang has no flag to stop drafting above a batch size; it "
                                 "speculates at every batch size. Run a patched SGLang and pass "
                                 "threshold_flag= (e.g. '--speculative-disable-batch-threshold') "
                                 "to apply it")
            elif not isinstance(policy, Always):
                notes.append(f"policy {policy!r}: workbench-only, not available in SGLang; "
                             "launched as Always()")
            if spec.draft_state != "warm":
                notes.append(f"draft_state={spec.draft_state!r}: workbench-only; SGLang keeps "
                             "the draft KV current (warm)")
            if spec.simulate_accept_length is not None:
                env[SIMULATE_ACC_LEN_ENV] = repr(float(spec.simulate_accept_length))
                notes.append(f"simulate_accept_length: {SIMULATE_ACC_LEN_ENV} set; outputs are "
                             "NOT the target's (not lossless)")
    cmd += ["--tp", str(tp), "--host", host, "--port", str(port)]
    taken = {c for c in cmd if c.startswith("--")}
    cmd += _extra_flags(extra, taken)
    return LaunchPlan(cmd, env, notes)


def launch_command(target: str, draft: str | None = None, tp: int = 8,
                   spec: SpecConfig | None = None, host: str = "0.0.0.0", port: int = 30000,
                   **extra: Any) -> list[str]:
    """``launch_plan(...).command``; read :func:`launch_plan`'s notes for policies that do not
    map onto upstream flags (``BatchThreshold`` does not)."""
    return launch_plan(target, draft, tp, spec, host, port, **extra).command


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
    if sp.stop_token_ids:
        d["stop_token_ids"] = list(sp.stop_token_ids)
    if sp.ignore_eos:
        d["ignore_eos"] = True
    if sp.seed is not None:
        d["sampling_seed"] = sp.seed
    return d


def approx_accept_lengths(completion_tokens: int, verify_ct: int) -> list[int]:
    """Per-step τ consistent with SGLang's per-request numbers: ``verify_ct`` integers summing
    to ``completion_tokens`` (mean = ``spec_accept_length``), spread as evenly as possible.
    SGLang reports only the mean, so the per-step spread is an approximation."""
    if verify_ct <= 0:
        return []
    q, r = divmod(completion_tokens, verify_ct)
    return [q + 1] * r + [q] * (verify_ct - r)


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
    finish_reason, metrics with ``verify_ct`` and ``accept_lengths`` from ``meta_info``; see
    :func:`approx_accept_lengths`) and, when a tracer is set (``wb.trace(client)`` works),
    emits ``RequestAdmitted`` and ``RequestFinished`` events like the engine does. Requests run
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

    def _check_spec(self, spec: SpecConfig) -> None:
        info = self.server_info()
        if info.get("speculative_algorithm") in (None, "", "NONE"):
            raise ConfigError("spec: the server was launched without speculative decoding")
        for name, key in (("num_steps", "speculative_num_steps"),
                          ("topk", "speculative_eagle_topk"),
                          ("num_draft_tokens", "speculative_num_draft_tokens")):
            have = info.get(key)
            if have is not None and have != getattr(spec, name):
                raise ConfigError(f"spec.{name}: server runs {key}={have}, asked for "
                                  f"{getattr(spec, name)}; spec is fixed at launch in SGLang")

    # -- generation --------------------------------------------------------------------------
    def generate(self, prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 spec: SpecConfig | None = None, progress: bool = False,
                 ) -> list[RequestOutput]:
        """Run prompts on the server, concurrently; outputs in prompt order.

        ``spec``: speculation is fixed when an SGLang server launches, so ``spec`` is checked
        against ``/server_info`` (ConfigError on a mismatch) rather than applied; ``None`` uses
        whatever the server runs. A 400 raises RequestError naming the field; other failures
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
        m.accept_lengths = approx_accept_lengths(n, m.verify_ct)
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
