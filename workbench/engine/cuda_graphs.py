"""CUDA graphs for the target forward: plain decode (and tree verify) per batch bucket.

A decode step of an 8B model launches ~10 kernels per layer; at small batch their launch
overhead is a large share of the step. :class:`GraphRunner` captures the whole target forward
once per bucket and replays it:

1. Buckets. A graph is keyed by (batch, q_len): q_len 1 is plain decode, q_len N a tree verify
   of N nodes (tree masks). A call with b requests uses the smallest captured batch >= b; the
   extra rows repeat request 0 (``triton_backend.pad_rows``), so their K/V writes are exact
   duplicates and their outputs are dropped.
2. Static inputs. tokens, positions (batch·q_len,) and the attention backend's index buffers
   (write slots, kv indices sized for ``max_kv`` keys, kv lengths, masks) live at fixed
   addresses; :meth:`GraphRunner.run` fills them in place (``plan_static``) before replaying.
   Attention inside a graph is the Triton kernel (decode and verify) or FlashInfer's
   cuda-graph decode wrapper (decode, when the engine's backend is flashinfer).
3. Sync-free forward. ``Rotary.cos_sin`` reads ``positions.max()`` (a device sync, illegal
   while capturing): capture and eager replays swap in a gather from a table pre-grown to
   ``max_kv`` positions (``static_rotary``); the runner keeps those tables alive because the
   graphs read them.
4. Capture (largest bucket first, one shared memory pool): two warm-up forwards on a side
   stream, then ``torch.cuda.graph``. Warm-ups write K/V into slots [0, q_len) of the pool, so
   capture runs only while no request holds KV (engine init).

``run`` = ``launch(prepare(...))``: ``prepare`` is the host half (bucket, ragged plan; no
device work), ``launch`` stages the inputs and replays, so a pipelined loop
(``overlap.run_pipelined``) can prepare step N+1 while step N runs. ``mode="eager"`` runs the
same static-buffer forward without a CUDA graph: it is how the CPU tests check buckets, padding
and plan_static against the eager backends. Outputs are cloned out of the static buffers (the
next replay overwrites them).

The engine calls :func:`capture` from its ``cuda_graphs`` init stage on CUDA only, and
``ModelRunner.forward`` hands a forward to :meth:`GraphRunner.run`, which returns None (→ eager)
for anything without a bucket: prefill chunks, draft extends, mixed q_lens, contexts beyond
``max_kv``. By default the engine captures decode buckets only (the verify size N is chosen per
request batch by the spec policy, not known at init); ``verify_nodes`` adds verify buckets.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch

from workbench.attention.triton_backend import (
    RaggedPlan,
    TritonTreeAttention,
    has_tree,
    pad_rows,
    ragged_plan,
)
from workbench.engine.overlap import Overlap

if TYPE_CHECKING:
    from workbench.engine.runner import ModelRunner

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
Mode = Literal["cuda", "eager"]


@contextmanager
def static_rotary(rotary: Any, cos: torch.Tensor, sin: torch.Tensor) -> Iterator[None]:
    """Make ``rotary.cos_sin(positions, dtype)`` a plain gather from fixed tables (no sync, no
    regrowth) for the duration; the instance attribute shadows the method and is removed."""

    def cos_sin(positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        return cos[positions], sin[positions]

    rotary.cos_sin = cos_sin
    try:
        yield
    finally:
        del rotary.cos_sin


@dataclass
class Prepared:
    """The host half of one replay: which bucket, and the ragged plan to stage into it."""

    key: tuple[int, int]
    plan: RaggedPlan
    want_aux: bool


@dataclass
class BucketGraph:
    """One captured forward: ``batch`` requests × ``q_len`` tokens."""

    batch: int
    q_len: int
    attn: Any  # TritonTreeAttention (static) or FlashInferDecodeGraph
    tokens: torch.Tensor  # (batch·q_len,) int64
    positions: torch.Tensor  # (batch·q_len,) int64
    hidden: torch.Tensor | None = None  # (batch·q_len, D): graph output
    aux: torch.Tensor | None = None  # (batch·q_len, n_aux·D) or None
    graph: Any = None  # torch.cuda.CUDAGraph, None in eager mode
    replays: int = field(default=0)


class GraphRunner:
    """Captured target forwards over the engine's paged pool. See the module docstring."""

    def __init__(self, target: torch.nn.Module, k_pool: torch.Tensor, v_pool: torch.Tensor, *,
                 num_heads: int, page_size: int, max_kv: int, aux_layers: Sequence[int] = (),
                 buckets: Sequence[int] = DEFAULT_BUCKETS, verify_nodes: Sequence[int] = (),
                 max_graph_tokens: int = 512, attention: str = "triton", mode: Mode = "cuda",
                 overlap: bool = False, kernel: Literal["triton", "reference"] = "triton"
                 ) -> None:
        if mode == "cuda" and k_pool.device.type != "cuda":
            raise RuntimeError(f"GraphRunner(mode='cuda') needs a CUDA pool, got {k_pool.device}")
        if attention not in ("triton", "flashinfer"):
            raise ValueError(f"GraphRunner: attention {attention!r} not in triton/flashinfer "
                             "(the torch backend's plan is not capturable)")
        self.target, self.k_pool, self.v_pool = target, k_pool, v_pool
        self.num_heads, self.page_size, self.max_kv = num_heads, page_size, max_kv
        self.aux_layers = tuple(aux_layers)
        self.buckets = tuple(sorted(set(buckets)))
        self.verify_nodes = tuple(sorted(set(verify_nodes)))
        self.max_graph_tokens = max_graph_tokens
        self.attention, self.mode, self.kernel = attention, mode, kernel
        self.device = k_pool.device
        self.overlap = Overlap(self.device, overlap)
        self.graphs: dict[tuple[int, int], BucketGraph] = {}
        self._tables: tuple[torch.Tensor, torch.Tensor] | None = None
        self._mempool: Any = None
        self._workspace: torch.Tensor | None = None
        self._rows: dict[tuple[int, int, int], torch.Tensor] = {}

    # -- what gets captured --------------------------------------------------------------
    def keys(self) -> list[tuple[int, int]]:
        """(batch, q_len) of every graph: decode for each bucket, verify for each N where
        batch·N <= max_graph_tokens."""
        out = [(b, 1) for b in self.buckets]
        out += [(b, n) for n in self.verify_nodes for b in self.buckets
                if b * n <= self.max_graph_tokens]
        return out

    def key_for(self, q_lens: list[int], kv_lens: list[int],
                tree_masks: list[torch.Tensor | None] | None) -> tuple[int, int] | None:
        """The bucket a forward replays in, or None when it must run eagerly."""
        q = q_lens[0]
        if any(x != q for x in q_lens) or max(kv_lens) > self.max_kv:
            return None
        tree = has_tree(tree_masks)
        if q == 1 and tree:
            return None
        if q > 1 and not (tree and tree_masks is not None and
                          all(m is not None for m in tree_masks)):
            return None  # multi-token forwards other than a full tree verify run eagerly
        for b in self.buckets:
            if b >= len(q_lens) and (b, q) in self.graphs:
                return b, q
        return None

    # -- capture -------------------------------------------------------------------------
    def _rotary_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._tables is None:
            model: Any = self.target.model
            dtype = model.embed_tokens.weight.dtype
            cos, sin = model.rotary_emb.table(self.max_kv, dtype)
            self._tables = (cos, sin)
        return self._tables

    @contextmanager
    def _sync_free(self) -> Iterator[None]:
        cos, sin = self._rotary_tables()
        model: Any = self.target.model
        with static_rotary(model.rotary_emb, cos, sin):
            yield

    def _static_attention(self, batch: int, q_len: int) -> Any:
        if self.attention == "flashinfer" and q_len == 1:
            from workbench.attention.flashinfer_backend import (
                WORKSPACE_BYTES,
                FlashInferDecodeGraph,
            )

            if self._workspace is None:
                self._workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8,
                                              device=self.device)
            fi = FlashInferDecodeGraph(self.k_pool, self.v_pool, self.num_heads, self.page_size,
                                       batch, self.max_kv, self._workspace)
            fi.pin = self.overlap.enabled
            return fi
        return TritonTreeAttention.static(self.k_pool, self.v_pool, self.num_heads, batch,
                                          q_len, self.max_kv, kernel=self.kernel)

    def _forward(self, g: BucketGraph) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.target(g.tokens, g.positions, g.attn, self.aux_layers)  # type: ignore[no-any-return]

    def _dummy(self, g: BucketGraph) -> None:
        """Valid inputs for warm-up/capture: every row is one request at positions [0, q)."""
        q = g.q_len
        slots = torch.arange(q, dtype=torch.int64, device="cpu")  # host, as every plan
        masks: list[torch.Tensor | None] | None = \
            [torch.ones(q, q, dtype=torch.bool, device="cpu").tril()] if q > 1 else None
        self._stage(g, torch.zeros(q, dtype=torch.int64, device="cpu"), slots.clone(),
                    ragged_plan(slots, [q], [slots], masks))

    @torch.inference_mode()
    def capture(self) -> None:
        """Build and capture every bucket (eager mode: build only). Largest first, so smaller
        graphs reuse the shared memory pool."""
        keys = sorted(self.keys(), key=lambda k: (k[0] * k[1], k[1]), reverse=True)
        if self.mode == "cuda":
            self._mempool = torch.cuda.graph_pool_handle()
        with self._sync_free():
            for batch, q_len in keys:
                n = batch * q_len
                g = BucketGraph(batch, q_len, self._static_attention(batch, q_len),
                                torch.zeros(n, dtype=torch.int64, device=self.device),
                                torch.zeros(n, dtype=torch.int64, device=self.device))
                self._dummy(g)
                if self.mode == "cuda":
                    self._capture_one(g)
                self.graphs[(batch, q_len)] = g
        if self.mode == "cuda":
            torch.cuda.synchronize(self.device)

    def _capture_one(self, g: BucketGraph) -> None:
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):  # compile/autotune and allocate outside the capture
                self._forward(g)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._mempool):
            g.hidden, g.aux = self._forward(g)
        g.graph = graph

    # -- replay --------------------------------------------------------------------------
    def _stage(self, g: BucketGraph, tokens: torch.Tensor, positions: torch.Tensor,
               p: RaggedPlan) -> None:
        """Fill g's static inputs. Host inputs go through the overlap stager; inputs already on
        the device (a pipelined loop's sampled tokens) are gathered there, with no sync."""
        n_real = len(p.q_lens)
        rows = pad_rows(n_real, g.batch, g.q_len)
        host: list[tuple[torch.Tensor, torch.Tensor]] = []
        for dst, src in ((g.tokens, tokens), (g.positions, positions)):
            if src.device == self.device and src.device.type != "cpu":
                dst.copy_(src[self._device_rows(g, n_real, rows)])
            else:
                host.append((dst, src.to("cpu")[rows]))
        g.attn.plan_static(p, host.extend)  # collect its copies: one staging per step
        self.overlap.stage(host)

    def _device_rows(self, g: BucketGraph, n_real: int, rows: torch.Tensor) -> torch.Tensor:
        """pad_rows on the device, cached (a pageable host→device copy would block the host)."""
        key = (g.batch, g.q_len, n_real)
        if key not in self._rows:
            self._rows[key] = rows.to(self.device)
        return self._rows[key]

    def prepare(self, write_slots: torch.Tensor, q_lens: list[int], kv_slots: list[torch.Tensor],
                tree_masks: list[torch.Tensor | None] | None = None, want_aux: bool = False
                ) -> Prepared | None:
        """Host half of a replay (no device work): the bucket and the ragged plan, or None when
        no bucket fits. Arguments as ``PagedAttention.plan``."""
        if want_aux and not self.aux_layers:
            return None
        key = self.key_for(q_lens, [int(s.numel()) for s in kv_slots], tree_masks)
        if key is None:
            return None
        return Prepared(key, ragged_plan(write_slots, q_lens, kv_slots, tree_masks), want_aux)

    @torch.inference_mode()
    def launch(self, prep: Prepared, tokens: torch.Tensor, positions: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Device half: stage the inputs and replay (asynchronous on CUDA). tokens, positions
        (T,) on the host or the device. Returns (hidden (T, D), aux (T, n·D) or None), fresh
        tensors (the next replay overwrites the graph's own outputs)."""
        g = self.graphs[prep.key]
        self._stage(g, tokens, positions, prep.plan)
        if g.graph is not None:
            g.graph.replay()
            hidden, aux = g.hidden, g.aux
        else:
            with self._sync_free():
                hidden, aux = self._forward(g)
        g.replays += 1
        assert hidden is not None
        n = len(prep.plan.q_lens) * g.q_len
        return hidden[:n].clone(), (aux[:n].clone() if prep.want_aux and aux is not None
                                    else None)

    def run(self, tokens: torch.Tensor, positions: torch.Tensor, write_slots: torch.Tensor,
            q_lens: list[int], kv_slots: list[torch.Tensor],
            tree_masks: list[torch.Tensor | None] | None = None, want_aux: bool = False
            ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """Replay the forward ``target(tokens, positions, backend)`` would compute after
        ``backend.plan(write_slots, q_lens, kv_slots, tree_masks)``, or return None when no
        bucket fits (the caller runs it eagerly). = ``launch(prepare(...))``."""
        prep = self.prepare(write_slots, q_lens, kv_slots, tree_masks, want_aux)
        return None if prep is None else self.launch(prep, tokens, positions)

    def close(self) -> None:
        """Drop the captured graphs and their static buffers (the engine is closing)."""
        self.graphs.clear()
        self._tables = self._mempool = self._workspace = None
        self._rows.clear()


def capture(runner: ModelRunner, max_model_len: int, *, mode: Mode = "cuda",
            buckets: Sequence[int] | None = None, verify_nodes: Sequence[int] = ()
            ) -> GraphRunner:
    """Capture the runner's decode graphs (its ``cuda_graphs`` init stage calls this on CUDA).

    Buckets: powers of two up to ``EngineConfig.max_batch_size``. Keys up to
    ``max_model_len`` (+ the largest verify size). Attention: FlashInfer's graph decode when the
    runner's backend is flashinfer, else the Triton kernel. Must run before any request holds
    KV (warm-ups write scratch K/V into the first slots)."""
    from workbench.attention import backend_name

    pool, target, cfg = runner.pool, runner.target, runner.config
    if pool is None or target is None or runner.attn is None:
        raise RuntimeError("cuda graphs: capture needs the target, the KV pool and its "
                           "attention backend first")
    if pool.used_blocks:
        raise RuntimeError("cuda graphs: capture while requests hold KV would overwrite it")
    if buckets is None:
        buckets = [b for b in DEFAULT_BUCKETS if b <= cfg.max_batch_size] or [1]
    max_kv = min(max_model_len + max(verify_nodes, default=0),
                 pool.num_blocks * pool.page_size)
    attention = "flashinfer" if backend_name(runner.attn) == "flashinfer" else "triton"
    graphs = GraphRunner(target, pool.k, pool.v, num_heads=target.config.num_attention_heads,
                         page_size=pool.page_size, max_kv=max_kv, aux_layers=runner.aux_layers,
                         buckets=buckets, verify_nodes=verify_nodes, attention=attention,
                         mode=mode, overlap=cfg.overlap_schedule)
    graphs.capture()
    return graphs
