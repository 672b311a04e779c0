"""Step-time cost model for speculation policies: linear in tokens, fitted from measurements.

A forward over T new tokens of R requests holding C tokens of context each costs

    ms = a + b·T + c·T·C/1000 + r·R

(weights read once per forward → a; per-token matmuls → b; attention reads → c; per-request
work — each request's own attention call and KV page walk → r, fitted only from samples that
give ``requests`` and tell R from T: ``calibrate(per_request=True)``; R defaults to T, one
token per request as in a decode step). Two such
components — the target forward (with the LM head) and one draft forward — compose a step:

    plain step (batch B)     = target(B) + [warm draft] draft(B) + plain_overhead(B)
    spec step (B, S, K, N, τ) = target(B·N) + (S−1)·draft(B·K) + draft(B·τ) + spec_overhead(B)

(tree step 0 reuses the logits of the last extend; steps 1..S−1 run the draft over the K
frontier nodes of every request; the extend after verify feeds τ accepted tokens per request).
The overheads (schedule, sampling, tree build, accept/commit bookkeeping) are fitted from
residuals of whole measured steps. ``fit`` takes samples (``workbench.engine.calibrate``
measures them on a live engine); ``observe``/``observe_step`` refresh the model online with an
EMA of measured/predicted. ``crossover`` predicts the decode batch where plain decoding catches
up with speculation (``BatchThreshold.from_cost_model``), at an accept length
(:class:`Acceptance`) that ``workbench.engine.calibrate.measure_tau`` measures.

MoE targets add a weight-bytes term to the target forward (``weights``, an
:class:`~workbench.policy.moe_cost.ExpertBytes`): ``ms_per_gb`` times the GB of expert weights
the forward's tokens touch, predicted from the coverage curve, plus ``ms_sorted`` per MoE layer
for a forward of more than one token (the sorted dispatch — argsort, gather, scatter — that the
one-token path skips: ``workbench.models.moe``), fitted with a, b, c, r.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np
import numpy.typing as npt

from workbench.errors import ConfigError
from workbench.policy.moe_cost import ExpertBytes

KINDS = ("target", "draft", "plain_overhead", "spec_overhead")
STEP_KINDS = ("plain", "spec")


@dataclass(frozen=True)
class LinearCost:
    """ms = a + b·tokens + c·tokens·context/1000 + r·requests (never below 0; ``requests``
    None: one per token)."""

    a: float = 0.0
    b: float = 0.0
    c: float = 0.0
    r: float = 0.0

    def __call__(self, tokens: float, context: float = 0.0,
                 requests: float | None = None) -> float:
        req = tokens if requests is None else requests
        return max(0.0, self.a + self.b * tokens + self.c * tokens * context / 1e3
                   + self.r * req)

    @classmethod
    def fit(cls, tokens: npt.ArrayLike, ms: npt.ArrayLike,
            context: npt.ArrayLike | None = None,
            requests: npt.ArrayLike | None = None) -> LinearCost:
        """Least squares. Columns that do not vary (one token count, one context, requests
        always equal to tokens) are dropped: their coefficient is 0 and the intercept (or b)
        absorbs them."""
        t = np.asarray(tokens, dtype=np.float64)
        y = np.asarray(ms, dtype=np.float64)
        ctx = np.zeros_like(t) if context is None else np.asarray(context, dtype=np.float64)
        req = t if requests is None else np.asarray(requests, dtype=np.float64)
        if t.size == 0 or t.shape != y.shape or ctx.shape != t.shape or req.shape != t.shape:
            raise ConfigError(f"LinearCost.fit: need equal, non-empty tokens/ms/context/"
                              f"requests, got {t.size}/{y.size}/{ctx.size}/{req.size}")
        cols = _columns(t, ctx, req)
        coef, *_ = np.linalg.lstsq(np.stack(list(cols.values()), axis=1), y, rcond=None)
        return cls(**{k: float(v) for k, v in zip(cols, coef, strict=True)})


def _columns(t: npt.NDArray[np.float64], ctx: npt.NDArray[np.float64],
             req: npt.NDArray[np.float64], min_tokens: int = 1) -> dict[str, Any]:
    """The design matrix's columns that the samples can tell apart: b needs more than
    ``min_tokens`` token counts, c more than one context, r requests that are not the token
    count and not a multiple of it throughout (else r and b are one column)."""
    cols: dict[str, Any] = {"a": np.ones_like(t)}
    if np.unique(t).size > min_tokens:
        cols["b"] = t
    if np.unique(ctx).size > 1:
        cols["c"] = t * ctx / 1e3
    if not np.array_equal(req, t):
        x = np.stack([*cols.values(), req], axis=1)
        if np.linalg.matrix_rank(x) == x.shape[1]:
            cols["r"] = req
    return cols


@dataclass(frozen=True)
class CostSample:
    """One measurement. kind: target | draft (one forward of ``tokens`` new tokens) or
    plain_overhead | spec_overhead (``tokens`` = decode batch, ms = step minus components);
    ``requests``: how many requests the tokens belong to (None: one per token)."""

    kind: str
    tokens: float
    ms: float
    context: float = 0.0
    requests: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConfigError(f"CostSample.kind: {self.kind!r} not in {KINDS}")


@dataclass
class CostModel:
    """Predicts plain and speculative step times; ``scale`` holds online EMA corrections.

    ``scale["target"|"draft"]`` multiply the components (refreshed by ``observe``);
    ``scale["plain"|"spec"]`` multiply whole steps (refreshed by ``observe_step``);
    ``weights`` / ``ms_per_gb`` / ``ms_sorted``: a MoE target's expert-bytes and dispatch
    terms (module doc).
    """

    target: LinearCost
    draft: LinearCost = LinearCost()
    plain_overhead: LinearCost = LinearCost()
    spec_overhead: LinearCost = LinearCost()
    ema: float = 0.1
    scale: dict[str, float] = field(
        default_factory=lambda: {k: 1.0 for k in ("target", "draft", *STEP_KINDS)})
    weights: ExpertBytes | None = None
    ms_per_gb: float = 0.0
    ms_sorted: float = 0.0

    # -- fitting -------------------------------------------------------------------------------
    @classmethod
    def fit(cls, samples: Iterable[CostSample], ema: float = 0.1,
            weights: ExpertBytes | None = None) -> CostModel:
        """Least-squares fit per kind; kinds without samples cost 0. Needs target samples.
        ``weights`` (a MoE target): the target is fitted with the expert-bytes column too."""
        by: dict[str, list[CostSample]] = {k: [] for k in KINDS}
        for s in samples:
            by[s.kind].append(s)
        if not by["target"]:
            raise ConfigError("CostModel.fit: no 'target' samples")
        fitted = {k: LinearCost.fit([s.tokens for s in v], [s.ms for s in v],
                                    [s.context for s in v], _requests(v)) if v else LinearCost()
                  for k, v in by.items()}
        per_gb = sorted_ms = 0.0
        if weights is not None:
            fitted["target"], per_gb, sorted_ms = _fit_with_bytes(by["target"], weights)
        return cls(target=fitted["target"], draft=fitted["draft"],
                   plain_overhead=fitted["plain_overhead"],
                   spec_overhead=fitted["spec_overhead"], ema=ema, weights=weights,
                   ms_per_gb=per_gb, ms_sorted=sorted_ms)

    # -- predictions ---------------------------------------------------------------------------
    def target_raw_ms(self, tokens: float, context: float = 0.0,
                      requests: float | None = None) -> float:
        """The target forward's unscaled prediction (linear terms + expert bytes + dispatch);
        ``requests`` None: one per token."""
        ms = self.target(tokens, context, requests)
        if self.weights is not None:
            ms += self.ms_per_gb * self.weights.expert_gb(tokens)
            if tokens > 1:
                ms += self.ms_sorted * self.weights.moe_layers
            ms = max(0.0, ms)
        return ms

    def target_ms(self, tokens: float, context: float = 0.0,
                  requests: float | None = None) -> float:
        return self.target_raw_ms(tokens, context, requests) * self.scale["target"]

    def draft_ms(self, tokens: float, context: float = 0.0,
                 requests: float | None = None) -> float:
        return self.draft(tokens, context, requests) * self.scale["draft"]

    def plain_step_ms(self, batch: int, context: float = 0.0, warm: bool = True,
                      scaled: bool = True) -> float:
        ms = self.target_ms(batch, context) + self.plain_overhead(batch)
        if warm:
            ms += self.draft_ms(batch, context)
        return max(ms, 1e-6) * (self.scale["plain"] if scaled else 1.0)

    def spec_step_ms(self, batch: int, num_steps: int, topk: int, num_draft_tokens: int,
                     tau: float = 1.0, context: float = 0.0, scaled: bool = True) -> float:
        ms = (self.target_ms(batch * num_draft_tokens, context, batch)
              + (num_steps - 1) * self.draft_ms(batch * topk, context, batch)
              + self.draft_ms(batch * tau, context, batch) + self.spec_overhead(batch))
        return max(ms, 1e-6) * (self.scale["spec"] if scaled else 1.0)

    def tok_s(self, batch: int, shape: Sequence[int] | None = None, tau: float = 1.0,
              context: float = 0.0, warm: bool = True) -> tuple[float, float]:
        """(predicted tokens/s, step ms) at decode batch ``batch``: a plain step (``shape``
        None; ``warm``: with the draft extend) or a speculative one at (S, K, N) emitting
        ``tau`` tokens per request."""
        if shape is None:
            ms = self.plain_step_ms(batch, context, warm=warm)
            return 1e3 * batch / ms, ms
        s, k, n = shape
        ms = self.spec_step_ms(batch, s, k, n, tau=tau, context=context)
        return 1e3 * tau * batch / ms, ms

    def crossover(self, shape: Sequence[int], tau: float, context: float = 0.0,
                  warm: bool = False, max_batch: int = 1024) -> Crossover:
        """The smallest decode batch B <= ``max_batch`` where plain decoding is predicted at
        least as fast as speculating at ``shape`` with accept length ``tau`` (tok/s from
        :meth:`tok_s`), and n = B − 1 for ``BatchThreshold(n)`` (0: never speculate;
        ``max_batch`` when speculation wins at every batch). The same rule as
        ``workbench.bench.concurrency.find_threshold`` on a measured sweep."""
        if not (isinstance(tau, (int, float)) and math.isfinite(tau) and tau >= 1.0):
            raise ConfigError(f"CostModel.crossover: tau must be a number >= 1 (bonus token "
                              f"included), got {tau!r}")
        if not isinstance(max_batch, int) or max_batch < 1:
            raise ConfigError(f"CostModel.crossover: max_batch must be an integer >= 1, got "
                              f"{max_batch!r}")
        s, k, n = (int(v) for v in shape)
        batch, plain, spec = max_batch, 0.0, 0.0
        for b in range(1, max_batch + 1):
            plain = self.tok_s(b, None, context=context, warm=warm)[0]
            spec = self.tok_s(b, (s, k, n), float(tau), context=context)[0]
            if plain >= spec:
                batch = b
                break
        else:
            return Crossover(max_batch, None, (s, k, n), float(tau), context, warm, max_batch,
                             plain, spec, self.to_dict())
        return Crossover(batch - 1, batch, (s, k, n), float(tau), context, warm, max_batch,
                         plain, spec, self.to_dict())

    # -- online refresh ------------------------------------------------------------------------
    def observe(self, kind: str, tokens: float, ms: float, context: float = 0.0) -> None:
        """A measured forward (kind target | draft, ``tokens`` new tokens) or plain step (kind
        plain, ``tokens`` = batch, warm draft): EMA of measured/predicted into ``scale``."""
        if kind == "plain":
            self.observe_step("plain", self.plain_step_ms(int(tokens), context, scaled=False),
                              ms)
            return
        if kind not in ("target", "draft"):
            raise ConfigError(f"CostModel.observe: kind {kind!r} not target/draft/plain "
                              "(use observe_step for spec steps)")
        raw = self.target_raw_ms(tokens, context) if kind == "target" else self.draft(tokens,
                                                                                      context)
        self._update(kind, raw, ms)

    def observe_step(self, kind: str, predicted_raw_ms: float, ms: float) -> None:
        """A whole plain/spec step took ``ms`` where the unscaled prediction (``scaled=False``)
        was ``predicted_raw_ms``: EMA of the ratio into ``scale[kind]``."""
        if kind not in STEP_KINDS:
            raise ConfigError(f"CostModel.observe_step: kind {kind!r} not plain/spec")
        self._update(kind, predicted_raw_ms, ms)

    def _update(self, key: str, raw: float, ms: float) -> None:
        if not (raw > 0 and ms > 0 and np.isfinite(raw) and np.isfinite(ms)):
            return
        # Clipped: one step that also ran a prefill chunk must not swing the model.
        ratio = min(max(ms / raw, 0.25 * self.scale[key]), 4.0 * self.scale[key])
        self.scale[key] = (1.0 - self.ema) * self.scale[key] + self.ema * ratio

    # -- persistence ---------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {k: vars(getattr(self, k)) for k in KINDS}
        d["ema"] = self.ema
        d["scale"] = dict(self.scale)
        if self.weights is not None:
            d["weights"] = self.weights.to_dict()
            d["ms_per_gb"] = self.ms_per_gb
            d["ms_sorted"] = self.ms_sorted
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CostModel:
        parts = {k: LinearCost(**d.get(k, {})) for k in KINDS}
        m = cls(target=parts["target"], draft=parts["draft"],
                plain_overhead=parts["plain_overhead"], spec_overhead=parts["spec_overhead"],
                ema=d.get("ema", 0.1),
                weights=ExpertBytes.from_dict(d["weights"]) if d.get("weights") else None,
                ms_per_gb=float(d.get("ms_per_gb", 0.0)),
                ms_sorted=float(d.get("ms_sorted", 0.0)))
        m.scale.update(d.get("scale", {}))
        return m

    def copy(self) -> CostModel:
        """A fresh copy (own scales): give each policy instance its own."""
        return replace(self, scale=dict(self.scale))


def _requests(samples: Sequence[CostSample]) -> npt.NDArray[np.float64]:
    return np.array([s.tokens if s.requests is None else s.requests for s in samples],
                    dtype=np.float64)


def _fit_with_bytes(samples: list[CostSample],
                    weights: ExpertBytes) -> tuple[LinearCost, float, float]:
    """Target ms = a + b·T + c·T·C/1000 + r·R + ms_per_gb·expert_gb(T) + ms_sorted·L·[T > 1],
    non-negative least squares (columns the samples cannot tell apart dropped, as
    :meth:`LinearCost.fit`; the dispatch column only when there are one-token and longer
    forwards and enough token counts besides)."""
    t = np.array([s.tokens for s in samples], dtype=np.float64)
    y = np.array([s.ms for s in samples], dtype=np.float64)
    ctx = np.array([s.context for s in samples], dtype=np.float64)
    # two token counts: bytes and b cannot both be told apart
    cols = _columns(t, ctx, _requests(samples), min_tokens=2)
    cols["gb"] = np.array([weights.expert_gb(v) for v in t])
    multi = (t > 1).astype(np.float64) * weights.moe_layers
    if (t <= 1).any() and np.unique(t[t > 1]).size > 2:
        cols["sorted"] = multi
    # every term is a cost, so none is negative: the expert-bytes column and b are nearly
    # collinear, and plain least squares on noisy timings (a busy machine) traded a large
    # negative b against a large ms_per_gb until a one-token forward cost 0 ms
    from scipy.optimize import nnls

    coef, _ = nnls(np.stack(list(cols.values()), axis=1), y)
    fit = dict(zip(cols, (float(v) for v in coef), strict=True))
    per_gb, sorted_ms = fit.pop("gb"), fit.pop("sorted", 0.0)
    return LinearCost(**fit), per_gb, sorted_ms


@dataclass(frozen=True)
class Crossover:
    """Where plain decoding catches up with speculation, as a cost model predicts it.

    ``batch``: the smallest decode batch where plain tok/s >= speculative tok/s (None: not
    up to ``max_batch``); ``n``: the threshold (``batch − 1``, or ``max_batch``);
    ``plain_tok_s``/``spec_tok_s``: the predictions at ``batch`` (at ``max_batch`` when None);
    ``model``: the cost model's ``to_dict()`` it was predicted from (provenance).
    """

    n: int
    batch: int | None
    shape: tuple[int, int, int]
    tau: float
    context: float
    warm: bool
    max_batch: int
    plain_tok_s: float
    spec_tok_s: float
    model: dict[str, Any] | None = field(default=None, compare=False, repr=False)

    def reason(self) -> str:
        """One line: the threshold and why."""
        shape = "S{}K{}N{}".format(*self.shape)
        plain = f"plain ({'warm' if self.warm else 'cold'} draft)"
        if self.batch is None:
            return (f"{shape} at τ {self.tau:.2f} is predicted faster than {plain} at every "
                    f"decode batch up to {self.max_batch} ({self.spec_tok_s:.0f} vs "
                    f"{self.plain_tok_s:.0f} tok/s there)")
        if self.n == 0:
            return (f"{shape} at τ {self.tau:.2f} is predicted slower than {plain} at every "
                    f"decode batch: at {self.batch} plain {self.plain_tok_s:.0f} tok/s >= "
                    f"speculative {self.spec_tok_s:.0f} tok/s")
        return (f"{shape} at τ {self.tau:.2f} is predicted faster than {plain} up to decode "
                f"batch {self.n}; at {self.batch} plain {self.plain_tok_s:.0f} tok/s >= "
                f"speculative {self.spec_tok_s:.0f} tok/s")

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "shape": list(self.shape), "reason": self.reason()}


@dataclass(frozen=True)
class Acceptance:
    """A measured accept length: τ (bonus included) over ``samples`` request-steps that
    speculated, at a mean of ``context`` tokens of KV per request; ``rates`` are the pooled
    per-depth acceptance a_1.. of that tree width ``topk`` (``policy.depth_rates``)."""

    tau: float
    context: float
    samples: int
    topk: int = 0
    rates: tuple[float, ...] = ()

    def seed(self) -> dict[int, tuple[float, ...]]:
        """``{topk: rates}`` for ``Goodput(accept_seed=...)`` (empty when not measured)."""
        return {self.topk: self.rates} if self.topk and self.rates else {}
