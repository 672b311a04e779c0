"""Sampling: logit bias, greedy, temperature, top-k, top-p, min-p, per-request seeded
generators.

``process_probs`` is shared by plain sampling and speculative verification, so the target
distribution that rejection sampling reproduces is exactly the one plain decoding samples from.

Numerics: every valid :class:`SamplingParams` yields a proper distribution for finite logits.
The filters run in float64 and always keep the most likely token, so a ``top_p`` that underflows
(1e-300), a ``min_p`` close to 1 or a temperature of 1e-30 narrow the distribution down to the
argmax instead of dropping every token (which would leave 0/0 = NaN for ``torch.multinomial``).
A row whose probabilities are still not a distribution (non-finite logits) is reported by
:func:`sample_rows` as a per-row error: the engine fails that request alone.
"""

from __future__ import annotations

import torch

from workbench.config import SamplingParams

MIN_TEMPERATURE = 1e-6  # below this a temperature divides like 1e-6 (still a sharp softmax)


def process_probs(logits: torch.Tensor, sp: SamplingParams) -> torch.Tensor:
    """logits (R, V) → probabilities (R, V) (float32) after temperature, top-k, top-p, min-p.

    Computed in float64; the argmax of every row always keeps a positive probability."""
    x = logits.double() / max(float(sp.temperature), MIN_TEMPERATURE)
    if sp.top_k and sp.top_k < x.shape[-1]:
        kth = torch.topk(x, sp.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if sp.top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        cum = sorted_p.cumsum(-1)
        drop_sorted = (cum - sorted_p) >= float(sp.top_p)  # keep the smallest prefix >= top_p
        drop_sorted[..., 0] = False  # the most likely token always stays
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
    if sp.min_p > 0.0:
        top = probs.amax(-1, keepdim=True)
        probs = probs.masked_fill((probs < float(sp.min_p) * top) & (probs < top), 0.0)
    return (probs / probs.sum(-1, keepdim=True)).to(torch.float32)


def bias_problem(sp: SamplingParams, vocab: int) -> str | None:
    """Why ``sp.logit_bias`` cannot apply to a vocabulary of ``vocab`` tokens (None: it can)."""
    bad = [t for t, _ in sp.logit_bias if t >= vocab]
    if not bad:
        return None
    return (f"logit_bias: token id {bad[0]} is not in the vocabulary ({vocab} tokens: ids "
            f"0..{vocab - 1})")


def biased(logits: torch.Tensor, sp: SamplingParams) -> torch.Tensor:
    """``logits`` (..., V) with ``sp.logit_bias`` added (OpenAI's ``logit_bias``): the same
    tensor when there is none, else a copy. Plain sampling (:func:`sample_rows`) and
    verification (:func:`workbench.speculative.verify.accept`) both take the target's
    distribution from the biased logits, so speculation stays lossless under a bias. Token ids
    outside the vocabulary raise ValueError (admission checks them: :func:`bias_problem`)."""
    if not sp.logit_bias:
        return logits
    why = bias_problem(sp, logits.shape[-1])
    if why is not None:
        raise ValueError(why)
    ids = torch.tensor([t for t, _ in sp.logit_bias], dtype=torch.int64, device=logits.device)
    vals = torch.tensor([b for _, b in sp.logit_bias], dtype=logits.dtype, device=logits.device)
    return logits.index_add(-1, ids, vals.expand(*logits.shape[:-1], len(ids)))


def valid_distribution(p: torch.Tensor) -> bool:
    """Finite, non-negative and with positive mass: what ``torch.multinomial`` accepts."""
    return bool(torch.isfinite(p).all()) and bool((p >= 0).all()) and float(p.sum()) > 0.0


# argmax_rows: rows of a CPU tensor are reduced in blocks of this many columns when there are at
# least ARGMAX_BLOCK_ROWS of them (blocks win from a few rows up, one row is faster plainly;
# figures in docs/MEASUREMENTS.md §4)
ARGMAX_BLOCK = 128
ARGMAX_BLOCK_ROWS = 4


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(-1)``, the same ids (ties → the lowest; a NaN counts as the largest).

    On the CPU torch's argmax walks each row element by element, while ``amax`` is vectorised:
    so take the block holding each row's maximum (the first such block, by the maxima of
    ``ARGMAX_BLOCK`` columns) and the first maximum inside it. Exactly ``argmax``: the first
    block whose maximum is the row's holds the row's first maximum."""
    return _argmax_rows(x, False)[0]


def argmax_max_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(:func:`argmax_rows`, each row's maximum ``x.amax(-1)``: NaN if the row holds a NaN).
    On the blocked path the maxima come from the blocks' (no second pass over ``x``): the
    greedy verify's finiteness check (a row is usable iff its maximum is finite) for free."""
    ids, top = _argmax_rows(x, True)
    assert top is not None
    return ids, top


def _argmax_rows(x: torch.Tensor, want_max: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    v = x.shape[-1]
    rows = x.numel() // v if v else 0
    if (x.device.type != "cpu" or rows < ARGMAX_BLOCK_ROWS or v % ARGMAX_BLOCK
            or not x.is_contiguous()):
        return x.argmax(-1), x.amax(-1) if want_max else None
    xb = x.view(rows, v // ARGMAX_BLOCK, ARGMAX_BLOCK)
    # (R, V / block) block maxima (a block holding a NaN has a NaN maximum), then each row's
    # maximum and its first block holding it in one reduction (max's index is argmax's)
    top, blk = xb.amax(-1).max(-1, keepdim=True)  # (R, 1) each
    inner = xb.gather(1, blk.unsqueeze(-1).expand(rows, 1, ARGMAX_BLOCK)).view(rows, -1)
    ids = (blk * ARGMAX_BLOCK + inner.argmax(-1, keepdim=True)).view(x.shape[:-1])
    return ids, top.view(x.shape[:-1]) if want_max else None


def sample_rows(logits: torch.Tensor, params: list[SamplingParams],
                generators: list[torch.Generator | None],
                errors: dict[int, str] | None = None) -> torch.Tensor:
    """logits (R, V) → token ids (R,). Greedy rows take the argmax (ties → lowest id).

    A sampled row whose probabilities are not a distribution gets its argmax and an entry
    ``errors[row]`` naming the problem (when ``errors`` is given; else RuntimeError): the caller
    fails that request alone."""
    out = argmax_rows(logits)
    for i, (sp, g) in enumerate(zip(params, generators, strict=True)):
        if sp.greedy and not sp.logit_bias:
            continue
        row = logits[i : i + 1]
        if sp.logit_bias:
            why = bias_problem(sp, row.shape[-1])
            if why is not None:
                if errors is None:
                    raise RuntimeError(why)
                errors[i] = why
                continue
            row = biased(row, sp)
            if sp.greedy:
                out[i] = row[0].argmax()
                continue
        p = process_probs(row, sp)[0]
        if not valid_distribution(p):
            msg = (f"sampling: no valid distribution for temperature={sp.temperature}, "
                   f"top_k={sp.top_k}, top_p={sp.top_p}, min_p={sp.min_p} (non-finite logits)")
            if errors is None:
                raise RuntimeError(msg)
            errors[i] = msg
            continue
        out[i] = torch.multinomial(p, 1, generator=g)[0]
    return out


def make_generator(sp: SamplingParams, fallback_seed: int) -> torch.Generator | None:
    if sp.greedy:
        return None
    return torch.Generator().manual_seed(sp.seed if sp.seed is not None else fallback_seed)
