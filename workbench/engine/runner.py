"""The ModelRunner: models, KV pool, attention backends and CUDA graphs; every forward.

A forward is described by one noun, :class:`ForwardBatch` (which requests, which new positions,
their tokens, optional tree masks); the runner builds it from the engine's state (prefill
chunks, a plain decode batch, a verify over draft trees, a draft extend), plans the attention
backend and runs the model. The runner owns the device: every tensor it builds is created
there. KV slot lists stay on the host (``KVPool.slots``: plan metadata), and each backend moves
its finished plan once.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from workbench.attention import AttentionBackend, backend_name, make_attention_backend
from workbench.config import EngineConfig
from workbench.core import DraftTree, Request
from workbench.engine.kv_cache import KVPool
from workbench.errors import ConfigError
from workbench.models.config import ModelConfig
from workbench.models.eagle3 import Eagle3Draft
from workbench.models.llama import LlamaForCausalLM
from workbench.models.moe_model import MoeForCausalLM
from workbench.trace import events as ev
from workbench.trace.tracer import Dispatcher


@dataclass
class ForwardBatch:
    """One forward: request i's new tokens occupy positions [starts[i], ends[i]); their KV is
    written to their slots and attention sees positions [0, ends[i]) (``tree_masks[i]``, when
    given, restricts the new tokens to their tree ancestors)."""

    reqs: list[Request]
    starts: list[int]
    ends: list[int]
    tokens: torch.Tensor  # (Σ q_len,) on the runner's device
    positions: torch.Tensor  # (Σ q_len,)
    tree_masks: list[torch.Tensor | None] | None = None
    want_aux: bool = False  # also return the draft's features (EAGLE-3 aux layers)
    kind: str = "prefill"  # prefill | decode | verify (named in ExpertRouting events)

    @property
    def q_lens(self) -> list[int]:
        return [e - s for s, e in zip(self.starts, self.ends, strict=True)]

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.numel())


class StepGraphs(Protocol):
    """A faster path for some target forwards, installed by an init stage: CUDA graphs
    (``cuda_graphs.GraphRunner``) or the Inductor-compiled bs=1 decode
    (``compiled.CompiledSteps``). :meth:`run` computes what ``target(tokens, positions, attn)``
    would after ``attn.plan(write_slots, q_lens, kv_slots, tree_masks)``, or returns None when
    it has no path for this batch (the runner then runs it eagerly)."""

    def run(self, tokens: torch.Tensor, positions: torch.Tensor, write_slots: torch.Tensor,
            q_lens: list[int], kv_slots: list[torch.Tensor],
            tree_masks: list[torch.Tensor | None] | None = None, want_aux: bool = False
            ) -> tuple[torch.Tensor, torch.Tensor | None] | None: ...

    def close(self) -> None: ...


class ModelRunner:
    """Target and draft models, the KV pool and its attention backends, the CUDA graphs."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = torch.device(config.device)
        self.target: LlamaForCausalLM | MoeForCausalLM | None = None
        self.draft: Eagle3Draft | None = None
        self.aux_layers: tuple[int, ...] = ()
        self.pool: KVPool | None = None
        self.attn: AttentionBackend | None = None
        self.draft_attn: AttentionBackend | None = None
        self.graphs: StepGraphs | None = None
        # where ExpertRouting events go (the engine's dispatcher), and the step they belong to
        self.trace: Dispatcher | None = None
        self.step_id = 0

    # -- init stages (called by Engine._init, which owns the order and the error policy) -----
    def load_target(self, path: str | Path) -> str:
        from workbench.models.loader import load_target

        self.target, _, _ = load_target(path, self.config.dtype, self.config.device)
        self.target.fuse(self.config.gemm)
        note = self.target.load_note  # e.g. a multimodal checkpoint's skipped vision tower
        return f"gemm={self.target.gemm}" + (f"; {note}" if note else "")

    def load_draft(self, path: str | Path) -> None:
        from workbench.models.loader import load_eagle3

        assert self.target is not None
        self.draft, self.aux_layers = load_eagle3(path, self.target, self.config.dtype,
                                                  self.config.device)
        self.draft.fuse(self.config.gemm)

    def allocate_kv(self, mc: ModelConfig) -> KVPool:
        cfg = self.config
        draft_shape = None
        if self.draft is not None:
            dc = self.draft.config
            draft_shape = (dc.num_key_value_heads, dc.head_dim)
        dtype = self.target.model.embed_tokens.weight.dtype if self.target else torch.float32
        heads, k_dim, v_dim = mc.kv_cache_shape()  # MLA: 1 latent "head", v a view of k
        self.pool = KVPool(cfg.kv_budget_tokens // cfg.page_size, cfg.page_size,
                           mc.num_hidden_layers, heads, k_dim, dtype, cfg.device, draft_shape,
                           v_dim=v_dim if v_dim != k_dim else None)
        return self.pool

    def attention_backend(self, mc: ModelConfig) -> str:
        assert self.pool is not None
        kind = self._attention_kind()
        # latent attention (key dim != value dim): SDPA or the invariant row kernel only
        if self.pool.v_shares_k and kind != "invariant":
            if kind not in ("auto", "torch"):
                raise ConfigError(f"EngineConfig.attention_backend: {kind!r} cannot run latent "
                                  "attention (MLA: key and value dims differ); use 'torch'")
            kind = "torch"
        self.attn = make_attention_backend(kind, self.pool.k, self.pool.v,
                                           mc.num_attention_heads, self.pool.page_size)
        return f"backend={backend_name(self.attn)}"

    def _attention_kind(self) -> str:
        """The configured backend; ``invariant`` under ``EngineConfig.batch_invariant``."""
        return "invariant" if self.config.batch_invariant else self.config.attention_backend

    def draft_attention_backend(self) -> None:
        if self.draft is None:
            return
        assert self.pool is not None and self.pool.dk is not None and self.pool.dv is not None
        self.draft_attn = make_attention_backend(self._attention_kind(), self.pool.dk,
                                                 self.pool.dv,
                                                 self.draft.config.num_attention_heads,
                                                 self.pool.page_size)

    def cuda_graphs(self, max_model_len: int) -> str:
        """CUDA: capture decode graphs for contexts up to ``max_model_len``
        (engine/cuda_graphs.py). CPU or cuda_graphs=False: skipped (status "ok", detail
        "skipped: ..."); every forward then runs eagerly."""
        if self.device.type != "cuda":
            return "skipped: not a CUDA device"
        assert self.target is not None
        if not self.target.graph_capturable:
            return (f"skipped: a {type(self.target).__name__} routes tokens by data (a captured "
                    "graph would replay one routing)")
        if not self.config.cuda_graphs:
            return "skipped: EngineConfig.cuda_graphs=False"
        from workbench.engine import cuda_graphs

        g = cuda_graphs.capture(self, max_model_len)
        self.graphs = g
        return f"captured {len(g.graphs)} graphs ({g.attention} attention)"

    def drop_draft(self) -> None:
        """The configured fallback after a draft stage failed: a baseline runner."""
        self.draft = None
        self.draft_attn = None
        self.aux_layers = ()
        if self.pool is not None:
            self.pool.dk = self.pool.dv = None

    def close(self) -> None:
        if self.graphs is not None:
            self.graphs.close()
        self.pool = None
        self.attn = self.draft_attn = None
        self.graphs = None
        self.target = None
        self.draft = None

    # -- input building --------------------------------------------------------------------
    def prefill_batch(self, chunks: list[tuple[Request, int, int]],
                      want_aux: bool) -> ForwardBatch:
        """Prompt chunks: request r's tokens [s, e) at positions [s, e)."""
        dev = self.device
        return ForwardBatch(
            [c[0] for c in chunks], [c[1] for c in chunks], [c[2] for c in chunks],
            torch.cat([torch.tensor(r.tokens[s:e], device=dev) for r, s, e in chunks]),
            torch.cat([torch.arange(s, e, device=dev) for _, s, e in chunks]), None, want_aux,
            "prefill")

    def decode_batch(self, reqs: list[Request], want_aux: bool) -> ForwardBatch:
        """One token per request: its root (the last token) at position kv_len."""
        kv = [r.kv_len for r in reqs]
        dev = self.device
        return ForwardBatch(reqs, kv, [k + 1 for k in kv],
                            torch.tensor([r.tokens[-1] for r in reqs], device=dev),
                            torch.tensor(kv, device=dev), None, want_aux, "decode")

    def verify_batch(self, reqs: list[Request], tree: DraftTree,
                     ride: Sequence[Request] = ()) -> ForwardBatch:
        """Every request's draft tree after its prefix, under the tree's ancestor masks; then
        each ``ride`` request as a one-node tree (its root: the last token at position kv_len,
        exactly its plain decode row). Rows: the trees' ``b·n`` nodes, then one per rider."""
        starts = [r.kv_len for r in reqs]
        n = tree.num_nodes
        masks: list[torch.Tensor | None] = [tree.mask[i] for i in range(len(reqs))]
        tokens, positions = tree.tokens.flatten(), tree.positions.flatten()
        if ride:
            plain = self.decode_batch(list(ride), want_aux=True)
            tokens = torch.cat([tokens, plain.tokens.to(tokens.dtype)])
            positions = torch.cat([positions, plain.positions.to(positions.dtype)])
            masks += [None] * len(ride)
        return ForwardBatch(reqs + list(ride), starts + [r.kv_len for r in ride],
                            [s + n for s in starts] + [r.kv_len + 1 for r in ride], tokens,
                            positions, masks, want_aux=True, kind="verify")

    # -- forwards ----------------------------------------------------------------------------
    def forward(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The target over ``batch``: (hidden (T, D), aux features (T, 3·D) or None)."""
        assert self.pool is not None and self.attn is not None and self.target is not None
        if not self._plan_run(self.attn, batch):
            write, kv = [], []
            for r, s, e in zip(batch.reqs, batch.starts, batch.ends, strict=True):
                all_slots = self.pool.slots(r.blocks, 0, e)
                write.append(all_slots[s:])
                kv.append(all_slots)
            q_lens, write_slots = batch.q_lens, _cat(write)
            if self.graphs is not None:
                out = self.graphs.run(batch.tokens, batch.positions, write_slots, q_lens, kv,
                                      batch.tree_masks, batch.want_aux)
                if out is not None:
                    return out
            self.attn.plan(write_slots, q_lens, kv, batch.tree_masks)
        result = self.target(batch.tokens, batch.positions, self.attn,
                             self.aux_layers if batch.want_aux else ())
        if self.trace is not None and self.trace.wants(ev.ExpertRouting) and isinstance(
                self.target, MoeForCausalLM):
            self.emit_routing(batch, self.target)
        return result

    def _plan_run(self, attn: AttentionBackend, batch: ForwardBatch) -> bool:
        """One request whose slots are one run of the pool, on a backend that attends to a
        view of it (``plan_run``) and without CUDA graphs: planned from host ints alone (no
        slot tensor made or read; ``KVPool.run``). False: plan from the slots."""
        plan_run = getattr(attn, "plan_run", None)
        if len(batch.reqs) != 1 or plan_run is None or self.graphs is not None:
            return False
        assert self.pool is not None
        r, s, e = batch.reqs[0], batch.starts[0], batch.ends[0]
        lo = self.pool.run(r.blocks, 0, e)
        if lo is None:
            return False
        plan_run(lo, e, e - s, batch.tree_masks[0] if batch.tree_masks else None)
        return True

    def emit_routing(self, batch: ForwardBatch, target: MoeForCausalLM) -> None:
        """One ExpertRouting event for the forward just run: tokens per expert per MoE layer
        (one device→host copy of E ints per layer; only while tracing)."""
        assert self.trace is not None and target.config.moe is not None
        routing = target.routing()
        self.trace.emit(ev.ExpertRouting(
            t=time.perf_counter(), step=self.step_id, kind=batch.kind, tokens=batch.num_tokens,
            top_k=target.config.moe.top_k, layers=list(routing),
            counts=[c.tolist() for c in routing.values()]))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        assert self.target is not None
        return self.target.logits(hidden)

    def draft_slots(self, r: Request, end: int) -> torch.Tensor:
        """Draft-pool slots of positions [0, end) the draft holds (its holes left out)."""
        assert self.pool is not None
        return r.draft.slots(self.pool.slots(r.blocks, 0, end))

    def draft_prefix(self, r: Request, scratch: int) -> torch.Tensor | tuple[int, int]:
        """A draft tree's prefix (TreeDraftAttention): ``(lo, n)`` when the draft holds every
        position (no holes) and the slots of its n positions and of ``scratch`` more after them
        are one run of the request's blocks (the tree's K/V go there: nothing gathered), else
        the slots of its positions."""
        assert self.pool is not None
        n = r.draft.len
        if not r.draft.holes:
            lo = self.pool.run(r.blocks, 0, n + scratch)
            if lo is not None:
                return lo, n
        return self.draft_slots(r, n)

    def draft_forward(self, batch: ForwardBatch, hidden: torch.Tensor,
                      logit_rows: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """The draft over ``batch`` from input features ``hidden`` (T, D): its KV is written
        to the draft pool (each request's holes left out) and attention sees the positions the
        draft holds. Returns (logits at ``logit_rows``, every row when None; hidden rows)."""
        assert self.draft is not None and self.draft_attn is not None
        if batch.reqs[0].draft.holes or not self._plan_run(self.draft_attn, batch):
            write, kv = [], []
            for r, s, e in zip(batch.reqs, batch.starts, batch.ends, strict=True):
                slots = self.draft_slots(r, e)
                write.append(slots[slots.numel() - (e - s):])
                kv.append(slots)
            self.draft_attn.plan(_cat(write), batch.q_lens, kv)
        return self.draft(batch.tokens, hidden, batch.positions, self.draft_attn,
                          logit_rows=logit_rows)

    def draft_extend(self, reqs: list[Request]
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
        """The draft over every position it has not seen, (feature at p, token at p+1) for p in
        [draft.len, kv_len). Returns (logits at each request's last row, all hidden rows,
        each request's last row index, rows per request)."""
        assert self.draft is not None
        dev = self.device
        toks, pos = [], []
        feats: list[torch.Tensor] = []
        for r in reqs:
            s, e = r.draft.len, r.kv_len
            toks.append(torch.tensor(r.tokens[s + 1 : e + 1], device=dev))
            pos.append(torch.arange(s, e, device=dev))
            feats.extend(r.draft.pending_feats or ())
        batch = ForwardBatch(reqs, [r.draft.len for r in reqs], [r.kv_len for r in reqs],
                             _cat(toks), _cat(pos))
        q_lens = batch.q_lens
        hidden = self.draft.features(_cat(feats))
        ends = torch.tensor([e - 1 for e in itertools.accumulate(q_lens)], device=dev)
        # logits only where the next draft starts (a catch-up over m positions needs 1 row)
        logits, out = self.draft_forward(batch, hidden, logit_rows=ends)
        return logits, out, ends, q_lens


def _cat(xs: list[torch.Tensor]) -> torch.Tensor:
    """torch.cat, without the copy for one piece (bs=1)."""
    return xs[0] if len(xs) == 1 else torch.cat(xs)
