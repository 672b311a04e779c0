"""Trees of any recorded sub-shape, and the draft tokens each would accept at every position.

A (S', K', N') tree at a position is the engine's ``build_tree`` over the first
``K' + (S'−1)·K'²`` candidates of the recorded top-K' frontier process (see
:mod:`workbench.lab.record` for why that prefix is exactly what the drafter would create).
Greedy acceptance m = the deepest tree node whose path matches the recorded continuation
(the target's argmax after each matched token is the next output token); the verify then emits
min(m + 1, tokens left). Past the recorded output nothing is known: a path reaching the end is
cut there (only the last step of a request can reach it, where the cut applies anyway).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from workbench.core import DraftTree
from workbench.errors import ConfigError
from workbench.policy.policies import Shape, check_shape, shape_name
from workbench.speculative.tree import build_tree

if TYPE_CHECKING:
    from workbench.lab.record import RecordedRun


def num_candidates(steps: int, topk: int) -> int:
    """Candidates a (steps, topk) frontier process creates: K at depth 1, K² per later step."""
    return topk + (steps - 1) * topk * topk


def check_recorded(run: RecordedRun, shape: Sequence[int], where: str) -> Shape:
    """``shape`` validated and within what ``run`` recorded (errors name ``where``)."""
    s, k, n = check_shape(tuple(shape), where)
    if k not in run.trees:
        raise ConfigError(f"{where}: {shape_name((s, k, n))} needs top-k {k} but the run "
                          f"recorded top-k 1..{max(run.trees)} (shape "
                          f"{shape_name(run.shape)}): record a larger shape")
    depth = run.steps_for[k]
    if s > depth:
        raise ConfigError(f"{where}: {shape_name((s, k, n))} drafts {s} steps but the run "
                          f"recorded {depth} at top-k {k} (shape {shape_name(run.shape)}, "
                          f"chains to {run.chain_steps}): record a larger shape")
    return (s, k, n)


def subtree(run: RecordedRun, shape: Sequence[int],
            rows: np.ndarray | None = None) -> DraftTree:
    """The engine's DraftTree of ``shape`` at tree rows ``rows`` (default: all), as
    ``build_tree`` builds it from the recorded candidates."""
    s, k, n = check_recorded(run, shape, "shape")
    t = run.trees[k]
    idx = slice(None) if rows is None else rows
    c = num_candidates(s, k)
    tok = torch.from_numpy(np.ascontiguousarray(t["tokens"][idx, :c]))
    roots = torch.from_numpy(root_tokens(run)[idx])
    return build_tree(roots, tok, torch.from_numpy(np.ascontiguousarray(t["parents"][idx, :c])),
                      torch.from_numpy(np.ascontiguousarray(t["scores"][idx, :c])),
                      torch.from_numpy(np.log(np.maximum(t["probs"][idx, :c], 1e-30))),
                      n, torch.from_numpy(run.pos[idx]))


def root_tokens(run: RecordedRun) -> np.ndarray:
    """Each tree row's root: output token ``pos`` of its request."""
    return np.asarray([run.outputs[r][p] for r, p in zip(run.req.tolist(), run.pos.tolist(),
                                                          strict=True)], dtype=np.int64)


def continuation(run: RecordedRun, depth: int) -> np.ndarray:
    """(P, depth + 1): output tokens pos .. pos + depth of each row's request (−1 past the
    end)."""
    out = np.full((len(run.req), depth + 1), -1, dtype=np.int64)
    for i, (r, p) in enumerate(zip(run.req.tolist(), run.pos.tolist(), strict=True)):
        seq = run.outputs[r][p : p + depth + 1]
        out[i, : len(seq)] = seq
    return out


def accepted(run: RecordedRun, shape: Sequence[int]) -> np.ndarray:
    """(P,) greedy accepted draft tokens m of ``shape`` at every tree row (bonus excluded),
    cached on the run."""
    key = tuple(shape)
    cache: dict[tuple[int, ...], np.ndarray] = run.__dict__.setdefault("_accept_cache", {})
    if key in cache:
        return cache[key]
    tree = subtree(run, shape)
    tokens, parents = tree.tokens.numpy(), tree.parents.numpy()
    depth = tree.depth.numpy()
    want = continuation(run, int(depth.max()))
    rows = np.arange(len(tokens))
    match = np.zeros(tokens.shape, dtype=bool)
    match[:, 0] = True
    for i in range(1, tokens.shape[1]):  # parents precede children
        match[:, i] = match[rows, parents[:, i]] & (tokens[:, i] == want[rows, depth[:, i]])
    m = np.where(match, depth, 0).max(axis=1).astype(np.int64)
    cache[key] = m
    return m


def bs1_accept_lengths(run: RecordedRun, shape: Sequence[int]) -> list[list[int]]:
    """Per request, the tokens each verify emits when it runs alone speculating every step at
    ``shape`` (a request with one token left decodes plainly, as the engine does): what
    ``RequestMetrics.accept_lengths`` of a real bs=1 run holds."""
    m = accepted(run, shape)
    out: list[list[int]] = []
    for r, off in enumerate(run.row_offsets()):
        last = len(run.outputs[r]) - 1
        j, lens = 0, []
        while j < last:
            left = last - j
            if left == 1:
                j += 1
                continue
            e = min(int(m[off + j]) + 1, left)
            lens.append(e)
            j += e
        out.append(lens)
    return out
