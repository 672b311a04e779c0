"""The weight-bytes term of the step-time model for MoE targets, and a what-if for a box.

A forward over T tokens of a MoE target reads the dense weights once (attention, dense MLPs,
shared experts, embedding rows, LM head) and, per MoE layer, the weights of every expert some
token was routed to. With E experts, k per token and routing spread like uniform random picks,
the distinct experts one layer touches are

    d(T) = E·(1 − (1 − k/E)^(1 + γ·(T − 1)))

exact at T = 1 (one token touches its k experts, whatever γ); γ = 1 is uniform routing of every
further token; real routers repeat experts across related tokens (a verify's draft tokens
share their context), so a measured coverage curve fits γ < 1 (:func:`fit_gamma`).
:class:`ExpertBytes` turns d(T) into bytes; :class:`~workbench.policy.costmodel.CostModel`
adds ``ms_per_gb ·`` those bytes to the target forward (fitted with its other terms), so
``crossover`` and ``Goodput`` see that a verify of B·N tokens reads far more expert bytes than
a decode of B tokens.

:func:`what_if` predicts a box's verify/decode cost ratio from its geometry alone (layers,
experts, bytes per expert, HBM bandwidth, tensor parallelism): memory-bound step time = bytes /
(tp · bandwidth), plus an optional FLOP term. It leaves out the all-reduce between TP ranks (two
per layer; the seeds' box paid them over PCIe), attention and KV reads (the context term),
kernel launch gaps, expert load imbalance across ranks, and any overlap of compute with loads:
docs/MOE.md. The whole box — those terms, the server's rules and tok/s for plain and
speculative decoding — is ``workbench.lab.boxmodel.what_if`` (``lab box``, docs/LAB.md).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from workbench.errors import ConfigError

if TYPE_CHECKING:
    import pandas as pd

    from workbench.models.config import ModelConfig


def uniform_coverage(num_experts: int, top_k: int, tokens: float, gamma: float = 1.0) -> float:
    """Expected distinct experts of ``num_experts`` touched by ``tokens`` tokens routed to
    ``top_k`` each: E·(1 − (1 − k/E)^(1 + γ·(tokens − 1))) — exactly k at one token (γ = 1:
    uniform random routing of every token; below one token, the uniform curve)."""
    if tokens <= 0:
        return 0.0
    power = 1.0 + gamma * (tokens - 1.0) if tokens >= 1 else tokens
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** power)


def fit_gamma(tokens: Sequence[float], distinct: Sequence[float], num_experts: int,
              top_k: int) -> float:
    """The γ in (0, 4] whose coverage curve fits measured (tokens, distinct experts) best
    (least squares; a grid, then a golden-section refinement)."""
    pts = [(float(t), float(d)) for t, d in zip(tokens, distinct, strict=True) if t > 0]
    if not pts:
        raise ConfigError("fit_gamma: no measured points with tokens > 0")

    def err(g: float) -> float:
        return sum((uniform_coverage(num_experts, top_k, t, g) - d) ** 2 for t, d in pts)

    grid = [0.01 * 1.1**i for i in range(60) if 0.01 * 1.1**i <= 4.0]
    best = min(grid, key=err)
    lo, hi = best / 1.1, min(best * 1.1, 4.0)
    phi = (math.sqrt(5) - 1) / 2
    for _ in range(40):
        a, b = hi - phi * (hi - lo), lo + phi * (hi - lo)
        if err(a) < err(b):
            hi = b
        else:
            lo = a
    return (lo + hi) / 2


@dataclass(frozen=True)
class ExpertBytes:
    """Weight bytes of one forward: ``dense_bytes`` always, plus ``expert_bytes`` for each
    expert touched in each of ``moe_layers`` layers (coverage γ, see the module doc)."""

    dense_bytes: float
    expert_bytes: float
    moe_layers: int
    num_experts: int
    top_k: int
    gamma: float = 1.0

    def __post_init__(self) -> None:
        if self.num_experts < 1 or not 1 <= self.top_k <= self.num_experts:
            raise ConfigError(f"ExpertBytes.top_k: {self.top_k} not in [1, num_experts="
                              f"{self.num_experts}]")
        if self.moe_layers < 0 or self.expert_bytes < 0 or self.dense_bytes < 0:
            raise ConfigError("ExpertBytes: moe_layers, expert_bytes and dense_bytes must be "
                              ">= 0")
        if not 0 < self.gamma <= 4:
            raise ConfigError(f"ExpertBytes.gamma: {self.gamma} not in (0, 4]")

    def distinct(self, tokens: float) -> float:
        """Experts touched per MoE layer by a forward of ``tokens`` tokens."""
        return uniform_coverage(self.num_experts, self.top_k, tokens, self.gamma)

    def expert_gb(self, tokens: float) -> float:
        """GB of expert weights a forward of ``tokens`` tokens reads (all MoE layers)."""
        return self.moe_layers * self.distinct(tokens) * self.expert_bytes / 1e9

    def total_gb(self, tokens: float) -> float:
        return self.dense_bytes / 1e9 + self.expert_gb(tokens)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ExpertBytes:
        return cls(**d)

    @classmethod
    def from_config(cls, cfg: ModelConfig, expert_bits: float = 32.0,
                    dense_bits: float = 32.0, gamma: float = 1.0) -> ExpertBytes:
        """From a MoE :class:`~workbench.models.config.ModelConfig`: parameter counts times
        bits (e.g. ``expert_bits=4.25`` for INT4 experts with group-32 bf16 scales)."""
        return Geometry.from_config(cfg, expert_bits, dense_bits).bytes_model(gamma)


@dataclass(frozen=True)
class Geometry:
    """A MoE model's shape as a box holds it: parameter counts and bits per parameter.

    ``dense_params``: every weight read once per forward whatever the routing (attention,
    dense MLPs, shared experts, norms, the LM head; the embedding is a row gather, not
    counted); ``expert_params``: one routed expert (gate, up, down)."""

    name: str
    layers: int
    moe_layers: int
    num_experts: int
    top_k: int
    dense_params: float
    expert_params: float
    dense_bits: float = 16.0
    expert_bits: float = 16.0
    flops_per_token: float = 0.0  # 2·active params (optional compute term)

    def bytes_model(self, gamma: float = 1.0) -> ExpertBytes:
        return ExpertBytes(self.dense_params * self.dense_bits / 8,
                           self.expert_params * self.expert_bits / 8, self.moe_layers,
                           self.num_experts, self.top_k, gamma)

    @classmethod
    def from_config(cls, cfg: ModelConfig, expert_bits: float = 16.0,
                    dense_bits: float = 16.0) -> Geometry:
        moe = cfg.moe
        if moe is None:
            raise ConfigError(f"Geometry.from_config: {cfg.family} has no routed experts")
        d, n = cfg.hidden_size, cfg.num_hidden_layers
        h = cfg.num_attention_heads
        m = cfg.mla
        if m is not None:
            qk = m.qk_nope_head_dim + m.qk_rope_head_dim
            q = d * h * qk if m.q_lora_rank is None else m.q_lora_rank * (d + h * qk)
            attn = (q + d * m.cache_dim + m.kv_lora_rank * h * (m.qk_nope_head_dim + m.v_head_dim)
                    + h * m.v_head_dim * d)
        else:
            attn = d * cfg.head_dim * (2 * h + 2 * cfg.num_key_value_heads)
        moe_layers = sum(1 for i in range(n) if moe.is_moe(i))
        dense_mlp = 3 * d * cfg.intermediate_size * (n - moe_layers)
        shared = 3 * d * moe.shared_intermediate_size * moe_layers
        router = d * moe.num_experts * moe_layers
        dense = n * attn + dense_mlp + shared + router + d * cfg.vocab_size
        expert = 3 * d * moe.moe_intermediate_size
        active = dense + moe_layers * moe.top_k * expert
        return cls(cfg.family, n, moe_layers, moe.num_experts, moe.top_k, float(dense),
                   float(expert), dense_bits, expert_bits, 2.0 * active)


# Kimi-K2.5 (its text model: DeepSeek-V3 shape, 61 layers, the first dense, 384 routed experts,
# 8 per token, one shared expert; hidden 7168, expert MLP 2048, dense MLP 18432, vocab 163840;
# MLA q_lora 1536, kv_lora 512, 64 heads of 128 + 64 rope, v 128). INT4 routed experts with
# one bf16 scale per 32 weights (4.5 bits); everything else bf16.
_KIMI_DENSE = (61 * (7168 * 1536 + 1536 * 64 * 192 + 7168 * 576 + 512 * 64 * 256
                    + 64 * 128 * 7168)
               + 3 * 7168 * 18432 + 60 * (3 * 7168 * 2048 + 7168 * 384) + 7168 * 163840)
_KIMI_EXPERT = 3 * 7168 * 2048
KIMI_K25_INT4 = Geometry(
    "Kimi-K2.5 INT4", 61, 60, 384, 8, dense_params=_KIMI_DENSE, expert_params=_KIMI_EXPERT,
    dense_bits=16.0, expert_bits=4.5,
    flops_per_token=2.0 * (_KIMI_DENSE + 60 * 8 * _KIMI_EXPERT))  # 2 x active parameters


def what_if(geometry: Geometry, batches: Sequence[int], num_draft_tokens: int,
            hbm_gbps: float, tp: int = 1, gamma: float = 1.0,
            peak_tflops: float | None = None) -> pd.DataFrame:
    """Predicted decode (B tokens) and verify (B·N tokens) forward times and their ratio at
    each batch, for ``geometry`` sharded over ``tp`` devices of ``hbm_gbps`` GB/s each
    (memory-bound: bytes / (tp·bandwidth); ``peak_tflops`` per device adds a compute floor,
    max(bytes time, FLOP time)). What is left out: module doc, docs/MOE.md."""
    import pandas as pd

    if hbm_gbps <= 0 or tp < 1 or num_draft_tokens < 1:
        raise ConfigError(f"what_if: need hbm_gbps > 0, tp >= 1, num_draft_tokens >= 1; got "
                          f"{hbm_gbps}, {tp}, {num_draft_tokens}")
    wb = geometry.bytes_model(gamma)
    bw = hbm_gbps * tp  # GB/s, all ranks reading their shard at once

    def ms(tokens: int) -> tuple[float, float]:
        mem = wb.total_gb(tokens) / bw * 1e3
        flop = (geometry.flops_per_token * tokens / (peak_tflops * 1e12 * tp) * 1e3
                if peak_tflops else 0.0)
        return max(mem, flop), wb.distinct(tokens)

    rows = []
    for b in batches:
        dec, d_dec = ms(b)
        ver, d_ver = ms(b * num_draft_tokens)
        rows.append({"geometry": geometry.name, "batch": b, "num_draft_tokens": num_draft_tokens,
                     "decode_tokens": b, "verify_tokens": b * num_draft_tokens,
                     "decode_experts": d_dec, "verify_experts": d_ver,
                     "decode_gb": wb.total_gb(b), "verify_gb": wb.total_gb(b * num_draft_tokens),
                     "decode_ms": dec, "verify_ms": ver, "ratio": ver / dec,
                     "hbm_gbps": hbm_gbps, "tp": tp, "gamma": gamma})
    return pd.DataFrame(rows)
