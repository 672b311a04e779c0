"""``draft_tree`` for one request on the CPU, its bookkeeping on host lists.

The same EAGLE-2 tree as :func:`workbench.speculative.drafter.draft_tree` (the same draft
forwards, the same float32 scores, the same stable orders: tests/speculative/test_host_tree.py
checks every field equal), with the per-step selection, the frontier's ancestry and the final
rerank done on Python lists instead of ~20 small tensor ops per step. On the CPU the tree is
built right after each draft forward, whose weights have just pushed the interpreter's and
torch's dispatch state out of the caches; a tensor op there costs several times its warm price
(measured on the 2-core EPYC: the accept's ~20 ops take 59 µs warm, 262 µs after a 64 MB
stream), and a list operation touches far less. On a GPU the tensor path stays: no host copy.

Only the vocabulary-wide work stays in torch: the log-softmax and top-K over the draft
vocabulary, the score additions (float32, as the tensor path), the hidden-state gather.
"""

from __future__ import annotations

import torch

from workbench.attention.tree_draft import TreeDraftAttention
from workbench.core import DraftTree
from workbench.models.eagle3 import Eagle3Draft


@torch.inference_mode()
def draft_tree_one(draft: Eagle3Draft, logits0: torch.Tensor, hidden0: torch.Tensor,
                   root_tokens: torch.Tensor, root_pos: torch.Tensor,
                   prefix_slots: list[torch.Tensor], k_pool: torch.Tensor,
                   v_pool: torch.Tensor, num_steps: int, k: int, num_draft_tokens: int,
                   inv_t: torch.Tensor | float | None) -> DraftTree:
    """``draft_tree`` (same arguments) for B = 1 on the CPU, without tracing; ``inv_t`` is
    1 / the score temperature (a float, a (1, 1) tensor, or None)."""
    dev = logits0.device
    to_target = draft.target_ids()
    x = logits0.float() if inv_t is None else logits0.float() * inv_t
    lp0, ids0 = torch.topk(torch.log_softmax(x, -1), k, dim=-1)  # (1, K)
    lp0 = lp0.clamp(max=0.0)  # a log-prob can round above 0: at most one per row
    f_tok = to_target[ids0[0]]  # (K,)
    # every candidate in creation order: target token, parent candidate (-1: the root),
    # cumulative score, own log-prob; the frontier by candidate index
    c_tok: list[int] = f_tok.tolist()
    c_lp: list[float] = lp0[0].tolist()
    c_score, c_par = list(c_lp), [-1] * k
    front = list(range(k))
    f_scores = lp0.view(k, 1)
    hidden = hidden0.expand(k, -1).contiguous()
    attn = TreeDraftAttention(k_pool, v_pool, draft.config.num_attention_heads, prefix_slots,
                              max_tree=(num_steps - 1) * k)
    # the frontier's ancestors-or-self among the tree entries the draft has seen, per row
    anc = [[i == j for i in range(k)] for j in range(k)]
    pos0 = root_pos.expand(k)  # a frontier node's position: the root's + step − 1
    for step in range(1, num_steps):
        attn.set_frontier(torch.tensor(anc, dtype=torch.bool, device=dev).view(1, k, -1))
        logits, out = draft(f_tok, hidden, pos0 if step == 1 else pos0 + (step - 1), attn)
        x = logits if inv_t is None else logits * inv_t
        lp, ids = torch.topk(torch.log_softmax(x, dim=-1), k, dim=-1)  # (K, K)
        lp = lp.clamp(max=0.0)
        scores: list[float] = (f_scores + lp).view(-1).tolist()  # float32, then exact floats
        toks: list[int] = to_target[ids.view(-1)].tolist()
        base = len(c_tok)
        c_tok += toks
        c_lp += lp.view(-1).tolist()
        c_score += scores
        c_par += [front[j // k] for j in range(k * k)]
        if step == num_steps - 1:
            break  # the last step's children propose nothing: no frontier to pick
        pick = sorted(range(k * k), key=lambda j: -scores[j])[:k]  # stable: ties by creation
        rows = [j // k for j in pick]
        front = [base + j for j in pick]
        f_tok = torch.tensor([toks[j] for j in pick], device=dev)
        f_scores = torch.tensor([scores[j] for j in pick], dtype=torch.float32,
                                device=dev).view(k, 1)
        hidden = out.index_select(0, torch.tensor(rows, device=dev))
        anc = [anc[r] + [i == j for i in range(k)] for j, r in enumerate(rows)]
    return _tree(int(root_tokens[0]), int(root_pos[0]), c_tok, c_par, c_score, c_lp,
                 num_draft_tokens, dev)


def _tree(root: int, root_pos: int, c_tok: list[int], c_par: list[int], c_score: list[float],
          c_lp: list[float], num_draft_tokens: int, dev: torch.device) -> DraftTree:
    """``build_tree`` + ``finish_tree`` for one request on lists: the best N−1 candidates by
    score (stable), in creation order (parents first), under the root."""
    keep = min(num_draft_tokens - 1, len(c_tok))
    chosen = sorted(sorted(range(len(c_tok)), key=lambda i: -c_score[i])[:keep])
    node = {c: i + 1 for i, c in enumerate(chosen)}
    parents, depth = [-1], [0]
    mask = [[True] + [False] * keep]
    for i, c in enumerate(chosen, 1):
        p = 0 if c_par[c] < 0 else node.get(c_par[c], -1)
        if p < 0:
            raise AssertionError("draft tree: a selected node's parent was not selected")
        parents.append(p)
        depth.append(depth[p] + 1)
        row = list(mask[p])
        row[i] = True
        mask.append(row)
    n = keep + 1
    ints = torch.tensor([[root] + [c_tok[c] for c in chosen], parents, depth,
                         [root_pos + d for d in depth]], dtype=torch.int64, device=dev)
    floats = torch.tensor([[0.0] + [c_score[c] for c in chosen],
                           [0.0] + [c_lp[c] for c in chosen]], dtype=torch.float32, device=dev)
    return DraftTree(tokens=ints[0].view(1, n), parents=ints[1].view(1, n),
                     depth=ints[2].view(1, n), positions=ints[3].view(1, n),
                     mask=torch.tensor(mask, dtype=torch.bool, device=dev).view(1, n, n),
                     scores=floats[0].view(1, n), draft_probs=floats[1].exp().view(1, n))
