"""What the two trainers' loops share (``target`` and ``eagle3``): the learning-rate schedule
and the checkpoint write."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Protocol

import torch


class Schedule(Protocol):
    """The config fields ``lr_at`` reads (both trainers' configs have them)."""

    @property
    def lr(self) -> float: ...
    @property
    def warmup(self) -> int: ...
    @property
    def steps(self) -> int: ...


def lr_at(step: int, cfg: Schedule) -> float:
    """Linear warmup, then cosine from lr down to lr/10."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    frac = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))


def save_checkpoint(ckpt: Path, state: dict[str, Any]) -> None:
    """Write ``state`` to ``ckpt`` atomically (a ``.tmp`` sibling, then rename): a run killed
    mid-write leaves the previous checkpoint intact."""
    tmp = ckpt.with_suffix(".tmp")
    tmp.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, tmp)
    tmp.replace(ckpt)
