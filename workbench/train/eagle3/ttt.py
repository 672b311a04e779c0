"""The training-time test as pure tensor functions: the draft vocabulary, the attention mask
of the unrolled steps, the unroll, the loss over one batch of windows, and the frozen target's
features (taps and logits) the head learns from."""

from __future__ import annotations

from collections.abc import Iterator
from functools import lru_cache

import numpy as np
import torch
import torch.nn.functional as F

from workbench.errors import ConfigError
from workbench.models.eagle3 import Eagle3Draft
from workbench.models.loader import Target


def build_draft_vocab(arrays: list[np.ndarray], vocab_size: int,
                      draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``draft_vocab_size`` most frequent ids in ``arrays`` (ties: lower id first; unseen ids
    fill up in id order). Returns d2t (Vd,) int64 with target_id = draft_id + d2t[draft_id]
    (target ids ascending, so d2t is non-decreasing and >= 0) and t2d (V,) bool."""
    if draft_vocab_size > vocab_size:
        raise ConfigError(f"draft_vocab_size {draft_vocab_size} > target vocab_size {vocab_size}")
    counts = np.zeros(vocab_size, dtype=np.int64)
    for a in arrays:
        if len(a):
            if int(a.max()) >= vocab_size:
                raise ConfigError(f"corpus: token id {int(a.max())} >= target vocab_size "
                                  f"{vocab_size} (tokenizer and model disagree)")
            counts += np.bincount(a.astype(np.int64), minlength=vocab_size)
    order = np.argsort(-counts, kind="stable")[:draft_vocab_size]
    target_ids = torch.from_numpy(np.sort(order)).to(torch.int64)
    d2t = target_ids - torch.arange(draft_vocab_size, dtype=torch.int64)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[target_ids] = True
    return d2t, t2d


@lru_cache(maxsize=64)
def ttt_mask(n: int, step: int) -> torch.Tensor:
    """Attention mask of unrolled step j=``step`` over cat(K_0, K_1, ..., K_j) along time.

    Shape: (n, (j+1)·n) bool, True = attend. Query row i sees step-0 keys at positions <= i-j and,
    for k = 1..j, the step-k key at position i-j+k: the chain a draft at inference builds when it
    starts from the target feature at i-j. Every row keeps at least its own step-j key.
    """
    i = torch.arange(n).unsqueeze(1)  # (n, 1)
    c = torch.arange(n).unsqueeze(0)  # (1, n)
    blocks = [c <= i - step] + [c == i - step + k for k in range(1, step + 1)]
    return torch.cat(blocks, dim=1)


def ttt_unroll(draft: Eagle3Draft, hidden: torch.Tensor, tokens: torch.Tensor,
               ttt_steps: int) -> Iterator[torch.Tensor]:
    """Unrolled draft steps over n rows; yields each step's draft logits (B, n, Vd).

    hidden: (B, n, D) fused target features fc(taps) of rows 0..n-1; tokens: (B, n) the token
    each row reads. Every step puts row i at rope position i. Step j >= 1 reads step j-1's pre-norm
    output at row i-1 (zeros at row 0) and attends (``ttt_mask``) to the chain of keys a draft at
    inference builds when started from the target feature at row i-j.
    """
    n = tokens.shape[1]
    pos = torch.arange(n, device=tokens.device)
    ks: list[torch.Tensor] = []
    vs: list[torch.Tensor] = []
    for j in range(ttt_steps):
        mask = ttt_mask(n, j).to(tokens.device)
        k_prev = torch.cat(ks, dim=1) if ks else None
        v_prev = torch.cat(vs, dim=1) if vs else None
        logits, out, k, v = draft.forward_dense(tokens, hidden, pos, mask, k_prev, v_prev)
        ks.append(k)
        vs.append(v)
        yield logits
        hidden = torch.cat([torch.zeros_like(out[:, :1]), out[:, :-1]], dim=1)


def ttt_forward(draft: Eagle3Draft, taps: torch.Tensor, target_logits: torch.Tensor,
                tokens: torch.Tensor, ttt_steps: int, step_decay: float,
                weights: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The training-time test over one batch of windows.

    taps: (B, T, 3·Dt) hidden states entering the tapped target layers; target_logits: (B, T, V);
    tokens: (B, T) the window. Draft row i (i = 0..T-2) reads token t_{i+1} and predicts t_{i+2};
    its target is softmax(target_logits[:, i+1]) restricted to the draft vocab. Step 0 reads
    fc(taps[:, i]); step j is scored on rows i >= j (rows whose chain starts inside the window).

    Returns (loss, kl (S,), acc (S,)): loss = sum_j step_decay**j · mean forward KL(p || q_j) of
    step j (the soft cross-entropy minus the target's entropy: same gradient, 0 when perfect);
    kl/acc detached; acc = top-1 agreement of the draft (mapped to target ids) with the target's
    argmax over the full vocab, which is what greedy verification accepts.

    weights: (B, T-1) per-row weights (e.g. 1 on rows predicting an answer token, 0 elsewhere):
    every mean above becomes the weighted mean over the rows each step scores (a step whose rows
    all weigh 0 adds nothing; its kl/acc read 0).
    """
    n = tokens.shape[1] - 1
    # 1. Targets, shared by every step: restricted distribution and full-vocab argmax.
    target_ids = draft.draft_to_target(torch.arange(draft.config.draft_vocab_size,
                                                    device=tokens.device))  # (Vd,)
    p = torch.softmax(target_logits[:, 1:, target_ids].float(), dim=-1)  # (B, n, Vd)
    neg_entropy = torch.special.xlogy(p, p).sum(-1)  # (B, n): makes a perfect draft score 0
    top = target_logits[:, 1:].argmax(-1)  # (B, n)
    # 2. Unroll: rows read t_{i+1}, step 0 the fused target features of position i.
    hidden = draft.fuse_features(taps[:, :n])  # (B, n, D)
    loss = hidden.new_zeros(())
    kl_steps, acc_steps = [], []
    if weights is not None and weights.shape != top.shape:
        raise ConfigError(f"weights: shape {tuple(weights.shape)}, expected {tuple(top.shape)}")

    def mean(v: torch.Tensor, j: int) -> torch.Tensor:
        if weights is None:
            return v.mean()
        w = weights[:, j:].to(v.dtype)
        return (v * w).sum() / w.sum().clamp_min(1e-12)

    for j, logits in enumerate(ttt_unroll(draft, hidden, tokens[:, 1:], ttt_steps)):
        # 3. Forward KL(p || q) on the rows whose chain starts at or after position 0.
        logq = F.log_softmax(logits[:, j:].float(), dim=-1)
        kl = neg_entropy[:, j:] - (p[:, j:] * logq).sum(-1)  # (B, n-j)
        loss = loss + step_decay**j * mean(kl, j)
        with torch.no_grad():
            agree = draft.draft_to_target(logits[:, j:].argmax(-1)) == top[:, j:]
            kl_steps.append(mean(kl, j).detach())
            acc_steps.append(mean(agree.float(), j))
    return loss, torch.stack(kl_steps), torch.stack(acc_steps)


@torch.no_grad()
def target_features(target: Target, x: torch.Tensor,
                    aux: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """x: (B, T) → target logits (B, T, V) and taps (B, T, len(aux)·Dt) in ``aux`` order.

    ``forward_dense`` concatenates taps in layer order and once per layer; small targets have
    repeated or unordered defaults (L=4: (2, 2, 1)), so ask for the distinct layers and reorder.
    """
    uniq = sorted(set(aux))
    logits, taps = target.forward_dense(x, uniq)
    assert taps is not None
    chunks = taps.chunk(len(uniq), dim=-1)
    return logits, torch.cat([chunks[uniq.index(a)] for a in aux], dim=-1)
