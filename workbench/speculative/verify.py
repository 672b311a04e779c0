"""Tree verification: greedy acceptance and lossless recursive rejection sampling.

Both take the target's output at every tree node (one forward over the whole tree) and return
the accepted root→node path plus one bonus token from the target (so τ = accepted + 1).
The batched math lives in ``workbench.kernels`` (Triton on CUDA, torch reference on CPU).
"""

from __future__ import annotations

import torch

from workbench import kernels
from workbench.core import DraftTree, VerifyResult


def greedy_verify(tree: DraftTree, target_logits: torch.Tensor) -> VerifyResult:
    """target_logits (B, N, V) → longest path whose tokens equal the target's argmax at the
    parent, then the bonus = argmax at the last accepted node."""
    predict = target_logits.argmax(-1)  # (B, N)
    idx, n_acc, bonus = kernels.greedy_accept(tree.tokens, tree.parents, predict)
    return VerifyResult(accept_index=idx, accept_len=n_acc, bonus=bonus, target_tokens=predict)


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
