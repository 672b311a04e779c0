"""Llama-family decoder (Llama 2/3, Qwen2 with qkv bias, Qwen3 with q/k RMSNorm).

Parameter names match HF ``LlamaForCausalLM`` so checkpoints load without renaming. One module
serves two callers:

* ``forward_dense(input_ids)`` — causal attention over a padded [B, T] batch (training, oracles);
* ``forward(tokens, positions, attn)`` — the engine's ragged path: T flattened tokens of many
  requests, per-token positions, and an attention backend that owns the paged KV cache.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn

from workbench.models.config import ModelConfig
from workbench.models.gemm import (
    EXACT_M,
    GEMMS,
    M_BUCKET,
    PACK_HINT,
    Linear,
    LinearAdd,
    dense_linear_add,
    fuse_linears,
    gemm_ops,
    onednn_linear,
    onednn_linear_add,
    onednn_ok,
    pack,
    prepare_weight,
    resolve_gemm,
    row_bucket,
)
from workbench.models.quant import QuantTensor, packed_or
from workbench.models.rope import (
    Rotary,
    apply_rope,
    apply_rope_rolled,
    rolled_rope_tables,
    rope_inv_freq,
)

# Split out of this module (issue 19): RoPE (models/rope.py) and the GEMM paths
# (models/gemm.py); their names stay importable from here.
__all__ = [
    "EXACT_M", "GEMMS", "M_BUCKET", "PACK_HINT", "MLP", "Attention", "AttentionBackend",
    "DecoderLayer", "FastLayer", "Linear", "LinearAdd", "LlamaForCausalLM", "LlamaModel",
    "RMSNorm", "Rotary", "apply_rope", "apply_rope_rolled", "dense_linear_add", "fuse_linears",
    "gather_taps", "gemm_ops", "init_weights", "onednn_linear", "onednn_linear_add", "onednn_ok",
    "pack", "prepare_weight", "resolve_gemm", "rolled_rope_tables", "rope_inv_freq",
    "row_bucket",
]


class AttentionBackend(Protocol):
    """Runs attention for one layer over whatever KV the backend manages."""

    def run(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: (T, H, hd), k/v: (T, Hkv, hd) for the new tokens → (T, H, hd)."""
        ...


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, device: torch.device | str | None = None) -> None:
        """``device`` None: torch's current default device (as ``nn.Linear``'s parameters;
        the loader builds models under ``torch.device("meta")``)."""
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, device=device))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)  # one fused op
        # Reduced precision: HF's op order (normalise in fp32, cast, then scale).
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


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

    def decoder_layers(self) -> list[DecoderLayer]:
        """``layers`` as their class (a ModuleList iterates as plain Modules; every entry is a
        DecoderLayer, built above)."""
        return [cast(DecoderLayer, layer) for layer in self.layers]


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

    # what the engine may do with it (MoeForCausalLM declares less)
    gemm_paths: tuple[str, ...] = ("dense", "onednn")
    compilable = True
    graph_capturable = True
    load_note = ""  # what the loader skipped (set by models.loader.load_target)

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
        # oneDNN row floor (gemm.row_bucket): set by the engine's autotune stage, measured
        self.row_floor = 1
        # tensors the checkpoint holds quantised, by parameter name (a GGUF's Q4_0/Q4_1/Q8_0):
        # what fuse("packed") runs (models/quant.py); empty for float checkpoints
        self.quant: dict[str, QuantTensor] = {}

    def fuse(self, gemm: str = "auto") -> None:
        """Build the inference weights (see :class:`FastLayer`); call again after changing the
        parameters. q/k/v and gate/up become single GEMMs; parameters stay valid for training
        (:func:`fuse_linears`). ``gemm``: see :func:`resolve_gemm`; the choice is ``self.gemm``."""
        layers = self.model.decoder_layers()
        for layer in layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()
        if gemm == "packed":
            self._fast, self._head = self.packed_weights()
            self.gemm = "packed"
            return
        self.gemm = resolve_gemm(gemm, self.lm_head.weight)
        head = self.lm_head.weight
        if self.gemm == "dense" and head.device.type == "cpu":
            if self.config.tie_word_embeddings:  # the embedding keeps the row layout: copy
                head = head.detach().t().contiguous().t()
            else:
                fuse_linears([self.lm_head])
                head = self.lm_head.weight
        self._head = prepare_weight(head.detach(), self.gemm)  # never a Parameter: a
        # plain attribute, so a later fuse may hold a packed copy instead
        self._fast = [FastLayer.of(layer, self.gemm) for layer in layers]

    def packed_weights(self) -> tuple[list[FastLayer], Any]:
        """(layers, head) with every GEMM whose tensors ``self.quant`` holds packed for the
        int4 kernel (q/k/v and gate/up stacked along N; ``models/quant.py``), the others dense
        views; ``gemm_ops("packed")`` runs both. ValueError when nothing is quantised."""
        if not self.quant:
            raise ValueError("weights='packed': the checkpoint holds no packed tensors (a GGUF "
                             "with Q4_0/Q4_1/Q8_0 tensors or a pack-quantized folder)")
        q, fast = self.quant, []
        for i, layer in enumerate(self.model.decoder_layers()):
            p, f = f"model.layers.{i}.", FastLayer.of(layer, "dense")
            fast.append(dataclasses.replace(
                f, qkv=packed_or(q, [p + f"self_attn.{n}_proj.weight" for n in "qkv"], f.qkv),
                o=packed_or(q, [p + "self_attn.o_proj.weight"], f.o),
                gate_up=packed_or(q, [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"],
                                  f.gate_up),
                down=packed_or(q, [p + "mlp.down_proj.weight"], f.down)))
        head = "model.embed_tokens.weight" if self.config.tie_word_embeddings else "lm_head.weight"
        return fast, packed_or(q, [head], self.lm_head.weight.detach())

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
        lin, lin_add = ops if ops is not None else gemm_ops(gemm or self.gemm, self.row_floor)
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
        return [FastLayer.of(layer, "dense") for layer in self.model.decoder_layers()]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: (T, D) → logits (T, V) in float32."""
        if self._head is None:
            return self.lm_head(hidden).float()
        lin, _ = gemm_ops(self.gemm, self.row_floor)
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
        for i, layer in enumerate(m.decoder_layers()):
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
            else:  # drawn on the host on purpose (a CPU generator: the same weights on every
                # device), then copied to the parameter's device
                p.copy_(torch.randn(p.shape, generator=g, device="cpu") * std)
