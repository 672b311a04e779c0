"""The MoE and MLA parts of an HF config: Mixtral, Qwen3-MoE, DeepSeek-V3 and Kimi-K2.5 (whose
``text_config`` is a DeepSeek-V3 config).

Every option the runtime does not implement is refused here, at load, with an error naming the
field (``config.scoring_func: ...``), never approximated: an unknown routing score, top-k
method, activation, a sliding window, a q/k-norm-less layout the module does not have.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from workbench.errors import ConfigError

MOE_FAMILIES = ("mixtral", "qwen3_moe", "deepseek_v3")


@dataclass(frozen=True)
class MoeSpec:
    """Routed experts of one model.

    ``scoring``: ``softmax`` (Mixtral, Qwen3-MoE: top-k of the softmax, renormalised when
    ``norm_topk_prob``) or ``sigmoid`` (DeepSeek-V3: top-k of sigmoid + ``e_score_correction_bias``
    within the best ``topk_group`` of ``n_group`` groups, weights from the uncorrected sigmoid,
    renormalised when ``norm_topk_prob``, times ``routed_scaling_factor``).
    ``dense_layers``: layers with a plain MLP of ``intermediate_size`` instead.
    ``naming``: the checkpoint's expert names (``w1/w3/w2`` for Mixtral, ``gate/up/down_proj``),
    ``block``: the layer's attribute holding the MoE (``block_sparse_moe`` or ``mlp``)."""

    num_experts: int
    top_k: int
    moe_intermediate_size: int
    scoring: str
    norm_topk_prob: bool
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    shared_intermediate_size: int = 0
    dense_layers: tuple[int, ...] = ()
    naming: str = "proj"
    block: str = "mlp"

    def is_moe(self, layer: int) -> bool:
        return layer not in self.dense_layers


@dataclass(frozen=True)
class MlaSpec:
    """DeepSeek-V3 multi-head latent attention. The KV cache holds, per token and layer, the
    normalised latent (``kv_lora_rank``) and the shared rope key (``qk_rope_head_dim``)."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool
    softmax_scale: float  # qk_head_dim**-0.5, times mscale² under YaRN with mscale_all_dim
    rope_attention_factor: float  # YaRN's cos/sin factor (1.0 otherwise)

    @property
    def cache_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim


def _pos_int(d: dict[str, Any], key: str) -> int:
    v = d.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise ConfigError(f"config.{key}: expected a positive integer, got {v!r}")
    return v


def _act(d: dict[str, Any]) -> None:
    act = d.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"config.hidden_act: {act!r} not supported (only 'silu')")


def _no_sliding(d: dict[str, Any]) -> None:
    sw = d.get("sliding_window")
    if d.get("use_sliding_window") or (sw is not None and "use_sliding_window" not in d):
        raise ConfigError(f"config.sliding_window: {sw!r} not supported (full attention only)")


def parse_moe(family: str, d: dict[str, Any]) -> MoeSpec:
    """The MoE spec of a ``family`` config dict (see :data:`MOE_FAMILIES`)."""
    _act(d)
    top_k = _pos_int(d, "num_experts_per_tok")
    if family == "mixtral":
        _no_sliding(d)
        e = _pos_int(d, "num_local_experts")
        spec = MoeSpec(e, top_k, _pos_int(d, "intermediate_size"), "softmax", True,
                       naming="w", block="block_sparse_moe")
    elif family == "qwen3_moe":
        _no_sliding(d)
        key = "num_experts" if "num_experts" in d else "num_local_experts"
        e = _pos_int(d, key)
        step = d.get("decoder_sparse_step", 1)
        if not isinstance(step, int) or step <= 0:
            raise ConfigError(f"config.decoder_sparse_step: expected a positive integer, got "
                              f"{step!r}")
        only = d.get("mlp_only_layers") or []
        if not isinstance(only, list) or not all(isinstance(i, int) for i in only):
            raise ConfigError(f"config.mlp_only_layers: expected a list of layer ids, got {only!r}")
        n = d["num_hidden_layers"]
        dense = tuple(i for i in range(n) if i in only or (i + 1) % step != 0)
        spec = MoeSpec(e, top_k, _pos_int(d, "moe_intermediate_size"), "softmax",
                       bool(d.get("norm_topk_prob", False)), dense_layers=dense)
    elif family == "deepseek_v3":
        scoring = d.get("scoring_func", "sigmoid")
        if scoring != "sigmoid":
            raise ConfigError(f"config.scoring_func: {scoring!r} not supported (DeepSeek-V3 "
                              "routing is 'sigmoid')")
        method = d.get("topk_method", "noaux_tc")
        if method != "noaux_tc":
            raise ConfigError(f"config.topk_method: {method!r} not supported (only 'noaux_tc': "
                              "grouped top-k with e_score_correction_bias)")
        e = _pos_int(d, "n_routed_experts")
        groups = _pos_int(d, "n_group") if d.get("n_group") is not None else 1
        tg = _pos_int(d, "topk_group") if d.get("topk_group") is not None else 1
        if e % groups or tg > groups:
            raise ConfigError(f"config.n_group: {groups} must divide n_routed_experts {e} and "
                              f"be >= topk_group {tg}")
        if top_k > tg * (e // groups):
            raise ConfigError(f"config.num_experts_per_tok: {top_k} > the {tg * (e // groups)} "
                              "experts of the topk_group groups")
        if e // groups < 2:
            raise ConfigError(f"config.n_group: {groups} groups of {e // groups} expert (group "
                              "scores sum each group's top 2)")
        moe_i = _pos_int(d, "moe_intermediate_size")
        shared = int(d.get("n_shared_experts") or 0)
        first = int(d.get("first_k_dense_replace") or 0)
        freq = int(d.get("moe_layer_freq") or 1)
        if freq != 1:
            raise ConfigError(f"config.moe_layer_freq: {freq} not supported (only 1)")
        n = d["num_hidden_layers"]
        spec = MoeSpec(e, top_k, moe_i, "sigmoid", bool(d.get("norm_topk_prob", True)),
                       float(d.get("routed_scaling_factor", 1.0)), groups, tg, shared * moe_i,
                       tuple(range(min(first, n))))
    else:
        raise ConfigError(f"config.model_type: {family!r} is not a MoE family {MOE_FAMILIES}")
    if not 1 <= top_k <= spec.num_experts:
        raise ConfigError(f"config.num_experts_per_tok: {top_k} not in [1, {spec.num_experts}]")
    return spec


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def parse_mla(d: dict[str, Any], rope: dict[str, Any] | None) -> MlaSpec:
    """DeepSeek-V3's attention fields; ``rope``: the rope scaling dict (None: plain RoPE)."""
    q_rank = d.get("q_lora_rank")
    if q_rank is not None:
        q_rank = _pos_int(d, "q_lora_rank")
    if d.get("attention_bias"):
        raise ConfigError("config.attention_bias: true not supported for MLA (no bias tensors)")
    nope, rope_d = _pos_int(d, "qk_nope_head_dim"), _pos_int(d, "qk_rope_head_dim")
    if rope_d % 2:
        raise ConfigError(f"config.qk_rope_head_dim: {rope_d} must be even")
    scale = (nope + rope_d) ** -0.5
    factor = 1.0
    if rope is not None:
        factor = float(rope.get("factor") or 1.0)
        mad = rope.get("mscale_all_dim")
        if mad:
            scale *= yarn_mscale(factor, float(mad)) ** 2
        af = rope.get("attention_factor")
        if af is None:
            m, mad2 = rope.get("mscale"), rope.get("mscale_all_dim")
            af = (yarn_mscale(factor, float(m)) / yarn_mscale(factor, float(mad2))
                  if m and mad2 else yarn_mscale(factor))
        factor = float(af)
    return MlaSpec(q_rank, _pos_int(d, "kv_lora_rank"), nope, rope_d, _pos_int(d, "v_head_dim"),
                   bool(d.get("rope_interleave", True)), scale, factor)
