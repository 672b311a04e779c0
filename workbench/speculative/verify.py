"""The acceptance rule: which draft tokens of a tree the target keeps, and its bonus token.

One target forward scores every node of every request's tree (node 0, the root, is the last
verified token; each node sees its ancestors). Then, per request, walk down from the root:

* **greedy** (temperature 0): among the children of the current node, in index order, accept
  the first whose token equals the target's argmax at the current node; move to it and repeat.
  When no child matches, stop: the bonus is the target's argmax at the last accepted node.
* **sampling**: at the current node take ``p``, the target distribution there (after the
  request's temperature / top-k / top-p / min-p: :func:`workbench.sampler.process_probs`, the
  same one plain decoding samples from). For each child in index order, with token x: accept
  iff ``coin · Σp < p[x]`` (a fresh uniform coin per node, from the request's own generator);
  accepted → move to it with a fresh ``p``; rejected → ``p[x] = 0`` and test the next child.
  When none is accepted, the bonus is drawn from ``p / Σp`` (the residual). With one-hot
  (top-k) drafts the emitted tokens are distributed exactly as sampling token by token.
  A greedy request in a batch with sampled ones takes the greedy walk on its own rows
  (:func:`mixed_verify`): what this walk does with a one-hot ``p`` at its argmax.
* a request's ``logit_bias`` is added to its target logits before either rule (as plain
  decoding adds it before sampling), so the walks accept against the biased distribution.
* **simulated** (``SpecConfig.simulate_accept_length``, NOT lossless: performance studies):
  a forced number of nodes along each tree's best-scored path.

Accepted = the path's nodes below the root; τ = accepted + 1 (the bonus). :func:`accept` is
the whole rule for a batch; the batched walks run in ``workbench.kernels`` (Triton on CUDA; on
CPU ``kernels.reference``, whose ``greedy_accept_walk`` / ``tree_speculative_sample`` are the
same walks written out line by line).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from workbench import kernels
from workbench.core import DraftTree, Request, VerifyResult
from workbench.kernels import reference
from workbench.sampler import (
    argmax_max_rows,
    bias_problem,
    biased,
    process_probs,
    valid_distribution,
)


def accept(tree: DraftTree, target_logits: torch.Tensor, reqs: Sequence[Request],
           simulate_accept_length: float | None = None
           ) -> tuple[VerifyResult, dict[int, str]]:
    """The acceptance rule (module doc) for ``reqs``' trees, given the target's logits at
    every node (B, N, V). Returns the result and ``{rid: error}`` for the requests whose target
    distribution was not a distribution (non-finite logits): their rows fall back to greedy
    here and the caller fails those requests alone."""
    errors: dict[int, str] = {}
    dev = target_logits.device
    target_logits = _biased(target_logits, reqs, errors)
    if simulate_accept_length is not None:
        a = simulate_accept_length - 1.0
        lo = int(a)
        forced = torch.tensor([lo + (1 if torch.rand((), device="cpu") < a - lo else 0)
                               for _ in reqs], device=dev)
        return simulated_verify(tree, target_logits, forced), errors
    greedy = [r.sampling.greedy for r in reqs]
    if all(greedy):
        return greedy_verify(tree, target_logits), errors
    if any(greedy):
        return mixed_verify(tree, target_logits, reqs, greedy, errors), errors
    idx, n_acc, bonus = _sampled_walk(tree.tokens, tree.parents, target_logits, reqs, errors)
    return VerifyResult(accept_index=idx, accept_len=n_acc, bonus=bonus,
                        target_tokens=target_logits.argmax(-1)), errors


def _sampled_walk(tokens: torch.Tensor, parents: torch.Tensor, target_logits: torch.Tensor,
                  reqs: Sequence[Request], errors: dict[int, str],
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rejection sampling (module doc) for sampled requests' trees (``tokens``, ``parents``:
    (b, N); ``target_logits``: (b, N, V)): accept_index, accept_len, bonus."""
    dev = target_logits.device
    b, n = tokens.shape
    logits = target_logits.float()
    probs = torch.zeros_like(logits)
    # the coins come from each request's own (host) generator, then move once
    coins = torch.zeros(b, n, device="cpu")
    final_u = torch.zeros(b, device="cpu")
    for i, r in enumerate(reqs):
        row = process_probs(logits[i], r.sampling)
        if not valid_distribution(row):
            errors[r.rid] = (f"sampling: no valid distribution at position {r.kv_len} "
                             "(non-finite logits)")
            row = torch.zeros_like(row).scatter_(-1, logits[i].argmax(-1, keepdim=True), 1.0)
        probs[i] = row
        coins[i] = torch.rand(n, generator=r.generator, device="cpu")
        final_u[i] = torch.rand((), generator=r.generator, device="cpu")
    return kernels.tree_speculative_sample(tokens, parents, probs, coins.to(dev),
                                           final_u.to(dev))


def mixed_verify(tree: DraftTree, target_logits: torch.Tensor, reqs: Sequence[Request],
                 greedy: list[bool], errors: dict[int, str]) -> VerifyResult:
    """A batch of greedy and sampled requests: the greedy rows take the greedy walk (what
    rejection sampling against a one-hot target at the argmax reduces to, token for token:
    the first child equal to the argmax, else the argmax as bonus; no coin drawn), the sampled
    rows rejection sampling over their own rows only, so a greedy request pays no
    distribution over the vocabulary because a sampled one shares its step. One argmax pass
    gives the greedy rows' targets, every row's ``target_tokens`` and its finiteness."""
    predict, top = argmax_max_rows(target_logits)  # (B, N) each
    dev = predict.device
    b, n = tree.tokens.shape
    g = [i for i, x in enumerate(greedy) if x]
    s = [i for i, x in enumerate(greedy) if not x]
    gi = torch.tensor(g, dtype=torch.int64, device=dev)
    si = torch.tensor(s, dtype=torch.int64, device=dev)
    host = None if tree.host is None else ([tree.host[0][i] for i in g],
                                           [tree.host[1][i] for i in g])
    g_idx, g_acc, g_bonus, _ = _greedy_walk(tree.tokens.index_select(0, gi),
                                            tree.parents.index_select(0, gi),
                                            predict.index_select(0, gi), host)
    s_idx, s_acc, s_bonus = _sampled_walk(tree.tokens.index_select(0, si),
                                          tree.parents.index_select(0, si),
                                          target_logits.index_select(0, si),
                                          [reqs[i] for i in s], errors)
    idx = torch.full((b, n), -1, dtype=torch.int64, device=dev)
    n_acc = torch.zeros(b, dtype=torch.int64, device=dev)
    bonus = torch.zeros(b, dtype=torch.int64, device=dev)
    for rows, (a, c, d) in ((gi, (g_idx, g_acc, g_bonus)), (si, (s_idx, s_acc, s_bonus))):
        idx[rows] = a.to(torch.int64)
        n_acc[rows] = c.to(torch.int64)
        bonus[rows] = d.to(torch.int64)
    return VerifyResult(accept_index=idx, accept_len=n_acc, bonus=bonus, target_tokens=predict,
                        finite=finite_rows(top))


def _biased(target_logits: torch.Tensor, reqs: Sequence[Request],
            errors: dict[int, str]) -> torch.Tensor:
    """The target's logits with each request's ``logit_bias`` added (a copy when any request
    has one): verification accepts against the same biased distribution plain decoding
    samples from (:func:`workbench.sampler.biased`). A bias naming a token outside the
    vocabulary is that request's error; its row stays unbiased."""
    if not any(r.sampling.logit_bias for r in reqs):
        return target_logits
    out = target_logits.clone()
    for i, r in enumerate(reqs):
        if not r.sampling.logit_bias:
            continue
        why = bias_problem(r.sampling, out.shape[-1])
        if why is not None:
            errors[r.rid] = why
            continue
        out[i] = biased(out[i], r.sampling)
    return out


def greedy_verify(tree: DraftTree, target_logits: torch.Tensor) -> VerifyResult:
    """target_logits (B, N, V) → longest path whose tokens equal the target's argmax at the
    parent, then the bonus = argmax at the last accepted node. The argmax's row maxima also
    say whether each request's logits are usable (``VerifyResult.finite``)."""
    predict, top = argmax_max_rows(target_logits)  # (B, N) each
    idx, n_acc, bonus, host = _greedy_walk(tree.tokens, tree.parents, predict, tree.host)
    return VerifyResult(accept_index=idx, accept_len=n_acc, bonus=bonus, target_tokens=predict,
                        host=host, finite=finite_rows(top))


def _greedy_walk(tokens: torch.Tensor, parents: torch.Tensor, predict: torch.Tensor,
                 host: tuple[list[list[int]], list[list[int]]] | None,
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Any]:
    """The greedy walk over trees (``tokens``, ``parents``) given the target's argmax at
    every node: accept_index, accept_len, bonus and, from the CPU walk, its host lists."""
    if predict.device.type == "cpu" and kernels.backend_for(predict.device) == "reference":
        # the CPU walk (kernels.greedy_accept's choice there); its host lists ride along
        (idx, n_acc, bonus), lists = reference.greedy_accept_host(tokens, parents, predict,
                                                                  host)
        return idx, n_acc, bonus, lists
    idx, n_acc, bonus = kernels.greedy_accept(tokens, parents, predict)
    return idx, n_acc, bonus, None


def finite_rows(top: torch.Tensor) -> list[bool]:
    """top (B, N): each node's maximum logit → per request, is every one finite (a NaN or +inf
    logit, or a row of -inf, makes it not). One read for the batch: a request's finite sum
    says all its maxima are; a non-finite one (or a finite overflow) is checked elementwise."""
    sums = top.sum(-1).tolist()
    return [math.isfinite(s) or bool(torch.isfinite(top[i]).all()) for i, s in enumerate(sums)]


def simulated_verify(tree: DraftTree, target_logits: torch.Tensor, accept_len: torch.Tensor
                     ) -> VerifyResult:
    """NOT LOSSLESS — performance studies only (SGLang's SGLANG_SIMULATE_ACC_LEN).

    Forces ``accept_len`` (B,) accepted nodes along the best-scored path of each tree (capped
    by the tree's depth); the bonus is the target's argmax at the last forced node."""
    b, n = tree.tokens.shape
    predict = target_logits.argmax(-1)
    dev = predict.device
    idx = torch.full((b, n), -1, dtype=torch.int64, device=dev)
    n_acc = torch.zeros(b, dtype=torch.int64, device=dev)
    bonus = torch.zeros(b, dtype=torch.int64, device=dev)
    for i in range(b):
        cur, path = 0, [0]
        while len(path) - 1 < int(accept_len[i]):
            kids = (tree.parents[i] == cur).nonzero().flatten()
            if kids.numel() == 0:
                break
            cur = int(kids[tree.scores[i, kids].argmax()])
            path.append(cur)
        idx[i, : len(path)] = torch.tensor(path, device=dev)
        n_acc[i] = len(path) - 1
        bonus[i] = predict[i, cur]
    return VerifyResult(accept_index=idx, accept_len=n_acc, bonus=bonus, target_tokens=predict)
