"""Calibration: measure this engine and fit the policy's cost model (``workbench.policy``).

The model itself (``CostModel``, ``LinearCost``, ``Acceptance``) is pure arithmetic in
:mod:`workbench.policy.costmodel`; measuring it needs a live engine, so it lives here.
:func:`calibrate` times target and draft forwards through the runner
(:meth:`ModelRunner.forward` / :meth:`ModelRunner.draft_forward` over a scratch
:class:`ForwardBatch`: the same path, CUDA graphs and compiled steps included, that the step
loop takes), then whole greedy steps for the overheads; :func:`measure_tau` measures the accept
length on the workload's own prompts.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np
import torch

from workbench.config import SamplingParams, SpecConfig
from workbench.core import Request
from workbench.engine.prompts import Prompt
from workbench.engine.runner import ForwardBatch, ModelRunner
from workbench.errors import ConfigError
from workbench.models.moe_model import MoeForCausalLM
from workbench.policy.costmodel import Acceptance, CostModel, CostSample
from workbench.policy.moe_cost import ExpertBytes, fit_gamma
from workbench.policy.policies import (
    Always,
    Decision,
    Never,
    RecordingPolicy,
    StepRecord,
    check_shape,
    depth_rates,
)

if TYPE_CHECKING:
    from workbench.engine.engine import Engine


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def time_forward(runner: ModelRunner, batch: int, q: int, context: int, repeats: int,
                 draft: bool) -> float:
    """Min ms of one target forward + LM head (or one draft forward) over ``batch`` requests ×
    ``q`` new tokens at ``context`` tokens of history, through the runner on scratch requests
    whose KV blocks are released afterwards (nothing stays allocated)."""
    pool, dev = runner.pool, runner.device
    if pool is None or runner.target is None:
        raise ConfigError("calibrate: the runner has no target or KV pool (engine closed?)")
    vocab = runner.target.config.vocab_size
    sp = SamplingParams()
    reqs = [Request(rid=-1 - i, prompt_ids=[], sampling=sp) for i in range(batch)]
    try:
        for r in reqs:
            pool.reserve(r.blocks, context + q)
        g = torch.Generator().manual_seed(0)
        fb = ForwardBatch(reqs, [context] * batch, [context + q] * batch,
                          torch.randint(1, vocab, (batch * q,), generator=g).to(dev),
                          torch.arange(context, context + q).repeat(batch).to(dev),
                          want_aux=runner.draft is not None)
        if draft:
            d = runner.draft
            if d is None:
                raise ConfigError("calibrate: the runner has no draft model")
            hidden = torch.randn(batch * q, d.config.hidden_size, generator=g).to(
                device=dev, dtype=d.lm_head.weight.dtype)

            def run() -> None:
                runner.draft_forward(fb, hidden)
        else:
            def run() -> None:
                runner.logits(runner.forward(fb)[0])
        best = float("inf")
        for _ in range(repeats + 1):  # +1: the first call pays allocator/first-use costs
            _sync(dev)
            t0 = time.perf_counter()
            run()
            _sync(dev)
            best = min(best, (time.perf_counter() - t0) * 1e3)
        return best
    finally:
        for r in reqs:
            pool.release(r.blocks)


def calibrate(engine: Engine, batch_sizes: Sequence[int] = (1, 2, 4, 8, 16, 32), repeats: int = 2,
              context: int = 128, contexts: Sequence[int] | None = None,
              shape: Sequence[int] = (5, 4, 16), steps: bool = True,
              step_batches: Sequence[int] | None = None, step_tokens: int = 12,
              ema: float = 0.1, progress: bool = False, per_request: bool = False) -> CostModel:
    """Measure ``engine`` and fit a CostModel.

    1. Components on scratch KV (released afterwards, nothing stays allocated): the target
       forward + LM head over B·1 and B·N new tokens, the draft forward over B·1 and B·K, for B
       in ``batch_sizes`` and every context in ``contexts`` (default: ``(context,)``; give two
       or more to fit the attention term c). Each point is the min of ``repeats`` runs.
       ``per_request``: the samples carry their request count, so the per-request term r is
       fitted (B requests × 1 token and × N tokens tell it from the per-token b); callers
       that price a multi-token forward must then pass ``requests`` (``CostModel`` does).
    2. With ``steps``: short greedy ``generate`` runs (plain via ``Never`` with a cold
       draft, speculative via ``Always`` at ``shape``) at ``step_batches`` (default: up to 3
       of ``batch_sizes``); a measured step minus its predicted components is an overhead
       residual, and the median residual per (kind, decode batch) is one overhead sample:
       one step that a busy machine preempted must not tilt the fit (it moves ``crossover``
       the most).
    The engine's stats are restored afterwards.
    """
    from tqdm.auto import tqdm

    s, k, n = check_shape(tuple(shape), "calibrate.shape")
    ctxs = tuple(contexts or (context,))
    runner = engine.runner
    pool, target = runner.pool, runner.target
    if pool is None or target is None:
        raise ConfigError("calibrate: the engine has no target or KV pool (closed?)")
    has_draft = runner.draft is not None and runner.draft_attn is not None
    free_tokens = len(pool.free) * pool.page_size
    bs = [b for b in batch_sizes
          if b * (-(-(max(ctxs) + n) // pool.page_size)) * pool.page_size <= free_tokens]
    if not bs:
        raise ConfigError("calibrate: the KV pool has no room for the smallest batch")
    points = [(c, b, q, False) for c in ctxs for b in bs for q in (1, n)]
    if has_draft:
        points += [(c, b, q, True) for c in ctxs for b in bs for q in sorted({1, k})]
    samples: list[CostSample] = []
    coverage: list[tuple[int, float]] = []  # MoE target: (tokens, mean distinct experts)
    for c, b, q, is_draft in tqdm(points, desc="calibrate", unit="pt", disable=not progress):
        ms = time_forward(runner, b, q, c, repeats, is_draft)
        samples.append(CostSample("draft" if is_draft else "target", b * q, ms, c,
                                  float(b) if per_request else None))
        if not is_draft and isinstance(target, MoeForCausalLM):
            counts = list(target.routing().values())
            coverage.append((b * q, float(np.mean([int((x > 0).sum()) for x in counts]))))
    weights = expert_bytes(target, coverage)
    model = CostModel.fit(samples, ema=ema, weights=weights)
    if not steps:
        return model
    saved = engine.stats.snapshot()  # the live engine keeps its stats object: restored in place
    engine.stats.reset()
    try:
        sb = list(step_batches or bs[:: max(1, len(bs) // 3)][:3])
        sb = [b for b in sb if b <= engine.config.max_batch_size]
        vocab = target.config.vocab_size
        g = torch.Generator().manual_seed(1)
        sp = SamplingParams(max_new_tokens=step_tokens, ignore_eos=True)
        kinds = ("plain", "spec") if has_draft else ("plain",)
        residuals: dict[tuple[str, int], list[float]] = {}
        for b in tqdm(sb, desc="calibrate steps", unit="batch", disable=not progress):
            prompts = [torch.randint(1, vocab, (context,), generator=g).tolist()
                       for _ in range(b)]
            for kind in kinds:
                # plain steps with a cold draft: the overhead fitted is a plain step's own
                # (``plain_step_ms(warm=True)`` adds the draft extend on top)
                spec = SpecConfig(num_steps=s, topk=k, num_draft_tokens=n,
                                  policy=Never() if kind == "plain" else Always(),
                                  draft_state="cold" if kind == "plain" else "auto") \
                    if has_draft else None
                for r in _measure_steps(engine, prompts, sp, spec)[1:]:
                    # (the first decode step pays first-use costs)
                    d, acc = r.decision, r.accepted
                    if not d.speculate:
                        pred = model.plain_step_ms(r.batch, context, warm=False,
                                                   scaled=False)
                    else:
                        tau = 1.0 + (sum(acc) / len(acc) if acc else 0.0)
                        pred = model.spec_step_ms(r.batch, d.num_steps, d.topk,
                                                  d.num_draft_tokens, tau, context, scaled=False)
                    residuals.setdefault((kind, r.batch), []).append(r.ms - pred)
    finally:
        engine.stats.restore(saved)
    samples += [CostSample(f"{kind}_overhead", batch, float(np.median(ms)), context)
                for (kind, batch), ms in residuals.items()]
    return CostModel.fit(samples, ema=ema, weights=weights)


def expert_bytes(target: object, coverage: Sequence[tuple[int, float]]) -> ExpertBytes | None:
    """A MoE target's weight-bytes model (its parameter counts at its dtype), with the coverage
    γ fitted to what the calibration forwards routed (random tokens); None for a dense one."""
    if not isinstance(target, MoeForCausalLM) or not coverage:
        return None
    moe = target.config.moe
    assert moe is not None
    bits = 8.0 * target.lm_head.weight.element_size()
    gamma = fit_gamma([t for t, _ in coverage], [d for _, d in coverage], moe.num_experts,
                      moe.top_k)
    return ExpertBytes.from_config(target.config, bits, bits, gamma)


def _measure_steps(engine: Engine, prompts: list[list[int]], sp: SamplingParams,
                   spec: SpecConfig | None) -> list[StepRecord]:
    """Run ``prompts`` together; one record per pure decode step (no prefill chunk): the
    policy's (through a :class:`RecordingPolicy`), or with ``spec`` None a plain one timed here
    (decision "baseline")."""
    rec = None
    if spec is not None:
        rec = RecordingPolicy(spec.policy)
        spec = replace(spec, policy=rec)
    previous = engine.spec
    engine.set_spec(spec)
    rows: list[StepRecord] = []
    rids: list[int] = []
    try:
        rids.extend(engine.add_request(p, sp) for p in prompts)
        live = set(rids)
        while live:
            prefilling = any(engine.requests[r].in_prefill for r in live)
            decoding = sum(1 for r in live if not engine.requests[r].in_prefill)
            n_rec = len(rec.rows) if rec is not None else 0
            t0 = time.perf_counter()
            outs = engine.step()
            ms = (time.perf_counter() - t0) * 1e3
            live -= {o.rid for o in outs if o.finished}
            if prefilling or not decoding:
                continue
            if rec is not None and len(rec.rows) > n_rec:
                rows.append(rec.rows[-1])
            elif rec is None:
                rows.append(StepRecord(decoding, Decision(False, reason="baseline"), ms, ()))
    finally:
        for r in rids:  # no-op for finished ones; frees KV if a step raised
            engine.abort(r)
        engine.set_spec(previous)
    return rows


def measure_tau(engine: Engine, prompts: Sequence[Prompt], shape: Sequence[int] = (5, 4, 16),
                max_new_tokens: int = 32, batch: int = 8) -> Acceptance:
    """τ of ``shape`` on the workload's own prompts: the first ``batch`` of ``prompts`` run
    together, greedy, speculating every step (``Always``); τ = 1 + the mean draft tokens a
    speculating request accepted per step, with the per-depth rates that seed ``Goodput``
    (``Acceptance.seed``). Acceptance depends on the prompts and models, not on the batch. The
    engine's stats are restored afterwards."""
    s, k, n = check_shape(tuple(shape), "measure_tau.shape")
    if engine.runner.draft is None:
        raise ConfigError("measure_tau: the engine has no draft model")
    if not prompts or batch < 1:
        raise ConfigError(f"measure_tau: need prompts and batch >= 1, got {len(prompts)} "
                          f"prompts, batch {batch}")
    rec = RecordingPolicy(Always())
    spec = SpecConfig(num_steps=s, topk=k, num_draft_tokens=n, policy=rec)
    saved = engine.stats.snapshot()
    engine.stats.reset()
    try:
        engine.generate(list(prompts[:batch]),
                        SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True),
                        spec=spec)
    finally:
        engine.stats.restore(saved)
    steps = [r for r in rec.rows if r.decision.speculate and r.accepted]
    accepted = [a for r in steps for a in r.accepted]
    if not accepted:
        raise ConfigError(f"measure_tau: no speculative step ran on {min(batch, len(prompts))} "
                          f"prompts with max_new_tokens {max_new_tokens}")
    return Acceptance(1.0 + float(np.mean(accepted)),
                      float(np.mean([r.context for r in steps])), len(accepted), k,
                      tuple(depth_rates(accepted, min(s, n - 1))))
