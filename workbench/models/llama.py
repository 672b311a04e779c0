"""Llama-family decoder (Llama 2/3, Qwen2 with qkv bias, Qwen3 with q/k RMSNorm).

Parameter names match HF ``LlamaForCausalLM`` so checkpoints load without renaming. One module
serves two callers:

* ``forward_dense(input_ids)`` — causal attention over a padded [B, T] batch (training, oracles);
* ``forward(tokens, positions, attn)`` — the engine's ragged path: T flattened tokens of many
  requests, per-token positions, and an attention backend that owns the paged KV cache.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
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
        self._sin_signed = torch.empty(0)  # sin with its first half negated (apply_rope_rolled)

    def table(self, n: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if self._cos.shape[0] < n or self._cos.dtype != dtype:
            size = max(n, 2 * self._cos.shape[0], 256)
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


def fuse_linears(linears: Sequence[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One (sum(out), in) weight for ``linears`` (and bias), each linear's parameter becoming a
    view of it, so there is one copy of the weights and in-place updates reach both.

    On CPU the storage is transposed — (in, out) contiguous, the weight a ``.t()`` view — because
    MKL reads that layout much faster for the engine's small-M GEMMs (the 18 layers of wb-target
    on the 2-core EPYC: 1.9 ms vs 3.5 ms per token at T=1, 3.2 vs 3.9 ms at T=6, equal at T=16).
    On CUDA the layout stays (out, in) (cuBLAS reads both)."""
    ws = [lin.weight.detach() for lin in linears]
    cpu = ws[0].device.type == "cpu"
    with torch.no_grad():
        if cpu:
            store = torch.cat([w.t() for w in ws], dim=1).contiguous()  # (in, sum out)
            w = store.t()
        else:
            w = torch.cat(ws).contiguous() if len(ws) > 1 else ws[0]
        o = 0
        for lin in linears:
            n = lin.weight.shape[0]
            lin.weight.data = w[o : o + n]
            o += n
        b = None
        if linears[0].bias is not None:
            b = torch.cat([lin.bias.detach() for lin in linears]).contiguous()
            o = 0
            for lin in linears:
                n = lin.bias.shape[0]
                lin.bias.data = b[o : o + n]
                o += n
    return w, b


GEMMS = ("auto", "onednn", "dense")


def onednn_ok(weight: torch.Tensor) -> bool:
    """Can oneDNN pack this weight? (float32 on a CPU with mkldnn.)"""
    return (weight.device.type == "cpu" and weight.dtype == torch.float32
            and torch.backends.mkldnn.is_available())


def resolve_gemm(kind: str, weight: torch.Tensor) -> str:
    """``onednn``: weights packed once by oneDNN (CPU float32; what Inductor's freezing pass
    does); ``dense``: plain ``F.linear``. ``auto`` here is ``dense`` (views, no packing): which
    path is faster depends on the machine — oneDNN won 1.6-2.5x at small M on a 2-core EPYC and
    lost 1.57x on a 2-core Xeon — so the engine times both at init on the real weights and
    re-fuses with the winner (``workbench.engine.autotune``)."""
    if kind not in GEMMS:
        raise ValueError(f"gemm: {kind!r} not in {GEMMS}")
    if kind == "onednn" and not onednn_ok(weight):
        raise ValueError(f"gemm='onednn' needs a float32 CPU model with mkldnn; got "
                         f"{weight.dtype} on {weight.device} (mkldnn available: "
                         f"{torch.backends.mkldnn.is_available()})")
    return "onednn" if kind == "onednn" else "dense"


# Packing batch hint: the oneDNN kernel chosen for M=16 serves M=1 as fast as the GEMV and
# M=6..64 2-2.5x faster than MKL's small-M path on the 2-core EPYC (wb-target's 18 layers:
# T=1 1.6 vs 2.7 ms, T=6 1.9 vs 4.9 ms, T=16 2.5 vs 6.6 ms, T=300 19 vs 42 ms).
PACK_HINT = 16
# oneDNN builds (JIT-compiles) and caches one primitive per input shape, and RSS grows with
# the number of distinct row counts M it has seen (the 18 layers of wb-target: +430 MB after
# M = 65..199). So rows are used as they come up to EXACT_M (decode batches, chain and N<=16
# tree verifies at bs=1, draft steps: padding those would cost ~0.7 ms per chain verify), then
# padded up to a power of two up to M_BUCKET, then to a multiple of M_BUCKET: at most
# EXACT_M + 2 + max_rows / 64 shapes, so a long-running engine stops growing once it has seen
# them. Padded rows are zeros and never change the real rows' results (oneDNN computes each row
# the same way at every M; the lossless and oracle tests run through these paths).
EXACT_M = 16
M_BUCKET = 64


def pack(w: torch.Tensor) -> torch.Tensor:
    """oneDNN-packed copy of a (out, in) float32 weight (an opaque ``_mkldnn`` tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(w.detach().contiguous(), PACK_HINT)


def row_bucket(m: int) -> int:
    """The padded row count for ``m`` rows (1..16 as is, 32, 64, 128, 192, ...)."""
    if m <= EXACT_M:
        return m
    if m <= M_BUCKET:
        return 1 << (m - 1).bit_length()
    return -(-m // M_BUCKET) * M_BUCKET


def onednn_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """x (M, in) · packed wᵀ (+ b), rows padded to :func:`row_bucket`."""
    m = x.shape[0]
    mb = row_bucket(m)
    if mb == m:
        return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
    xp = F.pad(x, (0, 0, 0, mb - m))
    return torch.ops.mkldnn._linear_pointwise(xp, w, b, "none", [], "")[:m]


def onednn_linear_add(x: torch.Tensor, w: torch.Tensor, res: torch.Tensor) -> torch.Tensor:
    """res + x·wᵀ in one oneDNN call (post-op add)."""
    m = x.shape[0]
    mb = row_bucket(m)
    if mb == m:
        return torch.ops.mkldnn._linear_pointwise.binary(x, res, w, None, "add")
    xp, rp = F.pad(x, (0, 0, 0, mb - m)), F.pad(res, (0, 0, 0, mb - m))
    return torch.ops.mkldnn._linear_pointwise.binary(xp, rp, w, None, "add")[:m]


def dense_linear_add(x: torch.Tensor, w: torch.Tensor, res: torch.Tensor) -> torch.Tensor:
    return torch.addmm(res, x, w.t())


Linear = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]
LinearAdd = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def gemm_ops(gemm: str) -> tuple[Linear, LinearAdd]:
    """(linear(x, w, b), linear_add(x, w, residual)) for fused weights prepared for ``gemm``."""
    if gemm == "onednn":
        return onednn_linear, onednn_linear_add
    return F.linear, dense_linear_add


def prepare_weight(w: torch.Tensor, gemm: str) -> torch.Tensor:
    """The weight as ``gemm_ops(gemm)`` reads it: a packed copy (onednn) or ``w`` itself."""
    return pack(w) if gemm == "onednn" else w


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
        """Concatenate q/k/v into one weight for inference (one GEMM instead of three); the
        three parameters become views of it (no second copy; training updates stay in sync)."""
        if self.fused is None:
            self.fused = fuse_linears([self.q_proj, self.k_proj, self.v_proj])
            fuse_linears([self.o_proj])

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
        """gate/up as one weight (views, as :meth:`Attention.fuse`); down re-laid out."""
        if self.fused is None:
            self.fused = fuse_linears([self.gate_proj, self.up_proj])
            fuse_linears([self.down_proj])

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


@dataclass(frozen=True)
class FastLayer:
    """One decoder layer's inference weights: views of its parameters (``dense``, see
    :func:`fuse_linears`) or oneDNN-packed copies (``onednn``)."""

    h: int
    kv: int
    hd: int
    norm1: torch.Tensor
    qkv: torch.Tensor  # (Hq·hd + 2·Hkv·hd, D); onednn: packed copies throughout
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: torch.Tensor  # o_proj (D, H·hd)
    norm2: torch.Tensor
    gate_up: torch.Tensor  # (2·I, D)
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor  # (D, I)
    down_bias: torch.Tensor | None

    @classmethod
    def of(cls, layer: DecoderLayer, gemm: str) -> FastLayer:
        """``gemm='onednn'``: packed copies (weights twice in memory, and a later in-place
        update of the parameters is not seen: call ``fuse`` again); ``dense``: views."""
        a, mlp = layer.self_attn, layer.mlp
        assert a.fused is not None and mlp.fused is not None
        def prep(w: torch.Tensor) -> torch.Tensor:
            return prepare_weight(w, gemm)

        return cls(a.h, a.kv, a.hd, layer.input_layernorm.weight, prep(a.fused[0]), a.fused[1],
                   a.q_norm.weight if a.q_norm is not None else None,
                   a.k_norm.weight if a.k_norm is not None else None,
                   prep(a.o_proj.weight), layer.post_attention_layernorm.weight,
                   prep(mlp.fused[0]), mlp.fused[1], prep(mlp.down_proj.weight),
                   mlp.down_proj.bias)


class LlamaForCausalLM(nn.Module):
    """Target model. ``forward`` returns final-normed hidden states and optional EAGLE-3 taps."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self._fast: list[FastLayer] | None = None  # set by fuse()
        self._head: torch.Tensor | None = None  # lm_head weight as gemm_ops reads it
        self.gemm = "dense"

    def fuse(self, gemm: str = "auto") -> None:
        """Build the inference weights (see :class:`FastLayer`); call again after changing the
        parameters. q/k/v and gate/up become single GEMMs; parameters stay valid for training
        (:func:`fuse_linears`). ``gemm``: see :func:`resolve_gemm`; the choice is ``self.gemm``."""
        for layer in self.model.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()
        self.gemm = resolve_gemm(gemm, self.lm_head.weight)
        head = self.lm_head.weight
        if self.gemm == "dense" and head.device.type == "cpu":
            if self.config.tie_word_embeddings:  # the embedding keeps the row layout: copy
                head = head.detach().t().contiguous().t()
            else:
                fuse_linears([self.lm_head])
                head = self.lm_head.weight
        self._head = prepare_weight(head, self.gemm)
        self._fast = [FastLayer.of(layer, self.gemm) for layer in self.model.layers]

    # -- engine path -----------------------------------------------------------------------
    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionBackend,
        aux_layers: Sequence[int] = (),
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """tokens, positions: (T,) ragged → hidden (T, D) after the final norm, and the hidden
        states entering ``aux_layers`` concatenated as (T, len(aux)·D), or None.

        One flat loop over plain tensors (no module calls): per layer norm, qkv GEMM, RoPE on
        q and k together, attention, o_proj GEMM with the residual add fused, norm, gate/up
        GEMM, SiLU·up, down GEMM with the residual fused. At bs=1 on a CPU the per-op overhead
        is a large share of a decode step, so every op counts here. GEMMs per ``self.gemm``."""
        if self._fast is None:
            self.fuse()
        x = F.embedding(tokens, self.model.embed_tokens.weight)  # the module's op, no __call__
        cos, sin = self.model.rotary_emb.rolled(positions, x.dtype)
        return self.layers_forward(x, cos, sin, attn, aux_layers)

    def layers_forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       attn: AttentionBackend, aux_layers: Sequence[int] = (),
                       fast: Sequence[FastLayer] | None = None, gemm: str | None = None,
                       ops: tuple[Linear, LinearAdd] | None = None,
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`forward` after the embedding and RoPE tables (``rolled_rope_tables``): the
        decoder layers and the final norm. Shape-static given x (T, D), which is what a
        compiled step (``workbench.engine.compiled``) traces — with ``fast``/``gemm`` set to
        dense views (:meth:`dense_layers`), or with ``ops`` (linear, linear_add) calling
        opaque custom ops on the packed weights, since those cannot be traced."""
        lin, lin_add = ops if ops is not None else gemm_ops(gemm or self.gemm)
        m, eps = self.model, self.config.rms_norm_eps
        d = (x.shape[-1],)
        taps: dict[int, torch.Tensor] = {}
        for i, f in enumerate(fast if fast is not None else self._fast):  # type: ignore[arg-type]
            if i in aux_layers:
                taps[i] = x
            qkv = lin(F.rms_norm(x, d, f.norm1, eps), f.qkv, f.qkv_bias)
            qkv = qkv.unflatten(-1, (f.h + 2 * f.kv, f.hd))
            if f.q_norm is None:
                qk = apply_rope_rolled(qkv[:, : f.h + f.kv], cos, sin)
                q, k = qk[:, : f.h], qk[:, f.h :]
            else:  # Qwen3: per-head RMSNorm on q and k before RoPE
                q = F.rms_norm(qkv[:, : f.h], (f.hd,), f.q_norm, eps)
                k = F.rms_norm(qkv[:, f.h : f.h + f.kv], (f.hd,), f.k_norm, eps)
                q, k = apply_rope_rolled(q, cos, sin), apply_rope_rolled(k, cos, sin)
            o = attn.run(i, q, k, qkv[:, f.h + f.kv :])  # (T, H, hd)
            x = lin_add(o.flatten(-2), f.o, x)
            g, u = lin(F.rms_norm(x, d, f.norm2, eps), f.gate_up, f.gate_up_bias).chunk(2, -1)
            if f.down_bias is None:
                x = lin_add(F.silu(g) * u, f.down, x)
            else:
                x = x + lin(F.silu(g) * u, f.down, f.down_bias)
        return m.norm(x), gather_taps(taps, aux_layers)

    def dense_layers(self) -> list[FastLayer]:
        """The decoder layers' inference weights as dense views (no copy), whatever
        ``self.gemm`` is."""
        if self._fast is None:
            self.fuse()
        if self.gemm == "dense":
            return list(self._fast)  # type: ignore[arg-type]
        return [FastLayer.of(layer, "dense") for layer in self.model.layers]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: (T, D) → logits (T, V) in float32."""
        if self._head is None:
            return self.lm_head(hidden).float()
        lin, _ = gemm_ops(self.gemm)
        flat = lin(hidden.reshape(-1, hidden.shape[-1]), self._head, None)
        return flat.view(*hidden.shape[:-1], -1).float()

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
