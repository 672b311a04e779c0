"""The EagleWorker: everything a step does with the draft, plus the decode that feeds it.

Per step the engine calls, in order: :meth:`EagleWorker.plan` (through the scheduler: the
policy decision and who may speculate), :meth:`prefill`, then :meth:`speculate` (catch-up →
draft trees → one verify forward → accept → commit KV → draft extend) and/or :meth:`plain`
(one decode forward). Each request's draft knowledge is its :class:`~workbench.core.DraftState`.

One rule says when a draft extends (:meth:`extend`): a speculating step extends every draft it
is about to use, and again after the commit (the next tree starts there); a step that does not
speculate (prefill, plain decode) extends per ``SpecConfig.draft_state``: ``warm`` all,
``cold`` none, ``auto`` — in the first AUTO_WARM_STEPS steps of an off stretch — those at most
``catchup_window`` behind (a fresh prompt's big backlog waits for its first speculative step,
which needs that extend anyway, so a policy that is off under load never pays for it).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Literal

import torch

from workbench import faults
from workbench.config import SpecConfig
from workbench.core import DraftTree, Request, StepOutput, VerifyResult
from workbench.engine.output import OutputProcessor
from workbench.engine.runner import ModelRunner
from workbench.engine.scheduler import DecodePlan, ScheduledBatch
from workbench.engine.stats import EngineStats, count_depths
from workbench.models.llama import row_bucket
from workbench.policy.policies import Decision, PolicyContext
from workbench.sampler import sample_rows
from workbench.speculative import verify
from workbench.speculative.drafter import draft_tree
from workbench.trace import events as ev
from workbench.trace.tracer import Dispatcher

# draft_state="auto": an off stretch keeps the draft warm for this many plain steps, then goes
# cold (measured on the 2-core EPYC: a warm plain step costs 0.7-4.6 ms more than a cold one at
# batch 1-64, a cold catch-up 1.3-12 ms once per switch; short flips stay cheap either way).
AUTO_WARM_STEPS = 8
# draft_state="auto" with catchup_window=None: warm plain steps extend backlogs up to this size
AUTO_CATCHUP_ROWS = 32
# Mixed steps: riders join the verify forward unless that grows the oneDNN GEMMs' padded row
# count (models/llama.row_bucket) by more than this. Measured on the 2-core EPYC, wb-target
# (docs/REFERENCE.md §3 "Mixed steps", figures in docs/MEASUREMENTS.md §2): one forward saves
# 2-5 ms a step, and 17 rows padded to 32 still save ~2 ms; 64 tree rows + 1 rider padded to
# 128 cost 5.5 ms more than two forwards.
RIDE_MAX_PAD_ROWS = 16

Phases = dict[str, float]


class EagleWorker:
    def __init__(self, runner: ModelRunner, out: OutputProcessor, stats: EngineStats,
                 trace: Dispatcher) -> None:
        self.runner, self.out, self.stats, self.trace = runner, out, stats, trace
        self.spec: SpecConfig | None = None  # this step's (Engine.begin of each step)
        self.step_id = 0
        self.plain_streak = 0  # consecutive decode steps without speculation (draft_state auto)
        # a speculating step's other decode requests ride in its verify forward as one-node
        # trees (True) or decode in a second, plain forward (False); see docs/REFERENCE.md §3
        self.plain_in_verify = runner.device.type != "cuda"

    def begin_step(self, spec: SpecConfig | None, step_id: int) -> None:
        self.spec, self.step_id = spec, step_id
        self.runner.step_id = step_id  # the step its ExpertRouting events belong to
        self.out.row_errors.clear()

    # -- the policy and the extend rule ------------------------------------------------------
    def plan(self, decode: list[Request]) -> DecodePlan:
        """The policy's decision for this decode batch; a request with one token left gains
        nothing from a draft: it decodes plainly."""
        spec = self.spec
        if spec is None or self.runner.draft is None:
            return DecodePlan(Decision(False, reason="no spec"), [], 1)
        ctx = PolicyContext(self.step_id, len(decode), *spec.shape,
                            context_tokens=sum(r.kv_len for r in decode) // len(decode),
                            draft_state="warm" if self.warm() else "cold")
        d = spec.policy.decide(ctx)
        if not d.speculate:
            return DecodePlan(d, [], 1)
        return DecodePlan(d, [r for r in decode if r.draft.capable and self.out.room(r) > 1],
                          d.num_draft_tokens)

    def warm(self) -> bool:
        """Does a step that does not speculate extend the draft now? (``draft_state``)"""
        spec = self.spec
        if spec is None:
            return False
        if spec.draft_state == "auto":
            return self.plain_streak < AUTO_WARM_STEPS
        return spec.draft_state == "warm"

    def extend(self, reqs: list[Request], speculating: bool) -> list[Request]:
        """The one extend rule (module docstring); returns the requests it extended."""
        spec = self.spec
        if not speculating:
            if spec is None or not reqs or not self.warm():
                return []
            if spec.draft_state == "auto":
                cap = spec.catchup_window or AUTO_CATCHUP_ROWS
                reqs = [r for r in reqs if r.kv_len - r.draft.len <= cap]
        return self._draft_extend(reqs)

    def _draft_extend(self, reqs: list[Request]) -> list[Request]:
        todo = []
        for r in reqs:
            d = r.draft
            if d.len == r.kv_len:
                continue
            if d.pending_feats is None or d.pending_rows != r.kv_len - d.len:
                d.capable = False  # features were not kept (spec toggled off): plain only
                continue
            todo.append(r)
        if not todo:
            return []
        faults.check("step:extend")
        logits, out, _, q_lens = self.runner.draft_extend(todo)
        end = -1
        for i, r in enumerate(todo):
            end += q_lens[i]  # the request's last row (host ints: a view, no index op)
            r.draft.logits = logits[i]
            r.draft.hidden = out[end]
            r.draft.consumed(r.kv_len)
        if self.trace.wants(ev.DraftExtended):  # after the state it describes (hook policy)
            self.trace.emit(ev.DraftExtended(
                t=time.perf_counter(), step=self.step_id, rids=[r.rid for r in todo],
                rows=q_lens, holes=[[[s, e] for s, e in r.draft.holes] for r in todo]))
        return todo

    # -- prefill ------------------------------------------------------------------------------
    def prefill(self, chunks: list[tuple[Request, int, int]],
                outputs: dict[int, StepOutput]) -> None:
        faults.check("step:prefill")
        t0 = time.perf_counter()
        reqs = [c[0] for c in chunks]
        runner, out = self.runner, self.out
        batch = runner.prefill_batch(chunks, runner.draft is not None and
                                     any(r.draft.capable for r in reqs))
        hidden, aux = runner.forward(batch)
        offs = 0
        done: list[Request] = []
        for r, s, e in chunks:
            n = e - s
            rows = hidden[offs : offs + n]
            if r.logprobs is not None and r.logprobs.start is not None:
                out.add_input_logprobs(r, s, e, rows, runner.logits)
            if aux is not None and r.draft.capable:
                r.draft.keep_feats(aux[offs : offs + n])
            r.draft.capable = aux is not None and r.draft.capable
            r.kv_len = e
            offs += n
            if not r.in_prefill:
                done.append(r)
                if r.sampling.max_new_tokens == 0:  # prefill only: no token to sample
                    out.finish(r, "length")
                    outputs[r.rid] = StepOutput(r.rid, [], True, "length", None)
                elif r.sample_after_prefill:
                    self._sample_first(r, runner.logits(rows[n - 1 :]), outputs)
        self.extend([r for r in done if r.draft.capable and not r.finished], speculating=False)
        if self.trace.wants(ev.Prefill):
            self.trace.emit(ev.Prefill(t=time.perf_counter(), rids=[r.rid for r in reqs],
                                       num_tokens=batch.num_tokens,
                                       chunked=any(r.in_prefill for r in reqs),
                                       seconds=time.perf_counter() - t0))

    def _sample_first(self, r: Request, logits: torch.Tensor,
                      outputs: dict[int, StepOutput]) -> None:
        if self.out.bad_logits(r, logits, outputs):
            return
        errors: dict[int, str] = {}
        tok = int(sample_rows(logits, [r.sampling], [r.generator], errors)[0])
        if errors:
            self.out.fail_request(r, f"request {r.rid}: {errors[0]}", outputs)
            return
        self.out.append_tokens(r, [tok], [False], outputs)
        if r.logprobs is not None:
            self.out.add_output_logprobs(r, logits)

    # -- plain decode --------------------------------------------------------------------------
    def plain(self, reqs: list[Request], outputs: dict[int, StepOutput], phases: Phases) -> None:
        """One decode forward over ``reqs`` (KV room reserved by the scheduler)."""
        runner = self.runner
        with phase(phases, "decode"):
            want_aux = self.spec is not None and runner.draft is not None and \
                any(r.draft.capable for r in reqs)
            hidden, aux = runner.forward(runner.decode_batch(reqs, want_aux))
            logits = runner.logits(hidden)
        self._plain_commit(reqs, logits, aux, outputs, phases)

    def _plain_commit(self, reqs: list[Request], logits: torch.Tensor, aux: torch.Tensor | None,
                      outputs: dict[int, StepOutput], phases: Phases) -> None:
        """Sample one token per request from its decode row (``logits[i]``, ``aux[i]``: a plain
        forward's or a one-node tree's in the verify forward), append it, keep the draft's
        features, extend per the rule for steps that do not speculate."""
        runner, out = self.runner, self.out
        warm = []
        with phase(phases, "commit", fault="sampler"):
            errors: dict[int, str] = {}
            toks = sample_rows(logits, [r.sampling for r in reqs], [r.generator for r in reqs],
                               errors)
            for i, msg in errors.items():
                out.row_errors[reqs[i].rid] = msg  # bad_logits below fails that request alone
            # a cold draft keeps only the latest catchup_window features (bounded catch-up);
            # the holes that leaves need a draft attention backend taking any slot list
            da = runner.draft_attn
            window = None if self.warm() or self.spec is None or da is None or \
                not da.arbitrary_slots else self.spec.catchup_window
            for i, r in enumerate(reqs):
                if out.bad_logits(r, logits[i : i + 1], outputs):
                    continue
                r.kv_len += 1
                r.metrics.plain_steps += 1
                r.metrics.spec_plain_steps += int(self.spec is not None)
                if aux is not None and r.draft.capable:
                    r.draft.keep_feats(aux[i : i + 1], window)
                    warm.append(r)
                r.draft.capable = aux is not None and r.draft.capable  # spec off: no features
                out.append_tokens(r, [int(toks[i])], [False], outputs)
                if r.logprobs is not None:
                    out.add_output_logprobs(r, logits[i : i + 1])
        with phase(phases, "extend"):
            self.extend([r for r in warm if not r.finished], speculating=False)

    # -- speculative decode ------------------------------------------------------------------
    def speculate(self, batch: ScheduledBatch, outputs: dict[int, StepOutput],
                  phases: Phases) -> tuple[list[Request], list[int]]:
        """Speculate ``batch.speculate`` (the decode requests that do not, riders, join the
        verify forward as one-node trees when :attr:`plain_in_verify`). Returns the requests
        this call advanced (speculating ones first, then riders; empty if none could
        speculate) and the speculating ones' accepted draft tokens (bonus excluded), for the
        policy's online acceptance estimates."""
        runner, d = self.runner, batch.decision
        assert d is not None
        # 1. Cold drafts catch up over the tokens they missed while speculation was off.
        reqs = batch.speculate
        with phase(phases, "catchup"):
            self.extend(reqs, speculating=True)
        phases["draft"] = phases["catchup"]  # the draft phase includes the catch-up
        reqs = [r for r in reqs if r.draft.capable and r.draft.logits is not None]
        if not reqs:
            return [], []
        # 2. Draft: build every request's tree.
        with phase(phases, "draft", fault="draft"):
            tree = self._draft(reqs, d)
        ride = self._riders(batch, reqs, tree.num_nodes)
        # 3. Verify: one target forward over all trees (ragged, tree masks), riders last.
        b, n = len(reqs), tree.num_nodes
        with phase(phases, "verify", fault="verify"):
            hidden, aux_all = runner.forward(runner.verify_batch(reqs, tree, ride))
            logits_all = runner.logits(hidden)
            logits = logits_all[: b * n].view(b, n, -1)
        # 4. Accept (the rule: speculative/verify.py).
        with phase(phases, "accept", fault="accept"):
            res = self._accept(reqs, tree, logits)
        # 5. Commit: move every accepted path's KV to consecutive positions, then per request
        # emit its TreeBuilt/Verified, then advance it. A fatal hook raising on request i's
        # events leaves requests before i committed and i onwards untouched (their moved rows
        # lie beyond kv_len: scratch the next verify rewrites), so the engine stays consistent.
        with phase(phases, "commit", fault="commit"):
            assert aux_all is not None
            host = _host_lists(res, tree)
            accepted = host[1]
            keep = self._commit(reqs, tree, res, host, logits,
                                aux_all[: b * n].view(b, n, -1), outputs)
        # 6. Draft extend over the accepted tokens (+ bonus) so the next tree can start.
        with phase(phases, "extend"):
            self.extend(keep, speculating=True)
        # 7. Riders: each samples its token as a plain step would (then extends per that rule).
        if ride:
            self._plain_commit(ride, logits_all[b * n :], aux_all[b * n :], outputs, phases)
        return reqs + ride, accepted

    def _riders(self, batch: ScheduledBatch, reqs: list[Request], n: int) -> list[Request]:
        """The decode requests that ride in this verify forward as one-node trees: every one
        that does not speculate, unless :attr:`plain_in_verify` is off or their rows would pad
        the oneDNN GEMMs by more than RIDE_MAX_PAD_ROWS rows (then a second forward is
        cheaper)."""
        ride = batch.plain_after(reqs) if self.plain_in_verify else []
        target = self.runner.target
        if ride and target is not None and target.gemm == "onednn":
            rows = len(reqs) * n
            if row_bucket(rows + len(ride)) - row_bucket(rows) > RIDE_MAX_PAD_ROWS:
                return []
        return ride

    def _draft(self, reqs: list[Request], d: Decision) -> DraftTree:
        runner = self.runner
        pool = runner.pool
        assert runner.draft is not None and pool is not None
        assert pool.dk is not None and pool.dv is not None
        on_step = self._trace_draft_step(reqs) if self.trace.wants(ev.DraftStep) else None
        prefix: list[torch.Tensor] | tuple[int, int]
        if len(reqs) == 1:  # a run of the pool with room for the tree after it, if it is one
            one = runner.draft_prefix(reqs[0], (d.num_steps - 1) * d.topk)
            prefix = one if isinstance(one, tuple) else [one]
        else:
            prefix = [runner.draft_slots(r, r.draft.len) for r in reqs]
        return draft_tree(
            runner.draft, _stack([r.draft.logits for r in reqs]),  # type: ignore[misc]
            _stack([r.draft.hidden for r in reqs]),  # type: ignore[misc]
            [r.tokens[-1] for r in reqs], [r.kv_len for r in reqs], prefix, pool.dk, pool.dv,
            d.num_steps, d.topk, d.num_draft_tokens, on_step, self._score_temperatures(reqs))

    def _commit(self, reqs: list[Request], tree: DraftTree, res: VerifyResult,
                host: HostLists, logits: torch.Tensor, aux: torch.Tensor,
                outputs: dict[int, StepOutput]) -> list[Request]:
        """Compact the accepted paths' KV, emit their tokens; returns the requests still
        running (their drafts extend next)."""
        pool, out = self.runner.pool, self.out
        assert pool is not None
        n = tree.num_nodes
        # one device read each for the batch; the per-request work below is on host lists
        acc_rows, accepted, bonus, tokens = host
        src: list[int] = []
        dst: list[int] = []
        ok: list[tuple[int, Request, int, list[int]]] = []
        for i, r in enumerate(reqs):
            if out.bad_logits(r, logits[i], outputs,
                              None if res.finite is None else res.finite[i]):
                continue
            m = accepted[i]
            path = acc_rows[i][: m + 1]
            moved = [j for j in range(1, m + 1) if path[j] != j]  # node 0 (the root) stays
            if moved:
                slots = pool.slot_list(r.blocks, r.kv_len, r.kv_len + n)
                src.extend(slots[path[j]] for j in moved)
                dst.extend(slots[j] for j in moved)
            ok.append((i, r, m, path))
        if src:
            pool.compact(src, dst)  # host lists (plan metadata): one index buffer
        keep: list[Request] = []
        for i, r, m, path in ok:
            new = [tokens[i][p] for p in path[1:]] + [bonus[i]]
            if self.trace.wants(ev.TreeBuilt, ev.Verified):
                self._trace_verify(r, tree, i, res, logits[i], new)
            cut = out.cut(r, new)  # a stop or max_new_tokens may end the block early
            self._record_accept(r, min(m, cut.keep), cut.keep, n - 1)
            r.kv_len += m + 1
            rows = res.accept_index[i, : m + 1]  # index_select: a third of aux[i, rows]'s µs
            r.draft.keep_feats(aux[i].index_select(0, rows))
            out.append_tokens(r, new, [True] * m + [False], outputs, cut)
            if r.logprobs is not None:  # the verify logits along the accepted path
                out.add_output_logprobs(r, logits[i].index_select(0, rows))
            if not r.finished:
                pool.trim(r.blocks, r.kv_len + 1)
                keep.append(r)
        return keep

    def _score_temperatures(self, reqs: list[Request]) -> torch.Tensor | float | None:
        """Greedy requests rank tree nodes with the head's calibration temperature (the draft
        is trained to the target's distribution, greedy verification accepts its argmax: a
        sharper score puts deep likely nodes before shallow unlikely ones); sampled ones 1.
        One float when every request has the same (None: all 1), else one per request."""
        assert self.runner.draft is not None
        t = self.runner.draft.config.greedy_score_temperature
        greedy = [r.sampling.greedy for r in reqs]
        if t == 1.0 or not any(greedy):
            return None
        if all(greedy):
            return float(t)
        return torch.tensor([t if g else 1.0 for g in greedy], device=self.runner.device)

    def _accept(self, reqs: list[Request], tree: DraftTree,
                logits: torch.Tensor) -> VerifyResult:
        """The acceptance rule (speculative/verify.py); a request whose target distribution
        is not one fails alone at its commit."""
        assert self.spec is not None
        res, errors = verify.accept(tree, logits, reqs, self.spec.simulate_accept_length)
        self.out.row_errors.update(errors)
        return res

    def _record_accept(self, r: Request, accepted: int, emitted: int, drafted: int) -> None:
        """Count one verify by what it emitted: ``emitted`` tokens, ``accepted`` of them draft
        tokens (a block cut at a stop or max_new_tokens counts only what it kept), of
        ``drafted`` tree nodes. Recorded before the tokens are appended, so the finish event
        of a request this verify finishes includes it."""
        met = r.metrics
        met.verify_ct += 1
        met.accept_lengths.append(emitted)
        met.correct_drafts.append(accepted)
        met.drafted_tokens += drafted
        count_depths(met.accepted_per_depth, accepted)
        self.stats.record_verify(accepted, drafted, emitted)

    # -- the step's accounting -----------------------------------------------------------------
    def end_step(self, batch: ScheduledBatch, mode: Literal["plain", "spec"], accepted: list[int],
                  phases: dict[str, float], total: float) -> None:
        """Count the step, let the policy learn its cost, trace it."""
        decision = batch.decision
        assert decision is not None
        self.plain_streak = 0 if mode == "spec" else self.plain_streak + 1
        self.stats.steps[mode] = self.stats.steps.get(mode, 0) + 1
        if self.spec is not None:
            if decision.speculate and mode != "spec":  # nobody could speculate: say so
                decision = Decision(False, reason=f"{decision.reason}; ran plain")
            # the policy learns the step's own cost: prefill and a cold draft's one-off
            # catch-up (bounded by catchup_window; in the trace's draft_ms) are left out
            self.spec.policy.observe(
                decision, total - phases.get("prefill", 0.0) - phases.get("catchup", 0.0),
                accepted)
        if self.trace.enabled:
            self._trace_step(decision, len(batch.decode), mode, phases, total)

    def _trace_step(self, d: Decision, batch: int, mode: Literal["plain", "spec"],
                    phases: dict[str, float], total: float) -> None:
        now, step, tr = time.perf_counter(), self.step_id, self.trace
        if tr.wants(ev.PolicyDecision):
            tr.emit(ev.PolicyDecision.of(step, batch, d, total, now))
        if tr.wants(ev.StepTiming):
            tr.emit(ev.StepTiming.of(step, batch, mode, phases, total, now))
        if not tr.wants(ev.KVUsage):
            return
        pool, sched = self.runner.pool, self.out.scheduler
        assert pool is not None and sched is not None
        # only running requests hold KV (waiting ones have kv_len 0); self.requests keeps every
        # request not yet released, so summing over it would grow with the engine's lifetime
        tr.emit(ev.KVUsage(t=now, step=step, used_blocks=pool.used_blocks,
                           total_blocks=pool.num_blocks,
                           used_tokens=sum(r.kv_len for r in sched.running)))

    # -- tracing helpers (only called when a tracer or hook is active) -------------------------
    def _trace_draft_step(self, reqs: list[Request]) -> Callable[..., None]:
        rids = [r.rid for r in reqs]

        def on_step(depth: int, tokens: torch.Tensor, probs: torch.Tensor,
                    parents: torch.Tensor) -> None:
            self.trace.emit(ev.DraftStep.of(self.step_id, rids, depth, tokens, probs, parents,
                                            time.perf_counter()))
        return on_step

    def _trace_verify(self, r: Request, tree: DraftTree, i: int, res: VerifyResult,
                      logits: torch.Tensor, new: list[int]) -> None:
        now = time.perf_counter()
        if self.trace.wants(ev.TreeBuilt):
            self.trace.emit(ev.TreeBuilt.of(self.step_id, r.rid, tree, i, now))
        if self.trace.wants(ev.Verified):
            self.trace.emit(ev.Verified.of(self.step_id, r.rid, tree, i, res, logits, new, now))


# accept_index rows, accept_len, bonus and the tree's tokens, as host lists
HostLists = tuple[list[list[int]], list[int], list[int], list[list[int]]]


def _host_lists(res: VerifyResult, tree: DraftTree) -> HostLists:
    """What the commit reads on the host: the accept's own lists when it ran on the host
    (``VerifyResult.host``), else one device read each for the batch."""
    if res.host is not None:
        return res.host
    return (res.accept_index.tolist(), res.accept_len.tolist(), res.bonus.tolist(),
            tree.tokens.tolist())


def _stack(xs: list[torch.Tensor]) -> torch.Tensor:
    """torch.stack, a view for one row (bs=1)."""
    return xs[0].unsqueeze(0) if len(xs) == 1 else torch.stack(xs)


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1e3


class phase:  # noqa: N801 (used as ``with phase(...)``, like a function)
    """One phase of a step: its fault point ``step:<fault>`` (``workbench.faults``) checked at
    the start, its milliseconds added to ``phases[name]`` when the block completes (a phase
    that raises records nothing: the step fails). A plain class, not a generator context
    manager: a step enters up to seven, right after forwards that left the caches cold."""

    __slots__ = ("name", "phases", "t")

    def __init__(self, phases: Phases, name: str, fault: str | None = None) -> None:
        self.phases, self.name = phases, name
        self.t = time.perf_counter()
        if fault is not None:
            faults.check(f"step:{fault}")

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        if kind is None:
            self.phases[self.name] = self.phases.get(self.name, 0.0) + _ms(self.t)
