"""Sampling: greedy, temperature, top-k, top-p, min-p, per-request seeded generators.

``process_probs`` is shared by plain sampling and speculative verification, so the target
distribution that rejection sampling reproduces is exactly the one plain decoding samples from.
"""

from __future__ import annotations

import torch

from workbench.config import SamplingParams


def process_probs(logits: torch.Tensor, sp: SamplingParams) -> torch.Tensor:
    """logits (R, V) float32 → probabilities (R, V) after temperature, top-k, top-p, min-p."""
    x = logits / max(sp.temperature, 1e-6)
    if sp.top_k and sp.top_k < x.shape[-1]:
        kth = torch.topk(x, sp.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if sp.top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        cum = sorted_p.cumsum(-1)
        drop_sorted = (cum - sorted_p) >= sp.top_p  # keep the smallest prefix reaching top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
    if sp.min_p > 0.0:
        probs = probs.masked_fill(probs < sp.min_p * probs.amax(-1, keepdim=True), 0.0)
    return probs / probs.sum(-1, keepdim=True)


def sample_rows(logits: torch.Tensor, params: list[SamplingParams],
                generators: list[torch.Generator | None]) -> torch.Tensor:
    """logits (R, V) → token ids (R,). Greedy rows take the argmax (ties → lowest id)."""
    out = logits.argmax(-1)
    for i, (sp, g) in enumerate(zip(params, generators, strict=True)):
        if not sp.greedy:
            p = process_probs(logits[i : i + 1], sp)
            out[i] = torch.multinomial(p[0], 1, generator=g)[0]
    return out


def make_generator(sp: SamplingParams, fallback_seed: int) -> torch.Generator | None:
    if sp.greedy:
        return None
    return torch.Generator().manual_seed(sp.seed if sp.seed is not None else fallback_seed)
