"""Llama-family decoder (Llama 2/3, Qwen2 with qkv bias, Qwen3 with q/k RMSNorm).

Parameter names match HF ``LlamaForCausalLM`` so checkpoints load without renaming. One module
serves two callers:

* ``forward_dense(input_ids)`` — causal attention over a padded [B, T] batch (training, oracles);
* ``forward(tokens, positions, attn)`` — the engine's ragged path: T flattened tokens of many
  requests, per-token positions, and an attention backend that owns the paged KV cache.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from workbench.models.config import ModelConfig


class AttentionBackend(Protocol):
    """Runs attention for one layer over whatever KV the backend manages."""

    def run(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: (T, H, hd), k/v: (T, Hkv, hd) for the new tokens → (T, H, hd)."""
        ...


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)  # one fused op
        # Reduced precision: HF's op order (normalise in fp32, cast, then scale).
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies (hd/2,) including ``rope_scaling`` (linear, llama3)."""
    hd = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
    rs = cfg.rope_scaling
    if not rs:
        return inv
    kind = rs.get("rope_type", rs.get("type"))
    if kind == "linear":
        return inv / float(rs["factor"])
    if kind == "llama3":
        factor = float(rs["factor"])
        low = float(rs.get("low_freq_factor", 1.0))
        high = float(rs.get("high_freq_factor", 4.0))
        old_ctx = float(rs.get("original_max_position_embeddings", 8192))
        low_wl, high_wl = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wl, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= high_wl) & (wavelen <= low_wl)
        return torch.where(is_mid, mid, scaled)
    return inv


class Rotary(nn.Module):
    """cos/sin table indexed by absolute position; grown on demand."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        self._cos = torch.empty(0)
        self._sin = torch.empty(0)

    def table(self, n: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if self._cos.shape[0] < n or self._cos.dtype != dtype:
            size = max(n, 2 * self._cos.shape[0], 256)
            t = torch.arange(size, dtype=torch.int64, device=self.inv_freq.device).float()
            freqs = torch.outer(t, self.inv_freq)
            emb = torch.cat((freqs, freqs), dim=-1)
            self._cos, self._sin = emb.cos().to(dtype), emb.sin().to(dtype)
        return self._cos, self._sin

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        cos, sin = self.table(int(positions.max()) + 1 if positions.numel() else 1, dtype)
        return cos[positions], sin[positions]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (..., T, heads, hd); cos/sin: (..., T, hd) broadcast over heads."""
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.unsqueeze(-2) + rot * sin.unsqueeze(-2)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.h, self.kv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        d, b = cfg.hidden_size, cfg.attention_bias
        self.q_proj = nn.Linear(d, self.h * self.hd, bias=b)
        self.k_proj = nn.Linear(d, self.kv * self.hd, bias=b)
        self.v_proj = nn.Linear(d, self.kv * self.hd, bias=b)
        self.o_proj = nn.Linear(self.h * self.hd, d, bias=False)
        if cfg.qk_norm:
            self.q_norm: RMSNorm | None = RMSNorm(self.hd, cfg.rms_norm_eps)
            self.k_norm: RMSNorm | None = RMSNorm(self.hd, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.fused: tuple[torch.Tensor, torch.Tensor | None] | None = None

    def fuse(self) -> None:
        """Concatenate q/k/v into one weight for inference (one GEMM instead of three)."""
        w = torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight]).detach()
        b = None
        if self.q_proj.bias is not None:
            b = torch.cat([self.q_proj.bias, self.k_proj.bias, self.v_proj.bias]).detach()
        self.fused = (w, b)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor,
            sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x: (..., T, D) → q (..., T, H, hd), k/v (..., T, Hkv, hd), rope applied."""
        if self.fused is not None and self.q_norm is None:
            # One GEMM, and RoPE applied to q and k together: (T, H + Hkv, hd).
            out = F.linear(x, *self.fused).unflatten(-1, (self.h + 2 * self.kv, self.hd))
            qk = apply_rope(out[..., : self.h + self.kv, :], cos, sin)
            return qk[..., : self.h, :], qk[..., self.h :, :], out[..., self.h + self.kv :, :]
        if self.fused is not None:
            out = F.linear(x, *self.fused)
            q, k, v = out.split([self.h * self.hd, self.kv * self.hd, self.kv * self.hd], -1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.unflatten(-1, (self.h, self.hd))
        k = k.unflatten(-1, (self.kv, self.hd))
        v = v.unflatten(-1, (self.kv, self.hd))
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


class MLP(nn.Module):
    def __init__(self, d: int, inter: int, bias: bool) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(d, inter, bias=bias)
        self.up_proj = nn.Linear(d, inter, bias=bias)
        self.down_proj = nn.Linear(inter, d, bias=bias)
        self.fused: tuple[torch.Tensor, torch.Tensor | None] | None = None

    def fuse(self) -> None:
        w = torch.cat([self.gate_proj.weight, self.up_proj.weight]).detach()
        b = None
        if self.gate_proj.bias is not None:
            b = torch.cat([self.gate_proj.bias, self.up_proj.bias]).detach()
        self.fused = (w, b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused is not None:
            g, u = F.linear(x, *self.fused).chunk(2, dim=-1)
        else:
            g, u = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(F.silu(g) * u)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = Rotary(cfg)


class LlamaForCausalLM(nn.Module):
    """Target model. ``forward`` returns final-normed hidden states and optional EAGLE-3 taps."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def fuse(self) -> None:
        """Build fused inference weights (call after loading; training must not use them)."""
        for layer in self.model.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()

    # -- engine path -----------------------------------------------------------------------
    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionBackend,
        aux_layers: Sequence[int] = (),
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """tokens, positions: (T,) ragged → hidden (T, D) after the final norm, and the hidden
        states entering ``aux_layers`` concatenated as (T, len(aux)·D), or None."""
        m = self.model
        x = m.embed_tokens(tokens)
        cos, sin = m.rotary_emb.cos_sin(positions, x.dtype)
        taps: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(m.layers):
            if i in aux_layers:
                taps[i] = x
            a = layer.self_attn
            q, k, v = a.qkv(layer.input_layernorm(x), cos, sin)
            o = attn.run(i, q, k, v)  # (T, H, hd)
            x = x + a.o_proj(o.flatten(-2))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return m.norm(x), gather_taps(taps, aux_layers)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: (T, D) → logits (T, V) in float32."""
        return self.lm_head(hidden).float()

    # -- dense path (training, oracles) ----------------------------------------------------
    def forward_dense(
        self, input_ids: torch.Tensor, aux_layers: Sequence[int] = ()
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """input_ids: (B, T) → logits (B, T, V) with causal attention, and taps (B, T, 3D)."""
        m = self.model
        b, t = input_ids.shape
        x = m.embed_tokens(input_ids)
        pos = torch.arange(t, device=input_ids.device)
        cos, sin = m.rotary_emb.cos_sin(pos, x.dtype)
        taps: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(m.layers):
            if i in aux_layers:
                taps[i] = x
            a = layer.self_attn
            q, k, v = a.qkv(layer.input_layernorm(x), cos, sin)
            o = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                is_causal=True, enable_gqa=a.h != a.kv,
            ).transpose(1, 2)
            x = x + a.o_proj(o.flatten(-2))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.lm_head(m.norm(x)), gather_taps(taps, aux_layers)


def gather_taps(taps: dict[int, torch.Tensor], aux_layers: Sequence[int]) -> torch.Tensor | None:
    """Concatenate taps in ``aux_layers`` order (ids may repeat or be unsorted): (..., n·D)."""
    return torch.cat([taps[i] for i in aux_layers], dim=-1) if aux_layers else None


def init_weights(model: nn.Module, std: float = 0.02, seed: int = 0) -> None:
    """Deterministic GPT-style init (normal(0, std) linears/embeddings, ones for norms)."""
    g = torch.Generator().manual_seed(seed)
    for name, p in sorted(model.named_parameters()):
        with torch.no_grad():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=g) * std)
