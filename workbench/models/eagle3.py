"""EAGLE-3 draft head (one decoder layer over fused low/mid/high target features).

Data flow at one draft position p (DESIGN.md §1)::

    h   = fc(cat(taps_low, taps_mid, taps_high))   at step 0   (3·Dt → D)
        = the draft's own pre-norm output           at later steps
    x   = cat(input_layernorm(embed(token)), hidden_norm(h))   (2D)
    h'  = h + o_proj(attn(q/k/v_proj(x)))                      (attention input width 2D)
    out = h' + mlp(post_attention_layernorm(h'))               (pre-norm hidden, fed back)
    logits_draft = lm_head(norm(out))                          (Vd)   → target id = i + d2t[i]

Position p pairs the target feature at p with the token at p+1 and predicts the token at p+2.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from workbench.errors import CheckpointError, ConfigError
from workbench.models.config import ModelConfig
from workbench.models.llama import (
    MLP,
    AttentionBackend,
    RMSNorm,
    Rotary,
    apply_rope,
    apply_rope_rolled,
    gemm_ops,
    prepare_weight,
    resolve_gemm,
)


def _score_temperature(d: dict[str, Any]) -> float:
    t = (d.get("workbench") or {}).get("greedy_score_temperature", 1.0)
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0.0 < t <= 100.0:
        raise ConfigError(f"draft config.workbench.greedy_score_temperature: must be a number in "
                          f"(0, 100], got {t!r}")
    return float(t)


@dataclass(frozen=True)
class Eagle3Config:
    hidden_size: int
    target_hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # target vocab V
    draft_vocab_size: int  # Vd
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    aux_layer_ids: tuple[int, ...] | None = None
    # Temperature that calibrates the draft's probabilities to greedy acceptance (P(token ==
    # target argmax)), fitted on held-out windows by the trainer; the drafter ranks greedy
    # requests' tree nodes with it. Ranking only: verification never reads draft probabilities,
    # so any value is lossless. Stored as config.json "workbench": {"greedy_score_temperature"}
    # (other loaders ignore it); 1.0 when absent.
    greedy_score_temperature: float = 1.0

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Eagle3Config:
        archs = d.get("architectures") or []
        if not any("Eagle3" in a or "Eagle" in a for a in archs):
            raise ConfigError(f"draft config.architectures: {archs!r} is not an EAGLE-3 head "
                              "(expected LlamaForCausalLMEagle3)")
        if d.get("num_hidden_layers", 1) != 1:
            raise ConfigError("draft config.num_hidden_layers: EAGLE-3 heads have exactly 1 layer,"
                              f" got {d.get('num_hidden_layers')}")
        heads = d["num_attention_heads"]
        eagle = d.get("eagle_config") or {}
        aux = eagle.get("eagle_aux_hidden_state_layer_ids")
        return cls(
            hidden_size=d["hidden_size"],
            target_hidden_size=d.get("target_hidden_size") or d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            vocab_size=d["vocab_size"],
            draft_vocab_size=d.get("draft_vocab_size") or d["vocab_size"],
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(d.get("rope_theta", 10000.0)),
            rope_scaling=d.get("rope_scaling"),
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            aux_layer_ids=tuple(aux) if aux else None,
            greedy_score_temperature=_score_temperature(d),
        )

    @classmethod
    def from_folder(cls, path: str | Path) -> Eagle3Config:
        p = Path(path) / "config.json"
        if not p.is_file():
            raise ConfigError(f"draft path {str(path)!r}: no config.json found")
        return cls.from_dict(json.loads(p.read_text()))

    def to_hf_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "architectures": ["LlamaForCausalLMEagle3"],
            "model_type": "llama",
            "hidden_size": self.hidden_size,
            "target_hidden_size": self.target_hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": 1,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": "silu",
            "tie_word_embeddings": False,
            "torch_dtype": "float32",
        }
        if self.aux_layer_ids is not None:
            d["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids)}
        if self.greedy_score_temperature != 1.0:
            d["workbench"] = {"greedy_score_temperature": self.greedy_score_temperature}
        return d

    def as_model_config(self) -> ModelConfig:
        """Rotary/attention settings in the target's config type (for shared helpers)."""
        return ModelConfig(
            family="llama", vocab_size=self.vocab_size, hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size, num_hidden_layers=1,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps, rope_theta=self.rope_theta,
            rope_scaling=self.rope_scaling,
            max_position_embeddings=self.max_position_embeddings,
        )

    def check_target(self, target: ModelConfig) -> tuple[int, ...]:
        """Refuse a draft made for another target; return the tapped layer ids."""
        if self.target_hidden_size != target.hidden_size:
            raise ConfigError(
                f"draft target_hidden_size {self.target_hidden_size} != target hidden_size "
                f"{target.hidden_size}: this head was trained for another target")
        if self.vocab_size != target.vocab_size:
            raise ConfigError(f"draft vocab_size {self.vocab_size} != target vocab_size "
                              f"{target.vocab_size}: this head was trained for another target")
        layers = self.aux_layer_ids or target.aux_layer_ids()
        if len(layers) != 3 or any(not 0 <= i < target.num_hidden_layers for i in layers):
            raise ConfigError(f"draft eagle_aux_hidden_state_layer_ids {list(layers)}: need three "
                              f"layer ids in [0, {target.num_hidden_layers})")
        return tuple(layers)


class Eagle3Attention(nn.Module):
    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        self.h, self.kv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        d2 = 2 * cfg.hidden_size
        self.q_proj = nn.Linear(d2, self.h * self.hd, bias=False)
        self.k_proj = nn.Linear(d2, self.kv * self.hd, bias=False)
        self.v_proj = nn.Linear(d2, self.kv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.h * self.hd, cfg.hidden_size, bias=False)


class Eagle3Layer(nn.Module):
    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Eagle3Attention(cfg)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, bias=False)


class Eagle3Draft(nn.Module):
    """The head. ``embed`` is the target's embedding unless the checkpoint ships its own."""

    # buffers (register_buffer in __init__): draft id i → target id i + d2t[i]; target ids kept
    d2t: torch.Tensor
    t2d: torch.Tensor

    def __init__(self, cfg: Eagle3Config, embed: nn.Embedding | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.fc = nn.Linear(3 * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.midlayer = Eagle3Layer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        dev = self.fc.weight.device  # where the module is being built (default or meta)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64,
                                                device=dev))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool, device=dev))
        self.rotary = Rotary(cfg.as_model_config(), dev)
        self.embed: nn.Embedding | None = embed
        self.gemm = "dense"
        # the dtype the engine path computes in (fuse(compute_dtype=...)): None = the
        # parameters'; bfloat16 on a float32 engine runs the draft's GEMMs on bf16 copies —
        # proposals only, the target's verify decides every token, so outputs never change
        self.compute_dtype: torch.dtype | None = None
        self._fast: dict[str, Any] | None = None  # set by fuse()
        self._target_ids: tuple[Any, torch.Tensor] | None = None  # target_ids()' table

    def set_embedding(self, embed: nn.Embedding) -> None:
        if embed.weight.shape[1] != self.config.hidden_size:
            raise CheckpointError(
                f"embed_tokens.weight: draft width {self.config.hidden_size} differs from the "
                f"target embedding {tuple(embed.weight.shape)} and the checkpoint has none")
        self.embed = embed

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def target_ids(self) -> torch.Tensor:
        """(Vd,) the target id of every draft id (``draft_to_target`` of them all), built once
        per ``d2t`` (rebuilt when it is replaced or written in place, e.g. a new checkpoint)."""
        key = (self.d2t.data_ptr(), self.d2t._version, self.d2t.device)
        if self._target_ids is None or self._target_ids[0] != key:
            ids = torch.arange(self.d2t.shape[0], device=self.d2t.device)
            self._target_ids = (key, self.draft_to_target(ids))
        return self._target_ids[1]

    def fuse_features(self, aux: torch.Tensor) -> torch.Tensor:
        """aux: (..., 3·Dt) target taps → (..., D) (differentiable: training)."""
        return self.fc(aux)

    def fuse(self, gemm: str = "auto", compute_dtype: torch.dtype | None = None) -> None:
        """Inference weights for the engine path (as ``LlamaForCausalLM.fuse``): q/k/v and
        gate/up concatenated, oneDNN-packed copies on a float32 CPU head. Call again after
        changing the parameters; training (``forward_dense``) never uses them.
        ``compute_dtype``: the engine path's dtype (None keeps the current one, at first the
        parameters'); the weights are cast copies, the parameters stay as they are, and inputs
        (target features, the embedding) are cast on the way in, attention runs in the KV
        pool's dtype (the parameters') and logits come out in float32."""
        lay = self.midlayer
        a, mlp = lay.self_attn, lay.mlp
        if compute_dtype is not None:
            self.compute_dtype = compute_dtype
        dt = self.compute_dtype or self.fc.weight.dtype
        self.gemm = resolve_gemm(gemm, self.fc.weight.detach()[:1].to(dt))

        def prep(w: torch.Tensor) -> torch.Tensor:
            return prepare_weight(w.detach().to(dt), self.gemm)

        with torch.no_grad():
            self._fast = {
                "fc": prep(self.fc.weight),
                "qkv": prep(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])),
                "o": prep(a.o_proj.weight),
                "gate_up": prep(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])),
                "down": prep(mlp.down_proj.weight),
                "head": prep(self.lm_head.weight),
                # (2, D): the two input norms' weights, applied to stacked (embedding, hidden)
                "norms": torch.stack([lay.input_layernorm.weight,
                                      lay.hidden_norm.weight]).to(dt),
                "post_norm": lay.post_attention_layernorm.weight.detach().to(dt),
                "final_norm": self.norm.weight.detach().to(dt),
            }

    def features(self, aux: torch.Tensor) -> torch.Tensor:
        """Engine path of :meth:`fuse_features` (fused weights when built)."""
        if self._fast is None:
            return self.fc(aux)
        lin, _ = gemm_ops(self.gemm)
        return lin(aux.to(self.compute_dtype or aux.dtype), self._fast["fc"], None)

    def _forward_fast(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                      attn: AttentionBackend, layer: int,
                      logit_rows: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`forward` over the fused weights, one flat sequence of ops (no module calls)."""
        assert self.embed is not None, "draft embedding not set"
        w, lay = self._fast, self.midlayer
        assert w is not None
        a = lay.self_attn
        lin, lin_add = gemm_ops(self.gemm)
        eps, d = self.config.rms_norm_eps, (hidden.shape[-1],)
        io = self.fc.weight.dtype  # the KV pool's (the engine's) dtype
        dt = self.compute_dtype or io
        hidden = hidden.to(dt)
        cos, sin = self.rotary.rolled(positions, dt)
        # Both input norms in one: rms_norm over the stacked (T, 2, D) rows, then the (2, D)
        # weights — rms_norm is x·rsqrt(mean(x²)+eps), then ·weight, so the values are those
        # of the two separate norms and their cat (tests/models/test_fast_paths.py), in 5 ops
        # instead of ~18 (35 → 20 µs per draft step on the 2-core EPYC).
        x = F.rms_norm(torch.stack([F.embedding(tokens, self.embed.weight).to(dt), hidden], 1),
                       d, None, eps).mul(w["norms"]).flatten(1)
        qkv = lin(x, w["qkv"], None).unflatten(-1, (a.h + 2 * a.kv, a.hd))
        qk = apply_rope_rolled(qkv[:, : a.h + a.kv], cos, sin)
        if dt == io:
            o = attn.run(layer, qk[:, : a.h], qk[:, a.h :], qkv[:, a.h + a.kv :])
        else:  # the pool holds the engine's dtype
            o = attn.run(layer, qk[:, : a.h].to(io), qk[:, a.h :].to(io),
                         qkv[:, a.h + a.kv :].to(io)).to(dt)
        h = lin_add(o.flatten(-2), w["o"], hidden)
        g, u = lin(F.rms_norm(h, d, w["post_norm"], eps), w["gate_up"], None).chunk(2, -1)
        out = lin_add(F.silu(g) * u, w["down"], h)
        last = out if logit_rows is None else out.index_select(0, logit_rows)
        logits = lin(F.rms_norm(last, d, w["final_norm"], eps), w["head"], None)
        return logits.float(), out

    def _qkv(self, tokens: torch.Tensor, h: torch.Tensor, cos: torch.Tensor,
             sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        assert self.embed is not None, "draft embedding not set"
        lay = self.midlayer
        x = torch.cat([lay.input_layernorm(self.embed(tokens)), lay.hidden_norm(h)], dim=-1)
        a = lay.self_attn
        q = a.q_proj(x).unflatten(-1, (a.h, a.hd))
        k = a.k_proj(x).unflatten(-1, (a.kv, a.hd))
        v = a.v_proj(x).unflatten(-1, (a.kv, a.hd))
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def _finish(self, h: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        lay = self.midlayer
        h = h + lay.self_attn.o_proj(o.flatten(-2))
        return h + lay.mlp(lay.post_attention_layernorm(h))

    def forward(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                attn: AttentionBackend, layer: int = 0,
                logit_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Ragged engine path. tokens (T,), hidden (T, D) (already fused), positions (T,) →
        (draft logits (T, Vd) float32 — only rows ``logit_rows`` (R,) when given: (R, Vd) —,
        pre-norm hidden (T, D))."""
        if self._fast is not None:
            return self._forward_fast(tokens, hidden, positions, attn, layer, logit_rows)
        cos, sin = self.rotary.cos_sin(positions, hidden.dtype)
        q, k, v = self._qkv(tokens, hidden, cos, sin)
        out = self._finish(hidden, attn.run(layer, q, k, v))
        last = out if logit_rows is None else out.index_select(0, logit_rows)
        return self.lm_head(self.norm(last)).float(), out

    def forward_dense(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                      mask: torch.Tensor, k_prev: torch.Tensor | None = None,
                      v_prev: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        """Training path. tokens (B, T), hidden (B, T, D), positions (T,), mask (T, Tk) bool over
        cat(k_prev, k_new) along time. Returns logits (B, T, Vd), out (B, T, D), k, v (B, T,
        Hkv, hd) of the new positions (for the next unrolled step's context)."""
        cos, sin = self.rotary.cos_sin(positions, hidden.dtype)
        q, k, v = self._qkv(tokens, hidden, cos, sin)
        kk = k if k_prev is None else torch.cat([k_prev, k], dim=1)
        vv = v if v_prev is None else torch.cat([v_prev, v], dim=1)
        a = self.midlayer.self_attn
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), kk.transpose(1, 2), vv.transpose(1, 2), attn_mask=mask,
            enable_gqa=a.h != a.kv).transpose(1, 2)
        out = self._finish(hidden, o)
        return self.lm_head(self.norm(out)), out, k, v
