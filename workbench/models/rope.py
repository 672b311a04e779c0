"""Rotary position embeddings (RoPE): inverse frequencies with ``rope_scaling`` (linear,
llama3), the cached cos/sin table, and the two ways to apply it (:func:`apply_rope`, HF's op
order for the module path; :func:`apply_rope_rolled` for the engine's flat loop)."""

from __future__ import annotations

import math

import torch
from torch import nn

from workbench.models.config import ModelConfig


def rope_inv_freq(cfg: ModelConfig, device: torch.device | str | None = None) -> torch.Tensor:
    """Inverse frequencies (hd/2,) including ``rope_scaling`` (linear, llama3), on ``device``
    (None: torch's current default device, e.g. a ``with torch.device("meta")`` block)."""
    hd = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64,
                                                 device=device).float() / hd))
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
    """cos/sin table indexed by absolute position; grown on demand, on ``inv_freq``'s device
    (the tables are plain attributes, not buffers, so ``Module.to`` does not move them: a table
    on another device than ``inv_freq`` is rebuilt)."""

    inv_freq: torch.Tensor  # a buffer (register_buffer in __init__)

    def __init__(self, cfg: ModelConfig, device: torch.device | str | None = None) -> None:
        super().__init__()
        inv = rope_inv_freq(cfg, device)
        self.register_buffer("inv_freq", inv, persistent=False)
        dev = inv.device
        self._cos = torch.empty(0, device=dev)
        self._sin = torch.empty(0, device=dev)
        # sin with its first half negated (apply_rope_rolled)
        self._sin_signed = torch.empty(0, device=dev)

    def table(self, n: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if (self._cos.shape[0] < n or self._cos.dtype != dtype
                or self._cos.device != self.inv_freq.device):
            # Grow geometrically; a new dtype or device alone rebuilds at the same length
            # (doubling there too made a table that flips dtype, e.g. bf16 autocast training
            # and float32 evaluation in turn, grow to gigabytes)
            grown = self._cos.shape[0] < n
            size = max(n, 2 * self._cos.shape[0], 256) if grown else self._cos.shape[0]
            t = torch.arange(size, dtype=torch.int64, device=self.inv_freq.device).float()
            freqs = torch.outer(t, self.inv_freq)
            emb = torch.cat((freqs, freqs), dim=-1)
            self._cos, self._sin = emb.cos().to(dtype), emb.sin().to(dtype)
            half = self._sin.shape[-1] // 2
            self._sin_signed = torch.cat((-self._sin[:, :half], self._sin[:, half:]), dim=-1)
        return self._cos, self._sin

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        cos, sin = self.table(int(positions.max()) + 1 if positions.numel() else 1, dtype)
        return cos[positions], sin[positions]

    def rolled(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """``rolled_rope_tables(*cos_sin(positions, dtype))`` as two row gathers from cached
        tables (the signed sin is built with the table): the same values (negation is exact),
        6 ops instead of ~12 — 24 vs ~10 µs per forward on the 2-core EPYC, paid once per
        target forward and once per draft step. A ``cos_sin`` shadowing the method on the
        instance (``engine.cuda_graphs.static_rotary``: fixed, sync-free tables) is honoured."""
        if "cos_sin" in vars(self):
            return rolled_rope_tables(*self.cos_sin(positions, dtype))
        self.table(int(positions.max()) + 1 if positions.numel() else 1, dtype)
        idx = positions.to(self._cos.device)  # as advanced indexing does (no-op when there)
        return (self._cos.index_select(0, idx).unsqueeze(-2),
                self._sin_signed.index_select(0, idx).unsqueeze(-2))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (..., T, heads, hd); cos/sin: (..., T, hd) broadcast over heads."""
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.unsqueeze(-2) + rot * sin.unsqueeze(-2)


def rolled_rope_tables(cos: torch.Tensor,
                       sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Once per forward: (T, hd) cos/sin → (T, 1, hd) cos and sin with its first half negated,
    for :func:`apply_rope_rolled`."""
    half = sin.shape[-1] // 2
    return cos.unsqueeze(-2), torch.cat((-sin[..., :half], sin[..., half:]), dim=-1).unsqueeze(-2)


def apply_rope_rolled(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """:func:`apply_rope` in 4 ops instead of 7 — ``x·cos + roll(x, hd/2)·sin_signed``: the same
    products and sum, so the same values. cos/sin_signed from :func:`rolled_rope_tables`."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin_signed
