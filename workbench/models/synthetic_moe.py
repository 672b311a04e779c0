"""Random-weight MoE checkpoints written by transformers itself (``save_pretrained``): Mixtral,
Qwen3-MoE, DeepSeek-V3 and Kimi-K2.5 (a DeepSeek-V3 ``text_config`` plus a small vision tower).

Weights are drawn N(0, ``std``) — larger than transformers' init, so logits and router scores
are far from ties and a greedy comparison tests the arithmetic, not the tie-breaking — and
DeepSeek-V3's ``e_score_correction_bias`` is drawn too (transformers initialises it to zeros,
which would leave the correction untested).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from workbench.errors import ConfigError

FAMILIES = ("mixtral", "qwen3_moe", "deepseek_v3", "kimi_k25")

# small defaults per family; callers override any field
DEFAULTS: dict[str, dict[str, Any]] = {
    "mixtral": dict(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                    num_experts_per_tok=2, max_position_embeddings=512),
    "qwen3_moe": dict(vocab_size=128, hidden_size=32, intermediate_size=48,
                      moe_intermediate_size=24, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, num_experts=8, num_experts_per_tok=2,
                      max_position_embeddings=512),
    "deepseek_v3": dict(vocab_size=128, hidden_size=32, intermediate_size=48,
                        moe_intermediate_size=16, num_hidden_layers=3, num_attention_heads=4,
                        num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2,
                        n_group=2, topk_group=1, first_k_dense_replace=1, q_lora_rank=24,
                        kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                        n_shared_experts=1, max_position_embeddings=512),
}


def hf_config(family: str, **overrides: Any) -> Any:
    """The transformers config object for ``family`` (DEFAULTS updated by ``overrides``)."""
    import transformers as tf

    if family not in FAMILIES:
        raise ConfigError(f"family: {family!r} not in {FAMILIES}")
    if family == "kimi_k25":
        vision = overrides.pop("vision_config", dict(hidden_size=16, num_hidden_layers=1,
                                                     num_attention_heads=2, intermediate_size=32))
        tie = overrides.pop("tie_word_embeddings", False)
        text = {**DEFAULTS["deepseek_v3"], "model_type": "deepseek_v3", **overrides}
        return tf.Kimi_K25Config(text_config=text, vision_config=vision, tie_word_embeddings=tie)
    cls = {"mixtral": tf.MixtralConfig, "qwen3_moe": tf.Qwen3MoeConfig,
           "deepseek_v3": tf.DeepseekV3Config}[family]
    return cls(**{**DEFAULTS[family], **overrides})


def hf_model(family: str, config: Any) -> Any:
    import transformers as tf

    cls = {"mixtral": tf.MixtralForCausalLM, "qwen3_moe": tf.Qwen3MoeForCausalLM,
           "deepseek_v3": tf.DeepseekV3ForCausalLM,
           "kimi_k25": tf.Kimi_K25ForConditionalGeneration}[family]
    return cls(config)


def write_random_moe(folder: str | Path, family: str, seed: int = 0, std: float = 0.2,
                     **overrides: Any) -> Path:
    """A random ``family`` model saved by transformers to ``folder``; returns the folder."""
    cfg = hf_config(family, **overrides)
    torch.manual_seed(seed)
    model = hf_model(family, cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if name.endswith("norm.weight") else 0.0, std)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, std)
    model.save_pretrained(str(folder))
    return Path(folder)
