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
  A greedy request in a mixed batch gets a one-hot ``p`` at its argmax: the same walk.
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
    if all(r.sampling.greedy for r in reqs):
        return greedy_verify(tree, target_logits), errors
    b, n = tree.tokens.shape
    logits = target_logits.float()
    probs = torch.zeros_like(logits)
    # the coins come from each request's own (host) generator, then move once
    coins = torch.zeros(b, n, device="cpu")
    final_u = torch.zeros(b, device="cpu")
    for i, r in enumerate(reqs):
        if r.sampling.greedy:  # one-hot at the argmax: rejection sampling reduces to greedy
            probs[i].scatter_(-1, logits[i].argmax(-1, keepdim=True), 1.0)
            continue
        row = process_probs(logits[i], r.sampling)
        if not valid_distribution(row):
            errors[r.rid] = (f"sampling: no valid distribution at position {r.kv_len} "
                             "(non-finite logits)")
            row = torch.zeros_like(row).scatter_(-1, logits[i].argmax(-1, keepdim=True), 1.0)
        probs[i] = row
        coins[i] = torch.rand(n, generator=r.generator, device="cpu")
        final_u[i] = torch.rand((), generator=r.generator, device="cpu")
    return sample_verify(tree, probs, coins.to(dev), final_u.to(dev)), errors


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
    finite = finite_rows(top)
    if predict.device.type == "cpu" and kernels.backend_for(predict.device) == "reference":
        # the CPU walk (kernels.greedy_accept's choice there); its host lists ride along
        (idx, n_acc, bonus), host = reference.greedy_accept_host(tree.tokens, tree.parents,
                                                                 predict, tree.host)
        return VerifyResult(accept_index=idx, accept_len=n_acc, bonus=bonus,
                            target_tokens=predict, host=host, finite=finite)
    idx, n_acc, bonus = kernels.greedy_accept(tree.tokens, tree.parents, predict)
    return VerifyResult(accept_index=idx, accept_len=n_acc, bonus=bonus, target_tokens=predict,
                        finite=finite)


def finite_rows(top: torch.Tensor) -> list[bool]:
    """top (B, N): each node's maximum logit → per request, is every one finite (a NaN or +inf
    logit, or a row of -inf, makes it not). One read for the batch: a request's finite sum
    says all its maxima are; a non-finite one (or a finite overflow) is checked elementwise."""
    sums = top.sum(-1).tolist()
    return [math.isfinite(s) or bool(torch.isfinite(top[i]).all()) for i, s in enumerate(sums)]


def sample_verify(tree: DraftTree, target_probs: torch.Tensor, coins: torch.Tensor,
                  final_u: torch.Tensor) -> VerifyResult:
    """target_probs (B, N, V) already temperature/top-k/top-p processed; coins (B, N) and
    final_u (B,) uniform in [0, 1). Lossless for deterministic (top-k) drafts: each sibling is
    tested against the residual target distribution, the bonus is drawn from the residual."""
    idx, n_acc, bonus = kernels.tree_speculative_sample(tree.tokens, tree.parents, target_probs,
                                                        coins, final_u)
    return VerifyResult(accept_index=idx, accept_len=n_acc, bonus=bonus,
                        target_tokens=target_probs.argmax(-1))


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
