"""Typed trace events: frozen, slotted dataclasses with JSON-friendly fields.

Every event carries ``t`` (``time.perf_counter()`` seconds; stamped at construction unless given)
and only ints, floats, strings, bools and (nested) lists of them — never tensors: the engine
converts with ``.tolist()`` and builds an event only behind ``if tracer.enabled:``.

Equality and hashing are value-based and JSON-faithful: lists and tuples compare equal element-wise
and NaN equals NaN, so ``event_from_dict(json.loads(json.dumps(event_to_dict(ev)))) == ev`` holds
for every event. In the dict form non-finite floats are the strings ``"nan"``, ``"inf"`` and
``"-inf"`` (plain JSON, ``allow_nan=False`` safe); ``event_from_dict`` turns them back into floats
only in fields annotated as float, so a ``str`` field holding ``"nan"`` stays a string.

Vocabulary (DESIGN.md §1): a *step* is one engine step; node 0 of a tree is the root (the last
verified token); τ (``accept_length``) counts the bonus token.
"""

from __future__ import annotations

import math
import time
import typing
from dataclasses import MISSING, dataclass, field, fields
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import torch

    from workbench.core import DraftTree, VerifyResult
    from workbench.policy.policies import Decision

InitStatus = Literal["ok", "failed", "fallback"]
StepMode = Literal["plain", "spec"]
FinishReason = Literal["stop", "length", "abort", "error"]

# StepTiming's phases in step order (DESIGN.md §4); the engine names them so
STEP_PHASES = ("schedule", "prefill", "draft", "verify", "decode", "accept", "commit", "extend")
# timed inside a phase, kept apart for the policy: a cold draft's catch-up is part of "draft"
SUB_PHASES = {"catchup": "draft"}

_NAN_KEY = ("<nan>",)  # stands in for NaN in equality/hash keys (NaN != NaN otherwise)


def _canon(x: Any) -> Any:
    """Hashable canonical form: sequences → tuples, NaN → a sentinel."""
    if isinstance(x, (list, tuple)):
        return tuple(_canon(v) for v in x)
    if isinstance(x, float) and x != x:
        return _NAN_KEY
    return x


@dataclass(frozen=True, slots=True, eq=False)
class Event:
    """Base of every trace event. ``t`` is keyword-only so subclasses list their fields first."""

    t: float = field(default_factory=time.perf_counter, kw_only=True)

    def _key(self) -> tuple[Any, ...]:
        return tuple(_canon(getattr(self, f.name)) for f in fields(self))

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return self._key() == other._key()  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash((type(self).__name__, self._key()))


@dataclass(frozen=True, slots=True, eq=False)
class InitStage(Event):
    """One engine init stage finished (DESIGN.md §5)."""

    stage: str
    status: InitStatus
    seconds: float
    detail: str = ""


@dataclass(frozen=True, slots=True, eq=False)
class RequestAdmitted(Event):
    """A request entered the scheduler's waiting queue."""

    rid: int
    prompt_len: int
    max_new_tokens: int
    temperature: float


@dataclass(frozen=True, slots=True, eq=False)
class Prefill(Event):
    """One prefill (or one chunk of a chunked prefill) over ``num_tokens`` tokens."""

    rids: list[int]
    num_tokens: int
    chunked: bool
    seconds: float


@dataclass(frozen=True, slots=True, eq=False)
class DraftExtended(Event):
    """One draft extend: the draft consumed the target features of the positions it had not
    seen yet (after a prefill, a warm plain step, a verify, or a cold catch-up).

    ``rows[i]`` positions were fed for request ``rids[i]``; ``holes[i]`` lists its draft holes
    ``[start, end)`` at that moment (positions a cold stretch skipped; DESIGN.md §1).
    """

    step: int
    rids: list[int]
    rows: list[int]
    holes: list[list[list[int]]]


@dataclass(frozen=True, slots=True, eq=False)
class DraftStep(Event):
    """One draft forward at tree depth ``depth``; per request ``rids[i]``, its frontier candidates.

    ``tokens[i][j]`` (target ids), ``probs[i][j]`` (draft probability) and ``parents[i][j]`` (index
    of the candidate's parent node) describe candidate ``j`` of request ``rids[i]``.
    """

    step: int
    rids: list[int]
    depth: int
    tokens: list[list[int]]
    probs: list[list[float]]
    parents: list[list[int]]

    @classmethod
    def of(cls, step: int, rids: list[int], depth: int, tokens: torch.Tensor,
           probs: torch.Tensor, parents: torch.Tensor, t: float) -> DraftStep:
        """One depth's frontier, (B, K) tensors row ``i`` for request ``rids[i]``."""
        return cls(t=t, step=step, rids=rids, depth=depth, tokens=tokens.tolist(),
                   probs=probs.tolist(), parents=parents.tolist())


@dataclass(frozen=True, slots=True, eq=False)
class TreeBuilt(Event):
    """The draft tree of one request, N nodes, node 0 = root, parents before children.

    ``scores`` is the cumulative draft log-prob (root 0.0); ``parents[0]`` is -1.
    """

    step: int
    rid: int
    tokens: list[int]
    parents: list[int]
    depth: list[int]
    scores: list[float]
    draft_probs: list[float]

    @classmethod
    def of(cls, step: int, rid: int, tree: DraftTree, i: int, t: float) -> TreeBuilt:
        """Row ``i`` of a batch's draft tree, as request ``rid``'s event."""
        return cls(t=t, step=step, rid=rid, tokens=tree.tokens[i].tolist(),
                   parents=tree.parents[i].tolist(), depth=tree.depth[i].tolist(),
                   scores=tree.scores[i].tolist(), draft_probs=tree.draft_probs[i].tolist())


@dataclass(frozen=True, slots=True, eq=False)
class Verified(Event):
    """Verification result of one request's tree.

    ``target_tokens[n]``: the target's argmax/sample given node ``n`` as the last context token.
    ``target_probs[n]``: target probability of node ``n``'s token given its parent (root: 1.0).
    ``accepted_path``: node indices from the root (starts with 0). ``accepted_tokens``: the
    block the verifier accepted, i.e. the accepted draft tokens then the bonus token, so
    ``accept_length == len(accepted_tokens)`` (τ of the step, bonus included). This is the
    verifier's decision: when a stop or max_new_tokens ends the request inside the block, the
    request emits fewer, and ``RequestMetrics`` / ``EngineStats`` count what it emitted
    (docs/DESIGN.md "Which count is which").
    """

    step: int
    rid: int
    target_tokens: list[int]
    target_probs: list[float]
    accepted_path: list[int]
    accepted_tokens: list[int]
    accept_length: int
    bonus_token: int

    @classmethod
    def of(cls, step: int, rid: int, tree: DraftTree, i: int, res: VerifyResult,
           logits: torch.Tensor, accepted_tokens: list[int], t: float) -> Verified:
        """Row ``i`` of a verify: ``logits`` (N, V) are the target's at each node, so node
        ``n``'s token has the probability its parent's row gives it (the root 1.0)."""
        import torch

        probs = torch.softmax(logits, -1)
        par = tree.parents[i].clamp(min=0)
        tp = probs[par, tree.tokens[i]]
        tp[0] = 1.0
        m = int(res.accept_len[i])
        return cls(t=t, step=step, rid=rid, target_tokens=res.target_tokens[i].tolist(),
                   target_probs=tp.tolist(), accepted_path=res.accept_index[i, : m + 1].tolist(),
                   accepted_tokens=accepted_tokens, accept_length=len(accepted_tokens),
                   bonus_token=int(res.bonus[i]))


@dataclass(frozen=True, slots=True, eq=False)
class PolicyDecision(Event):
    """What the speculation policy chose for this step, and why.

    ``predicted_ms``: the policy's cost-model estimate; ``measured_ms``: nan until known.
    """

    step: int
    batch_size: int
    decode_batch: int
    speculate: bool
    num_steps: int
    topk: int
    num_draft_tokens: int
    reason: str
    predicted_ms: float = math.nan
    measured_ms: float = math.nan

    @classmethod
    def of(cls, step: int, batch: int, d: Decision, measured_ms: float, t: float) -> PolicyDecision:
        """The decision ``d`` a step of ``batch`` decoding requests ran with."""
        return cls(t=t, step=step, batch_size=batch, decode_batch=batch, speculate=d.speculate,
                   num_steps=d.num_steps, topk=d.topk, num_draft_tokens=d.num_draft_tokens,
                   reason=d.reason, predicted_ms=d.predicted_ms, measured_ms=measured_ms)


@dataclass(frozen=True, slots=True, eq=False)
class StepTiming(Event):
    """Wall time of each phase of one step, in milliseconds (DESIGN.md §4 order). Contiguous:
    they sum to ``total_ms`` up to the few statements between timers.

    ``schedule``: admission, the policy decision and every KV reservation; ``prefill``: the
    step's prompt chunks (their first tokens and draft extends included); ``draft``: a cold
    draft's catch-up and the tree; ``verify``: the tree forward; ``decode``: the plain decode
    forward and its sampling; ``accept``; ``commit``: KV compaction and token appends (both
    kinds); ``extend``: draft extends after the commit / plain decode."""

    step: int
    batch_size: int
    mode: StepMode
    schedule_ms: float = 0.0
    prefill_ms: float = 0.0
    draft_ms: float = 0.0
    verify_ms: float = 0.0
    decode_ms: float = 0.0
    accept_ms: float = 0.0
    commit_ms: float = 0.0
    extend_ms: float = 0.0
    total_ms: float = 0.0

    @classmethod
    def of(cls, step: int, batch: int, mode: StepMode, phases: dict[str, float], total_ms: float,
           t: float) -> StepTiming:
        """A step's phase milliseconds by name (``phases``; a phase it did not run is 0; a
        sub-phase such as ``catchup`` is already inside its phase)."""
        unknown = set(phases) - set(STEP_PHASES) - set(SUB_PHASES)
        if unknown:
            raise ValueError(f"StepTiming: unknown phase(s) {sorted(unknown)}; "
                             f"known: {', '.join(STEP_PHASES)}")
        return cls(t=t, step=step, batch_size=batch, mode=mode, total_ms=total_ms,
                   **{f"{p}_ms": phases.get(p, 0.0) for p in STEP_PHASES})


@dataclass(frozen=True, slots=True, eq=False)
class KVUsage(Event):
    """KV pool occupancy after a step."""

    step: int
    used_blocks: int
    total_blocks: int
    used_tokens: int


@dataclass(frozen=True, slots=True, eq=False)
class RequestFinished(Event):
    """A request left the engine; ``accept_lengths`` holds τ of each of its ``verify_ct`` steps."""

    rid: int
    reason: FinishReason
    prompt_len: int
    output_len: int
    verify_ct: int
    accept_lengths: list[int]
    ttft_s: float
    e2e_s: float
    error: str = ""


@dataclass(frozen=True, slots=True, eq=False)
class ExpertRouting(Event):
    """What one target forward routed, per MoE layer (MoE targets only).

    ``kind``: ``prefill``, ``decode`` or ``verify`` (the forward's rows: prompt chunks, one per
    request, or the draft trees' nodes plus riders); ``tokens``: rows in the forward;
    ``layers``: the MoE layer ids; ``counts[i][e]``: tokens routed to expert e at ``layers[i]``
    (a token counts once at each of its ``top_k`` experts, so each list sums to
    ``tokens·top_k``). Distinct experts touched = non-zero entries."""

    step: int
    kind: str
    tokens: int
    top_k: int
    layers: list[int]
    counts: list[list[int]]


EVENT_TYPES: dict[str, type[Event]] = {
    cls.__name__: cls
    for cls in (
        InitStage,
        RequestAdmitted,
        Prefill,
        DraftExtended,
        DraftStep,
        TreeBuilt,
        Verified,
        PolicyDecision,
        StepTiming,
        KVUsage,
        RequestFinished,
        ExpertRouting,
    )
}

# ---- dict / JSON form -------------------------------------------------------------------------

_NONFINITE_OUT = {math.inf: "inf", -math.inf: "-inf"}
_NONFINITE_IN = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def _encode(x: Any) -> Any:
    """Sequences → lists, non-finite floats → strings; everything else unchanged."""
    if isinstance(x, float):
        if x != x:
            return "nan"
        return _NONFINITE_OUT.get(x, x)
    if isinstance(x, (list, tuple)):
        return [_encode(v) for v in x]
    return x


def _decode_floats(x: Any) -> Any:
    """Inverse of ``_encode`` for a float-typed field (possibly nested in lists)."""
    if isinstance(x, str):
        try:
            return _NONFINITE_IN[x]
        except KeyError:
            raise ValueError(f"expected a float or 'nan'/'inf'/'-inf', got {x!r}") from None
    if isinstance(x, list):
        return [_decode_floats(v) for v in x]
    return x


def _mentions_float(tp: Any) -> bool:
    return tp is float or any(_mentions_float(a) for a in typing.get_args(tp))


def _float_fields(cls: type[Event]) -> frozenset[str]:
    hints = typing.get_type_hints(cls)
    return frozenset(f.name for f in fields(cls) if _mentions_float(hints[f.name]))


_FLOAT_FIELDS: dict[type[Event], frozenset[str]] = {
    c: _float_fields(c) for c in EVENT_TYPES.values()
}


def event_to_dict(ev: Event) -> dict[str, Any]:
    """``{"type": <class name>, <field>: <value>, ...}``; JSON-safe with ``allow_nan=False``."""
    d: dict[str, Any] = {"type": type(ev).__name__}
    for f in fields(ev):
        d[f.name] = _encode(getattr(ev, f.name))
    return d


def event_from_dict(d: dict[str, Any]) -> Event:
    """Rebuild an event from ``event_to_dict`` output; raises ValueError naming what is wrong."""
    d = dict(d)
    name = d.pop("type", None)
    cls = EVENT_TYPES.get(name)  # type: ignore[arg-type]
    if cls is None:
        raise ValueError(f"event type {name!r} unknown; known: {sorted(EVENT_TYPES)}")
    names = {f.name for f in fields(cls)}
    # a field with a default may be absent (traces written before it existed); ``t`` may not
    required = {f.name for f in fields(cls) if f.default is MISSING and f.name != "t"} | {"t"}
    unknown, missing = set(d) - names, required - set(d)
    if unknown or missing:
        raise ValueError(
            f"{name}: unknown fields {sorted(unknown)}, missing fields {sorted(missing)}"
        )
    for k in _FLOAT_FIELDS[cls]:
        try:
            d[k] = _decode_floats(d[k])
        except ValueError as e:
            raise ValueError(f"{name}.{k}: {e}") from None
    return cls(**d)
