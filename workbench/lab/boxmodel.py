"""The box's step model, by named terms (docs/LAB.md, "The box").

A forward of T tokens for R requests at mean context C (q = T/R query tokens per request) on
one TP rank costs

    floor                   the fitted per-forward floor F (kernel minima, sampling, host
                            sync), scaled by (layers + 1) for the draft head
    weights                 bytes(T) / (eta * BW): replicated + sharded dense bytes + per MoE
                            layer the distinct experts T tokens touch (uniform routing)
    collectives             2 * layers + 1 all-reduces of T * hidden * 2 bytes, each priced
                            by its size on the path it takes (fused, custom or NCCL:
                            :mod:`workbench.lab.collectives`)
    attention               R * C * (KV bytes / (eta * BW) + a * layers * q): the KV read is
                            given, a (``fit.attn_ns``, ns per context token per layer per
                            query token) is the second fitted constant
    compute_excess          max(0, T * FLOPs per token / peak - weights)

A plain step is one target forward of the decode batch (padded to SGLang's CUDA-graph size) plus
the host's scheduling where the overlap scheduler is off. A speculative step (a chain, SGLang's
EAGLE worker) is S - 1 draft forwards of B * K tokens, the verify of B * N tokens, the draft
extend of B * N tokens and the host's work when the overlap scheduler is off (spec v1).
Throughput over a request's life adds its prefill (one target forward of the prompt, attention
as FLOPs, and the draft's extend of it), so tok/s = b * O / ((O / tokens per step) * step + b *
prefill), b = min(concurrency, the server's running-request cap, the requests its KV pool holds
at the workload's mean context: :func:`kv_requests`): a level above that runs at it (the server
queues the rest) and says so.
"""

from __future__ import annotations

from typing import Any

from workbench.errors import ConfigError
from workbench.lab import collectives
from workbench.lab.boxspec import Geometry, capture_sizes, geometry, rules, weights_per_rank_gb

TERMS = ("floor", "weights", "collectives", "attention", "compute_excess")


def coverage(g: Geometry, tokens: float) -> float:
    """Distinct experts per MoE layer that ``tokens`` tokens touch (uniform routing)."""
    if g.moe_layers == 0 or tokens <= 0:
        return 0.0
    return g.num_experts * (1.0 - (1.0 - g.top_k / g.num_experts) ** tokens)


def allreduce_us(box: dict[str, Any], tokens: float, hidden: int) -> float:
    """One all-reduce of ``tokens`` rows of ``hidden`` bf16 values, on the path the server's
    rules send it (:mod:`workbench.lab.collectives`: priced by message size)."""
    r = rules(box)
    return collectives.allreduce_us(box, tokens, hidden, r["allreduce_fusion"],
                                    r["custom_allreduce"])


def forward(box: dict[str, Any], tokens: float, requests: float, context: float,
            which: str = "model", prefill: bool = False) -> dict[str, float]:
    """The terms (ms) of one forward of ``which`` (``model`` or ``draft``) on one rank."""
    g, t = geometry(box, which), geometry(box)
    gpu, fit = box["gpu"], box["fit"]
    bw = float(gpu["eta"]) * float(gpu["hbm_gbps"]) * 1e6  # bytes per ms
    q = tokens / max(requests, 1e-9)
    weights = (g.replicated_bytes + g.dense_bytes
               + g.moe_layers * coverage(g, tokens) * g.expert_bytes) / bw
    flops = tokens * g.flops_per_token
    kv_read = requests * context * g.kv_bytes_per_token / bw
    if prefill:  # a prefill's attention is FLOPs (4 * hidden per context token per layer)
        flops += tokens * context * 4 * g.hidden * g.layers / int(box["layout"]["tp"])
        attention = kv_read
    else:
        attention = kv_read + float(fit["attn_ns"]) * 1e-6 * g.layers * requests * context * q
    compute = flops / (float(gpu["tflops"]["bf16"]) * 1e9)
    return {"floor": float(fit["floor_ms"]) * (g.layers + 1) / (t.layers + 1),
            "weights": weights,
            "collectives": g.allreduces * allreduce_us(box, tokens, g.hidden) / 1e3,
            "attention": attention,
            "compute_excess": max(0.0, compute - weights)}


def padded(box: dict[str, Any], batch: int, spec: bool) -> int:
    """The decode batch SGLang runs: padded up to the next CUDA-graph size (eager above)."""
    sizes = capture_sizes(rules(box)["cuda_graph_max_bs"], spec)
    return next((b for b in sizes if b >= batch), batch)


def kv_requests(box: dict[str, Any], spec: bool) -> int:
    """Requests the KV pool holds at the workload's mean context (P + O/2): SGLang sizes the
    pool as the GPU's memory x mem_fraction_static less the weights (0.5.9's rule: reserved
    = 512 MB + 1.5 x chunked prefill (8192) + 2 x cuda_graph_max_bs + tp/8 GB, at least 10 GB
    on a GPU over 60 GB, + 2 GB for an EAGLE draft), and admits requests while tokens are
    free. ``server.kv_tokens`` overrides the pool; ``model.checkpoint_gb`` (when given) sets
    the weights each rank holds (its 1/tp share, plus what every rank replicates)."""
    srv, w = box["server"], box["workload"]
    g, d = geometry(box), geometry(box, "draft")
    per_token = g.kv_bytes_per_token + (d.kv_bytes_per_token if spec else 0.0)
    if srv.get("kv_tokens"):
        tokens = float(srv["kv_tokens"])
    else:
        mib = float(box["gpu"]["mem_gb"]) * 1024
        tp = int(box["layout"]["tp"])
        reserved = 512 + 8192 * 1.5 + rules(box)["cuda_graph_max_bs"] * 2 + tp / 8 * 1024
        reserved = max(reserved, 10 * 1024) if mib > 60 * 1024 else reserved
        reserved += 2 * 1024 if spec else 0
        weights = weights_per_rank_gb(box) * 1e9
        if spec:
            weights += d.replicated_bytes + d.dense_bytes
        tokens = max(0.0, (mib - reserved) * 2**20 - weights) / per_token
    ctx = float(w["prompt_len"]) + float(w["output_len"]) / 2
    return max(1, int(tokens // ctx))


def _host(box: dict[str, Any], batch: int, overlap: bool) -> float:
    r = rules(box)
    return 0.0 if overlap else r["host_ms"] + r["host_ms_per_req"] * batch


def plain_step(box: dict[str, Any], batch: int, context: float) -> dict[str, Any]:
    """One plain decode step at ``batch``: {"target": terms, "host": ms, "ms": total}."""
    b = padded(box, batch, spec=False)
    f = forward(box, b, batch, context)
    host = _host(box, batch, rules(box)["plain_overlap"])
    return {"target": f, "host": host, "ms": sum(f.values()) + host}


def spec_step(box: dict[str, Any], batch: int, context: float,
              shape: tuple[int, int, int] | None = None) -> dict[str, Any]:
    """One speculative step (a chain or tree of ``shape``, default the workload's)."""
    s, k, n = shape or tuple(box["workload"]["shape"])
    b = padded(box, batch, spec=True)
    draft = forward(box, b * k, batch, context, "draft")
    parts = {"draft": {key: (s - 1) * v for key, v in draft.items()},
             "verify": forward(box, b * n, batch, context),
             "extend": forward(box, b * n, batch, context, "draft")}
    host = _host(box, batch, rules(box)["spec_overlap"])
    return {**parts, "host": host, "ms": sum(sum(p.values()) for p in parts.values()) + host}


def prefill_ms(box: dict[str, Any], spec: bool) -> float:
    """One request's prefill: the target over its prompt (+ the draft's extend of it)."""
    p = float(box["workload"]["prompt_len"])
    ms = sum(forward(box, p, 1, p / 2, prefill=True).values())
    if spec:
        ms += sum(forward(box, p, 1, p / 2, "draft", prefill=True).values())
    return ms


def level(box: dict[str, Any], concurrency: int, tau: float | None = None,
          shape: tuple[int, int, int] | None = None) -> dict[str, Any]:
    """Plain and speculative tok/s at one concurrency, with the step decompositions
    (``shape``/``tau``: the speculative step's, default the workload's)."""
    if concurrency < 1:
        raise ConfigError(f"levels: concurrency must be >= 1, got {concurrency}")
    r, w = rules(box), box["workload"]
    tau = float(w["tau"] if tau is None else tau)
    shape = tuple(shape or w["shape"])  # type: ignore[assignment]
    s, _, n = shape  # type: ignore[misc]
    if not 1.0 <= tau <= min(s, n - 1) + 1:
        raise ConfigError(f"workload.tau: {tau} outside 1..{min(s, n - 1) + 1}")
    out_len, ctx = float(w["output_len"]), float(w["prompt_len"]) + float(w["output_len"]) / 2
    row: dict[str, Any] = {"concurrency": concurrency, "tau": tau}
    for mode, cap in (("plain", r["max_running_requests"]),
                      ("spec", r["spec_max_running_requests"])):
        b = min(concurrency, cap, kv_requests(box, mode == "spec"))
        step = spec_step(box, b, ctx, shape) if mode == "spec" else plain_step(box, b, ctx)
        per = b * (tau if mode == "spec" else 1.0)
        life = out_len / (per / b) * step["ms"] + b * prefill_ms(box, mode == "spec")
        row.update({f"{mode}_batch": b, f"{mode}_capped": b < concurrency,
                    f"{mode}_step_ms": step["ms"], f"{mode}_tok_s": 1e3 * b * out_len / life,
                    f"{mode}_terms": by_term(step), f"{mode}_step": step})
    row["gain"] = row["spec_tok_s"] / row["plain_tok_s"]
    return row


def off_level(box: dict[str, Any], concurrency: int) -> dict[str, Any]:
    """A speculative server's step with speculation off (a dynamic policy's 0 steps): the
    target over the decode batch and the draft's extend of it (SGLang keeps the draft warm),
    under the speculative server's cap and overlap rule."""
    r, w = rules(box), box["workload"]
    out_len, ctx = float(w["output_len"]), float(w["prompt_len"]) + float(w["output_len"]) / 2
    b = min(concurrency, r["spec_max_running_requests"], kv_requests(box, True))
    pb = padded(box, b, spec=True)
    step = {"target": forward(box, pb, b, ctx), "extend": forward(box, pb, b, ctx, "draft"),
            "host": _host(box, b, r["spec_overlap"])}
    step["ms"] = sum(step["target"].values()) + sum(step["extend"].values()) + step["host"]
    life = out_len * step["ms"] + b * prefill_ms(box, True)
    return {"batch": b, "capped": b < concurrency, "step": step,
            "tok_s": 1e3 * b * out_len / life}


def by_term(step: dict[str, Any]) -> dict[str, float]:
    """A step's ms summed by term over its forwards, plus ``host``."""
    out = dict.fromkeys(TERMS, 0.0)
    for part in step.values():
        if isinstance(part, dict):
            for t in TERMS:
                out[t] += part[t]
    out["host"] = float(step["host"])
    return out


def what_if(box: dict[str, Any], levels: list[int] | None = None,
            tau: float | None = None) -> Any:
    """tok/s of plain and speculative decoding at each level (a DataFrame: ``*_tok_s``,
    ``gain``, the batch the server runs, whether the level was capped, step ms and each step's
    terms as ``plain_<term>`` / ``spec_<term>`` columns)."""
    import pandas as pd

    rows = []
    for c in levels or list(box["workload"]["levels"]):
        row = level(box, int(c), tau)
        flat = {k: v for k, v in row.items() if not isinstance(v, dict)}
        for mode in ("plain", "spec"):
            flat.update({f"{mode}_{t}": v for t, v in row[f"{mode}_terms"].items()})
        rows.append(flat)
    return pd.DataFrame(rows)


def crossing(box: dict[str, Any], tau: float, top: int = 256,
             shape: tuple[int, int, int] | None = None) -> int | None:
    """The smallest concurrency where plain decoding (a plain server) is at least as fast
    (None: never up to ``top``); 1 when speculation never wins."""
    for c in range(1, top + 1):
        row = level(box, c, tau, shape)
        if row["plain_tok_s"] >= row["spec_tok_s"]:
            return c
    return None


def crossing_one_server(box: dict[str, Any], tau: float, shape: tuple[int, int, int],
                        top: int = 256) -> int | None:
    """As :func:`crossing`, but with speculation turned off inside the EAGLE-3 server (its
    cap, its overlap rule, the draft kept warm: :func:`off_level`) instead of routing to a
    plain server beside it."""
    for c in range(1, top + 1):
        if off_level(box, c)["tok_s"] >= level(box, c, tau, shape)["spec_tok_s"]:
            return c
    return None
