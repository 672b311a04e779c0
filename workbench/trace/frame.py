"""Events → tidy pandas DataFrames (one row per observation), ready for groupby and plotly.

``frame(events, kind)``; the columns of each kind are in :data:`FRAME_COLUMNS` and stay the same
for an empty event list (zero rows). List-valued columns hold plain Python lists.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import fields
from typing import TYPE_CHECKING, Any, TypeVar

from workbench.policy.moe_cost import uniform_coverage
from workbench.trace.events import (
    STEP_PHASES,
    DraftStep,
    Event,
    ExpertRouting,
    InitStage,
    KVUsage,
    PolicyDecision,
    Prefill,
    RequestAdmitted,
    RequestFinished,
    StepTiming,
    TreeBuilt,
    Verified,
)

if TYPE_CHECKING:
    import pandas as pd

E = TypeVar("E", bound=Event)

TIMING_PHASES = STEP_PHASES  # one definition, beside StepTiming


def _cols(names: str) -> tuple[str, ...]:
    return tuple(names.split())


FRAME_COLUMNS: dict[str, tuple[str, ...]] = {
    # every event: its type name, time, and step / rid where it has them (else -1)
    "events": _cols("type t step rid"),
    "init": _cols("t stage status seconds detail"),
    "admitted": _cols("t rid prompt_len max_new_tokens temperature"),
    "prefill": _cols("t num_requests num_tokens chunked seconds rids"),
    # one row per candidate of a DraftStep
    "draft": _cols("t step rid depth cand token prob parent"),
    # one row per tree node; verified/accepted/target_* joined from the Verified of (step, rid):
    # without one, verified=False, accepted=False, target_prob=nan, target_token=-1
    "tree": _cols(
        "t step rid node token parent depth score draft_prob"
        " verified accepted target_prob target_token"
    ),
    # one row per Verified; n_nodes includes the root, n_drafted = n_nodes - 1
    "verify": _cols(
        "t step rid accept_length n_nodes n_drafted bonus_token accepted_tokens accepted_path"
    ),
    # per draft depth >= 1 over verified trees: rate = accepted / drafted nodes;
    # trees = verified trees reaching that depth, tree_rate = accepted / trees
    "accept_by_depth": _cols("depth drafted accepted rate trees tree_rate"),
    "timing": ("t", "step", "batch_size", "mode", *(f"{p}_ms" for p in TIMING_PHASES), "total_ms"),
    # long form of "timing": one row per (step, phase), phases in TIMING_PHASES order
    "timing_long": _cols("t step batch_size mode phase ms"),
    "policy": _cols(
        "t step batch_size decode_batch speculate num_steps topk num_draft_tokens reason"
        " predicted_ms measured_ms"
    ),
    # utilization = used_blocks / total_blocks
    "kv": _cols("t step used_blocks total_blocks used_tokens utilization"),
    # tau = mean of accept_lengths (nan when the request never verified)
    "requests": _cols(
        "t rid reason prompt_len output_len verify_ct tau ttft_s e2e_s error accept_lengths"
    ),
    # one row per (ExpertRouting, MoE layer): distinct experts the forward's tokens touched,
    # beside the uniform-routing expectation E·(1 − (1 − k/E)^tokens); counts: tokens per expert
    "expert_coverage": _cols(
        "t step kind tokens layer num_experts top_k distinct expected_uniform max_load counts"
    ),
}

Row = dict[str, Any]


def _fields(e: Event) -> Row:
    return {f.name: getattr(e, f.name) for f in fields(e)}


def _of(evs: list[Event], cls: type[E]) -> list[E]:
    return [e for e in evs if isinstance(e, cls)]


def _events_rows(evs: list[Event]) -> list[Row]:
    return [
        {
            "type": type(e).__name__,
            "t": e.t,
            "step": getattr(e, "step", -1),
            "rid": getattr(e, "rid", -1),
        }
        for e in evs
    ]


def _init_rows(evs: list[Event]) -> list[Row]:
    return [_fields(e) for e in _of(evs, InitStage)]


def _admitted_rows(evs: list[Event]) -> list[Row]:
    return [_fields(e) for e in _of(evs, RequestAdmitted)]


def _prefill_rows(evs: list[Event]) -> list[Row]:
    return [
        {**_fields(e), "num_requests": len(e.rids), "rids": list(e.rids)} for e in _of(evs, Prefill)
    ]


def _draft_rows(evs: list[Event]) -> list[Row]:
    rows = []
    for e in _of(evs, DraftStep):
        for rid, toks, probs, parents in zip(e.rids, e.tokens, e.probs, e.parents, strict=True):
            for j, (tok, p, par) in enumerate(zip(toks, probs, parents, strict=True)):
                rows.append(
                    {
                        "t": e.t,
                        "step": e.step,
                        "rid": rid,
                        "depth": e.depth,
                        "cand": j,
                        "token": tok,
                        "prob": p,
                        "parent": par,
                    }
                )
    return rows


def _verified_by_key(evs: list[Event]) -> dict[tuple[int, int], Verified]:
    return {(e.step, e.rid): e for e in _of(evs, Verified)}


def _tree_rows(evs: list[Event]) -> list[Row]:
    ver = _verified_by_key(evs)
    rows = []
    for e in _of(evs, TreeBuilt):
        v = ver.get((e.step, e.rid))
        path = set(v.accepted_path) if v is not None else set()
        for n, tok in enumerate(e.tokens):
            joined = v is not None and n < len(v.target_tokens)
            rows.append(
                {
                    "t": e.t,
                    "step": e.step,
                    "rid": e.rid,
                    "node": n,
                    "token": tok,
                    "parent": e.parents[n],
                    "depth": e.depth[n],
                    "score": e.scores[n],
                    "draft_prob": e.draft_probs[n],
                    "verified": v is not None,
                    "accepted": n in path,
                    "target_prob": v.target_probs[n] if v is not None and joined else math.nan,
                    "target_token": v.target_tokens[n] if v is not None and joined else -1,
                }
            )
    return rows


def _verify_rows(evs: list[Event]) -> list[Row]:
    return [
        {
            **_fields(e),
            "n_nodes": len(e.target_tokens),
            "n_drafted": len(e.target_tokens) - 1,
            "accepted_tokens": list(e.accepted_tokens),
            "accepted_path": list(e.accepted_path),
        }
        for e in _of(evs, Verified)
    ]


def _accept_by_depth_rows(evs: list[Event]) -> list[Row]:
    ver = _verified_by_key(evs)
    drafted: Counter[int] = Counter()
    accepted: Counter[int] = Counter()
    trees: Counter[int] = Counter()
    for e in _of(evs, TreeBuilt):
        if (e.step, e.rid) not in ver:
            continue  # acceptance unknown: not counted
        path = set(ver[(e.step, e.rid)].accepted_path)
        trees.update(set(e.depth[1:]))
        drafted.update(e.depth[1:])
        accepted.update(e.depth[n] for n in path if n > 0)
    return [
        {
            "depth": d,
            "drafted": drafted[d],
            "accepted": accepted[d],
            "rate": accepted[d] / drafted[d],
            "trees": trees[d],
            "tree_rate": accepted[d] / trees[d],
        }
        for d in sorted(drafted)
    ]


def _timing_rows(evs: list[Event]) -> list[Row]:
    return [_fields(e) for e in _of(evs, StepTiming)]


def _timing_long_rows(evs: list[Event]) -> list[Row]:
    return [
        {
            "t": e.t,
            "step": e.step,
            "batch_size": e.batch_size,
            "mode": e.mode,
            "phase": p,
            "ms": getattr(e, f"{p}_ms"),
        }
        for e in _of(evs, StepTiming)
        for p in TIMING_PHASES
    ]


def _policy_rows(evs: list[Event]) -> list[Row]:
    return [_fields(e) for e in _of(evs, PolicyDecision)]


def _kv_rows(evs: list[Event]) -> list[Row]:
    return [
        {
            **_fields(e),
            "utilization": e.used_blocks / e.total_blocks if e.total_blocks else math.nan,
        }
        for e in _of(evs, KVUsage)
    ]


def _requests_rows(evs: list[Event]) -> list[Row]:
    return [
        {
            **_fields(e),
            "accept_lengths": list(e.accept_lengths),
            "tau": sum(e.accept_lengths) / len(e.accept_lengths) if e.accept_lengths else math.nan,
        }
        for e in _of(evs, RequestFinished)
    ]


def _coverage_rows(evs: list[Event]) -> list[Row]:
    return [
        {
            "t": e.t, "step": e.step, "kind": e.kind, "tokens": e.tokens, "layer": layer,
            "num_experts": len(c), "top_k": e.top_k, "distinct": sum(1 for n in c if n),
            "expected_uniform": uniform_coverage(len(c), e.top_k, e.tokens),
            "max_load": max(c, default=0), "counts": list(c),
        }
        for e in _of(evs, ExpertRouting)
        for layer, c in zip(e.layers, e.counts, strict=True)
    ]


_BUILDERS: dict[str, Callable[[list[Event]], list[Row]]] = {
    "events": _events_rows,
    "init": _init_rows,
    "admitted": _admitted_rows,
    "prefill": _prefill_rows,
    "draft": _draft_rows,
    "tree": _tree_rows,
    "verify": _verify_rows,
    "accept_by_depth": _accept_by_depth_rows,
    "timing": _timing_rows,
    "timing_long": _timing_long_rows,
    "policy": _policy_rows,
    "kv": _kv_rows,
    "requests": _requests_rows,
    "expert_coverage": _coverage_rows,
}
FRAME_KINDS: tuple[str, ...] = tuple(FRAME_COLUMNS)


def frame(events: Iterable[Event], kind: str) -> pd.DataFrame:
    """A tidy DataFrame of ``kind`` (columns: :data:`FRAME_COLUMNS`) built from ``events``.

    Unknown ``kind`` raises ValueError listing the valid kinds.
    """
    import pandas as pd

    build = _BUILDERS.get(kind)
    if build is None:
        raise ValueError(f"frame kind {kind!r} unknown; valid kinds: {', '.join(FRAME_KINDS)}")
    return pd.DataFrame(build(list(events)), columns=list(FRAME_COLUMNS[kind]))
