"""SGLang's own benchmark client, unchanged, against ``workbench serve`` on the shipped pair.

``python -m sglang.bench_serving`` (sglang 0.5.23 from PyPI) runs from its own venv, built by
``make sglang-client`` (``make test`` builds it and names it in WORKBENCH_SGLANG_CLIENT; run
alone, the test uses ~/.cache/workbench/sglang-client-venv if it exists and skips otherwise).
Offline: random token ids, the shipped tokenizer, HF_HUB_OFFLINE=1. Every request must succeed
and the accept length it reports must equal the server's. The workbench's own ``bench --url`` client
reads the same fields: its exact per-round accept lengths must add up to the server's counters.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
TARGET = ROOT / "data" / "models" / "wb-target"
DRAFT = ROOT / "data" / "models" / "wb-eagle3"
NUM_PROMPTS = 8


def _client_python() -> Path:
    env = os.environ.get("WORKBENCH_SGLANG_CLIENT")
    if env:
        if not Path(env).is_file():
            pytest.fail(f"WORKBENCH_SGLANG_CLIENT={env} does not exist (make sglang-client)")
        return Path(env)
    local = Path.home() / ".cache" / "workbench" / "sglang-client-venv" / "bin" / "python"
    if not local.is_file():
        pytest.skip("SGLang's client venv is not built: run `make sglang-client` (make test "
                    "builds it)")
    return local


@pytest.fixture(scope="module")
def served() -> Iterator[str]:
    """``python -m workbench serve`` with the shipped target + EAGLE-3 head on loopback."""
    cmd = [sys.executable, "-m", "workbench", "serve", "--model", str(TARGET), "--draft",
           str(DRAFT), "--host", "127.0.0.1", "--port", "0", "--kv-budget-tokens", "16384"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                            text=True)
    try:
        url = None
        assert proc.stderr is not None
        for line in proc.stderr:  # the engine loads, then one "serving ... on URL" line
            m = re.search(r"serving .* on (http://\S+)", line)
            if m:
                url = m.group(1)
                break
        assert url is not None, f"workbench serve exited with {proc.wait()} before serving"
        # keep draining its log (uvicorn's access lines) so a full pipe never blocks it
        threading.Thread(target=proc.stderr.read, daemon=True).start()
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _metrics(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=30).text
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name.split("{model_name=")[0]] = float(value)
    return out


def test_bench_serving_runs_against_workbench_serve(served: str, tmp_path: Path) -> None:
    client = _client_python()
    result = tmp_path / "bench.jsonl"
    cmd = [str(client), "-W", "ignore", "-m", "sglang.bench_serving", "--backend", "sglang",
           "--base-url", served, "--model", str(TARGET), "--tokenizer", str(TARGET),
           "--dataset-name", "random-ids", "--random-input-len", "64", "--random-output-len",
           "32", "--random-range-ratio", "1.0", "--num-prompts", str(NUM_PROMPTS),
           "--max-concurrency", "4", "--output-file", str(result), "--seed", "1"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env.pop("TRITON_INTERPRET", None)
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, f"bench_serving failed:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    assert "Serving Benchmark Result" in run.stdout, run.stdout[-2000:]
    assert re.search(rf"Successful requests:\s+{NUM_PROMPTS}\b", run.stdout), run.stdout[-2000:]
    rec = json.loads(result.read_text().splitlines()[-1])
    assert rec["completed"] == NUM_PROMPTS
    assert rec["total_output_tokens"] == NUM_PROMPTS * 32  # ignore_eos: every token generated
    info = httpx.get(served + "/server_info", timeout=30).json()
    server_tau = info["internal_states"][0]["avg_spec_accept_length"]
    assert server_tau > 1.0  # the shipped head is accepted
    assert rec["accept_length"] == pytest.approx(server_tau, abs=1e-12)
    assert _metrics(served)["sglang:spec_accept_length"] == pytest.approx(server_tau, abs=1e-9)
    printed = re.search(r"Accept length:\s+([0-9.]+)", run.stdout)
    assert printed and float(printed.group(1)) == pytest.approx(server_tau, abs=0.005)


def _bench(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env.pop("TRITON_INTERPRET", None)
    return subprocess.run([str(_client_python()), "-W", "ignore", "-m", "sglang.bench_serving",
                           *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=600)


def test_shortest_command_asks_the_server(served: str, tmp_path: Path) -> None:
    """No --model, no --tokenizer: bench_serving names the model from /v1/models and loads
    the tokenizer /model_info names (an absolute path: it runs from another directory here)."""
    run = _bench(["--backend", "sglang", "--base-url", served, "--dataset-name", "random-ids",
                  "--num-prompts", "4", "--random-input-len", "32", "--random-output-len", "8"],
                 tmp_path)
    assert run.returncode == 0, f"bench_serving failed:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    assert re.search(r"Successful requests:\s+4\b", run.stdout), run.stdout[-2000:]
    assert "model='wb-target'" in run.stdout and "tokenizer=None" in run.stdout


def test_chat_backend_with_flush_cache(served: str, tmp_path: Path) -> None:
    """``--backend sglang-oai-chat`` renders with the shipped chat template on the server;
    ``--flush-cache`` calls /flush_cache after the warmup."""
    run = _bench(["--backend", "sglang-oai-chat", "--base-url", served, "--dataset-name",
                  "random-ids", "--num-prompts", "4", "--random-input-len", "32",
                  "--random-output-len", "8", "--flush-cache"], tmp_path)
    assert run.returncode == 0, f"bench_serving failed:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    assert re.search(r"Successful requests:\s+4\b", run.stdout), run.stdout[-2000:]


def test_workbench_bench_reads_exact_rounds(served: str) -> None:
    """``bench --url``: per-round accept lengths from spec_correct_drafts_histogram add up to
    the server's own verify and acceptance counters over the same requests (plus its plain
    rounds, accept length 1 each)."""
    from workbench.bench.http import run_http_bench

    before = _metrics(served)
    prompts = [list(range(10 + i, 40 + i)) for i in range(6)]
    res = run_http_bench(served, prompts, concurrency=3, max_new_tokens=24, progress=False)
    after = _metrics(served)
    assert res["completed"] == len(prompts) and res["failed"] == 0, res["errors"]
    assert res["accept_lengths_exact"]
    reqs = res["requests"]
    rounds = [a for r in reqs for a in r["accept_lengths"]]
    verify = after["vllm:spec_decode_num_drafts_total"] - before[
        "vllm:spec_decode_num_drafts_total"]
    accepted = after["vllm:spec_decode_num_accepted_tokens_total"] - before[
        "vllm:spec_decode_num_accepted_tokens_total"]
    # SGLang's rounds: our verify steps, and the plain steps the speculating server took
    # (one token left, ...) as rounds with 0 correct drafts
    assert len(rounds) == sum(r["verify_ct"] for r in reqs) >= verify > 0
    assert sum(rounds) - len(rounds) == accepted
    assert sum(res["accept_length_histogram"]) == len(rounds)
    assert res["round_accept_length"] == pytest.approx(sum(rounds) / len(rounds))
