"""Random-weight checkpoints in the real formats: targets of any Llama shape (written by
``transformers``' ``save_pretrained``) and EAGLE-3 heads for them (our standard checkpoint).

For cost studies and loader tests: a random pair has the exact compute of a trained pair of the
same shape, and with ``SpecConfig(simulate_accept_length=τ)`` any acceptance can be posed
(``workbench.bench.shapes``). Nothing here is a usable model.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from workbench.errors import ConfigError
from workbench.models.eagle3 import Eagle3Config, Eagle3Draft
from workbench.models.loader import load_target, save_eagle3


@dataclass(frozen=True)
class TargetShape:
    """A Llama target's shape (head_dim = hidden / heads)."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int = 8192

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "intermediate", "heads", "kv_heads", "vocab"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"TargetShape.{name}: must be an integer >= 1, got {v!r}")
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise ConfigError(f"TargetShape: hidden {self.hidden} must divide into heads "
                              f"{self.heads}, and heads into kv_heads {self.kv_heads}")

    @property
    def params(self) -> int:
        """Weights per layer × layers + the (tied) embedding."""
        hd = self.hidden // self.heads
        attn = self.hidden * hd * (2 * self.heads + 2 * self.kv_heads)
        return self.layers * (attn + 3 * self.hidden * self.intermediate) + \
            self.vocab * self.hidden


def write_random_target(folder: str | Path, shape: TargetShape, seed: int = 0,
                        tokenizer_from: str | Path | None = None) -> Path:
    """A random ``LlamaForCausalLM`` of ``shape`` saved by transformers (tied embeddings,
    float32). ``tokenizer_from``: copy that folder's tokenizer files (their vocab must fit)."""
    from transformers import LlamaConfig
    from transformers import LlamaForCausalLM as HFLlama

    out = Path(folder)
    cfg = LlamaConfig(vocab_size=shape.vocab, hidden_size=shape.hidden,
                      intermediate_size=shape.intermediate, num_hidden_layers=shape.layers,
                      num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
                      max_position_embeddings=2048, tie_word_embeddings=True,
                      bos_token_id=0, eos_token_id=0, pad_token_id=0)
    torch.manual_seed(seed)
    HFLlama(cfg).save_pretrained(str(out))
    if tokenizer_from is not None:
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            src = Path(tokenizer_from) / name
            if src.is_file():
                shutil.copy(src, out / name)
    return out


def write_random_head(target: str | Path, out: str | Path, draft_vocab: int = 128,
                      seed: int = 0, std: float = 0.3) -> Path:
    """A random 1-layer EAGLE-3 head for ``target`` (its width, heads, vocab; a random draft
    vocabulary of ``draft_vocab`` target ids), written as a standard EAGLE-3 checkpoint."""
    _, cfg, _ = load_target(target)
    if not 1 <= draft_vocab <= cfg.vocab_size:
        raise ConfigError(f"write_random_head: draft_vocab {draft_vocab} not in "
                          f"[1, {cfg.vocab_size}]")
    dc = Eagle3Config(hidden_size=cfg.hidden_size, target_hidden_size=cfg.hidden_size,
                      intermediate_size=cfg.intermediate_size,
                      num_attention_heads=cfg.num_attention_heads,
                      num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                      vocab_size=cfg.vocab_size, draft_vocab_size=draft_vocab,
                      rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta)
    d = Eagle3Draft(dc)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in d.named_parameters():
            p.copy_(torch.ones_like(p) if "norm" in name else torch.randn(p.shape, generator=g)
                    * std)
        ids = torch.sort(torch.randperm(cfg.vocab_size, generator=g)[:draft_vocab]).values
        d.d2t.copy_(ids - torch.arange(draft_vocab))
        d.t2d.zero_()
        d.t2d[ids] = True
    save_eagle3(d, out)
    return Path(out)


def random_pair(folder: str | Path, shape: TargetShape, draft_vocab: int = 2048,
                tokenizer_from: str | Path | None = None) -> tuple[Path, Path]:
    """``folder/target`` and ``folder/draft`` for ``shape``, written once and reused while
    ``folder/shape.json`` matches."""
    root = Path(folder)
    stamp = root / "shape.json"
    want = {**asdict(shape), "draft_vocab": draft_vocab}
    target, draft = root / "target", root / "draft"
    if stamp.is_file() and json.loads(stamp.read_text()) == want and \
            (target / "config.json").is_file() and (draft / "config.json").is_file():
        return target, draft
    if root.exists():
        shutil.rmtree(root)
    write_random_target(target, shape, tokenizer_from=tokenizer_from)
    write_random_head(target, draft, draft_vocab=min(draft_vocab, shape.vocab))
    stamp.write_text(json.dumps(want) + "\n")
    return target, draft
