"""Micro EAGLE-3 heads for the micro target."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from workbench.models.eagle3 import Eagle3Config, Eagle3Draft
from workbench.models.loader import load_target, save_eagle3


def write_random_head(target: Path, out: Path, draft_vocab: int = 128, seed: int = 0,
                      std: float = 0.3) -> Path:
    model, cfg, _ = load_target(target)
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
    return out


@pytest.fixture(scope="session")
def random_head(micro_target: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_head(micro_target, tmp_path_factory.mktemp("random_head"))


@pytest.fixture(scope="session")
def trained_head(micro_target: Path, tiny_corpus: Path,
                 tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A micro head trained for a few seconds (acceptance well above zero)."""
    from workbench.train.eagle3 import DraftTrainConfig, train_draft

    root = tmp_path_factory.mktemp("trained_head")
    train_draft(DraftTrainConfig(target=str(micro_target), out=str(root / "head"),
                                 work=str(root / "work"), corpus=str(tiny_corpus),
                                 **MICRO_DRAFT_TRAINING))
    return root / "head"


# Seconds on one core; regenerated (target-greedy) data makes acceptance clearly non-zero.
MICRO_DRAFT_TRAINING: dict = dict(
    draft_vocab_size=128, steps=80, batch=4, seq_len=48, lr=3e-3, warmup=5, ttt_steps=5,
    regenerate=True, regen_sequences=16, regen_prompt_len=16, regen_batch=16, eval_batches=2,
    ckpt_every=40, threads=1)
