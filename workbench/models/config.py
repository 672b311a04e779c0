"""Model configuration parsed from an HF ``config.json``: Llama, Qwen2, Qwen3, and the MoE
families (Mixtral, Qwen3-MoE, DeepSeek-V3, Kimi-K2.5's DeepSeek-V3 ``text_config``; their
expert and MLA fields: :mod:`workbench.models.moe_config`)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from workbench.errors import ConfigError
from workbench.models.moe_config import MlaSpec, MoeSpec, parse_mla, parse_moe

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MixtralForCausalLM": "mixtral",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "Kimi_K25ForConditionalGeneration": "deepseek_v3",
}
MODEL_TYPES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
               "mixtral": "mixtral", "qwen3_moe": "qwen3_moe", "deepseek_v3": "deepseek_v3",
               "kimi_k2": "deepseek_v3"}


@dataclass(frozen=True)
class ModelConfig:
    """The subset of an HF decoder config the runtime needs."""

    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)
    torch_dtype: str = "float32"
    moe: MoeSpec | None = None  # routed experts (Mixtral, Qwen3-MoE, DeepSeek-V3)
    mla: MlaSpec | None = None  # latent attention (DeepSeek-V3)
    # a multimodal checkpoint (Kimi-K2.5): the text model's tensor prefix, and the top-level
    # tensor prefixes of the parts the runtime does not run (vision tower, projector)
    text_prefix: str = ""
    skipped_prefixes: tuple[str, ...] = ()

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        if d.get("model_type") == "kimi_k25" or "Kimi_K25ForConditionalGeneration" in (
                d.get("architectures") or []):
            return cls._from_kimi(d)
        archs = d.get("architectures") or []
        family = None
        for a in archs:
            if a in SUPPORTED_ARCHITECTURES:
                family = SUPPORTED_ARCHITECTURES[a]
        if family is None:
            family = MODEL_TYPES.get(str(d.get("model_type")))
        if family is None:
            raise ConfigError(
                f"config.architectures: unknown architecture {archs or d.get('model_type')!r}; "
                f"supported: {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads"):
            if not isinstance(d.get(key), int) or d[key] <= 0:
                raise ConfigError(f"config.{key}: expected a positive integer, got {d.get(key)!r}")
        heads = d["num_attention_heads"]
        kv = d.get("num_key_value_heads") or heads
        if heads % kv:
            raise ConfigError(
                f"config.num_key_value_heads: {kv} does not divide num_attention_heads {heads}"
            )
        head_dim = d.get("head_dim") or d["hidden_size"] // heads
        eos = d.get("eos_token_id")
        eos_list = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        rope_scaling = d.get("rope_scaling")
        rope_theta = d.get("rope_theta")
        rp = d.get("rope_parameters")
        if isinstance(rp, dict):  # transformers >= 5 stores rope settings here
            rope_theta = rp.get("rope_theta", rope_theta)
            if rp.get("rope_type", "default") != "default":
                rope_scaling = rp
        kinds = ("default", "yarn") if family == "deepseek_v3" else ("default", "linear", "llama3")
        if rope_scaling is not None:
            kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
            if kind not in kinds:
                raise ConfigError(f"config.rope_scaling: unsupported rope_type {kind!r} for "
                                  f"{family} (supported: {', '.join(kinds)})")
        moe = parse_moe(family, d) if family in ("mixtral", "qwen3_moe", "deepseek_v3") else None
        mla = parse_mla(d, rope_scaling) if family == "deepseek_v3" else None
        if mla is not None:  # the rope dims are qk_rope_head_dim; the draft's head is v_head_dim
            head_dim, kv = mla.v_head_dim, heads
        return cls(
            family=family,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=kv,
            head_dim=head_dim,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta or 10000.0),
            rope_scaling=rope_scaling,
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", family == "qwen2")),
            mlp_bias=bool(d.get("mlp_bias", False)),
            qk_norm=family in ("qwen3", "qwen3_moe"),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=eos_list,
            torch_dtype=str(d.get("torch_dtype") or d.get("dtype") or "float32"),
            moe=moe,
            mla=mla,
        )

    @classmethod
    def _from_kimi(cls, d: dict[str, Any]) -> ModelConfig:
        """Kimi-K2.5: the DeepSeek-V3 ``text_config`` is the model; the vision tower and the
        projector are skipped (named in ``skipped_prefixes``; the loader says so)."""
        tc = d.get("text_config")
        if not isinstance(tc, dict):
            raise ConfigError("config.text_config: a Kimi-K2.5 config needs its DeepSeek-V3 "
                              "text_config")
        mt = tc.get("model_type", "deepseek_v3")
        if mt not in ("deepseek_v3", "kimi_k2"):
            raise ConfigError(f"config.text_config.model_type: {mt!r} (expected deepseek_v3)")
        text = {**tc, "model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"]}
        # the top-level flag decides (transformers' Kimi_K25Config: default true), not text_config's
        text["tie_word_embeddings"] = bool(d.get("tie_word_embeddings", True))
        for key in ("torch_dtype", "dtype"):
            if key in d and key not in text:
                text[key] = d[key]
        base = cls.from_dict(text)
        return replace(base, text_prefix="language_model.",
                       skipped_prefixes=("vision_tower.", "mm_projector.", "model.mm_projector.",
                                         "model.vision_tower."))

    @property
    def is_moe(self) -> bool:
        return self.moe is not None or self.mla is not None

    def kv_cache_shape(self) -> tuple[int, int, int]:
        """(heads, key dim, value dim) of one layer's cache entry per token: MLA keeps the
        latent + rope key (one shared head; the value is the latent, a view of the key)."""
        if self.mla is not None:
            return 1, self.mla.cache_dim, self.mla.kv_lora_rank
        return self.num_key_value_heads, self.head_dim, self.head_dim

    @classmethod
    def from_folder(cls, path: str | Path) -> ModelConfig:
        """A model folder's ``config.json``, or a GGUF's metadata: a ``.gguf`` file, a folder
        holding one and no safetensors, or a pointer folder (``gguf.json``)."""
        from workbench.models.fetch import POINTER, resolve_pointer
        from workbench.models.gguf import find_gguf, read_hf_config

        if (Path(path) / POINTER).is_file():
            path = resolve_pointer(path)
        gguf_file = find_gguf(path)
        if gguf_file is not None:
            return cls.from_dict(read_hf_config(gguf_file))
        p = Path(path) / "config.json"
        if not p.is_file():
            raise ConfigError(f"model path {str(path)!r}: no config.json found")
        return cls.from_dict(json.loads(p.read_text()))

    def to_hf_dict(self) -> dict[str, Any]:
        if self.is_moe:
            raise ConfigError(f"ModelConfig.to_hf_dict: {self.family} configs are read, not "
                              "written (write them with transformers)")
        arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                "qwen3": "Qwen3ForCausalLM"}[self.family]
        d: dict[str, Any] = {
            "architectures": [arch],
            "model_type": self.family,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "mlp_bias": self.mlp_bias,
            "hidden_act": "silu",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id[0] if len(self.eos_token_id) == 1 else
            self.eos_token_id,
            "torch_dtype": self.torch_dtype,
        }
        return d

    def aux_layer_ids(self) -> tuple[int, int, int]:
        """EAGLE-3 default taps: hidden states entering layers (2, L//2, L-3)."""
        n = self.num_hidden_layers
        return (min(2, n - 1), n // 2, max(n - 3, 0))
