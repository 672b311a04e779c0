"""``draft_tree`` for one request on the CPU, its bookkeeping on host lists.

The same EAGLE-2 tree as :func:`workbench.speculative.drafter.draft_tree` (the same draft
forwards, the same float32 scores, the same stable orders: tests/speculative/test_host_tree.py
checks every field equal), with the per-step selection, the frontier's ancestry and the final
rerank done on Python lists instead of ~20 small tensor ops per step. On the CPU the tree is
built right after each draft forward, whose weights have just pushed the interpreter's and
torch's dispatch state out of the caches; a tensor op there costs several times its warm price
(measured on the 2-core EPYC: the accept's ~20 ops take 59 µs warm, 262 µs after a 64 MB
stream), and a list operation touches far less. On a GPU the tensor path stays: no host copy.

Only the vocabulary-wide work stays in torch: per step the log-softmax and top-K over the
draft vocabulary and the hidden-state gather, and the draft probabilities' ``exp`` once.
The rest is host floats, ints and bytes:

* the clamp and the score sums: a sum of two float32 numbers computed in double and rounded
  to float32 (``array('f')``) is the correctly rounded float32 sum, i.e. the tensor path's
  (double has 53 ≥ 2·24 + 2 bits, so the double rounding is innocuous); ``0.0 if v > 0.0
  else v`` is ``clamp(max=0)``, -inf and NaN included;
* draft id → target id through a host copy of ``draft.target_ids()`` (made once per table);
* the tensors the draft reads (frontier tokens, positions, hidden-row picks, ancestor rows)
  and the tree's fields come from ``array``/``bytearray`` buffers (``torch.frombuffer``,
  several times cheaper than ``torch.tensor`` of a list), one buffer per kind, rows as views;
* the ancestor rows are float32 bytes of the additive mask (0 / -inf) TreeDraftAttention
  hands SDPA, which would otherwise convert a bool mask in every draft forward.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from operator import add

import torch

from workbench.attention.tree_draft import TreeDraftAttention
from workbench.core import DraftTree
from workbench.models.eagle3 import Eagle3Draft

# id(table) → (table, its version or None, table.tolist()): the table is held, so its id is
# not reused while cached; a few tables at most (one per draft in the process)
_TARGET_LISTS: dict[int, tuple[torch.Tensor, int | None, list[int]]] = {}
_MAX_TABLES = 4


def target_list(table: torch.Tensor) -> list[int]:
    """``table.tolist()``, made once per table (``Eagle3Draft.target_ids`` makes a new table
    when ``d2t`` changes) and again after an in-place write to a table that tracks its version
    (an inference tensor does not: it is only ever replaced)."""
    hit = _TARGET_LISTS.get(id(table))
    version = None if table.is_inference() else table._version
    if hit is None or hit[0] is not table or hit[1] != version:
        if len(_TARGET_LISTS) >= _MAX_TABLES:
            del _TARGET_LISTS[next(iter(_TARGET_LISTS))]  # the oldest
        hit = (table, version, table.tolist())
        _TARGET_LISTS[id(table)] = hit
    return hit[2]


def _longs(values: list[int], rows: int) -> torch.Tensor:
    """(rows, len / rows) int64 from a host list, without ``torch.tensor``'s list walk."""
    return torch.frombuffer(array("q", values), dtype=torch.int64).view(rows, -1)


def _bools(rows: Sequence[bytes | bytearray], n: int) -> torch.Tensor:
    """(1, len(rows), n) bool from rows of n bytes, each 0 or 1."""
    return torch.frombuffer(bytearray().join(rows), dtype=torch.bool).view(1, -1, n)


# an attention mask entry as float32 bytes: 0 (may look), -inf (may not)
_SEE, _HIDE = array("f", [0.0]).tobytes(), array("f", [float("-inf")]).tobytes()


@torch.inference_mode()
def draft_tree_one(draft: Eagle3Draft, logits0: torch.Tensor, hidden0: torch.Tensor,
                   root: int, pos0: int,
                   prefix_slots: list[torch.Tensor] | tuple[int, int], k_pool: torch.Tensor,
                   v_pool: torch.Tensor, num_steps: int, k: int, num_draft_tokens: int,
                   inv_t: torch.Tensor | float | None) -> DraftTree:
    """``draft_tree`` for B = 1 on the CPU, without tracing (its arguments, with the root's
    token ``root`` and position ``pos0`` as ints); ``inv_t`` is 1 / the score temperature (a
    float, a (1, 1) tensor, or None)."""
    if logits0.device.type != "cpu":
        raise ValueError(f"draft_tree_one: logits0 on {logits0.device}; the host tree is "
                         "CPU-only")
    to_target = target_list(draft.target_ids())
    x = logits0 if logits0.dtype == torch.float32 else logits0.float()
    x = x if inv_t is None else x * inv_t  # not in place: logits0 is the request's
    lp0, ids0 = torch.topk(torch.log_softmax(x, -1), k, dim=-1)  # (1, K)
    # every candidate in creation order: target token, parent candidate (-1: the root),
    # cumulative score, own log-prob (clamped: a log-prob can round above 0); the frontier by
    # candidate index, and its scores
    c_lp = [0.0 if v > 0.0 else v for v in lp0.tolist()[0]]
    c_tok = list(map(to_target.__getitem__, ids0.tolist()[0]))
    c_score, c_par = list(c_lp), [-1] * k
    front = list(range(k))
    f_scores = [v for v in c_lp for _ in range(k)]  # each frontier score, once per child
    hidden = hidden0.expand(k, -1).contiguous()
    attn = TreeDraftAttention(k_pool, v_pool, draft.config.num_attention_heads, prefix_slots,
                              max_tree=(num_steps - 1) * k)
    # the frontier's ancestors-or-self among the tree entries the draft has seen, per
    # frontier node a row of float32 bytes, the additive mask TreeDraftAttention copies (0:
    # an ancestor, -inf: not); the identity rows each step's new entries add
    eye = [_HIDE * j + _SEE + _HIDE * (k - 1 - j) for j in range(k)]
    anc = eye
    # the frontier's tokens, its positions (a frontier node's: the root's + step − 1) and,
    # from step 2, the forward rows its hidden states come from: one buffer, rows as views
    tok, pos = _longs(c_tok + [pos0] * k, 2).unbind(0)  # rows as views: one op for all
    for step in range(1, num_steps):
        attn.set_frontier(torch.frombuffer(bytearray().join(anc),
                                           dtype=torch.float32).view(1, k, step * k))
        logits, out = draft(tok, hidden, pos, attn)
        # in place: the draft's logits are its fresh output, read only here
        x = logits if inv_t is None else logits.mul_(inv_t)
        lp, ids = torch.topk(torch.log_softmax(x, dim=-1), k, dim=-1)  # (K, K)
        lps = [0.0 if v > 0.0 else v for row in lp.tolist() for v in row]
        scores = array("f", map(add, f_scores, lps)).tolist()
        toks = [to_target[i] for row in ids.tolist() for i in row]
        base = len(c_tok)
        c_tok += toks
        c_lp += lps
        c_score += scores
        c_par += [f for f in front for _ in range(k)]
        if step == num_steps - 1:
            break  # the last step's children propose nothing: no frontier to pick
        # the best K (stable: ties by creation order, as reverse=True keeps equal keys' order)
        pick = sorted(range(k * k), key=scores.__getitem__, reverse=True)[:k]
        rows = [j // k for j in pick]
        front = [base + j for j in pick]
        f_scores = [scores[j] for j in pick for _ in range(k)]
        tok, pos, src = _longs(list(map(toks.__getitem__, pick)) + [pos0 + step] * k + rows,
                               3).unbind(0)
        hidden = out.index_select(0, src)
        anc = [anc[r] + e for r, e in zip(rows, eye, strict=True)]
    return _tree(root, pos0, c_tok, c_par, c_score, c_lp, num_draft_tokens)


def _tree(root: int, root_pos: int, c_tok: list[int], c_par: list[int], c_score: list[float],
          c_lp: list[float], num_draft_tokens: int) -> DraftTree:
    """``build_tree`` + ``finish_tree`` for one request on lists: the best N−1 candidates by
    score (stable), in creation order (parents first), under the root."""
    keep = min(num_draft_tokens - 1, len(c_tok))
    n = keep + 1
    chosen = sorted(sorted(range(len(c_tok)), key=c_score.__getitem__, reverse=True)[:keep])
    node = {c: i for i, c in enumerate(chosen, 1)}
    parents, depth = [-1], [0]
    # each node's ancestors-or-self, a row of n bytes (0/1)
    mask: list[bytes | bytearray] = [b"\x01" + bytes(keep)]
    for i, c in enumerate(chosen, 1):
        p = 0 if c_par[c] < 0 else node.get(c_par[c], -1)
        if p < 0:
            raise AssertionError("draft tree: a selected node's parent was not selected")
        parents.append(p)
        depth.append(depth[p] + 1)
        row = bytearray(mask[p])
        row[i] = 1
        mask.append(row)
    tokens = [root] + list(map(c_tok.__getitem__, chosen))
    # each field a (1, n) row of one buffer per kind (one unbind for all of them)
    toks, pars, deps, poss = _longs(tokens + parents + depth + [root_pos + d for d in depth],
                                    4).view(4, 1, n).unbind(0)
    scores, lps = torch.frombuffer(
        array("f", [0.0] + list(map(c_score.__getitem__, chosen)) + [0.0]
              + list(map(c_lp.__getitem__, chosen))), dtype=torch.float32).view(2, 1, n).unbind(0)
    return DraftTree(tokens=toks, parents=pars, depth=deps, positions=poss, mask=_bools(mask, n),
                     scores=scores, draft_probs=lps.exp(), host=([tokens], [parents]))
