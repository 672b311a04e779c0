"""Run the EAGLE-3 head to build draft trees for a batch of requests.

Step 0 takes the top-K of the draft logits left by the last draft extend (position n−1 predicts
the token after the root). Each of the S−1 further steps runs one draft forward over the K
frontier nodes of every request, at position n−1+depth, feeding each node the pre-norm hidden
state of its parent, attending to the draft prefix plus its own ancestors (TreeDraftAttention).
"""

from __future__ import annotations

import torch

from workbench.attention.tree_draft import TreeDraftAttention
from workbench.core import DraftTree
from workbench.models.eagle3 import Eagle3Draft
from workbench.speculative.tree import build_tree, expand, select_frontier


@torch.inference_mode()
def draft_tree(draft: Eagle3Draft, logits0: torch.Tensor, hidden0: torch.Tensor,
               root_tokens: torch.Tensor, root_pos: torch.Tensor,
               prefix_slots: list[torch.Tensor], k_pool: torch.Tensor, v_pool: torch.Tensor,
               num_steps: int, topk: int, num_draft_tokens: int,
               on_step: object = None,
               score_temperature: torch.Tensor | None = None) -> DraftTree:
    """logits0 (B, Vd), hidden0 (B, D) from the last extend; root_tokens, root_pos (B,);
    prefix_slots: per request the draft-pool slots of positions [0, n). Returns the tree
    (target-vocab ids). ``on_step(depth, tokens (B, K), probs (B, K), parents (B, K))`` is
    called per step when given (tracing). ``score_temperature`` (B,) divides each request's
    draft logits before they score and rank nodes (calibration, see
    ``Eagle3Config.greedy_score_temperature``); the tree's scores and draft probs are the
    calibrated ones. None: 1."""
    b = logits0.shape[0]
    k = topk
    dev = logits0.device
    inv_t = None if score_temperature is None else (1.0 / score_temperature.float()).view(b, 1)
    logp = torch.log_softmax(logits0.float() if inv_t is None else logits0.float() * inv_t, -1)
    f_ids, f_scores, f_lp = expand(torch.zeros(b, 1, device=dev), logp.unsqueeze(1), k)  # (B, K)
    cand_ids, cand_scores, cand_lp = [f_ids], [f_scores], [f_lp]
    cand_parents = [torch.full((b, k), -1, dtype=torch.int64, device=dev)]
    f_cand = torch.arange(k, device=dev).expand(b, k)  # candidate index of each frontier node
    if callable(on_step):
        on_step(1, draft.draft_to_target(f_ids), f_lp.exp(), cand_parents[0])
    hidden = hidden0.unsqueeze(1).expand(b, k, -1)
    attn = TreeDraftAttention(k_pool, v_pool, draft.config.num_attention_heads, prefix_slots,
                              max_tree=(num_steps - 1) * k)
    eye = torch.eye(k, dtype=torch.bool, device=dev).expand(b, k, k)
    anc = eye
    d = hidden0.shape[-1]
    pos0 = (root_pos - 1).repeat_interleave(k)  # each frontier node's position is pos0 + step
    n_cand = k
    for step in range(1, num_steps):
        attn.set_frontier(anc)
        logits, out = draft(draft.draft_to_target(f_ids).flatten(), hidden.reshape(b * k, -1),
                            pos0 + step, attn)
        if inv_t is not None:
            logits = logits.view(b, k, -1) * inv_t.unsqueeze(-1)
        lp = torch.log_softmax(logits, dim=-1).view(b, k, -1)
        c_ids, c_scores, c_lp = expand(f_scores, lp, k)  # (B, K·K)
        parents = f_cand.repeat_interleave(k, dim=1)
        cand_ids.append(c_ids)
        cand_scores.append(c_scores)
        cand_lp.append(c_lp)
        cand_parents.append(parents)
        if callable(on_step):
            on_step(step + 1, draft.draft_to_target(c_ids), c_lp.exp(), parents)
        pick = select_frontier(c_scores, k)  # (B, K)
        par = pick // k  # which frontier node each new frontier node descends from
        # row gathers (one op each; advanced indexing with a batch-row index costs ~3)
        f_ids, f_scores = c_ids.gather(1, pick), c_scores.gather(1, pick)
        f_cand = n_cand + pick
        n_cand += k * k
        hidden = out.view(b, k, d).gather(1, par.unsqueeze(-1).expand(b, k, d))
        anc = torch.cat([anc.gather(1, par.unsqueeze(-1).expand(b, k, anc.shape[2])), eye], 2)
    tokens = draft.draft_to_target(torch.cat(cand_ids, 1))
    return build_tree(root_tokens, tokens, torch.cat(cand_parents, 1), torch.cat(cand_scores, 1),
                      torch.cat(cand_lp, 1), num_draft_tokens, root_pos)
