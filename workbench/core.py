"""The nouns every module imports: Request, DraftTree, VerifyResult, outputs."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from workbench.config import SamplingParams
from workbench.errors import RequestError


@dataclass(frozen=True)
class LogprobParams:
    """Which log-probabilities a request returns (SGLang ``return_logprob``).

    Output tokens always: ``log_softmax(logits / T)`` of the target's logits at the position
    that produced the token (T = the request's temperature; raw logits when greedy), as
    SGLang computes them; under speculation these are the verify logits, so they equal the
    baseline's. ``top_k`` > 0 adds that many most likely tokens per position. ``start`` (SGLang
    ``logprob_start_len``) also scores the prompt tokens from that index on, with the raw
    logits of the prefill (the prompt token at index 0 has no context: its entry is None).
    """

    top_k: int = 0
    start: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise RequestError(f"top_logprobs_num: must be an integer >= 0, got {self.top_k!r}")
        s = self.start
        if s is not None and (not isinstance(s, int) or isinstance(s, bool) or s < 0):
            raise RequestError(f"logprob_start_len: must be an integer >= 0 or None, got {s!r}")


# one position's top-k alternatives: (token id, logprob), most likely first
TopLogprobs = list[tuple[int, float]]


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


def accept_length(accepted: int, verify_ct: int) -> float:
    """τ, the one definition (SGLang/vLLM ``spec_accept_length`` semantics): tokens emitted per
    verify step = accepted draft tokens per step + the bonus token; 1.0 with no verify steps.
    ``accepted`` is Σ(emitted − 1) over the steps: a block cut at a stop or max_new_tokens
    counts the tokens it kept (SGLang's ``spec_num_correct_drafts`` counts the whole block).
    (SGLang's per-request ``meta_info`` field divides completion_tokens instead, prefill token
    and plain-decoded tokens included, over SGLang's rounds: remote/sglang.py's
    sglang_spec_meta computes that one for /generate, as upstream.)"""
    return (accepted + verify_ct) / verify_ct if verify_ct else 1.0


@dataclass
class RequestMetrics:
    """SGLang/vLLM semantics: τ (accept length) counts the bonus token."""

    verify_ct: int = 0
    accept_lengths: list[int] = field(default_factory=list)
    # per verify step, the draft tokens it kept: accept length − 1, except a block a stop or
    # max_new_tokens cut inside its drafts (every kept token a draft: the accept length itself).
    # SGLang's correct-drafts histogram and the accepted-token counters count these.
    correct_drafts: list[int] = field(default_factory=list)
    drafted_tokens: int = 0
    accepted_per_depth: list[int] = field(default_factory=list)
    plain_steps: int = 0
    # plain decode steps taken while the engine speculated (spec set: policy off, one token
    # left, a draft not capable): SGLang counts each as a round (steps-0, 0 correct drafts)
    spec_plain_steps: int = 0
    preemptions: int = 0
    arrival: float = 0.0
    first_token: float | None = None
    finished: float | None = None
    token_times: list[float] = field(default_factory=list)

    @property
    def accept_length(self) -> float:
        """Mean tokens per verify step (= spec_accept_length); 1.0 with no verify steps."""
        n = len(self.accept_lengths)
        return accept_length(sum(self.accept_lengths) - n, n)

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def e2e(self) -> float | None:
        return None if self.finished is None else self.finished - self.arrival


@dataclass
class DraftState:
    """What the draft knows of one request (owned by the EagleWorker, kept on the Request).

    Invariant: ``len`` <= the request's kv_len, and ``pending_feats`` holds the target features
    of positions [len, kv_len) the draft has not consumed yet. ``holes`` lists position ranges
    [s, e) below ``len`` the draft skipped (a cold stretch longer than
    ``SpecConfig.catchup_window``): they have no draft KV and the draft does not attend to them.
    """

    len: int = 0  # positions [0, len) are in the draft's KV (holes excepted)
    # chunks of (m_i, 3·Dt), concatenated once at the next draft extend (a cold stretch appends
    # one chunk per step: no quadratic re-copying)
    pending_feats: list[torch.Tensor] | None = None
    pending_rows: int = 0  # rows in pending_feats (kept, not summed: it is read every step)
    holes: list[tuple[int, int]] = field(default_factory=list)
    logits: torch.Tensor | None = None  # (Vd,) at position kv_len-1
    hidden: torch.Tensor | None = None  # (D,) pre-norm, position kv_len-1
    capable: bool = False  # may speculate (features kept since its prefill)

    def reset(self) -> None:
        """Forget everything the draft knew (preemption, finish); ``capable`` stays."""
        self.len = 0
        self.pending_feats = self.logits = self.hidden = None
        self.pending_rows = 0
        self.holes = []

    def keep_feats(self, feats: torch.Tensor, window: int | None = None) -> None:
        """Append the target features of the next position(s). With ``window`` (a cold stretch:
        ``SpecConfig.catchup_window``) keep only the latest ``window`` rows; the dropped
        positions become a hole and ``len`` moves past them."""
        if self.pending_feats is None:
            self.pending_feats = []
        self.pending_feats.append(feats)
        self.pending_rows += feats.shape[0]
        if window is None or self.pending_rows <= window:
            return
        chunks, drop = self.pending_feats, self.pending_rows - window
        start = self.len
        self.len += drop
        self.pending_rows = window
        while drop >= chunks[0].shape[0]:
            drop -= chunks.pop(0).shape[0]
        if drop:
            chunks[0] = chunks[0][drop:]
        if self.holes and self.holes[-1][1] == start:
            self.holes[-1] = (self.holes[-1][0], self.len)
        else:
            self.holes.append((start, self.len))

    def consumed(self, kv_len: int) -> None:
        """A draft extend fed every pending position: the draft is current at ``kv_len``."""
        self.len = kv_len
        self.pending_feats = None
        self.pending_rows = 0

    def slots(self, slots: torch.Tensor) -> torch.Tensor:
        """Of ``slots`` (positions [0, end)), those the draft holds: its holes left out."""
        if not self.holes:
            return slots
        keep = torch.ones(slots.numel(), dtype=torch.bool, device=slots.device)
        for s, e in self.holes:
            keep[s:e] = False
        return slots[keep]


@dataclass
class Request:
    """One sequence. ``tokens`` = prompt + output; target KV holds ``kv_len`` of them.

    Decode invariant: kv_len == len(tokens) - 1 (the last token, the *root*, is not yet in
    the cache). ``draft`` is what the draft model knows of it (:class:`DraftState`).
    """

    rid: int
    prompt_ids: list[int]
    sampling: SamplingParams
    tokens: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    blocks: list[int] = field(default_factory=list)
    kv_len: int = 0
    prefill_target: int = 0  # prefill covers tokens[:prefill_target]
    sample_after_prefill: bool = True
    draft: DraftState = field(default_factory=DraftState)
    generator: torch.Generator | None = None
    finish_reason: str | None = None
    matched_stop: int | str | None = None  # finish_reason "stop": the stop token id or string
    stop_scan: Any = None  # engine.stops.ScanState: where the output's text-stop scan stands
    error: str | None = None
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    emitted_from_draft: list[bool] = field(default_factory=list)
    # LogprobParams set: one entry per output token, and per prompt token from logprobs.start
    logprobs: LogprobParams | None = None
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[TopLogprobs] = field(default_factory=list)
    input_logprobs: list[float | None] = field(default_factory=list)
    input_top_logprobs: list[TopLogprobs | None] = field(default_factory=list)
    # backpressure (workbench.serve.loop): its client is not reading its stream; the scheduler
    # leaves it out of decode batches and batch slots (KV and place kept) until cleared
    held: bool = False

    def __post_init__(self) -> None:
        if not self.tokens:
            self.tokens = list(self.prompt_ids)
        self.prefill_target = len(self.tokens)
        if not self.metrics.arrival:
            self.metrics.arrival = time.perf_counter()

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[len(self.prompt_ids):]

    @property
    def in_prefill(self) -> bool:
        return self.kv_len < self.prefill_target

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED


@dataclass(frozen=True)
class DraftTree:
    """A batch of draft trees. Node 0 is the root (last verified token). Shapes (B, N).

    Invariants: parents[:, 0] = -1 and parents[b, i] < i; depth[b, i] = depth[b, parent] + 1;
    positions = prefix_len + depth; mask[b, i, j] iff j is i or an ancestor of i.
    """

    tokens: torch.Tensor  # (B, N) int64 target-vocab ids
    parents: torch.Tensor  # (B, N) int64
    depth: torch.Tensor  # (B, N) int64
    positions: torch.Tensor  # (B, N) int64
    mask: torch.Tensor  # (B, N, N) bool
    scores: torch.Tensor  # (B, N) float cumulative draft log-prob (root 0)
    draft_probs: torch.Tensor  # (B, N) float draft prob of each node given its parent (root 1)
    # tokens and parents as host lists (rows of ints) when the tree was built on the host (the
    # CPU one-request tree): the accept reads them without a device read; None otherwise
    host: tuple[list[list[int]], list[list[int]]] | None = None

    @property
    def num_nodes(self) -> int:
        return int(self.tokens.shape[1])


@dataclass(frozen=True)
class VerifyResult:
    """Acceptance per request. accept_index (B, N) path node indices (-1 padded)."""

    accept_index: torch.Tensor
    accept_len: torch.Tensor  # (B,) accepted draft nodes, bonus excluded
    bonus: torch.Tensor  # (B,)
    target_tokens: torch.Tensor  # (B, N) target argmax (greedy) at each node
    # the same accept_index rows, accept_len and bonus, and the tree's tokens, as host lists
    # when the acceptance already ran on the host (the CPU greedy walk); None otherwise
    host: tuple[list[list[int]], list[int], list[int], list[list[int]]] | None = None
    # per request: is every node's target distribution usable (each row's maximum finite: no
    # NaN, no +inf, some finite logit), when the acceptance learnt it on the way (the greedy
    # verify's argmax); None: the commit checks the logits itself
    finite: list[bool] | None = None


@dataclass(frozen=True)
class RequestOutput:
    rid: int
    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    metrics: RequestMetrics
    error: str | None = None
    lossless: bool = True
    from_draft: list[bool] = field(default_factory=list)
    # finish_reason "stop": the stop token id (EOS or stop_token_ids) or stop string matched
    matched_stop: int | str | None = None
    # with LogprobParams (else None): per output token; per prompt token from logprob_start
    output_logprobs: list[float] | None = None
    output_top_logprobs: list[TopLogprobs] | None = None
    input_logprobs: list[float | None] | None = None
    input_top_logprobs: list[TopLogprobs | None] | None = None
    logprob_start: int | None = None


@dataclass(frozen=True)
class StepOutput:
    """Delta of one request in one step (streaming)."""

    rid: int
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    error: str | None = None
