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

import torch
import torch.nn.functional as F
from torch import nn

from workbench.models.config import ModelConfig
from workbench.models.gemm import fuse_linears
from workbench.models.llama import MLP, Attention, AttentionBackend, RMSNorm, gather_taps
from workbench.models.mla import MlaAttention, MlaRotary
from workbench.models.moe import SparseMoe
from workbench.models.rope import Rotary, apply_rope_rolled


def _norm(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """``norm(x)`` without the module call (float32: one fused op)."""
    if x.dtype == torch.float32 and norm.weight.dtype == torch.float32:
        return F.rms_norm(x, norm.weight.shape, norm.weight, norm.eps)
    return norm(x)  # type: ignore[no-any-return]


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

    def gemm_pass(self, m: int) -> Callable[[], None]:
        """A timing pass for thread-count measurements (``engine.contention``): the dense
        forward over ``m`` fixed tokens (every GEMM a forward of m rows runs, the experts its
        routing picks; no KV touched, so safe while requests run)."""
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, self.config.vocab_size, (1, m), generator=g, device="cpu").to(
            self.lm_head.weight.device)

        def run() -> None:
            with torch.inference_mode():
                self.forward_dense(ids)

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

    def _attend(self, layer: MoeDecoderLayer, x: torch.Tensor, rope: tuple[torch.Tensor, ...],
                attn: AttentionBackend, i: int) -> torch.Tensor:
        """x + attention(norm(x)). Grouped-query layers after ``fuse``: one qkv GEMM, RoPE on
        q and k together (rolled tables), o_proj with the residual fused (llama's fast path)."""
        a, h = layer.self_attn, _norm(layer.input_layernorm, x)
        if isinstance(a, MlaAttention):
            return x + a(h, *rope, attn)  # type: ignore[no-any-return]
        assert isinstance(a, Attention)
        if a.fused is None:
            q, k, v = a.qkv(h, *rope)
            return x + a.o_proj(attn.run(i, q, k, v).flatten(-2))  # type: ignore[no-any-return]
        cos, sin = rope
        qkv = F.linear(h, *a.fused).unflatten(-1, (a.h + 2 * a.kv, a.hd))
        if a.q_norm is None or a.k_norm is None:
            qk = apply_rope_rolled(qkv[:, : a.h + a.kv], cos, sin)
            q, k = qk[:, : a.h], qk[:, a.h :]
        else:  # Qwen3-MoE: per-head RMSNorm on q and k before RoPE
            q = apply_rope_rolled(_norm(a.q_norm, qkv[:, : a.h]), cos, sin)
            k = apply_rope_rolled(_norm(a.k_norm, qkv[:, a.h : a.h + a.kv]), cos, sin)
        o = attn.run(i, q, k, qkv[:, a.h + a.kv :]).flatten(-2)
        return torch.addmm(x, o, a.o_proj.weight.t())

    # -- engine path -----------------------------------------------------------------------
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend,
                aux_layers: Sequence[int] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
        """tokens, positions (T,) ragged → hidden (T, D) after the final norm, and the hidden
        states entering ``aux_layers`` concatenated (T, len(aux)·D), or None.

        One flat loop (norms as plain ops, residual adds fused into o_proj and the experts'
        down GEMMs): at bs=1 on a CPU the per-op overhead is a large share of a decode step."""
        m = self.model
        x = F.embedding(tokens, m.embed_tokens.weight)
        rot = m.rotary_emb
        fused = self._head is not None and not isinstance(rot, MlaRotary)
        rope = rot.rolled(positions, x.dtype) if fused else rot.cos_sin(positions, x.dtype)
        taps: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(m.decoder_layers()):
            if i in aux_layers:
                taps[i] = x
            x = self._attend(layer, x, rope, attn, i)
            h, ffn = _norm(layer.post_attention_layernorm, x), layer.ffn
            x = ffn(h, x) if isinstance(ffn, SparseMoe) else x + ffn(h)
        return _norm(m.norm, x), gather_taps(taps, aux_layers)

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
