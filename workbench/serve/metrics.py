"""Prometheus text exposition of engine counters, with SGLang and vLLM metric names.

:func:`snapshot` runs on the engine-loop thread (it reads engine state); :func:`render` turns the
snapshot into the text format (version 0.0.4) on any thread. Names and meaning:

- ``sglang:spec_accept_length`` (gauge): mean τ over every verify step, bonus token included;
- ``sglang:spec_accept_rate`` (gauge): accepted draft tokens / drafted tokens;
- ``sglang:spec_num_steps`` / ``sglang:spec_num_draft_tokens`` (gauges): the configured tree
  depth S and node count N (0 without speculation);
- ``sglang:spec_verify_calls_total`` (counter): verify steps (one per request per step);
- ``sglang:num_running_reqs`` (gauge): requests in the engine's running batch (prefilling or
  decoding); ``sglang:num_queue_reqs`` (gauge): submitted requests not in it yet (queued for
  admission or waiting in the scheduler);
- ``sglang:generation_tokens_total`` / ``sglang:prompt_tokens_total`` (counters);
- ``sglang:gen_throughput`` (gauge, tokens/s over the engine's busy time), ``sglang:token_usage``
  (gauge: KV pages in use / pages), ``sglang:cache_hit_rate`` (gauge: always 0, no prefix
  cache here); the TTFT / inter-token / end-to-end latency histograms with SGLang's names,
  labels and buckets: :mod:`workbench.serve.sglang_metrics`;

Every ``sglang:`` series carries a ``model_name`` label (the served model name), as SGLang's do.
- ``vllm:spec_decode_num_drafts_total``, ``..._num_draft_tokens_total``,
  ``..._num_accepted_tokens_total`` and ``..._num_accepted_tokens_per_pos_total{position="i"}``
  (counters; position i counts verify steps whose accepted path reached depth i+1);
- ``workbench:kv_used_blocks`` / ``workbench:kv_total_blocks`` (gauges, pages of the KV pool).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from workbench.engine.engine import Engine

# (name, type, help); label-less unless noted in render().
METRICS: tuple[tuple[str, str, str], ...] = (
    ("sglang:spec_accept_length", "gauge",
     "Mean accepted tokens per verify step, bonus token included."),
    ("sglang:spec_accept_rate", "gauge", "Accepted draft tokens / drafted tokens."),
    ("sglang:spec_num_steps", "gauge", "Configured draft depth S (0: no speculation)."),
    ("sglang:spec_num_draft_tokens", "gauge", "Configured draft tree nodes N (0: none)."),
    ("sglang:spec_verify_calls_total", "counter", "Verify steps (one per request per step)."),
    ("sglang:num_running_reqs", "gauge", "Requests in the running batch."),
    ("sglang:num_queue_reqs", "gauge", "Submitted requests not in the running batch yet."),
    ("sglang:generation_tokens_total", "counter", "Generated tokens."),
    ("sglang:prompt_tokens_total", "counter", "Prompt tokens of admitted requests."),
    ("sglang:num_requests_total", "counter", "Admitted requests."),
    ("sglang:gen_throughput", "gauge", "The generation throughput (token/s)."),
    ("sglang:token_usage", "gauge", "The token usage (share of the KV pool in use)."),
    ("sglang:cache_hit_rate", "gauge",
     "The prefix cache hit rate (0: the workbench keeps no prefix cache)."),
    ("vllm:spec_decode_num_drafts_total", "counter", "Verify steps (one draft tree each)."),
    ("vllm:spec_decode_num_draft_tokens_total", "counter", "Drafted tokens (tree nodes)."),
    ("vllm:spec_decode_num_accepted_tokens_total", "counter", "Accepted draft tokens."),
    ("vllm:spec_decode_num_accepted_tokens_per_pos_total", "counter",
     "Accepted draft tokens per tree depth (position)."),
    ("workbench:kv_used_blocks", "gauge", "KV pool pages in use."),
    ("workbench:kv_total_blocks", "gauge", "KV pool pages."),
    ("workbench:verify_steps_total", "counter", "Engine steps that speculated."),
    ("workbench:plain_steps_total", "counter", "Engine decode steps without speculation."),
)


def snapshot(engine: Engine, loop: Any) -> dict[str, Any]:
    """Counters of ``engine`` and of the serving ``loop`` (call on the engine-loop thread)."""
    st = engine.stats
    kv = engine.kv_usage()
    spec = engine.spec
    running = engine.num_running()
    return {
        "sglang:spec_accept_length": st.accept_length,
        "sglang:spec_accept_rate": st.accept_rate,
        "sglang:spec_num_steps": 0 if spec is None else spec.num_steps,
        "sglang:spec_num_draft_tokens": 0 if spec is None else spec.num_draft_tokens,
        "sglang:spec_verify_calls_total": st.verify_ct,
        "sglang:num_running_reqs": running,
        "sglang:num_queue_reqs": max(0, loop.num_pending - running),
        "sglang:generation_tokens_total": st.generated_tokens,
        "sglang:prompt_tokens_total": loop.prompt_tokens_total,
        "sglang:num_requests_total": loop.requests_total,
        **loop.metrics.snapshot(),
        "sglang:token_usage": kv["used_blocks"] / kv["total_blocks"] if kv["total_blocks"] else 0.0,
        "sglang:cache_hit_rate": 0.0,
        "vllm:spec_decode_num_drafts_total": st.num_drafts,
        "vllm:spec_decode_num_draft_tokens_total": st.num_draft_tokens,
        "vllm:spec_decode_num_accepted_tokens_total": st.num_accepted_tokens,
        "vllm:spec_decode_num_accepted_tokens_per_pos_total": list(st.accepted_per_pos),
        "workbench:kv_used_blocks": kv["used_blocks"],
        "workbench:kv_total_blocks": kv["total_blocks"],
        "workbench:verify_steps_total": st.steps.get("spec", 0),
        "workbench:plain_steps_total": st.steps.get("plain", 0),
    }


def _num(v: float | int) -> str:
    return repr(float(v)) if isinstance(v, float) else str(int(v))


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def render(snap: dict[str, Any], num_positions: int = 0, model_name: str | None = None) -> str:
    """Prometheus text. Per-position counters cover at least ``num_positions`` positions (zeros
    until a verify step reaches that depth), so dashboards see every series from the start.
    ``model_name``: the label on every ``sglang:`` series."""
    lines: list[str] = []
    for name, kind, help_ in METRICS:
        lines.append(f"# HELP {name} {help_}")
        lines.append(f"# TYPE {name} {kind}")
        v = snap[name]
        label = f'{{model_name="{_label(model_name)}"}}' \
            if model_name is not None and name.startswith("sglang:") else ""
        if isinstance(v, list):
            counts = list(v) + [0] * max(0, num_positions - len(v))
            lines += [f'{name}{{position="{i}"}} {c}' for i, c in enumerate(counts)]
        else:
            lines.append(f"{name}{label} {_num(v)}")
    return "\n".join(lines) + "\n"
