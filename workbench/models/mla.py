"""DeepSeek-V3 multi-head latent attention (MLA) over a latent KV cache.

Per token and layer the cache holds c = RMSNorm(latent) (``kv_lora_rank``) and the rope key
k_pe (``qk_rope_head_dim``, shared by every head) — not the expanded per-head K/V. The engine
path absorbs ``kv_b_proj`` into the query and the output (the weight-absorption form of MLA):

    score_h = q_nope_h · (W_UK_h c) + q_pe_h · k_pe = (W_UK_hᵀ q_nope_h) · c + q_pe_h · k_pe
    out_h   = W_UV_h (Σ_j p_hj c_j)

so attention runs as multi-query attention with one shared head: key [c, k_pe], value c (a view
of the key's first ``kv_lora_rank`` columns, so the pool stores the latent once). The softmax
scale (``qk_head_dim``⁻⁰·⁵, times mscale² under YaRN) is folded into the query, since the
backends use SDPA's default 1/√(key dim). ``forward_dense`` (training, oracles) runs the expanded
form instead: per-head K/V from ``kv_b_proj``, as the checkpoint's reference does.

Interleaved rope (``rope_interleave``): pairs (x0, x1), (x2, x3), … each rotated by one
frequency; applied as the usual rotate-half rope on the dims reordered evens-then-odds (q and k
alike, so their dot products are the same).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from workbench.models.config import ModelConfig
from workbench.models.rope import Rotary, apply_rope


def mla_inv_freq(cfg: ModelConfig, device: torch.device | str | None = None) -> torch.Tensor:
    """Inverse frequencies over ``qk_rope_head_dim`` dims, with YaRN when configured."""
    assert cfg.mla is not None
    dim = cfg.mla.qk_rope_head_dim
    base = cfg.rope_theta
    pos = base ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim)
    extra = 1.0 / pos
    rs = cfg.rope_scaling
    if not rs or rs.get("rope_type", rs.get("type")) in (None, "default"):
        return extra
    old = float(rs["original_max_position_embeddings"])
    factor = float(rs.get("factor") or cfg.max_position_embeddings / old)
    fast, slow = float(rs.get("beta_fast") or 32), float(rs.get("beta_slow") or 1)

    def corr(rot: float) -> float:
        return dim * math.log(old / (rot * 2 * math.pi)) / (2 * math.log(base))

    low, high = corr(fast), corr(slow)
    if rs.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=device) - low)
            / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # share of the extrapolated (unscaled) frequency
    return extra / factor * (1 - keep) + extra * keep


class MlaRotary(Rotary):
    """The rope table of ``qk_rope_head_dim`` dims; cos/sin carry YaRN's attention factor."""

    def __init__(self, cfg: ModelConfig, device: torch.device | str | None = None) -> None:
        super().__init__(cfg, device)
        assert cfg.mla is not None
        self.register_buffer("inv_freq", mla_inv_freq(cfg, device), persistent=False)
        self.factor = cfg.mla.rope_attention_factor

    def table(self, n: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        inv = self.inv_freq
        assert isinstance(inv, torch.Tensor)
        if self._cos.shape[0] < n or self._cos.dtype != dtype or self._cos.device != inv.device:
            size = max(n, 2 * self._cos.shape[0], 256)
            t = torch.arange(size, dtype=torch.int64, device=inv.device).float()
            emb = torch.outer(t, inv).repeat(1, 2)
            self._cos = (emb.cos() * self.factor).to(dtype)
            self._sin = (emb.sin() * self.factor).to(dtype)
            half = self._sin.shape[-1] // 2
            self._sin_signed = torch.cat((-self._sin[:, :half], self._sin[:, half:]), dim=-1)
        return self._cos, self._sin


class MlaAttention(nn.Module):
    """HF names: ``q_proj`` or ``q_a_proj``/``q_a_layernorm``/``q_b_proj``,
    ``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``, ``o_proj``."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        from workbench.models.llama import RMSNorm

        m = cfg.mla
        assert m is not None
        self.spec, self.layer, self.h = m, layer, cfg.num_attention_heads
        d, qk = cfg.hidden_size, m.qk_nope_head_dim + m.qk_rope_head_dim
        if m.q_lora_rank is None:
            self.q_proj: nn.Linear | None = nn.Linear(d, self.h * qk, bias=False)
            self.q_a_proj = self.q_b_proj = None
            self.q_a_layernorm: RMSNorm | None = None
        else:
            self.q_proj = None
            self.q_a_proj = nn.Linear(d, m.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = nn.Linear(m.q_lora_rank, self.h * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d, m.kv_lora_rank + m.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = nn.Linear(m.kv_lora_rank, self.h * (m.qk_nope_head_dim + m.v_head_dim),
                                   bias=False)
        self.o_proj = nn.Linear(self.h * m.v_head_dim, d, bias=False)
        # the key dim of the cache; SDPA scales by its -1/2 power: fold the true scale into q
        self.q_gain = m.softmax_scale * math.sqrt(m.cache_dim)

    def _q(self, x: torch.Tensor) -> torch.Tensor:
        m = self.spec
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            assert self.q_a_proj is not None and self.q_a_layernorm is not None
            assert self.q_b_proj is not None
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        return q.unflatten(-1, (self.h, m.qk_nope_head_dim + m.qk_rope_head_dim))

    def _latent(self, x: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                            torch.Tensor]:
        """x (..., T, D) → q_nope (..., T, H, n), q_pe (..., T, H, r) roped, c (..., T, R)
        normed latent, k_pe (..., T, 1, r) roped; cos/sin (..., T, r)."""
        m = self.spec
        q = self._q(x)
        q_nope, q_pe = q.split([m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
        ckv = self.kv_a_proj_with_mqa(x)
        c, k_pe = ckv.split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        c = self.kv_a_layernorm(c)
        k_pe = k_pe.unsqueeze(-2)
        if m.rope_interleave:  # evens then odds: rotate-half rope on the reordered dims
            q_pe = torch.cat([q_pe[..., 0::2], q_pe[..., 1::2]], dim=-1)
            k_pe = torch.cat([k_pe[..., 0::2], k_pe[..., 1::2]], dim=-1)
        return q_nope, apply_rope(q_pe, cos, sin), c, apply_rope(k_pe, cos, sin)

    def _wkv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK (H, n, R) and W_UV (H, v, R): views of ``kv_b_proj.weight``."""
        m = self.spec
        w = self.kv_b_proj.weight.view(self.h, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank)
        return w[:, : m.qk_nope_head_dim], w[:, m.qk_nope_head_dim :]

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attn: object) -> torch.Tensor:
        """Engine path: x (T, D) ragged, ``attn`` a backend over the latent pool → (T, D)."""
        q_nope, q_pe, c, k_pe = self._latent(x, cos, sin)
        w_uk, w_uv = self._wkv()
        q_lat = torch.einsum("thn,hnr->thr", q_nope, w_uk)
        q = torch.cat([q_lat, q_pe], dim=-1) * self.q_gain  # (T, H, R + r)
        k = torch.cat([c.unsqueeze(-2), k_pe], dim=-1)  # (T, 1, R + r)
        o = attn.run(self.layer, q, k, c.unsqueeze(-2))  # type: ignore[attr-defined]
        out = torch.einsum("thr,hvr->thv", o, w_uv)  # (T, H, v)
        return self.o_proj(out.flatten(-2))

    def forward_dense(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Training/oracle path: x (B, T, D), causal, expanded per-head K/V → (B, T, D)."""
        m = self.spec
        q_nope, q_pe, c, k_pe = self._latent(x, cos, sin)
        kv = self.kv_b_proj(c).unflatten(-1, (self.h, m.qk_nope_head_dim + m.v_head_dim))
        k_nope, v = kv.split([m.qk_nope_head_dim, m.v_head_dim], dim=-1)
        q = torch.cat([q_nope, q_pe], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(*k_nope.shape[:-1], m.qk_rope_head_dim)], dim=-1)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=True, scale=m.softmax_scale).transpose(1, 2)
        return self.o_proj(o.flatten(-2))
