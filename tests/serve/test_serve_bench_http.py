"""run_http_bench against the native server: closed and poisson arrivals, both APIs."""

from __future__ import annotations

import math

import pytest
from helpers import id_prompts
from serve.serving import TEXT_PROMPTS

from workbench.bench.http import format_table, run_http_bench

PROMPTS = TEXT_PROMPTS + id_prompts(8, seed=2, lo=2, hi=24)
STATS = ("ttft", "itl", "tpot", "e2e")


@pytest.mark.parametrize("mode,rate,api", [("closed", None, "generate"),
                                           ("poisson", 200.0, "generate"),
                                           ("closed", None, "completions")])
def test_http_bench(server, mode: str, rate: float | None, api: str) -> None:
    res = run_http_bench(server.url, PROMPTS, concurrency=6, mode=mode, rate=rate,
                         max_new_tokens=6, api=api, progress=False)
    assert res["completed"] == len(PROMPTS) and res["failed"] == 0, res["errors"]
    assert res["total_output_tokens"] == 6 * len(PROMPTS)  # ignore_eos by default
    assert res["total_input_tokens"] > 0
    assert res["request_throughput"] > 0 and res["output_throughput"] > 0
    for s in STATS:
        assert math.isfinite(res[f"mean_{s}_ms"]) and res[f"mean_{s}_ms"] > 0, s
        assert res[f"p50_{s}_ms"] <= res[f"p99_{s}_ms"] <= res[f"max_{s}_ms"]
    for r in res["requests"]:
        assert r["success"] and r["ttft"] <= r["e2e"]
        assert len(r["itl"]) >= 1
    if api == "generate":
        assert res["accept_length"] >= 1.0  # server-side τ from meta_info
    table = format_table(res)
    assert "Serving Benchmark Result" in table and "Median TTFT (ms)" in table
    assert f"{len(PROMPTS)}" in table
    assert server.wait_idle(30) and server.kv_usage()["used_blocks"] == 0


def test_http_bench_reports_failures(server) -> None:
    res = run_http_bench(server.url, ["ok prompt", ""], concurrency=2, max_new_tokens=3,
                         progress=False)
    assert res["completed"] == 1 and res["failed"] == 1
    assert "400" in res["errors"][0] and "empty prompt" in res["errors"][0]


def test_http_bench_argument_errors() -> None:
    with pytest.raises(ValueError, match="rate"):
        run_http_bench("http://127.0.0.1:9", ["a"], mode="poisson")
    with pytest.raises(ValueError, match="concurrency"):
        run_http_bench("http://127.0.0.1:9", ["a"], concurrency=0)
