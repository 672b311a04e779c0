"""Benchmarks and summary for ``scripts/gpu_check.sh`` (one H200; also ``--smoke`` on CPU).

Sections, each timed with CUDA events and bounded by ``--budget-s``:

1. tests: pytest results read from the JUnit XML files the shell script wrote;
2. tree_attention: Triton kernel vs the torch reference vs FlashInfer's paged prefill with a custom
   mask (when installed), on Llama-3-8B attention shapes (H 32, Hkv 8, hd 128, bf16, page 16);
3. decode_bandwidth: an 8B-shaped Llama decode over random bf16 weights (32 layers of q/k/v/o
   and a 4096x14336 gated MLP, plus the LM head): weight bytes read per forward / measured time,
   against the H200's ~4.8 TB/s HBM bound and a measured device-to-device copy;
4. decode_step: the engine's own decode path on an 8B-shaped random Llama over a paged pool —
   each attention backend eager, replayed from CUDA graphs, and graphs with overlapped host
   preparation (workbench/engine/{triton,flashinfer}_backend.py, cuda_graphs.py, overlap.py).

Everything lands in one JSON file. A failing section records its error and the rest still run.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback
import xml.etree.ElementTree as ET
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))
from gpu_device import software  # noqa: E402

H200_HBM_TB_S = 4.8
SECTION_ERRORS: tuple[type[BaseException], ...] = (
    RuntimeError, ValueError, TypeError, ImportError, AssertionError, OSError, KeyError,
    IndexError, NotImplementedError, ZeroDivisionError,
)
try:
    from triton.errors import TritonError

    SECTION_ERRORS = (*SECTION_ERRORS, TritonError)
except ImportError:
    pass


class Budget:
    """Wall-clock budget shared by the sections: each checks ``left()`` before starting work."""

    def __init__(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds

    def left(self) -> float:
        return self.deadline - time.monotonic()


def timed_ms(fn: Callable[[], object], device: torch.device, warmup: int, reps: int
             ) -> dict[str, float]:
    """Median and min milliseconds of ``fn()`` (CUDA events on GPU, perf_counter on CPU)."""
    for _ in range(warmup):
        fn()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(reps):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    else:
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return {"median_ms": statistics.median(times), "min_ms": min(times), "reps": reps}


def machine_info(device: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": str(device),
        "hostname": platform.node(),
    }
    for name in ("triton", "flashinfer"):
        try:
            module = __import__(name)
            info[name] = getattr(module, "__version__", "installed")
        except ImportError:
            info[name] = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(gpu=props.name, capability=f"{props.major}.{props.minor}",
                    gpu_memory_gib=round(props.total_memory / 2**30, 1),
                    sm_count=props.multi_processor_count, cuda=torch.version.cuda)
    return info


# ---------------------------------------------------------------- 1. tests


def read_junit(spec: str) -> dict[str, Any]:
    """``NAME=PATH:RC`` → counts from a pytest JUnit XML file and the pytest exit code."""
    name, rest = spec.split("=", 1)
    path, rc = rest.rsplit(":", 1)
    out: dict[str, Any] = {"name": name, "exit_code": int(rc), "junit": path}
    if not Path(path).exists():
        out["note"] = "no JUnit file (pytest did not start, or was killed by its timeout)"
        return out
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    for key in ("tests", "failures", "errors", "skipped"):
        out[key] = sum(int(s.get(key, 0)) for s in suites)
    out["time_s"] = round(sum(float(s.get("time", 0.0)) for s in suites), 1)
    failed = []
    for case in root.iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            failed.append(f"{case.get('classname')}::{case.get('name')}")
    out["failed"] = failed[:50]
    return out


# ---------------------------------------------------------------- 2. tree attention


def ancestor_closure(parents: list[int]) -> torch.Tensor:
    """(N, N) bool: [i, j] = j is i or an ancestor of i."""
    n = len(parents)
    out = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            out[i, j] = True
            j = parents[j]
    return out


def tree_problem(batch: int, nodes: int, prefix: int, heads: int, kv_heads: int, head_dim: int,
                 page_size: int, dtype: torch.dtype, device: torch.device, seed: int = 0
                 ) -> tuple[dict[str, Any], list[list[int]]]:
    """A tree-verify problem on a shuffled paged pool. Returns (kwargs, page table)."""
    gen = torch.Generator().manual_seed(seed)
    kv_len = prefix + nodes
    pages_per_req = -(-kv_len // page_size)
    num_pages = batch * pages_per_req
    perm = torch.randperm(num_pages, generator=gen).view(batch, pages_per_req)
    pos = torch.arange(kv_len)
    kv_indices = perm[:, pos // page_size] * page_size + pos % page_size  # (B, kv_len)
    slots = num_pages * page_size
    parents = [-1] + [(i - 1) // 4 for i in range(1, nodes)]  # EAGLE-like: 4 children per node
    mask = torch.ones(batch, nodes, kv_len, dtype=torch.bool)
    mask[:, :, prefix:] = ancestor_closure(parents)
    kwargs = dict(
        q=torch.randn(batch * nodes, heads, head_dim, device=device, dtype=dtype),
        k_cache=torch.randn(slots, kv_heads, head_dim, device=device, dtype=dtype),
        v_cache=torch.randn(slots, kv_heads, head_dim, device=device, dtype=dtype),
        qo_indptr=torch.arange(0, batch * nodes + 1, nodes, device=device),
        kv_indices=kv_indices.to(device),
        kv_lens=torch.full((batch,), kv_len, dtype=torch.int64, device=device),
        mask=mask.to(device),
        sm_scale=head_dim**-0.5,
    )
    return kwargs, perm.tolist()


def flashinfer_runner(kw: dict[str, Any], page_table: list[list[int]], page_size: int
                      ) -> Callable[[], torch.Tensor]:
    """Plan FlashInfer's paged prefill with the same custom mask once; return its run()."""
    import flashinfer

    q, k_cache, v_cache = kw["q"], kw["k_cache"], kw["v_cache"]
    heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = k_cache.shape[1]
    device = q.device
    kv_lens = kw["kv_lens"].tolist()
    indptr = kw["qo_indptr"].tolist()
    page_indptr = [0]
    for pages in page_table:
        page_indptr.append(page_indptr[-1] + len(pages))
    blocks = [kw["mask"][b, : indptr[b + 1] - indptr[b], : kv_lens[b]].reshape(-1)
              for b in range(len(kv_lens))]
    workspace = torch.empty(256 * 1024 * 1024, dtype=torch.uint8, device=device)
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
    wrapper.plan(
        kw["qo_indptr"].to(torch.int32),
        torch.tensor(page_indptr, dtype=torch.int32, device=device),
        torch.tensor([p for pages in page_table for p in pages], dtype=torch.int32,
                     device=device),
        torch.tensor([(n - 1) % page_size + 1 for n in kv_lens], dtype=torch.int32,
                     device=device),
        heads, kv_heads, head_dim, page_size,
        custom_mask=torch.cat(blocks), sm_scale=kw["sm_scale"],
        q_data_type=q.dtype, kv_data_type=k_cache.dtype,
    )
    kv_pages = (k_cache.view(-1, page_size, kv_heads, head_dim),
                v_cache.view(-1, page_size, kv_heads, head_dim))

    def run() -> torch.Tensor:
        return wrapper.run(q, kv_pages)

    return run


def bench_tree_attention(device: torch.device, smoke: bool, budget: Budget) -> list[dict[str, Any]]:
    from workbench.kernels import reference

    use_triton = device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
    if use_triton:
        from workbench.kernels.triton_tree_attention import tree_attention_triton
    try:
        import flashinfer  # noqa: F401

        have_flashinfer = device.type == "cuda"
    except ImportError:
        have_flashinfer = False

    if smoke:
        dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
        configs = [(2, 6, 20, 4, 2, 64, 4, dtype)]
        warmup, reps = 1, 2
    else:
        bf16 = torch.bfloat16
        configs = [  # (B, N, prefix, H, Hkv, hd, page_size, dtype): Llama-3-8B attention
            (1, 64, 1024, 32, 8, 128, 16, bf16),
            (8, 64, 2048, 32, 8, 128, 16, bf16),
            (32, 16, 4096, 32, 8, 128, 16, bf16),
            (64, 8, 1024, 32, 8, 128, 16, bf16),
            (4, 64, 16384, 32, 8, 128, 16, bf16),
        ]
        warmup, reps = 5, 30
    rows = []
    for batch, nodes, prefix, heads, kv_heads, hd, page_size, dtype in configs:
        if budget.left() < 10:
            rows.append({"skipped": "time budget spent"})
            break
        row: dict[str, Any] = dict(batch=batch, nodes=nodes, prefix=prefix, heads=heads,
                                   kv_heads=kv_heads, head_dim=hd, page_size=page_size,
                                   dtype=str(dtype).removeprefix("torch."))
        try:
            kw, page_table = tree_problem(batch, nodes, prefix, heads, kv_heads, hd, page_size,
                                          dtype, device)
            kv_bytes = 2 * batch * (prefix + nodes) * kv_heads * hd * kw["k_cache"].element_size()
            row["kv_bytes"] = kv_bytes
            expected = reference.tree_attention(**kw)
            row["reference"] = timed_ms(partial(reference.tree_attention, **kw), device,
                                        warmup=1, reps=3)
            if use_triton:
                got = tree_attention_triton(**kw)
                row["triton_max_abs_diff_vs_reference"] = float(
                    (got.float() - expected.float()).abs().max())
                row["triton"] = timed_ms(partial(tree_attention_triton, **kw), device,
                                         warmup, reps)
                row["triton_kv_tb_s"] = kv_bytes / (row["triton"]["median_ms"] * 1e-3) / 1e12
                row["reference_over_triton"] = (row["reference"]["median_ms"]
                                                / row["triton"]["median_ms"])
            if have_flashinfer:
                run = flashinfer_runner(kw, page_table, page_size)
                theirs = run()
                row["flashinfer_max_abs_diff_vs_reference"] = float(
                    (theirs.float() - expected.float()).abs().max())
                row["flashinfer"] = timed_ms(run, device, warmup, reps)
                if use_triton:
                    row["triton_over_flashinfer"] = (row["triton"]["median_ms"]
                                                     / row["flashinfer"]["median_ms"])
            del kw, expected
        except SECTION_ERRORS as exc:
            row["error"] = f"{type(exc).__name__}: {exc}"
            row["traceback"] = traceback.format_exc(limit=8)
        rows.append(row)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


# ---------------------------------------------------------------- 3. decode bandwidth


def decode_bandwidth(device: torch.device, smoke: bool, budget: Budget) -> dict[str, Any]:
    """Weights-only decode of an 8B-shaped Llama; time per forward for a few token counts.

    The attention over the KV cache is left out (it reads KV, not weights); q/k/v/o, the MLP and
    the LM head are all there, so the bytes a forward must read are exactly the weight bytes.
    """
    tokens: tuple[int, ...]
    if smoke:
        layers, hidden, inter, kv_dim, vocab = 2, 256, 512, 64, 1000
        tokens, dtype, reps = (1, 4), torch.float32, 2
    else:
        layers, hidden, inter, kv_dim, vocab = 32, 4096, 14336, 1024, 128256
        tokens, dtype, reps = (1, 8, 32, 64, 128), torch.bfloat16, 20

    def weight(out_f: int, in_f: int) -> torch.Tensor:
        w = torch.empty(out_f, in_f, device=device, dtype=dtype)
        return w.normal_(0.0, 0.5 / math.sqrt(in_f))

    blocks: list[dict[str, torch.Tensor]] = [
        {"q": weight(hidden, hidden), "k": weight(kv_dim, hidden), "v": weight(kv_dim, hidden),
         "o": weight(hidden, hidden), "gate": weight(inter, hidden), "up": weight(inter, hidden),
         "down": weight(hidden, inter)}
        for _ in range(layers)
    ]
    blocks.append({"lm_head": weight(vocab, hidden)})  # the last "block" holds the LM head
    weight_bytes = sum(w.numel() * w.element_size() for block in blocks for w in block.values())

    def forward(x: torch.Tensor) -> torch.Tensor:  # x: (T, hidden)
        for w in blocks[:-1]:
            q = F.linear(x, w["q"])
            F.linear(x, w["k"])
            F.linear(x, w["v"])
            x = x + F.linear(q, w["o"])
            x = x + F.linear(F.silu(F.linear(x, w["gate"])) * F.linear(x, w["up"]), w["down"])
        return F.linear(x, blocks[-1]["lm_head"])  # (T, vocab)

    out: dict[str, Any] = {
        "shape": dict(layers=layers, hidden=hidden, intermediate=inter, kv_dim=kv_dim,
                      vocab=vocab, dtype=str(dtype).removeprefix("torch.")),
        "weight_bytes": weight_bytes,
        "hbm_bound_tb_s": H200_HBM_TB_S,
        "ideal_ms_per_forward": weight_bytes / (H200_HBM_TB_S * 1e12) * 1e3,
        "rows": [],
    }
    if device.type == "cuda":  # what a plain copy achieves: read + write of 4 GiB
        src = torch.empty(2**31, dtype=torch.bfloat16, device=device)
        dst = torch.empty_like(src)
        t = timed_ms(lambda: dst.copy_(src), device, warmup=2, reps=10)
        out["copy_tb_s"] = 2 * src.numel() * src.element_size() / (t["median_ms"] * 1e-3) / 1e12
        del src, dst
        torch.cuda.empty_cache()
    for n_tok in tokens:
        if budget.left() < 5:
            out["rows"].append({"tokens": n_tok, "skipped": "time budget spent"})
            continue
        x = torch.randn(n_tok, hidden, device=device, dtype=dtype) * 0.1
        row: dict[str, Any] = {"tokens": n_tok}
        with torch.inference_mode():
            row["eager"] = timed_ms(partial(forward, x), device, warmup=2, reps=reps)
            if device.type == "cuda":
                row["graph"] = _graph_timing(forward, x, device, reps)
        best = min(v["median_ms"] for k, v in row.items() if k in ("eager", "graph"))
        row["best_ms"] = best
        row["weights_tb_s"] = weight_bytes / (best * 1e-3) / 1e12
        row["fraction_of_hbm_bound"] = row["weights_tb_s"] / H200_HBM_TB_S
        row["bytes_per_token"] = weight_bytes / n_tok
        row["tokens_per_s"] = n_tok / (best * 1e-3)
        out["rows"].append(row)
    blocks.clear()  # free ~15 GB before the next section
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def _graph_timing(forward: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
                  device: torch.device, reps: int) -> dict[str, float]:
    """Capture one forward in a CUDA graph (no launch overhead) and time its replays."""
    static_x = x.clone()
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(2):
            forward(static_x)
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward(static_x)
    return timed_ms(graph.replay, device, warmup=2, reps=reps)


# ---------------------------------------------------------------- 4. decode step (engine path)


def _random_llama(cfg: Any, dtype: torch.dtype, device: torch.device) -> Any:
    """A LlamaForCausalLM with random weights built directly in ``dtype`` on ``device``."""
    from workbench.models.llama import LlamaForCausalLM, rope_inv_freq

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(previous)
    model = model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
        model.model.rotary_emb.inv_freq = rope_inv_freq(cfg).to(device)  # to_empty left junk
    model.fuse()
    return model.eval()


class _DecodeLoop:
    """B requests decoding one token per step over a paged pool (context ``ctx`` at start).

    prepare(i) is the host work of step i (slot lists; the eager backend's plan, or the graph
    runner's bucket + ragged plan), launch runs the forward + argmax on the device, finish
    reads the tokens back (the per-step sync an engine needs for stop checks)."""

    def __init__(self, model: Any, pool: Any, batch: int, ctx: int, device: torch.device
                 ) -> None:
        self.m, self.pool, self.batch, self.ctx, self.device = model, pool, batch, ctx, device
        per_req = pool.num_blocks // batch
        self.blocks = [list(range(b * per_req, (b + 1) * per_req)) for b in range(batch)]
        self.tokens = torch.ones(batch, dtype=torch.int64, device=device)

    def slots(self, i: int) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
        kv = [self.pool.slots(blk, 0, self.ctx + i + 1) for blk in self.blocks]
        return torch.cat([s[-1:] for s in kv]), kv, torch.full((self.batch,), self.ctx + i)

    def eager_pipe(self, attn: Any) -> Any:
        from workbench.engine.overlap import Pipeline

        def prepare(i: int) -> torch.Tensor:
            write, kv, pos = self.slots(i)
            attn.plan(write, [1] * self.batch, kv)
            return pos

        def launch(pos: torch.Tensor) -> torch.Tensor:
            hidden, _ = self.m(self.tokens, pos.to(self.device), attn)
            self.tokens = self.m.logits(hidden).argmax(-1)
            return self.tokens

        return Pipeline(prepare, launch, lambda i, toks: toks.tolist())

    def graph_pipe(self, runner: Any) -> Any:
        from workbench.engine.overlap import Pipeline

        def prepare(i: int) -> tuple[Any, torch.Tensor]:
            write, kv, pos = self.slots(i)
            prep = runner.prepare(write, [1] * self.batch, kv)
            assert prep is not None, "no decode bucket for this batch"
            return prep, pos

        def launch(p: tuple[Any, torch.Tensor]) -> torch.Tensor:
            hidden, _ = runner.launch(p[0], self.tokens, p[1])
            self.tokens = self.m.logits(hidden).argmax(-1)
            return self.tokens

        return Pipeline(prepare, launch, lambda i, toks: toks.tolist())


def _step_ms(pipe: Any, steps: int, overlap: bool, device: torch.device) -> float:
    from workbench.engine.overlap import run_pipelined

    run_pipelined(2, pipe, overlap)  # warm-up
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    run_pipelined(steps, pipe, overlap)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - t0) * 1e3 / steps


def decode_step(device: torch.device, smoke: bool, budget: Budget) -> dict[str, Any]:
    """Decode step time through the engine's own modules on an 8B-shaped random Llama (bf16,
    paged pool, page 16): each attention backend eager, the same forward replayed from CUDA
    graphs (engine/cuda_graphs.py), and graphs with overlapped host preparation
    (engine/overlap.py: step N+1's slots and plan built while step N runs; pinned, side-stream
    metadata copies). Step = host prep + forward + LM head + argmax + token readback."""
    from workbench.attention import make_attention_backend
    from workbench.engine.cuda_graphs import GraphRunner
    from workbench.engine.kv_cache import KVPool
    from workbench.models.config import ModelConfig

    batches: tuple[int, ...]
    if smoke:
        cfg = ModelConfig(family="llama", vocab_size=1000, hidden_size=256,
                          intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=64, max_position_embeddings=4096)
        dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
        batches, ctx, steps = (1, 4), 48, 3
    else:
        cfg = ModelConfig(family="llama", vocab_size=128256, hidden_size=4096,
                          intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                          num_key_value_heads=8, head_dim=128, rope_theta=500000.0,
                          max_position_embeddings=8192)
        dtype, batches, ctx, steps = torch.bfloat16, (1, 8, 32), 1024, 20
    backends = []
    if device.type == "cuda":
        backends.append("triton")
        try:
            import flashinfer  # noqa: F401

            backends.append("flashinfer")
        except ImportError:
            pass
    else:
        backends.append("torch")  # CPU smoke: eager torch, graphs in eager mode (reference)
    page = 16
    span = ctx + 2 * (steps + 2) + page
    blocks = max(batches) * -(-span // page)
    out: dict[str, Any] = {
        "shape": dict(layers=cfg.num_hidden_layers, hidden=cfg.hidden_size,
                      heads=cfg.num_attention_heads, kv_heads=cfg.num_key_value_heads,
                      head_dim=cfg.head_dim, vocab=cfg.vocab_size,
                      dtype=str(dtype).removeprefix("torch.")),
        "context": ctx, "steps": steps, "page_size": page, "rows": [],
    }
    model = _random_llama(cfg, dtype, device)
    pool = KVPool(blocks, page, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim,
                  dtype, str(device))
    try:
        for backend in backends:
            if budget.left() < 20:
                out["rows"].append({"backend": backend, "skipped": "time budget spent"})
                continue
            row: dict[str, Any] = {"backend": backend}
            try:
                attn = make_attention_backend(backend, pool.k, pool.v, cfg.num_attention_heads,
                                              page)
                t0 = time.monotonic()
                runner = GraphRunner(
                    model, pool.k, pool.v, num_heads=cfg.num_attention_heads, page_size=page,
                    max_kv=span, buckets=batches,
                    attention="flashinfer" if backend == "flashinfer" else "triton",
                    mode="cuda" if device.type == "cuda" else "eager",
                    kernel="triton" if device.type == "cuda" else "reference", overlap=True)
                runner.capture()
                row["capture_s"] = round(time.monotonic() - t0, 2)
                row["overlap_staging"] = runner.overlap.enabled
                for b in batches:
                    if budget.left() < 10:
                        row[f"b{b}"] = {"skipped": "time budget spent"}
                        continue
                    loop = _DecodeLoop(model, pool, b, ctx, device)
                    with torch.inference_mode():
                        t = time.perf_counter()
                        for i in range(steps):
                            loop.slots(i)
                        host_ms = (time.perf_counter() - t) * 1e3 / steps
                        r = {"host_slots_ms": host_ms,
                             "eager_ms": _step_ms(loop.eager_pipe(attn), steps, False, device),
                             "graph_ms": _step_ms(loop.graph_pipe(runner), steps, False, device),
                             "graph_overlap_ms": _step_ms(loop.graph_pipe(runner), steps, True,
                                                          device)}
                    r["eager_over_graph"] = r["eager_ms"] / r["graph_ms"]
                    r["graph_over_overlap"] = r["graph_ms"] / r["graph_overlap_ms"]
                    row[f"b{b}"] = r
                del runner, attn
            except SECTION_ERRORS as exc:
                row["error"] = f"{type(exc).__name__}: {exc}"
                row["traceback"] = traceback.format_exc(limit=8)
            out["rows"].append(row)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    finally:
        del model, pool
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


# ---------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON summary path")
    parser.add_argument("--junit", action="append", default=[], metavar="NAME=PATH:RC",
                        help="a pytest run to summarise (repeatable)")
    parser.add_argument("--budget-s", type=float, default=150.0,
                        help="wall-clock budget of the benchmark sections")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes on any device: checks this script, measures nothing")
    args = parser.parse_args(argv)

    t0 = time.monotonic()
    budget = Budget(args.budget_s)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    summary: dict[str, Any] = {
        "started": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "smoke": args.smoke,
        "machine": machine_info(device),
        "software": software(device),
        "tests": [read_junit(spec) for spec in args.junit],
        "errors": [],
    }
    if device.type != "cuda" and not args.smoke:
        summary["errors"].append("no CUDA device: benchmarks skipped (use --smoke on CPU)")
    else:
        torch.manual_seed(0)
        sections: list[tuple[str, Callable[[], Any]]] = [
            ("decode_bandwidth", lambda: decode_bandwidth(device, args.smoke, budget)),
            ("tree_attention", lambda: bench_tree_attention(device, args.smoke, budget)),
            ("decode_step", lambda: decode_step(device, args.smoke, budget)),
        ]
        for name, run in sections:
            _write(args.out, summary, t0)  # a run killed by its timeout keeps what it had
            start = time.monotonic()
            try:
                summary[name] = run()
            except SECTION_ERRORS as exc:
                summary["errors"].append(f"{name}: {type(exc).__name__}: {exc}")
                summary[f"{name}_traceback"] = traceback.format_exc(limit=8)
            summary[f"{name}_s"] = round(time.monotonic() - start, 1)
    _write(args.out, summary, t0)
    print(json.dumps(_headline(summary), indent=2, default=str))
    print(f"summary written to {args.out}")
    return 0 if not summary["errors"] else 1


def _write(path: Path, summary: dict[str, Any], t0: float) -> None:
    summary["elapsed_s"] = round(time.monotonic() - t0, 1)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=2, default=str) + "\n")


def _headline(summary: dict[str, Any]) -> dict[str, Any]:
    """A short digest for the console."""
    head: dict[str, Any] = {"machine": summary["machine"].get("gpu", summary["machine"]["device"])}
    head["tests"] = {t["name"]: {k: t.get(k) for k in ("exit_code", "tests", "failures",
                                                       "errors", "skipped")}
                     for t in summary["tests"]}
    head["tree_attention_ms"] = [
        {k: (r[k]["median_ms"] if isinstance(r.get(k), dict) else r.get(k))
         for k in ("batch", "nodes", "prefix", "triton", "reference", "flashinfer", "error")
         if k in r}
        for r in summary.get("tree_attention", [])
    ]
    decode = summary.get("decode_bandwidth", {})
    head["decode"] = [{k: r.get(k) for k in ("tokens", "best_ms", "weights_tb_s",
                                             "fraction_of_hbm_bound")}
                      for r in decode.get("rows", [])]
    head["copy_tb_s"] = decode.get("copy_tb_s")
    head["decode_step_ms"] = [
        {"backend": r.get("backend"), **{k: {m: v.get(m) for m in ("eager_ms", "graph_ms",
                                                                  "graph_overlap_ms")}
                                         for k, v in r.items() if k[:1] == "b"
                                         and k[1:].isdigit() and isinstance(v, dict)},
         **({"error": r["error"]} if "error" in r else {})}
        for r in summary.get("decode_step", {}).get("rows", [])
    ]
    head["errors"] = summary["errors"]
    return head


if __name__ == "__main__":
    sys.exit(main())
