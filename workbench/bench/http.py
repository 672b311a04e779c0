"""Serving benchmark over HTTP, like SGLang's ``bench_serving``: TTFT, ITL, TPOT, E2E latency,
request and token throughput, against SGLang or ``python -m workbench serve``.

Two arrival modes:

- ``closed``: ``concurrency`` clients, each sending its next request as soon as the previous one
  finished (a fixed number in flight);
- ``poisson``: requests arrive at ``rate`` per second (exponential gaps, seeded); at most
  ``concurrency`` are in flight (SGLang's ``--max-concurrency``); ``rate=inf`` sends all at once.

Every request streams (server-sent events). Per request: TTFT = first chunk carrying a token −
send time; ITL = gaps between successive token-carrying chunks (a speculative step that emits
several tokens is one chunk, as in bench_serving); TPOT = (E2E − TTFT) / (output tokens − 1).
Output tokens are the server's ``completion_tokens`` (``/generate``) or ``usage`` (OpenAI).

Speculation (``/generate``): the finished chunk's ``meta_info`` carries ``spec_verify_ct`` and
``spec_correct_drafts_histogram`` (SGLang 0.5.23 and ``workbench serve`` alike); each request's
per-round accept lengths come from the histogram (exact: k correct drafts → k + 1 tokens), and
only from a server that sends none are they spread evenly over ``completion_tokens``
(``accept_lengths_exact`` False).
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from workbench.errors import RequestFailed
from workbench.remote.sglang import round_accept_lengths
from workbench.stats import percentile

Mode = Literal["closed", "poisson"]
Api = Literal["generate", "completions"]


@dataclass
class RequestRecord:
    """What one benchmark request measured (seconds; ``start`` relative to the run start)."""

    index: int
    start: float = 0.0
    success: bool = False
    error: str = ""
    prompt_len: int = 0
    output_len: int = 0
    ttft: float = math.nan
    e2e: float = math.nan
    itl: list[float] = field(default_factory=list)
    verify_ct: int = 0
    accept_lengths: list[int] = field(default_factory=list)  # per verify round, bonus included
    accept_lengths_exact: bool = True  # from spec_correct_drafts_histogram (else spread evenly)

    @property
    def tpot(self) -> float:
        if self.output_len <= 1 or math.isnan(self.ttft):
            return math.nan
        return (self.e2e - self.ttft) / (self.output_len - 1)


def _body(api: Api, prompt: str | Sequence[int], max_new_tokens: int, temperature: float,
          ignore_eos: bool, extra: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    if api == "generate":
        sp = {"max_new_tokens": max_new_tokens, "temperature": temperature, **extra}
        if ignore_eos:
            sp["ignore_eos"] = True
        key = "text" if isinstance(prompt, str) else "input_ids"
        value = prompt if isinstance(prompt, str) else list(prompt)
        return "/generate", {key: value, "sampling_params": sp, "stream": True}
    body: dict[str, Any] = {"prompt": prompt if isinstance(prompt, str) else list(prompt),
                            "max_tokens": max_new_tokens, "temperature": temperature,
                            "stream": True, "stream_options": {"include_usage": True}, **extra}
    if ignore_eos:
        body["ignore_eos"] = True
    return "/v1/completions", body


async def _request(client: Any, rec: RequestRecord, path: str, body: dict[str, Any], api: Api,
                   t_run: float) -> None:
    import httpx

    t0 = time.perf_counter()
    rec.start = t0 - t_run
    last_tok = t0
    seen = 0
    try:
        async with client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                text = (await r.aread())[:300].decode(errors="replace")
                rec.error = f"HTTP {r.status_code}: {text}"
                return
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                now = time.perf_counter()
                if api == "generate":
                    meta = chunk.get("meta_info") or {}
                    ids = chunk.get("output_ids") or []
                    count = int(meta.get("completion_tokens") or len(ids))
                    rec.prompt_len = int(meta.get("prompt_tokens") or 0)
                    if meta.get("spec_verify_ct"):  # the finished chunk (SGLang: only there)
                        rec.verify_ct = int(meta["spec_verify_ct"])
                        rec.accept_lengths = round_accept_lengths(meta)
                        rec.accept_lengths_exact = bool(meta.get("spec_correct_drafts_histogram"))
                else:
                    usage = chunk.get("usage")
                    if usage:
                        rec.prompt_len = int(usage.get("prompt_tokens") or 0)
                        rec.output_len = int(usage.get("completion_tokens") or 0)
                        continue
                    text = "".join(c.get("text", "") for c in chunk.get("choices", []))
                    count = seen + (1 if text else 0)  # text deltas: count chunks, fixed by usage
                if count > seen:
                    if seen == 0:
                        rec.ttft = now - t0
                    else:
                        rec.itl.append(now - last_tok)
                    last_tok = now
                    seen = count
        rec.e2e = time.perf_counter() - t0
        if api == "generate" or rec.output_len == 0:
            rec.output_len = seen
        rec.success = True
    except (httpx.HTTPError, OSError, ValueError, RequestFailed) as e:  # transport, JSON, meta
        rec.error = f"{type(e).__name__}: {e}"


async def _run(url: str, prompts: list[str | Sequence[int]], concurrency: int, mode: Mode,
               rate: float | None, api: Api, max_new_tokens: int, temperature: float,
               ignore_eos: bool, seed: int, timeout: float, progress: bool,
               extra: dict[str, Any]) -> tuple[list[RequestRecord], float]:
    import httpx

    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(prompts), desc=f"bench {mode} c={concurrency}", unit="req")
    records = [RequestRecord(i) for i in range(len(prompts))]
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url.rstrip("/"), timeout=timeout,
                                 limits=limits) as client:
        t_run = time.perf_counter()

        async def one(i: int) -> None:
            path, body = _body(api, prompts[i], max_new_tokens, temperature, ignore_eos, extra)
            await _request(client, records[i], path, body, api, t_run)
            if bar is not None:
                bar.update(1)

        if mode == "closed":
            it = iter(range(len(prompts)))

            async def worker() -> None:
                for i in it:
                    await one(i)

            await asyncio.gather(*(worker() for _ in range(min(concurrency, len(prompts)))))
        else:
            rng = random.Random(seed)
            sem = asyncio.Semaphore(concurrency)

            async def limited(i: int) -> None:
                async with sem:
                    await one(i)

            tasks = []
            for i in range(len(prompts)):
                tasks.append(asyncio.ensure_future(limited(i)))
                if rate is not None and math.isfinite(rate) and i + 1 < len(prompts):
                    await asyncio.sleep(rng.expovariate(rate))
            await asyncio.gather(*tasks)
        duration = time.perf_counter() - t_run
    if bar is not None:
        bar.close()
    return records, duration


def _run_sync(coro: Any) -> Any:
    """``asyncio.run``, on a helper thread when this thread already runs a loop (Jupyter)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1, thread_name_prefix="http-bench") as pool:
        return pool.submit(asyncio.run, coro).result()


def _summary(name: str, xs: list[float]) -> dict[str, float]:
    ms = [x * 1e3 for x in xs if not math.isnan(x)]
    return {f"mean_{name}_ms": statistics.fmean(ms) if ms else math.nan,
            f"median_{name}_ms": percentile(ms, 50), f"p50_{name}_ms": percentile(ms, 50),
            f"p90_{name}_ms": percentile(ms, 90), f"p99_{name}_ms": percentile(ms, 99),
            f"max_{name}_ms": max(ms) if ms else math.nan}


def run_http_bench(url: str, prompts: Sequence[str | Sequence[int]], concurrency: int = 8,
                   mode: Mode = "closed", rate: float | None = None,
                   max_new_tokens: int = 128, *, temperature: float = 0.0,
                   ignore_eos: bool = True, api: Api = "generate", seed: int = 0,
                   timeout: float = 600.0, progress: bool = True,
                   extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Benchmark the server at ``url`` with ``prompts`` (text or token ids); module doc.

    Returns a flat dict: counts, ``duration_s``, ``request_throughput`` (req/s),
    ``output_throughput`` and ``total_throughput`` (tok/s), mean/median/p50/p90/p99/max of
    ``ttft``, ``itl``, ``tpot`` and ``e2e`` in ms, ``accept_length`` (server-side τ: output
    tokens / verify steps over successful requests; None without speculation), the first few
    ``errors`` and the ``requests`` list (one dict per request).
    """
    if concurrency < 1:
        raise ValueError(f"concurrency: must be >= 1, got {concurrency}")
    if mode not in ("closed", "poisson"):
        raise ValueError(f"mode: expected 'closed' or 'poisson', got {mode!r}")
    if mode == "poisson" and (rate is None or rate <= 0):
        raise ValueError("rate: poisson mode needs a request rate > 0 (req/s; inf = all at once)")
    if api not in ("generate", "completions"):
        raise ValueError(f"api: expected 'generate' or 'completions', got {api!r}")
    plist = list(prompts)
    records, duration = _run_sync(_run(url, plist, concurrency, mode, rate, api, max_new_tokens,
                                       temperature, ignore_eos, seed, timeout, progress,
                                       dict(extra or {})))
    ok = [r for r in records if r.success]
    out_tok = sum(r.output_len for r in ok)
    in_tok = sum(r.prompt_len for r in ok)
    verify = sum(r.verify_ct for r in ok)
    result: dict[str, Any] = {
        "url": url, "api": api, "mode": mode, "concurrency": concurrency, "rate": rate,
        "max_new_tokens": max_new_tokens, "num_prompts": len(plist), "completed": len(ok),
        "failed": len(records) - len(ok), "duration_s": duration,
        "total_input_tokens": in_tok, "total_output_tokens": out_tok,
        "request_throughput": len(ok) / duration if duration > 0 else math.nan,
        "output_throughput": out_tok / duration if duration > 0 else math.nan,
        "total_throughput": (in_tok + out_tok) / duration if duration > 0 else math.nan,
        "concurrency_achieved": (sum(r.e2e for r in ok) / duration) if duration > 0 else math.nan,
        "accept_length": out_tok / verify if verify else None,
    }
    rounds = [a for r in ok for a in r.accept_lengths]
    # τ over verify rounds alone (the prefill's token left out), and its distribution
    result["round_accept_length"] = sum(rounds) / len(rounds) if rounds else None
    hist: list[int] = []
    for a in rounds:
        hist.extend([0] * (a - len(hist)))
        hist[a - 1] += 1
    result["accept_length_histogram"] = hist  # [i]: rounds that emitted i + 1 tokens
    result["accept_lengths_exact"] = all(r.accept_lengths_exact for r in ok)
    result.update(_summary("ttft", [r.ttft for r in ok]))
    result.update(_summary("itl", [x for r in ok for x in r.itl]))
    result.update(_summary("tpot", [r.tpot for r in ok]))
    result.update(_summary("e2e", [r.e2e for r in ok]))
    result["errors"] = [f"request {r.index}: {r.error}" for r in records if not r.success][:10]
    result["requests"] = [{**asdict(r), "tpot": r.tpot} for r in records]
    return result


def format_table(result: dict[str, Any]) -> str:
    """A bench_serving-style text table of :func:`run_http_bench`'s result."""
    def f(v: Any, digits: int = 2) -> str:
        if v is None or (isinstance(v, float) and math.isnan(v)):
            return "n/a"
        return f"{v:.{digits}f}" if isinstance(v, float) else str(v)

    rate = result.get("rate")
    rows: list[tuple[str, Any] | str] = [
        " Serving Benchmark Result ",
        ("Backend URL", result["url"]), ("API", result["api"]),
        ("Arrival mode", result["mode"]),
        ("Request rate (req/s)", "n/a" if rate is None else f(float(rate))),
        ("Max concurrency", result["concurrency"]),
        ("Successful requests", result["completed"]), ("Failed requests", result["failed"]),
        ("Benchmark duration (s)", f(result["duration_s"])),
        ("Total input tokens", result["total_input_tokens"]),
        ("Total generated tokens", result["total_output_tokens"]),
        ("Request throughput (req/s)", f(result["request_throughput"])),
        ("Output token throughput (tok/s)", f(result["output_throughput"])),
        ("Total token throughput (tok/s)", f(result["total_throughput"])),
        ("Concurrency achieved", f(result["concurrency_achieved"])),
        ("Accept length (server)", f(result["accept_length"])),
        ("Accept length (per round)", f(result.get("round_accept_length"))),
    ]
    for name, title in (("e2e", "End-to-End Latency"), ("ttft", "Time to First Token"),
                        ("tpot", "Time per Output Token (excl. 1st token)"),
                        ("itl", "Inter-Token Latency")):
        rows.append(f" {title} ")
        for stat in ("mean", "median", "p90", "p99"):
            rows.append((f"{stat.capitalize()} {name.upper()} (ms)",
                         f(result[f"{stat}_{name}_ms"])))
    width = 50
    lines: list[str] = []
    for row in rows:
        if isinstance(row, str):
            lines.append(row.center(width, "=" if not lines else "-"))
        else:
            lines.append(f"{row[0] + ':':<40}{row[1]!s:>10}")
    lines.append("=" * width)
    for e in result.get("errors", [])[:3]:
        lines.append(f"error: {e}")
    return "\n".join(lines)
