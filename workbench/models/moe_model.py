"""MoE decoders: Mixtral, Qwen3-MoE, DeepSeek-V3 (and Kimi-K2.5's text model).

One decoder composed per layer from an attention kind — grouped-query attention
(:class:`workbench.models.llama.Attention`, with Qwen3's q/k norms) or latent attention
(:class:`workbench.models.mla.MlaAttention`) — and an MLP kind — a dense SwiGLU
(:class:`workbench.models.llama.MLP`) or routed experts (:class:`workbench.models.moe.SparseMoe`).
It offers the engine what :class:`~workbench.models.llama.LlamaForCausalLM` does (``forward``
over the paged pool, ``logits``, ``forward_dense`` for training and oracles, ``fuse``) and
declares what it does not: oneDNN-packed weights, the Inductor-compiled step and CUDA graphs
(routing is data-dependent: a captured graph would replay one routing).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from workbench.models.config import ModelConfig
from workbench.models.gemm import fuse_linears
from workbench.models.llama import MLP, Attention, AttentionBackend, RMSNorm, gather_taps
from workbench.models.mla import MlaAttention, MlaRotary
from workbench.models.moe import SparseMoe
from workbench.models.rope import Rotary, apply_rope_rolled


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """``RMSNorm`` without the module call: one fused op in float32, else HF's op order."""
    if x.dtype == torch.float32 and w.dtype == torch.float32:
        return F.rms_norm(x, w.shape, w, eps)
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@dataclass(frozen=True)
class MoeFastLayer:
    """One decoder layer as the engine path reads it (built by ``fuse``): plain tensors —
    views of the parameters — and the layer's MLA / MoE / dense-MLP part, so a decode step
    makes no module calls and no module attribute look-ups. Grouped-query attention: ``qkv``
    the fused (out, in) weight, ``o_t`` o_proj's (in, out) operand; MLA layers: ``mla``."""

    norm1: torch.Tensor
    norm2: torch.Tensor
    h: int = 0
    kv: int = 0
    hd: int = 0
    qkv: torch.Tensor | None = None
    qkv_bias: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    o_t: torch.Tensor | None = None
    mla: MlaAttention | None = None
    moe: SparseMoe | None = None
    mlp: MLP | None = None

    @classmethod
    def of(cls, layer: MoeDecoderLayer) -> MoeFastLayer:
        a, ffn = layer.self_attn, layer.ffn
        moe, mlp = (ffn, None) if isinstance(ffn, SparseMoe) else (None, ffn)
        n1, n2 = layer.input_layernorm.weight, layer.post_attention_layernorm.weight
        if isinstance(a, MlaAttention):
            return cls(n1, n2, mla=a, moe=moe, mlp=mlp)
        assert isinstance(a, Attention) and a.fused is not None
        return cls(n1, n2, a.h, a.kv, a.hd, a.fused[0], a.fused[1],
                   a.q_norm.weight if a.q_norm is not None else None,
                   a.k_norm.weight if a.k_norm is not None else None,
                   a.o_proj.weight.t(), moe=moe, mlp=mlp)


class MoeDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.mla = cfg.mla is not None
        self.self_attn: nn.Module = MlaAttention(cfg, layer) if self.mla else Attention(cfg, layer)
        moe = cfg.moe
        assert moe is not None
        self.block = moe.block
        ffn: nn.Module = SparseMoe(cfg.hidden_size, moe) if moe.is_moe(layer) else MLP(
            cfg.hidden_size, cfg.intermediate_size, False)
        setattr(self, moe.block, ffn)  # HF's name: block_sparse_moe (Mixtral) or mlp
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    @property
    def ffn(self) -> SparseMoe | MLP:
        f = getattr(self, self.block)
        assert isinstance(f, (SparseMoe, MLP))
        return f


class MoeModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(MoeDecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb: Rotary = MlaRotary(cfg) if cfg.mla is not None else Rotary(cfg)

    def decoder_layers(self) -> list[MoeDecoderLayer]:
        return [layer for layer in self.layers if isinstance(layer, MoeDecoderLayer)]


class MoeForCausalLM(nn.Module):
    """Target model with routed experts. ``forward`` returns final-normed hidden states and
    optional EAGLE-3 taps; :meth:`routing` what the last forward routed."""

    gemm_paths: tuple[str, ...] = ("dense",)  # expert GEMMs run on slices: no packed copies
    compilable = False  # the expert loop's trip counts are data: no fixed graph to trace
    graph_capturable = False  # a CUDA graph would replay one routing
    load_note = ""  # what the loader skipped (set by models.loader.load_target)

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.moe is None:
            raise ValueError("MoeForCausalLM needs a config with routed experts (cfg.moe)")
        self.config = cfg
        self.model = MoeModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.gemm = "dense"
        self._head: torch.Tensor | None = None  # lm_head weight as logits() reads it (fuse)
        self._fast: list[MoeFastLayer] | None = None  # the engine path's layers (fuse)

    def reset_rope(self, device: torch.device | str) -> None:
        """Rebuild the rope table's inverse frequencies (a buffer, not in the checkpoint)."""
        rot = MlaRotary if self.config.mla is not None else Rotary
        self.model.rotary_emb = rot(self.config, device)

    def fuse(self, gemm: str = "auto") -> None:
        """Inference weights: q/k/v as one GEMM (grouped-query layers), gate/up of dense MLPs as
        one, the experts stacked (:meth:`SparseMoe.fuse`). Dense GEMMs only."""
        if gemm not in ("auto", "dense"):
            raise ValueError(f"gemm={gemm!r}: a {self.config.family} target runs dense GEMMs "
                             "only (its experts' weights are used as slices, never packed)")
        for layer in self.model.decoder_layers():
            if isinstance(layer.self_attn, Attention):
                layer.self_attn.fuse()
            layer.ffn.fuse()
        self.gemm = "dense"
        head = self.lm_head.weight
        if head.device.type == "cpu":  # (in, out) storage, as fuse_linears (faster in MKL)
            if self.config.tie_word_embeddings:  # the embedding keeps the row layout: copy
                head = head.detach().t().contiguous().t()
            else:
                fuse_linears([self.lm_head])
                head = self.lm_head.weight
        self._head = head
        self._fast = [MoeFastLayer.of(layer) for layer in self.model.decoder_layers()]

    def gemm_pass(self, m: int) -> Callable[[], None]:
        """A timing pass for thread-count measurements (``engine.contention``), as the dense
        target's: every GEMM a forward of ``m`` rows runs, on fixed inputs — attention
        projections, router, the experts such a forward touches under uniform routing
        (min(E, m·k) of them, the m·k rows spread over them), shared experts, dense MLPs, the
        head. GEMMs only (a whole forward's many small ops each wait on every thread when a
        core is busy, stalling the run being measured); no KV and no coverage record touched,
        so safe while requests run."""
        if self._fast is None:
            self.fuse()
        assert self._fast is not None and self._head is not None
        plan: list[tuple[int, torch.Tensor]] = []  # (rows, (in, out) operand of x @ w)
        for f in self._fast:
            if f.mla is not None:
                plan += [(m, lin.weight.t()) for lin in f.mla.modules()
                         if isinstance(lin, nn.Linear)]
            else:
                assert f.qkv is not None and f.o_t is not None
                plan += [(m, f.qkv.t()), (m, f.o_t)]
            if f.moe is not None:
                moe, spec = f.moe, f.moe.spec
                touched = min(spec.num_experts, m * spec.top_k)
                rows = -(-m * spec.top_k // touched)
                plan.append((m, moe.gate.weight.t()))
                plan += [(rows, w) for e in range(touched) for w in moe.mm_weights[e]]
                if moe.shared is not None:
                    plan += [(m, moe.shared[0].t()), (m, moe.shared[1].t())]
            else:
                assert f.mlp is not None and f.mlp.fused is not None
                plan += [(m, f.mlp.fused[0].t()), (m, f.mlp.down_proj.weight.t())]
        plan.append((m, self._head.t()))
        g = torch.Generator().manual_seed(0)
        w0 = self.lm_head.weight
        xs = {(r, w.shape[0]): torch.randn(r, w.shape[0], generator=g, device="cpu").to(
            w0.device, w0.dtype) for r, w in plan}  # CPU generator: the same inputs anywhere

        def run() -> None:
            with torch.inference_mode():
                for r, w in plan:
                    torch.mm(xs[(r, w.shape[0])], w)

        return run

    def moe_layers(self) -> list[int]:
        return [i for i, layer in enumerate(self.model.decoder_layers())
                if isinstance(layer.ffn, SparseMoe)]

    def routing(self) -> dict[int, torch.Tensor]:
        """Layer id → tokens routed to each expert (E,) in the last forward (MoE layers)."""
        out: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.model.decoder_layers()):
            ffn = layer.ffn
            if isinstance(ffn, SparseMoe) and ffn.last_counts is not None:
                out[i] = ffn.last_counts
        return out

    def _attend(self, f: MoeFastLayer, x: torch.Tensor, rope: tuple[torch.Tensor, ...],
                attn: AttentionBackend, i: int, eps: float) -> torch.Tensor:
        """x + attention(norm(x)). Grouped-query layers: one qkv GEMM, RoPE on q and k together
        (rolled tables), o_proj with the residual fused (llama's fast path)."""
        h = _rms(x, f.norm1, eps)
        if f.mla is not None:
            return x + f.mla(h, *rope, attn)  # type: ignore[no-any-return]
        assert f.qkv is not None and f.o_t is not None
        cos, sin = rope
        qkv = F.linear(h, f.qkv, f.qkv_bias).unflatten(-1, (f.h + 2 * f.kv, f.hd))
        if f.q_norm is None or f.k_norm is None:
            qk = apply_rope_rolled(qkv[:, : f.h + f.kv], cos, sin)
            q, k = qk[:, : f.h], qk[:, f.h :]
        else:  # Qwen3-MoE: per-head RMSNorm on q and k before RoPE
            q = apply_rope_rolled(_rms(qkv[:, : f.h], f.q_norm, eps), cos, sin)
            k = apply_rope_rolled(_rms(qkv[:, f.h : f.h + f.kv], f.k_norm, eps), cos, sin)
        o = attn.run(i, q, k, qkv[:, f.h + f.kv :]).flatten(-2)
        return torch.addmm(x, o, f.o_t)

    # -- engine path -----------------------------------------------------------------------
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend,
                aux_layers: Sequence[int] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
        """tokens, positions (T,) ragged → hidden (T, D) after the final norm, and the hidden
        states entering ``aux_layers`` concatenated (T, len(aux)·D), or None.

        One flat loop over :class:`MoeFastLayer` records (norms as plain ops, residual adds
        fused into o_proj and the experts' down GEMMs, no module calls but MLA's): at bs=1 on
        a CPU the per-op and per-call overhead is a large share of a decode step."""
        if self._fast is None:
            self.fuse()
        assert self._fast is not None
        m, eps = self.model, self.config.rms_norm_eps
        x = F.embedding(tokens, m.embed_tokens.weight)
        rot = m.rotary_emb
        mla = isinstance(rot, MlaRotary)
        rope = rot.cos_sin(positions, x.dtype) if mla else rot.rolled(positions, x.dtype)
        taps: dict[int, torch.Tensor] = {}
        for i, f in enumerate(self._fast):
            if i in aux_layers:
                taps[i] = x
            x = self._attend(f, x, rope, attn, i, eps)
            h = _rms(x, f.norm2, eps)
            if f.moe is not None:
                x = f.moe.forward(h, x)
            else:
                assert f.mlp is not None
                x = x + f.mlp.forward(h)
        return _rms(x, m.norm.weight, m.norm.eps), gather_taps(taps, aux_layers)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (T, D) → logits (T, V) in float32."""
        if self._head is None:
            return self.lm_head(hidden).float()  # type: ignore[no-any-return]
        return F.linear(hidden, self._head).float()

    # -- dense path (training, oracles) ----------------------------------------------------
    def forward_dense(self, input_ids: torch.Tensor, aux_layers: Sequence[int] = ()
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """input_ids (B, T) → logits (B, T, V) with causal attention, and taps (B, T, 3D)."""
        m = self.model
        b, t = input_ids.shape
        x = m.embed_tokens(input_ids)
        cos, sin = m.rotary_emb.cos_sin(torch.arange(t, device=input_ids.device), x.dtype)
        taps: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(m.decoder_layers()):
            if i in aux_layers:
                taps[i] = x
            a, h = layer.self_attn, layer.input_layernorm(x)
            if isinstance(a, MlaAttention):
                x = x + a.forward_dense(h, cos, sin)
            else:
                assert isinstance(a, Attention)
                q, k, v = a.qkv(h, cos, sin)
                o = F.scaled_dot_product_attention(
                    q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                    enable_gqa=a.h != a.kv).transpose(1, 2)
                x = x + a.o_proj(o.flatten(-2))
            h = layer.post_attention_layernorm(x)
            x = x + layer.ffn(h.flatten(0, 1)).view_as(x)
        return self.lm_head(m.norm(x)), gather_taps(taps, aux_layers)
