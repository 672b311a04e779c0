"""The engine: staged all-or-nothing init, the public API, and the step loop.

The init loop is here (each stage timed, reported as an InitStage event, everything freed on a
failure); what each stage does is in :mod:`workbench.engine.stages`.

Three parts do the work (DESIGN.md §4): the :class:`~workbench.engine.scheduler.Scheduler`
plans each step's whole batch (admission, prefill chunks, the policy decision, every KV
reservation) before any forward; the :class:`~workbench.engine.runner.ModelRunner` owns the
models, the KV pool, the attention backends and every forward; the
:class:`~workbench.engine.worker.EagleWorker` runs prefill, plain decode and the speculative
loop (draft → verify → accept → commit → draft extend). Tokens reach a request only through the
:class:`~workbench.engine.output.OutputProcessor`.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

import torch

from workbench import faults
from workbench.config import EngineConfig, SamplingParams, SpecConfig
from workbench.core import LogprobParams, Request, RequestOutput, StepOutput
from workbench.engine import affinity, driver, policy_init, stages
from workbench.engine.contention import ContentionMonitor
from workbench.engine.output import OutputProcessor
from workbench.engine.prompts import Prompt, check_params, check_prompt, new_request, tokenize
from workbench.engine.runner import ModelRunner
from workbench.engine.scheduler import Scheduler
from workbench.engine.stats import EngineStats
from workbench.engine.stops import hold_back_stops
from workbench.engine.worker import EagleWorker
from workbench.errors import ConfigError, EngineInitError, RequestError
from workbench.models.config import ModelConfig
from workbench.trace import events as ev
from workbench.trace.tracer import Dispatcher

__all__ = ["Engine", "EngineStats", "Prompt", "hold_back_stops"]


class Engine:
    """Build with :meth:`from_pretrained`. Either fully initialised or not at all."""

    def __init__(self, model: str | Path, draft: str | Path | None = None,
                 config: EngineConfig | None = None, tracer: Any = None) -> None:
        # Every attribute exists before the first fallible stage (no half-built object).
        self.config = config or EngineConfig()
        self.model_path = model
        self.draft_path = draft
        self.model_config: ModelConfig | None = None
        # the output side's limits, set by the load_config and allocate_kv stages (and handed to
        # the OutputProcessor at the same time)
        self.tokenizer: Any = None
        self.eos_ids: set[int] = set()
        self.max_model_len = 0
        self.runner = ModelRunner(self.config)
        self.scheduler: Scheduler | None = None
        self.spec: SpecConfig | None = None
        self.stats = EngineStats()
        self.trace = Dispatcher()
        if tracer is not None:
            self.trace.tracer = tracer
        self.hooks = self.trace.hooks
        self.out = OutputProcessor(self.stats, self.trace)
        self.worker = EagleWorker(self.runner, self.out, self.stats, self.trace)
        self.runner.trace = self.trace  # ExpertRouting events (MoE targets)
        self.requests: dict[int, Request] = {}
        self.step_id = 0
        self.baseline_only = False
        self._rids = itertools.count()
        self._closed = False
        self._stepping = False  # inside step(): abort() defers to the step's end
        self._deferred_aborts: list[int] = []
        self.init_log: list[tuple[str, str, float]] = []
        self.init_details: dict[str, str] = {}  # stage → its detail line (InitStage.detail)
        # every machine-dependent "auto", decided at init (engine/autotune.py): name → Choice dict
        self.choices: dict[str, Any] = {}
        # re-measures the thread count as the machine's load changes (engine/contention.py)
        self.contention: ContentionMonitor | None = None
        self._init()

    @classmethod
    def from_pretrained(cls, model: str | Path, draft: str | Path | None = None,
                        config: EngineConfig | None = None) -> Engine:
        return cls(model, draft, config)

    # -- staged init ----------------------------------------------------------------------
    def _init(self) -> None:
        r = self.runner
        order: list[tuple[str, Callable[[], str | None]]] = [
            ("load_config", lambda: stages.load_config(self)),
            ("load_target", lambda: r.load_target(self.model_path)),
            ("load_draft", lambda: None if self.draft_path is None else
             r.load_draft(self.draft_path)),
            ("autotune", lambda: stages.autotune(self)),
            ("allocate_kv", lambda: stages.allocate_kv(self)),
            ("attention_backend", lambda: stages.attention_backend(self)),
            ("draft_attention_backend", r.draft_attention_backend),
            ("cuda_graphs", lambda: r.cuda_graphs(self.max_model_len)),
            ("compile", lambda: stages.compile_forward(self)),
            ("policy_costmodel", lambda: policy_init.stage(self)),
            ("self_check", lambda: stages.self_check(self)),
        ]
        for name, fn in order:
            t0 = time.perf_counter()
            try:
                faults.check(f"init:{name}")
                detail = fn()
            except Exception as e:  # re-raised as EngineInitError after freeing everything
                if self._draft_stage(name) and self.config.allow_baseline_fallback:
                    # configured: an explicit baseline engine, said so in an InitStage event
                    self.runner.drop_draft()
                    self.baseline_only = True
                    self._record_stage(name, "fallback", t0, f"{type(e).__name__}: {e}")
                    continue
                if name == "cuda_graphs" and self.config.cuda_graphs_fallback:
                    self.runner.graphs = None  # configured: run eagerly, said so in the event
                    self._record_stage(name, "fallback", t0, f"{type(e).__name__}: {e}")
                    continue
                self._record_stage(name, "failed", t0, f"{type(e).__name__}: {e}")
                self.close()
                raise EngineInitError(name, e) from e
            self._record_stage(name, "ok", t0, detail or "")

    def _draft_stage(self, name: str) -> bool:
        return self.draft_path is not None and name in ("load_draft", "draft_attention_backend")

    def _record_stage(self, name: str, status: Literal["ok", "failed", "fallback"], t0: float,
                      detail: str) -> None:
        seconds = time.perf_counter() - t0
        self.init_log.append((name, status, seconds))
        self.init_details[name] = detail
        if self.trace.wants(ev.InitStage):
            self.trace.emit(ev.InitStage(t=time.perf_counter(), stage=name, status=status,
                                         seconds=seconds, detail=detail))

    # -- public API -------------------------------------------------------------------------
    def set_tracer(self, tracer: Any) -> None:
        self.trace.tracer = tracer

    @property
    def tracer(self) -> Any:
        return self.trace.tracer

    def set_spec(self, spec: SpecConfig | None) -> None:
        if spec is not None and not isinstance(spec, SpecConfig):
            raise ConfigError(f"spec: expected a SpecConfig or None, got {spec!r}")
        if spec is not None and self.runner.draft is None:
            why = " (draft init failed; running as an explicit baseline)" if self.baseline_only \
                else ""
            raise ConfigError(f"spec: this engine has no draft model{why}")
        # BatchThreshold("auto") / Goodput(): this machine's cost model (policy_init)
        self.spec = policy_init.resolve(self, spec) if spec is not None else None

    def tokenize(self, prompt: Prompt, field: str = "prompt") -> list[int]:
        """Text, token ids or chat messages → token ids; RequestError naming ``field``.

        Reads only the tokenizer and the model config (both fixed after init), so a server may
        call it off the engine thread."""
        vocab = self.model_config.vocab_size if self.model_config is not None else 0
        return tokenize(self.tokenizer, vocab, prompt, field)

    def add_request(self, prompt: Prompt, sampling: SamplingParams | None = None,
                    logprobs: LogprobParams | None = None) -> int:
        """Queue one request; returns its id. Invalid input raises RequestError (nothing queued).
        ``logprobs``: return log-probabilities too (:class:`~workbench.core.LogprobParams`)."""
        self.check_open()
        sp = check_params(sampling, logprobs)
        ids = self.tokenize(prompt)
        pool = self.runner.pool
        assert pool is not None and self.scheduler is not None
        check_prompt(ids, logprobs, self.max_model_len, pool.num_blocks * pool.page_size)
        rid = next(self._rids)
        req = new_request(rid, ids, sp, logprobs)
        req.draft.capable = self.spec is not None
        self.requests[rid] = req
        self.scheduler.add(req)
        if self.trace.wants(ev.RequestAdmitted):
            self.trace.emit(ev.RequestAdmitted(t=time.perf_counter(), rid=rid,
                                               prompt_len=len(ids),
                                               max_new_tokens=sp.max_new_tokens,
                                               temperature=float(sp.temperature)))
        return rid

    def abort(self, rid: int) -> None:
        """Abort a request in any state; its KV is freed now. Unknown ids are ignored.

        Called while a step runs (from a hook), the abort takes effect when that step ends."""
        req = self.requests.get(rid)
        if req is None or req.finished:
            return
        if self._stepping:
            self._deferred_aborts.append(rid)
            return
        self.out.finish(req, "abort")

    def has_unfinished(self) -> bool:
        return self.scheduler is not None and self.scheduler.has_work()

    def kv_usage(self) -> dict[str, int]:
        self.check_open()
        pool = self.runner.pool
        assert pool is not None
        return {"used_blocks": pool.used_blocks, "total_blocks": pool.num_blocks,
                "page_size": pool.page_size}

    def release(self, rid: int) -> RequestOutput:
        """Return a finished request's output and forget it (long-running servers)."""
        req = self.requests.get(rid)
        if req is None:
            raise RequestError(f"rid: unknown request {rid}")
        if not req.finished:
            raise RequestError(f"rid: request {rid} is still running (abort it first)")
        out = self.output(rid)
        del self.requests[rid]
        return out

    def num_waiting(self) -> int:
        return len(self.scheduler.waiting) if self.scheduler is not None else 0

    def num_running(self) -> int:
        return len(self.scheduler.running) if self.scheduler is not None else 0

    def output(self, rid: int, text: bool = True) -> RequestOutput:
        """Snapshot of a request (running or finished); ``text=False`` skips detokenizing.

        A "stop" finish trims the matched stop from ``text`` as SGLang and OpenAI do (the stop
        string and what follows it; a stop token id's text) unless ``no_stop_trim``;
        ``token_ids`` always keep every generated token."""
        req = self.requests.get(rid) if isinstance(rid, int) else None
        if req is None:
            raise RequestError(f"rid: unknown request {rid!r}")
        return self.out.request_output(req, text, self.spec is None or self.spec.lossless)

    def text_of(self, req: Request) -> str:
        """The request's output text, its matched stop trimmed (see :meth:`output`)."""
        return self.out.text_of(req)

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling: SamplingParams | Sequence[SamplingParams] | None = None,
                 spec: SpecConfig | None = None, progress: bool = False,
                 logprobs: LogprobParams | None = None) -> list[RequestOutput]:
        """Run prompts to completion (continuous batching) and return outputs in order;
        ``logprobs``: every request also returns its log-probabilities."""
        return driver.generate(self, prompts, sampling, spec, progress, logprobs)

    def stream(self, prompt: Prompt, sampling: SamplingParams | None = None,
               spec: SpecConfig | None = None) -> Iterator[str]:
        """Yield text deltas as tokens are produced (drives the engine itself)."""
        return driver.stream(self, prompt, sampling, spec)

    def close(self) -> None:
        """Free every allocation; idempotent; the engine refuses work afterwards."""
        if self.scheduler is not None:
            for req in list(self.scheduler.running) + list(self.scheduler.waiting):
                self.scheduler.finish(req)
        self.runner.close()
        if self.contention is not None and affinity.current() is not None:
            # this engine pinned the process to fewer cores (at init or since): give them back
            affinity.pin(len(affinity.HOME or ()), None)
            self.contention.cpus = None
        self.scheduler = self.out.scheduler = None
        self._closed = True

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def check_open(self) -> None:
        if self._closed:
            raise RuntimeError("engine is closed")

    # -- the step -----------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[StepOutput]:
        """Advance every running request by one step; returns per-request token deltas.

        Step faults: an exception escaping any phase (schedule, prefill, draft, verify, accept,
        commit, extend, sampler; a ``fatal`` hook) fails every request running in this step —
        ``finish_reason="error"``, ``error`` naming the exception, KV freed — and is then
        re-raised with a note listing them; it is never swallowed. Waiting requests are untouched
        and the engine stays consistent: later steps and new requests run as usual (a serving
        loop may still choose to stop, as :mod:`workbench.serve.loop` does). Non-finite logits
        are not a step fault: that request alone fails and the step returns normally.

        Aborts asked for during the step (from a hook) take effect when it ends; each such
        request then has a finished output with ``finish_reason="abort"``.
        """
        self.check_open()
        outputs: dict[int, StepOutput] = {}
        self._stepping = True
        try:
            self._step(outputs)
        except BaseException as e:
            failed = self._fail_running(e)
            if hasattr(e, "add_note"):  # Python >= 3.11
                e.add_note(f"workbench: step {self.step_id} failed; requests {failed} were "
                           "failed with this error and their KV freed; the engine keeps serving")
            raise
        finally:
            self._stepping = False
            while self._deferred_aborts:
                rid = self._deferred_aborts.pop(0)
                req = self.requests.get(rid)
                if req is not None and not req.finished:
                    self.out.finish(req, "abort")
                    prev = outputs.get(rid)
                    outputs[rid] = StepOutput(rid, prev.new_token_ids if prev else [], True,
                                              "abort", None)
        return list(outputs.values())

    def _fail_running(self, e: BaseException) -> list[int]:
        """After a step fault: fail every running request with ``e`` and free its KV."""
        assert self.scheduler is not None
        failed = []
        for r in list(self.scheduler.running):
            r.error = f"request {r.rid}: step {self.step_id} failed: {type(e).__name__}: {e}"
            self.out.finish(r, "error")
            failed.append(r.rid)
        return failed

    def _step(self, outputs: dict[int, StepOutput]) -> None:
        """schedule (policy decision, KV room) → prefill → [draft → verify → accept → commit →
        draft extend] for the speculating requests → a plain decode for the rest → account."""
        assert self.scheduler is not None
        t_start = time.perf_counter()
        self.step_id += 1
        self.worker.begin_step(self.spec, self.step_id)
        faults.check("step:schedule")
        batch = self.scheduler.plan_step(self.worker.plan)
        phases: dict[str, float] = {}
        if batch.prefill:
            t = time.perf_counter()
            self.worker.prefill(batch.prefill, outputs)
            phases["prefill"] = _ms(t)
        if batch.decision is None:
            self.stats.steps["prefill"] += bool(batch.prefill)
            return
        # phases are contiguous: "schedule" runs from the step's start to the decode work
        phases["schedule"] = _ms(t_start) - phases.get("prefill", 0.0)
        ran, accepted = self.worker.speculate(batch, outputs, phases) if batch.speculate \
            else ([], [])
        plain = batch.plain_after(ran)  # policy off, no room for a tree, draft not ready
        if plain:
            self.worker.plain(plain, outputs, phases)
        mode: Literal["plain", "spec"] = "spec" if accepted else "plain"
        total = _ms(t_start)
        self.worker.end_step(batch, mode, accepted, phases, total)
        if self.contention is not None:
            shape = batch.decision.shape if accepted else None
            self.contention.observe(mode, len(batch.decode), total, shape,
                                    max(r.kv_len for r in batch.decode) if batch.decode else 0)


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1e3
