"""Run the EAGLE-3 head to build draft trees for a batch of requests.

Step 0 takes the top-K of the draft logits left by the last draft extend (position n−1 predicts
the token after the root). Each of the S−1 further steps runs one draft forward over the K
frontier nodes of every request, at position n−1+depth, feeding each node the pre-norm hidden
state of its parent, attending to the draft prefix plus its own ancestors (TreeDraftAttention).
"""

from __future__ import annotations

from collections.abc import Hashable

import torch

from workbench.attention.tree_draft import TreeDraftAttention
from workbench.core import DraftTree
from workbench.models.eagle3 import Eagle3Draft
from workbench.speculative.host_tree import draft_tree_one
from workbench.speculative.tree import build_tree, expand, per_shape, select_frontier


@torch.inference_mode()
def draft_tree(draft: Eagle3Draft, logits0: torch.Tensor, hidden0: torch.Tensor,
               root_tokens: torch.Tensor | list[int], root_pos: torch.Tensor | list[int],
               prefix_slots: list[torch.Tensor] | tuple[int, int], k_pool: torch.Tensor,
               v_pool: torch.Tensor,
               num_steps: int, topk: int, num_draft_tokens: int,
               on_step: object = None,
               score_temperature: torch.Tensor | float | None = None) -> DraftTree:
    """logits0 (B, Vd), hidden0 (B, D) from the last extend; root_tokens, root_pos (B,), as
    tensors or host int lists (the engine's: the CPU one-request tree reads them as ints);
    prefix_slots: per request the draft-pool slots of positions [0, n), or (lo, n) for one
    request whose slots [lo, lo + n + (S−1)·K) are one run (TreeDraftAttention). Returns the tree
    (target-vocab ids). ``on_step(depth, tokens (B, K), probs (B, K), parents (B, K))`` is
    called per step when given (tracing). ``score_temperature`` (B,) divides each request's
    draft logits before they score and rank nodes (calibration, see
    ``Eagle3Config.greedy_score_temperature``); the tree's scores and draft probs are the
    calibrated ones. A float: every request's (one scalar multiply per step). None: 1.
    One request on the CPU, untraced: :func:`~workbench.speculative.host_tree.draft_tree_one`
    (the same tree, its bookkeeping on host lists)."""
    b = logits0.shape[0]
    k = topk
    dev = logits0.device
    inv_t: torch.Tensor | float | None = None
    if isinstance(score_temperature, float):
        inv_t = 1.0 / score_temperature
    elif score_temperature is not None:
        inv_t = (1.0 / score_temperature.float()).view(b, 1)
    if b == 1 and dev.type == "cpu" and on_step is None:  # the same tree, on host lists
        return draft_tree_one(draft, logits0, hidden0, int(root_tokens[0]), int(root_pos[0]),
                              prefix_slots, k_pool, v_pool, num_steps, k, num_draft_tokens,
                              inv_t)
    if isinstance(root_tokens, list):
        root_tokens = torch.tensor(root_tokens, device=dev)
    if isinstance(root_pos, list):
        root_pos = torch.tensor(root_pos, device=dev)
    c = _constants(b, k, num_steps, dev)
    # draft id → target id as one table lookup per step (the same ids, one op instead of two)
    to_target = draft.target_ids()
    logp = torch.log_softmax(logits0.float() if inv_t is None else logits0.float() * inv_t, -1)
    # depth 1: the root's top-K children, scored by their own log-probs (``expand`` from a
    # zero score, in two ops)
    f_lp, f_ids = torch.topk(logp, k, dim=-1)  # (B, K)
    f_lp = f_scores = f_lp.clamp(max=0.0)
    c_tok = to_target[f_ids]
    cand_tok, cand_scores, cand_lp = [c_tok], [f_scores], [f_lp]
    picks: list[torch.Tensor] = []  # per step, the frontier's candidate columns in that step
    if callable(on_step):
        on_step(1, c_tok, f_lp.exp(), c.parents0)
    f_tok = c_tok
    hidden = hidden0.unsqueeze(1).expand(b, k, -1).reshape(b * k, -1)
    attn = TreeDraftAttention(k_pool, v_pool, draft.config.num_attention_heads, prefix_slots,
                              max_tree=(num_steps - 1) * k)
    anc = c.eye
    inv_t3 = inv_t.unsqueeze(-1) if isinstance(inv_t, torch.Tensor) else inv_t
    # each frontier node's position is the root's + step − 1 (one request: a view of it)
    pos0 = root_pos.expand(k) if b == 1 else root_pos.repeat_interleave(k)
    for step in range(1, num_steps):
        attn.set_frontier(anc)
        pos = pos0 if step == 1 else pos0 + (step - 1)
        logits, out = draft(f_tok.flatten(), hidden, pos, attn)
        logits = logits.view(b, k, -1)
        if inv_t3 is not None:
            logits = logits * inv_t3
        c_ids, c_scores, c_lp = expand(f_scores, torch.log_softmax(logits, dim=-1), k)
        c_tok = to_target[c_ids]
        cand_tok.append(c_tok)
        cand_scores.append(c_scores)
        cand_lp.append(c_lp)
        if callable(on_step):
            on_step(step + 1, c_tok, c_lp.exp(), _parents(c, picks, k)[:, -k * k:])
        if step == num_steps - 1:
            break  # the last step's children propose nothing: no frontier to pick
        pick = select_frontier(c_scores, k)  # (B, K)
        picks.append(pick)
        # which frontier row (of the B·K the forward ran) each new frontier node descends from
        rows = (pick // k).flatten() if b == 1 else (pick // k + c.row_base).flatten()
        f_tok, f_scores = c_tok.gather(1, pick), c_scores.gather(1, pick)
        hidden = out.index_select(0, rows)
        anc = torch.cat([anc.flatten(0, 1).index_select(0, rows).view(b, k, -1), c.eye], 2)
    parents = c.parents0 if num_steps == 1 else _parents(c, picks, k)
    return build_tree(root_tokens, torch.cat(cand_tok, 1), parents,
                      torch.cat(cand_scores, 1), torch.cat(cand_lp, 1), num_draft_tokens,
                      root_pos)


class _Consts:
    """Per (B, K, S, device) tensors draft_tree reuses every step (never written to)."""

    def __init__(self, b: int, k: int, num_steps: int, dev: torch.device) -> None:
        self.dev = dev
        self.parents0 = torch.full((b, k), -1, dtype=torch.int64, device=dev)
        self.eye = torch.eye(k, dtype=torch.bool, device=dev).expand(b, k, k)
        self.row_base = (torch.arange(b, device=dev) * k).view(b, 1)
        # the candidate index of frontier node j at step s ≥ 1: k + (s−1)·k² + pick (step 0's
        # frontier is candidates 0..K−1); as one row per step count, for all steps at once
        self.first = torch.arange(k, device=dev).expand(b, k)
        self.offsets = [torch.tensor([k + s * k * k for s in range(m) for _ in range(k)],
                                     dtype=torch.int64, device=dev) for m in range(num_steps)]


_CONSTS: dict[Hashable, _Consts] = {}


def _constants(b: int, k: int, num_steps: int, dev: torch.device) -> _Consts:
    return per_shape(_CONSTS, (b, k, num_steps, str(dev)), lambda: _Consts(b, k, num_steps, dev))


def _parents(c: _Consts, picks: list[torch.Tensor], k: int) -> torch.Tensor:
    """Every candidate's parent (candidate index; -1: the root) given the frontier picks of
    steps 1..len(picks): step 0's K children of the root, then K children per frontier node
    of each step (frontier f's children at columns [f·K, (f+1)·K) of its step)."""
    if not picks:
        front = c.first
    else:
        front = torch.cat([c.first, torch.cat(picks, 1) + c.offsets[len(picks)]], 1)
    return torch.cat([c.parents0, front.repeat_interleave(k, dim=1)], 1)
