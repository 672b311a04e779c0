"""Reliability test kit: micro engines, prompts, a bounded drain, greedy references, and
``workbench serve`` in a subprocess for the measure_*.py scripts."""

from __future__ import annotations

import re
import subprocess
import sys
import threading

import workbench as wb

SPEC = wb.SpecConfig(num_steps=3, topk=2, num_draft_tokens=6)
CONFIG = wb.EngineConfig(kv_budget_tokens=4096, max_model_len=256, self_check=False)


def greedy(max_new_tokens: int) -> wb.SamplingParams:
    return wb.SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)


def drain(e: wb.Engine, max_steps: int = 2000) -> int:
    """Step until no work is left; a livelock fails the test instead of hanging it."""
    for n in range(max_steps):
        if not e.has_unfinished():
            return n
        e.step()
    raise AssertionError(f"engine still has work after {max_steps} steps (livelock?): "
                         f"{e.num_running()} running, {e.num_waiting()} waiting")


def kv_used(e: wb.Engine) -> int:
    return e.kv_usage()["used_blocks"]


def serve_subprocess(model: str, draft: str) -> tuple[subprocess.Popen[str], str]:
    """``python -m workbench serve`` on a free loopback port in a subprocess (so a load generator
    does not share its interpreter): the process and its URL, once it has printed its banner.
    Its stderr keeps being drained; the caller terminates it."""
    proc = subprocess.Popen([sys.executable, "-m", "workbench", "serve", "--model", model,
                             "--draft", draft, "--port", "0"], stderr=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, text=True)  # no access log
    assert proc.stderr is not None
    url = None
    for line in proc.stderr:
        m = re.search(r"serving .* on (http://\S+)", line)
        if m:
            url = m.group(1)
            break
    assert url, "no banner"
    threading.Thread(target=proc.stderr.read, daemon=True).start()  # keep the pipe drained
    return proc, url
