"""The engine: staged all-or-nothing init, then one ``step`` loop for plain and speculative steps.

A step (DESIGN.md §4): schedule → prefill chunks → policy → [draft tree → verify (one target
forward over every request's tree) → accept → commit KV] or [one plain decode forward] →
draft extend → emit. Plain steps never touch tree machinery or reserve lookahead KV.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from workbench import faults
from workbench.attention import backend_name, make_attention_backend
from workbench.attention.paged import PagedAttention
from workbench.config import EngineConfig, SamplingParams, SpecConfig
from workbench.core import LogprobParams, Request, RequestOutput, StepOutput, TopLogprobs
from workbench.engine.kv_cache import KVPool
from workbench.engine.sampler import (
    make_generator,
    process_probs,
    sample_rows,
    valid_distribution,
)
from workbench.engine.scheduler import Scheduler
from workbench.errors import ConfigError, EngineInitError, RequestError
from workbench.models.config import ModelConfig
from workbench.models.eagle3 import Eagle3Draft
from workbench.models.llama import LlamaForCausalLM
from workbench.speculative.drafter import draft_tree
from workbench.speculative.policy import Decision, PolicyContext
from workbench.speculative.verify import greedy_verify, sample_verify, simulated_verify
from workbench.trace import events as ev
from workbench.trace.tracer import Dispatcher

Prompt = str | Sequence[int] | Sequence[dict[str, str]]


# draft_state="auto": an off stretch keeps the draft warm for this many plain steps, then goes
# cold (measured on the 2-core EPYC: a warm plain step costs 0.7-4.6 ms more than a cold one at
# batch 1-64, a cold catch-up 1.3-12 ms once per switch; short flips stay cheap either way).
AUTO_WARM_STEPS = 8
# draft_state="auto" with catchup_window=None: warm plain steps extend backlogs up to this size
AUTO_CATCHUP_ROWS = 32


class EngineStats:
    """Engine-wide counters with SGLang/vLLM semantics."""

    def __init__(self) -> None:
        self.steps = {"plain": 0, "spec": 0, "prefill": 0}
        self.verify_ct = 0
        self.accept_lengths: list[int] = []
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos: list[int] = []
        self.generated_tokens = 0

    @property
    def accept_length(self) -> float:
        """Mean τ: every verify emits its accepted tokens plus one bonus token (O(1))."""
        if not self.verify_ct:
            return 1.0
        return (self.num_accepted_tokens + self.verify_ct) / self.verify_ct

    @property
    def accept_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0


class Engine:
    """Build with :meth:`from_pretrained`. Either fully initialised or not at all."""

    def __init__(self, model: str | Path, draft: str | Path | None = None,
                 config: EngineConfig | None = None, tracer: Any = None) -> None:
        # Every attribute exists before the first fallible stage (no half-built object).
        self.config = config or EngineConfig()
        self.model_path = model
        self.draft_path = draft
        self.model_config: ModelConfig | None = None
        self.target: LlamaForCausalLM | None = None
        self.draft: Eagle3Draft | None = None
        self.aux_layers: tuple[int, ...] = ()
        self.tokenizer: Any = None
        self.pool: KVPool | None = None
        self.attn: PagedAttention | None = None
        self.draft_attn: PagedAttention | None = None
        self.graphs: Any = None  # cuda_graphs.GraphRunner on CUDA, else None (eager)
        self.scheduler: Scheduler | None = None
        self.spec: SpecConfig | None = None
        self.stats = EngineStats()
        self.trace = Dispatcher()
        if tracer is not None:
            self.trace.tracer = tracer
        self.hooks = self.trace.hooks
        self.requests: dict[int, Request] = {}
        self.step_id = 0
        self._plain_streak = 0  # consecutive decode steps without speculation (draft_state auto)
        self.max_model_len = 0
        self.eos_ids: set[int] = set()
        self.baseline_only = False
        self._rids = itertools.count()
        self._closed = False
        self._stepping = False  # inside step(): abort() defers to the step's end
        self._deferred_aborts: list[int] = []
        self._row_errors: dict[int, str] = {}  # rid → request-scoped sampling failure this step
        self.init_log: list[tuple[str, str, float]] = []
        # every machine-dependent "auto", decided at init (engine/autotune.py): name → Choice dict
        self.choices: dict[str, Any] = {}
        self._init()

    @classmethod
    def from_pretrained(cls, model: str | Path, draft: str | Path | None = None,
                        config: EngineConfig | None = None) -> Engine:
        return cls(model, draft, config)

    # -- staged init ----------------------------------------------------------------------
    def _init(self) -> None:
        stages: list[tuple[str, Callable[[], str | None]]] = [
            ("load_config", self._stage_load_config),
            ("load_target", self._stage_load_target),
            ("load_draft", self._stage_load_draft),
            ("autotune", self._stage_autotune),
            ("allocate_kv", self._stage_allocate_kv),
            ("attention_backend", self._stage_attention_backend),
            ("draft_attention_backend", self._stage_draft_attention_backend),
            ("cuda_graphs", self._stage_cuda_graphs),
            ("compile", self._stage_compile),
            ("self_check", self._stage_self_check),
        ]
        for name, fn in stages:
            t0 = time.perf_counter()
            try:
                faults.check(f"init:{name}")
                detail = fn()
            except Exception as e:  # re-raised as EngineInitError after freeing everything
                if self._draft_stage(name) and self.config.allow_baseline_fallback:
                    self._drop_draft(f"{type(e).__name__}: {e}")
                    self._record_stage(name, "fallback", t0, f"{type(e).__name__}: {e}")
                    continue
                if name == "cuda_graphs" and self.config.cuda_graphs_fallback:
                    self.graphs = None  # configured: run eagerly, said so in the InitStage event
                    self._record_stage(name, "fallback", t0, f"{type(e).__name__}: {e}")
                    continue
                self._record_stage(name, "failed", t0, f"{type(e).__name__}: {e}")
                self.close()
                raise EngineInitError(name, e) from e
            self._record_stage(name, "ok", t0, detail or "")

    def _draft_stage(self, name: str) -> bool:
        return self.draft_path is not None and name in ("load_draft", "draft_attention_backend")

    def _drop_draft(self, why: str) -> None:
        """Configured fallback: an explicit baseline engine, said so in an InitStage event."""
        self.draft = None
        self.draft_attn = None
        self.aux_layers = ()
        self.baseline_only = True
        if self.pool is not None:
            self.pool.dk = self.pool.dv = None

    def _record_stage(self, name: str, status: str, t0: float, detail: str) -> None:
        seconds = time.perf_counter() - t0
        self.init_log.append((name, status, seconds))
        if self.trace.enabled:
            self.trace.emit(ev.InitStage(t=time.perf_counter(), stage=name, status=status,
                                         seconds=seconds, detail=detail))

    def _stage_load_config(self) -> None:
        from workbench.models.loader import resolve_path

        folder = resolve_path(self.model_path)
        self.model_path = folder
        self.model_config = ModelConfig.from_folder(folder)
        if self.config.threads:
            torch.set_num_threads(self.config.threads)
        cfg_len = self.model_config.max_position_embeddings
        self.max_model_len = min(cfg_len, self.config.max_model_len or cfg_len)
        self.eos_ids = set(self.model_config.eos_token_id)
        if (Path(folder) / "tokenizer.json").is_file() or \
                (Path(folder) / "tokenizer_config.json").is_file():
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(str(folder))

    def _stage_load_target(self) -> str:
        from workbench.models.loader import load_target

        self.target, _, _ = load_target(self.model_path, self.config.dtype, self.config.device)
        self.target.fuse(self.config.gemm)
        return f"gemm={self.target.gemm}"

    def _stage_load_draft(self) -> None:
        if self.draft_path is None:
            return
        from workbench.models.loader import load_eagle3

        assert self.target is not None
        self.draft, self.aux_layers = load_eagle3(self.draft_path, self.target,
                                                  self.config.dtype, self.config.device)
        self.draft.fuse(self.config.gemm)

    def _stage_autotune(self) -> str:
        """Measure every machine-dependent "auto" (GEMM path...) on the real weights, or read
        the per-machine cache (engine/autotune.py); the choices and timings are the detail."""
        from workbench.engine import autotune

        found = autotune.autotune(self)
        self.choices = {name: c.to_dict() for name, c in found.items()}
        return autotune.describe(found)

    def _stage_allocate_kv(self) -> None:
        cfg, mc = self.config, self.model_config
        assert mc is not None
        draft_shape = None
        if self.draft is not None:
            dc = self.draft.config
            draft_shape = (dc.num_key_value_heads, dc.head_dim)
        self.pool = KVPool(cfg.kv_budget_tokens // cfg.page_size, cfg.page_size,
                           mc.num_hidden_layers, mc.num_key_value_heads, mc.head_dim,
                           self.target.model.embed_tokens.weight.dtype if self.target else
                           torch.float32, cfg.device, draft_shape)
        self.scheduler = Scheduler(self.pool, cfg.max_batch_size, cfg.max_prefill_tokens)
        # A request alone must always fit the pool, or preemption could never make room for it
        # (it would wait forever): cap its context at the pool's capacity ("length" finish).
        self.max_model_len = min(self.max_model_len, self.pool.num_blocks * self.pool.page_size)

    def _stage_attention_backend(self) -> str:
        assert self.pool is not None and self.model_config is not None
        self.attn = make_attention_backend(self.config.attention_backend, self.pool.k,
                                           self.pool.v, self.model_config.num_attention_heads,
                                           self.pool.page_size)
        return f"backend={backend_name(self.attn)}"

    def _stage_draft_attention_backend(self) -> None:
        if self.draft is None:
            return
        assert self.pool is not None and self.pool.dk is not None and self.pool.dv is not None
        self.draft_attn = make_attention_backend(self.config.attention_backend, self.pool.dk,
                                                 self.pool.dv,
                                                 self.draft.config.num_attention_heads,
                                                 self.pool.page_size)

    def _stage_cuda_graphs(self) -> str:
        """CUDA: capture decode graphs (engine/cuda_graphs.py). CPU or cuda_graphs=False: skipped
        (status "ok", detail "skipped: ..."); the engine then runs every forward eagerly."""
        if torch.device(self.config.device).type != "cuda":
            return "skipped: not a CUDA device"
        if not self.config.cuda_graphs:
            return "skipped: EngineConfig.cuda_graphs=False"
        from workbench.engine import cuda_graphs

        self.graphs = cuda_graphs.capture(self)
        return f"captured {len(self.graphs.graphs)} graphs ({self.graphs.attention} attention)"

    def _stage_compile(self) -> str:
        """CPU: the Inductor-compiled bs=1 decode forward per ``EngineConfig.compile``
        (engine/compiled.py). A compile that fails or overruns its budget leaves the engine
        eager, named in the detail; the self-check below then runs through whichever path won."""
        from workbench.engine import compiled

        return compiled.compile_stage(self)

    def _stage_self_check(self) -> None:
        if not self.config.self_check:
            return
        assert self.model_config is not None
        prompt = list(range(1, min(9, self.model_config.vocab_size)))
        sp = SamplingParams(max_new_tokens=4)
        plain = self.generate([prompt], sp)[0].token_ids
        if len(plain) != 4:
            raise RuntimeError(f"self-check produced {len(plain)} tokens, expected 4")
        if self.draft is not None:
            spec = self.generate([prompt], sp, spec=SpecConfig(num_steps=2, topk=2,
                                                               num_draft_tokens=4))[0].token_ids
            if spec != plain:
                raise RuntimeError(f"self-check: speculative output {spec} != plain {plain}")
        self.stats = EngineStats()
        self.step_id = 0
        self._plain_streak = 0

    # -- public API -------------------------------------------------------------------------
    def set_tracer(self, tracer: Any) -> None:
        self.trace.tracer = tracer

    @property
    def tracer(self) -> Any:
        return self.trace.tracer

    def set_spec(self, spec: SpecConfig | None) -> None:
        if spec is not None and not isinstance(spec, SpecConfig):
            raise ConfigError(f"spec: expected a SpecConfig or None, got {spec!r}")
        if spec is not None and self.draft is None:
            why = " (draft init failed; running as an explicit baseline)" if self.baseline_only \
                else ""
            raise ConfigError(f"spec: this engine has no draft model{why}")
        self.spec = spec

    def tokenize(self, prompt: Prompt, field: str = "prompt") -> list[int]:
        """Text, token ids or chat messages → token ids; RequestError naming ``field``.

        Reads only the tokenizer and the model config (both fixed after init), so a server may
        call it off the engine thread."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError(f"{field}: text given but the model folder has no tokenizer")
            if not prompt:
                raise RequestError(f"{field}: empty prompt")
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError as e:
                raise RequestError(f"{field}: not valid Unicode text (lone surrogate at index "
                                   f"{e.start})") from None
            return list(self.tokenizer.encode(prompt, add_special_tokens=False))
        if not isinstance(prompt, Sequence) or isinstance(prompt, (bytes, bytearray)):
            raise RequestError(f"{field}: expected text, a list of token ids or a list of chat "
                               f"messages, got {type(prompt).__name__}")
        items = list(prompt)
        if items and all(isinstance(m, dict) for m in items):
            if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
                raise RequestError(f"{field}: chat messages given but the tokenizer has no chat "
                                   "template")
            return list(self.tokenizer.apply_chat_template(items, add_generation_prompt=True,
                                                           tokenize=True))
        if not items:
            raise RequestError(f"{field}: empty prompt")
        assert self.model_config is not None
        vocab = self.model_config.vocab_size
        for t in items:
            if not isinstance(t, int) or isinstance(t, bool):
                raise RequestError(f"{field}: token ids must be integers, got {t!r}")
            if not 0 <= t < vocab:
                raise RequestError(f"{field}: token id {t} outside the vocabulary [0, {vocab})")
        return items

    def add_request(self, prompt: Prompt, sampling: SamplingParams | None = None,
                    logprobs: LogprobParams | None = None) -> int:
        """Queue one request; returns its id. Invalid input raises RequestError (nothing queued).
        ``logprobs``: return log-probabilities too (:class:`~workbench.core.LogprobParams`)."""
        self._check_open()
        sp = sampling or SamplingParams()
        if not isinstance(sp, SamplingParams):
            raise RequestError(f"sampling: expected SamplingParams, got {type(sp).__name__}")
        if logprobs is not None and not isinstance(logprobs, LogprobParams):
            raise RequestError(f"logprobs: expected LogprobParams, got "
                               f"{type(logprobs).__name__}")
        ids = self.tokenize(prompt)
        if logprobs is not None and logprobs.start is not None and logprobs.start > len(ids):
            raise RequestError(f"logprob_start_len: {logprobs.start} is beyond the prompt "
                               f"({len(ids)} tokens)")
        if len(ids) >= self.max_model_len:
            raise RequestError(f"prompt: {len(ids)} tokens does not fit the context "
                               f"(max_model_len {self.max_model_len})")
        assert self.pool is not None and self.scheduler is not None
        capacity = self.pool.num_blocks * self.pool.page_size
        if len(ids) + 1 > capacity:
            raise RequestError(f"prompt: {len(ids)} tokens exceeds the KV pool ({capacity} tokens)")
        rid = next(self._rids)
        req = Request(rid=rid, prompt_ids=ids, sampling=sp, logprobs=logprobs)
        if logprobs is not None and logprobs.start == 0 and ids:
            req.input_logprobs.append(None)  # the first prompt token has no context
            req.input_top_logprobs.append(None)
        req.generator = make_generator(sp, fallback_seed=rid)
        req.spec_capable = self.spec is not None
        self.requests[rid] = req
        self.scheduler.add(req)
        if self.trace.enabled:
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
        self._finish(req, "abort")

    def has_unfinished(self) -> bool:
        return self.scheduler is not None and self.scheduler.has_work()

    def kv_usage(self) -> dict[str, int]:
        self._check_open()
        assert self.pool is not None
        return {"used_blocks": self.pool.used_blocks, "total_blocks": self.pool.num_blocks,
                "page_size": self.pool.page_size}

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
        text_s = self.text_of(req) if self.tokenizer is not None and text else ""
        lossless = self.spec is None or self.spec.lossless
        lp = req.logprobs
        return RequestOutput(rid=rid, prompt_ids=req.prompt_ids, token_ids=list(req.output_ids),
                             text=text_s, finish_reason=req.finish_reason or "",
                             metrics=req.metrics, error=req.error, lossless=lossless,
                             from_draft=list(req.emitted_from_draft),
                             matched_stop=req.matched_stop,
                             output_logprobs=None if lp is None else list(req.output_logprobs),
                             output_top_logprobs=None if lp is None or not lp.top_k else
                             list(req.output_top_logprobs),
                             input_logprobs=None if lp is None or lp.start is None else
                             list(req.input_logprobs),
                             input_top_logprobs=None if lp is None or lp.start is None or
                             not lp.top_k else list(req.input_top_logprobs),
                             logprob_start=None if lp is None else lp.start)

    def text_of(self, req: Request) -> str:
        """The request's output text, its matched stop trimmed (see :meth:`output`)."""
        ids, m = req.output_ids, req.matched_stop
        trim = req.finish_reason == "stop" and m is not None and not req.sampling.no_stop_trim
        if trim and isinstance(m, int) and ids:
            ids = ids[:-1]
        text = self.tokenizer.decode(ids)
        if trim and isinstance(m, str):
            pos = text.find(m)
            if pos != -1:
                text = text[:pos]
        return text

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling: SamplingParams | Sequence[SamplingParams] | None = None,
                 spec: SpecConfig | None = None, progress: bool = False) -> list[RequestOutput]:
        """Run prompts to completion (continuous batching) and return outputs in order."""
        self._check_open()
        if isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts and
                                        isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        if not isinstance(prompts, Sequence) or isinstance(prompts, (bytes, bytearray)):
            raise RequestError(f"prompts: expected a prompt or a list of prompts, got "
                               f"{type(prompts).__name__}")
        plist = list(prompts)
        for i, p in enumerate(plist):  # before anything is queued: all or nothing
            if not isinstance(p, (str, Sequence)) or isinstance(p, (bytes, bytearray)):
                raise RequestError(f"prompts[{i}]: expected text, token ids or chat messages, "
                                   f"got {type(p).__name__}")
        sps = list(sampling) if isinstance(sampling, Sequence) else [sampling] * len(plist)
        if len(sps) != len(plist):
            raise RequestError(f"sampling: {len(sps)} params for {len(plist)} prompts")
        previous = self.spec
        self.set_spec(spec)
        rids: list[int] = []
        try:
            for p, s in zip(plist, sps, strict=True):
                rids.append(self.add_request(p, s))
            bar = None
            if progress:
                from tqdm.auto import tqdm

                bar = tqdm(total=len(rids), desc="generate", unit="req")
            pending = set(rids)
            while pending:
                self.step()
                # by state, not by step outputs: a request aborted outside a step has none
                done = {r for r in pending if self.requests[r].finished}
                pending -= done
                if bar is not None:
                    bar.update(len(done))
            if bar is not None:
                bar.close()
            return [self.output(r) for r in rids]
        finally:
            for r in rids:  # a bad prompt, a step fault or Ctrl-C leaves no request behind
                self.abort(r)
            self.spec = previous

    def stream(self, prompt: Prompt, sampling: SamplingParams | None = None,
               spec: SpecConfig | None = None) -> Iterator[str]:
        """Yield text deltas as tokens are produced (drives the engine itself)."""
        previous = self.spec
        self.set_spec(spec)
        try:
            rid = self.add_request(prompt, sampling)
        except BaseException:
            self.spec = previous  # a refused prompt leaves the engine's spec as it was
            raise
        text = ""
        try:
            while True:
                self.step()
                req = self.requests[rid]
                if self.tokenizer is not None:
                    full = self.text_of(req)
                    if not req.finished:  # a partial stop string may still complete
                        full = hold_back_stops(full, req.sampling.stop)
                    if not full.endswith("\ufffd") and len(full) > len(text):
                        yield full[len(text):]
                        text = full
                if req.finished:
                    if req.error:
                        raise RequestError(req.error)
                    return
        finally:
            self.abort(rid)
            self.spec = previous

    def close(self) -> None:
        """Free every allocation; idempotent; the engine refuses work afterwards."""
        if self.scheduler is not None:
            for req in list(self.scheduler.running) + list(self.scheduler.waiting):
                self.scheduler.finish(req)
        self.pool = None
        self.attn = self.draft_attn = None
        self.graphs = None
        self.scheduler = None
        self.target = None
        self.draft = None
        self._closed = True

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
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
        self._check_open()
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
                    self._finish(req, "abort")
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
            self._finish(r, "error")
            failed.append(r.rid)
        return failed

    def _step(self, outputs: dict[int, StepOutput]) -> None:
        assert self.scheduler is not None
        t_start = time.perf_counter()
        self.step_id += 1
        self._row_errors.clear()
        phases: dict[str, float] = {}
        faults.check("step:schedule")
        sched = self.scheduler.schedule()
        if sched.prefill:
            t = time.perf_counter()
            self._prefill(sched.prefill, outputs)
            phases["prefill"] = _ms(t)
        decode = [r for r in sched.decode if not r.finished]
        mode = "prefill" if sched.prefill else "idle"
        if decode:
            decision = self._decide(decode)
            # a request with one token left gains nothing from a draft: it decodes plainly
            spec_reqs = [r for r in decode if r.spec_capable and self._room(r) > 1] \
                if decision.speculate else []
            # phases are contiguous: "schedule" runs from the step's start to the decode work
            # (scheduling + policy decision); prefill is timed on its own
            phases["schedule"] = _ms(t_start) - phases.get("prefill", 0.0)
            accepted: list[int] = []
            if spec_reqs:
                spec_reqs, accepted = self._spec_step(spec_reqs, decision, outputs, phases)
                mode = "spec"
            # Everything that did not speculate (policy off, draft not ready) decodes plainly.
            done = {id(r) for r in spec_reqs}
            plain_reqs = [r for r in decode if id(r) not in done and not r.finished]
            if plain_reqs:
                self._plain_step(plain_reqs, outputs, phases)
                mode = "plain" if not spec_reqs else "spec"
            total = _ms(t_start)
            self._plain_streak = 0 if spec_reqs else self._plain_streak + 1
            self.stats.steps[mode] = self.stats.steps.get(mode, 0) + 1
            if self.spec is not None:
                if decision.speculate and mode != "spec":  # nobody could speculate: say so
                    decision = Decision(False, reason=f"{decision.reason}; ran plain")
                # the policy learns the step's own cost: prefill and a cold draft's one-off
                # catch-up (bounded by catchup_window; in the trace's draft_ms) are left out
                self.spec.policy.observe(  # type: ignore[union-attr]
                    decision, total - phases.get("prefill", 0.0) - phases.get("catchup", 0.0),
                    accepted)
            if self.trace.enabled:
                self._emit_step(decision, len(decode), mode, phases, total)
        elif sched.prefill:
            self.stats.steps["prefill"] += 1

    def _room(self, r: Request) -> int:
        """How many more tokens ``r`` may emit (max_new_tokens, context length)."""
        return min(r.sampling.max_new_tokens - (len(r.tokens) - len(r.prompt_ids)),
                   self.max_model_len - len(r.tokens))

    def _draft_warm(self) -> bool:
        """Does a plain step extend the draft now? (``SpecConfig.draft_state``)"""
        spec = self.spec
        if spec is None:
            return False
        if spec.draft_state == "auto":
            return self._plain_streak < AUTO_WARM_STEPS
        return spec.draft_state == "warm"

    def _extend_now(self, reqs: list[Request]) -> list[Request]:
        """The drafts a step that does not speculate (prefill, plain decode) extends now:
        ``warm`` all of them, ``cold`` none, ``auto`` — in the first AUTO_WARM_STEPS steps of
        an off stretch — those at most ``catchup_window`` behind: current drafts stay current,
        a big backlog (a fresh prompt) waits for the request's first speculative step, which
        needs that extend anyway, so a policy that is off under load never pays for it."""
        spec = self.spec
        if spec is None or not reqs or not self._draft_warm():
            return []
        if spec.draft_state == "auto":
            cap = spec.catchup_window or AUTO_CATCHUP_ROWS
            return [r for r in reqs if r.kv_len - r.draft_len <= cap]
        return reqs

    def _decide(self, decode: list[Request]) -> Decision:
        spec = self.spec
        if spec is None or self.draft is None:
            return Decision(False, reason="no spec")
        ctx = PolicyContext(self.step_id, len(decode), spec.num_steps, spec.topk,
                            spec.num_draft_tokens or spec.num_steps + 1,
                            context_tokens=sum(r.kv_len for r in decode) // len(decode),
                            draft_state="warm" if self._draft_warm() else "cold")
        return spec.policy.decide(ctx)  # type: ignore[union-attr]

    def _emit_step(self, d: Decision, batch: int, mode: str, phases: dict[str, float],
                   total: float) -> None:
        now = time.perf_counter()
        self.trace.emit(ev.PolicyDecision(t=now, step=self.step_id, batch_size=batch,
                                          decode_batch=batch, speculate=d.speculate,
                                          num_steps=d.num_steps, topk=d.topk,
                                          num_draft_tokens=d.num_draft_tokens, reason=d.reason,
                                          predicted_ms=d.predicted_ms, measured_ms=total))
        self.trace.emit(ev.StepTiming(
            t=now, step=self.step_id, batch_size=batch, mode=mode,
            schedule_ms=phases.get("schedule", 0.0) + phases.get("prefill", 0.0),
            draft_ms=phases.get("draft", 0.0), verify_ms=phases.get("verify", 0.0),
            accept_ms=phases.get("accept", 0.0), commit_ms=phases.get("commit", 0.0),
            extend_ms=phases.get("extend", 0.0) + phases.get("decode", 0.0), total_ms=total))
        assert self.pool is not None and self.scheduler is not None
        # only running requests hold KV (waiting ones have kv_len 0); self.requests keeps every
        # request not yet released, so summing over it would grow with the engine's lifetime
        self.trace.emit(ev.KVUsage(t=now, step=self.step_id, used_blocks=self.pool.used_blocks,
                                   total_blocks=self.pool.num_blocks,
                                   used_tokens=sum(r.kv_len for r in self.scheduler.running)))

    # -- forward helpers -----------------------------------------------------------------------
    def _target_forward(self, reqs: list[Request], starts: list[int], ends: list[int],
                        tokens: torch.Tensor, positions: torch.Tensor,
                        tree_masks: list[torch.Tensor | None] | None = None,
                        want_aux: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """New tokens of request i occupy positions [starts[i], ends[i]); KV for them is
        written to their slots and attention sees positions [0, ends[i])."""
        assert self.pool is not None and self.attn is not None and self.target is not None
        write, kv = [], []
        for r, s, e in zip(reqs, starts, ends, strict=True):
            all_slots = self.pool.slots(r.blocks, 0, e)
            write.append(all_slots[s:])
            kv.append(all_slots)
        q_lens = [e - s for s, e in zip(starts, ends, strict=True)]
        if self.graphs is not None:
            out = self.graphs.run(tokens, positions, torch.cat(write), q_lens, kv, tree_masks,
                                  want_aux)
            if out is not None:
                return out  # type: ignore[no-any-return]
        self.attn.plan(torch.cat(write), q_lens, kv, tree_masks)
        return self.target(tokens, positions, self.attn, self.aux_layers if want_aux else ())

    def _draft_extend(self, reqs: list[Request]) -> None:
        """Feed the draft every position it has not seen: (feature at p, token at p+1)."""
        todo = []
        for r in reqs:
            if r.draft_len == r.kv_len:
                continue
            if r.pending_feats is None or r.pending_rows != r.kv_len - r.draft_len:
                r.spec_capable = False  # features were not kept (spec toggled off): plain only
                continue
            todo.append(r)
        reqs = todo
        if not reqs:
            return
        faults.check("step:extend")
        assert self.draft is not None and self.draft_attn is not None and self.pool is not None
        toks, pos, feats, write, kv, q_lens = [], [], [], [], [], []
        for r in reqs:
            s, e = r.draft_len, r.kv_len
            toks.append(torch.tensor(r.tokens[s + 1 : e + 1]))
            pos.append(torch.arange(s, e))
            feats.extend(r.pending_feats)  # type: ignore[arg-type]
            slots = self._draft_slots(r, e)
            write.append(slots[slots.numel() - (e - s):])
            kv.append(slots)
            q_lens.append(e - s)
        self.draft_attn.plan(torch.cat(write), q_lens, kv)
        hidden = self.draft.features(torch.cat(feats))
        ends = torch.tensor(q_lens).cumsum(0) - 1
        # logits only where the next draft starts (a catch-up over m positions needs 1 row)
        logits, out = self.draft(torch.cat(toks), hidden, torch.cat(pos), self.draft_attn,
                                 logit_rows=ends)
        for i, r in enumerate(reqs):
            r.draft_logits = logits[i]
            r.draft_hidden = out[ends[i]]
            r.draft_len = r.kv_len
            r.pending_feats = None
            r.pending_rows = 0
        if self.trace.enabled:  # after the state it describes (tracer.py: hook policy)
            self.trace.emit(ev.DraftExtended(
                t=time.perf_counter(), step=self.step_id, rids=[r.rid for r in reqs],
                rows=q_lens, holes=[[[s, e] for s, e in r.draft_holes] for r in reqs]))

    def _draft_slots(self, r: Request, end: int) -> torch.Tensor:
        """Draft-pool slots of positions [0, end) the draft holds (its holes left out)."""
        assert self.pool is not None
        slots = self.pool.slots(r.blocks, 0, end)
        if not r.draft_holes:
            return slots
        keep = torch.ones(end, dtype=torch.bool)
        for s, e in r.draft_holes:
            keep[s:e] = False
        return slots[keep]

    def _keep_feats(self, r: Request, feats: torch.Tensor, window: int | None = None) -> None:
        """Append the target features of the next position(s) for the draft. With ``window``
        (a cold stretch: ``SpecConfig.catchup_window``) keep only the latest ``window`` rows;
        the dropped positions become a draft hole and draft_len moves past them."""
        if r.pending_feats is None:
            r.pending_feats = []
        r.pending_feats.append(feats)
        r.pending_rows += feats.shape[0]
        if window is None or r.pending_rows <= window:
            return
        chunks, drop = r.pending_feats, r.pending_rows - window
        start = r.draft_len
        r.draft_len += drop
        r.pending_rows = window
        while drop >= chunks[0].shape[0]:
            drop -= chunks.pop(0).shape[0]
        if drop:
            chunks[0] = chunks[0][drop:]
        holes = r.draft_holes
        if holes and holes[-1][1] == start:
            holes[-1] = (holes[-1][0], r.draft_len)
        else:
            holes.append((start, r.draft_len))

    # -- prefill -----------------------------------------------------------------------------
    def _prefill(self, chunks: list[tuple[Request, int, int]],
                 outputs: dict[int, StepOutput]) -> None:
        faults.check("step:prefill")
        t0 = time.perf_counter()
        reqs = [c[0] for c in chunks]
        starts = [c[1] for c in chunks]
        ends = [c[2] for c in chunks]
        tokens = torch.cat([torch.tensor(r.tokens[s:e]) for r, s, e in chunks])
        positions = torch.cat([torch.arange(s, e) for _, s, e in chunks])
        want_aux = self.draft is not None and any(r.spec_capable for r in reqs)
        hidden, aux = self._target_forward(reqs, starts, ends, tokens, positions,
                                           want_aux=want_aux)
        offs = 0
        done: list[Request] = []
        for r, s, e in chunks:
            n = e - s
            if r.logprobs is not None and r.logprobs.start is not None:
                self._add_input_logprobs(r, s, e, hidden[offs : offs + n])
            if aux is not None and r.spec_capable:
                self._keep_feats(r, aux[offs : offs + n])
            elif r.spec_capable:
                r.spec_capable = False
            r.kv_len = e
            if not r.in_prefill:
                done.append(r)
                if r.sample_after_prefill:
                    logits = self.target.logits(hidden[offs + n - 1 : offs + n])  # type: ignore
                    if self._bad_logits(r, logits, outputs):
                        offs += n
                        continue
                    errors: dict[int, str] = {}
                    tok = int(sample_rows(logits, [r.sampling], [r.generator], errors)[0])
                    if errors:
                        self._fail_request(r, f"request {r.rid}: {errors[0]}", outputs)
                    else:
                        self._emit(r, [tok], [False], outputs)
                        if r.logprobs is not None:
                            self._add_output_logprobs(r, logits)
            offs += n
        todo = self._extend_now([r for r in done if r.spec_capable and not r.finished])
        if todo:
            self._draft_extend(todo)
        if self.trace.enabled:
            self.trace.emit(ev.Prefill(t=time.perf_counter(), rids=[r.rid for r in reqs],
                                       num_tokens=int(tokens.numel()),
                                       chunked=any(r.in_prefill for r in reqs),
                                       seconds=time.perf_counter() - t0))

    # -- plain decode --------------------------------------------------------------------------
    def _plain_step(self, reqs: list[Request], outputs: dict[int, StepOutput],
                    phases: dict[str, float]) -> None:
        assert self.scheduler is not None and self.target is not None
        t = time.perf_counter()
        reqs = self.scheduler.ensure_decode_room(reqs, 1)
        if not reqs:
            phases["decode"] = phases.get("decode", 0.0) + _ms(t)
            return
        kv = [r.kv_len for r in reqs]
        tokens = torch.tensor([r.tokens[-1] for r in reqs])
        want_aux = self.spec is not None and self.draft is not None and \
            any(r.spec_capable for r in reqs)
        hidden, aux = self._target_forward(reqs, kv, [k + 1 for k in kv], tokens,
                                           torch.tensor(kv), want_aux=want_aux)
        logits = self.target.logits(hidden)
        faults.check("step:sampler")
        errors: dict[int, str] = {}
        toks = sample_rows(logits, [r.sampling for r in reqs], [r.generator for r in reqs],
                           errors)
        for i, msg in errors.items():
            self._row_errors[reqs[i].rid] = msg  # _bad_logits below fails that request alone
        phases["decode"] = phases.get("decode", 0.0) + _ms(t)
        t = time.perf_counter()
        warm = []
        # a cold draft keeps only the latest catchup_window features (bounded catch-up); the
        # holes that leaves need a draft attention backend taking any slot list
        window = None if self._draft_warm() or self.spec is None or \
            not getattr(self.draft_attn, "arbitrary_slots", False) else self.spec.catchup_window
        for i, r in enumerate(reqs):
            if self._bad_logits(r, logits[i : i + 1], outputs):
                continue
            r.kv_len += 1
            r.metrics.plain_steps += 1
            if aux is not None and r.spec_capable:
                self._keep_feats(r, aux[i : i + 1], window)
                warm.append(r)
            elif r.spec_capable:
                r.spec_capable = False  # spec was switched off engine-wide: no features kept
            self._emit(r, [int(toks[i])], [False], outputs)
            if r.logprobs is not None:
                self._add_output_logprobs(r, logits[i : i + 1])
        phases["commit"] = phases.get("commit", 0.0) + _ms(t)
        todo = self._extend_now([r for r in warm if not r.finished])
        if todo:
            t = time.perf_counter()
            self._draft_extend(todo)
            phases["extend"] = phases.get("extend", 0.0) + _ms(t)

    # -- speculative decode ------------------------------------------------------------------
    def _spec_step(self, reqs: list[Request], d: Decision, outputs: dict[int, StepOutput],
                   phases: dict[str, float]) -> tuple[list[Request], list[int]]:
        """Returns the requests that speculated and their accepted draft tokens (bonus
        excluded), for the policy's online acceptance estimates."""
        assert self.scheduler is not None and self.target is not None and self.pool is not None
        assert self.draft is not None and self.spec is not None
        n_nodes = d.num_draft_tokens
        t = time.perf_counter()
        reqs = self.scheduler.ensure_decode_room(reqs, n_nodes)
        if not reqs:
            phases["draft"] = _ms(t)
            return [], []
        # 1. Cold drafts catch up over the tokens they missed while speculation was off.
        tc = time.perf_counter()
        self._draft_extend(reqs)
        phases["catchup"] = _ms(tc)
        reqs = [r for r in reqs if r.spec_capable and r.draft_logits is not None]
        if not reqs:
            phases["draft"] = _ms(t)
            return [], []
        # 2. Draft: build every request's tree.
        faults.check("step:draft")
        b = len(reqs)
        root_pos = torch.tensor([r.kv_len for r in reqs])
        on_step = self._trace_draft_step(reqs) if self.trace.enabled else None
        tree = draft_tree(
            self.draft, torch.stack([r.draft_logits for r in reqs]),  # type: ignore[misc]
            torch.stack([r.draft_hidden for r in reqs]),  # type: ignore[misc]
            torch.tensor([r.tokens[-1] for r in reqs]), root_pos,
            [self._draft_slots(r, r.draft_len) for r in reqs], self.pool.dk,
            self.pool.dv, d.num_steps, d.topk, n_nodes, on_step,
            self._score_temperatures(reqs))
        phases["draft"] = _ms(t)
        # 3. Verify: one target forward over all trees (ragged, tree masks).
        t = time.perf_counter()
        faults.check("step:verify")
        n = tree.num_nodes
        starts = [r.kv_len for r in reqs]
        hidden, aux = self._target_forward(
            reqs, starts, [s + n for s in starts], tree.tokens.flatten(),
            tree.positions.flatten(), [tree.mask[i] for i in range(b)], want_aux=True)
        logits = self.target.logits(hidden).view(b, n, -1)
        phases["verify"] = _ms(t)
        # 4. Accept.
        t = time.perf_counter()
        faults.check("step:accept")
        res = self._accept(reqs, tree, logits)
        phases["accept"] = _ms(t)
        # 5. Commit: move every accepted path's KV to consecutive positions, then per request
        # emit its TreeBuilt/Verified, then advance it. A fatal hook raising on request i's
        # events leaves requests before i committed and i onwards untouched (their moved rows
        # lie beyond kv_len: scratch the next verify rewrites), so the engine stays consistent.
        t = time.perf_counter()
        faults.check("step:commit")
        src, dst = [], []
        ok: list[tuple[int, Request, int, torch.Tensor]] = []
        assert aux is not None
        aux = aux.view(b, n, -1)
        for i, r in enumerate(reqs):
            if self._bad_logits(r, logits[i], outputs):
                continue
            m = int(res.accept_len[i])
            path = res.accept_index[i, : m + 1]
            slots = self.pool.slots(r.blocks, r.kv_len, r.kv_len + n)
            moved = path != torch.arange(m + 1)
            if bool(moved.any()):
                src.append(slots[path[moved]])
                dst.append(slots[torch.arange(m + 1)[moved]])
            ok.append((i, r, m, path))
        if src:
            self.pool.compact(torch.cat(src), torch.cat(dst))
        keep: list[Request] = []
        for i, r, m, path in ok:
            new = tree.tokens[i, path[1:]].tolist() + [int(res.bonus[i])]
            if self.trace.enabled:
                self._trace_verify(r, tree, i, res, logits[i], new)
            self._record_accept(r, m, n - 1)
            r.kv_len += m + 1
            self._keep_feats(r, aux[i, path])
            self._emit(r, new, [True] * m + [False], outputs)
            if r.logprobs is not None:  # the verify logits along the accepted path
                self._add_output_logprobs(r, logits[i, path])
            if not r.finished:
                self.pool.trim(r.blocks, r.kv_len + 1)
                keep.append(r)
        phases["commit"] = _ms(t)
        # 6. Draft extend over the accepted tokens (+ bonus) so the next tree can start.
        t = time.perf_counter()
        self._draft_extend(keep)
        phases["extend"] = _ms(t)
        return reqs, res.accept_len.tolist()

    def _score_temperatures(self, reqs: list[Request]) -> torch.Tensor | None:
        """Greedy requests rank tree nodes with the head's calibration temperature (the draft
        is trained to the target's distribution, greedy verification accepts its argmax: a
        sharper score puts deep likely nodes before shallow unlikely ones); sampled ones 1."""
        assert self.draft is not None
        t = self.draft.config.greedy_score_temperature
        if t == 1.0:
            return None
        return torch.tensor([t if r.sampling.greedy else 1.0 for r in reqs])

    def _accept(self, reqs: list[Request], tree: Any, logits: torch.Tensor) -> Any:
        spec = self.spec
        assert spec is not None
        if spec.simulate_accept_length is not None:
            a = spec.simulate_accept_length - 1.0
            lo = int(a)
            acc = torch.tensor([lo + (1 if torch.rand(()) < a - lo else 0) for _ in reqs])
            return simulated_verify(tree, logits, acc)
        greedy = [i for i, r in enumerate(reqs) if r.sampling.greedy]
        if len(greedy) == len(reqs):
            return greedy_verify(tree, logits)
        b, n = tree.tokens.shape
        logits = logits.float()
        probs = torch.zeros_like(logits)
        coins = torch.zeros(b, n)
        final_u = torch.zeros(b)
        for i, r in enumerate(reqs):
            if r.sampling.greedy:  # one-hot at the argmax: rejection sampling reduces to greedy
                probs[i].scatter_(-1, logits[i].argmax(-1, keepdim=True), 1.0)
            else:
                row = process_probs(logits[i], r.sampling)
                if not valid_distribution(row):  # the commit loop fails this request alone
                    self._row_errors[r.rid] = ("sampling: no valid distribution at position "
                                               f"{r.kv_len} (non-finite logits)")
                    row = torch.zeros_like(row).scatter_(
                        -1, logits[i].argmax(-1, keepdim=True), 1.0)
                probs[i] = row
                coins[i] = torch.rand(n, generator=r.generator)
                final_u[i] = torch.rand((), generator=r.generator)
        dev = logits.device
        return sample_verify(tree, probs, coins.to(dev), final_u.to(dev))

    def _record_accept(self, r: Request, m: int, drafted: int) -> None:
        met, st = r.metrics, self.stats
        met.verify_ct += 1
        met.accept_lengths.append(m + 1)
        met.drafted_tokens += drafted
        _count_depths(met.accepted_per_depth, m)
        st.verify_ct += 1
        st.accept_lengths.append(m + 1)
        st.num_drafts += 1
        st.num_draft_tokens += drafted
        st.num_accepted_tokens += m
        _count_depths(st.accepted_per_pos, m)

    # -- emit / finish -------------------------------------------------------------------------
    def _bad_logits(self, r: Request, logits: torch.Tensor,
                    outputs: dict[int, StepOutput]) -> bool:
        """Request-scoped numeric failures fail this request only; the others continue: its
        logits are non-finite, or its sampling found no valid distribution (``_row_errors``)."""
        sampling_error = self._row_errors.pop(r.rid, None)
        if sampling_error is not None:
            self._fail_request(r, f"request {r.rid}: {sampling_error}", outputs)
            return True
        # A finite sum means every logit is finite (a NaN or inf would make it NaN or inf); only
        # a non-finite sum (or a huge finite overflow) pays for the elementwise check.
        if faults.active(f"step:nan_logits@{r.rid}") or (
                not bool(torch.isfinite(logits.sum())) and not bool(torch.isfinite(logits).all())):
            self._fail_request(r, f"request {r.rid}: non-finite logits at position {r.kv_len}",
                               outputs)
            return True
        return False

    def _fail_request(self, r: Request, error: str, outputs: dict[int, StepOutput]) -> None:
        r.error = error
        self._finish(r, "error")
        outputs[r.rid] = StepOutput(r.rid, [], True, "error", r.error)

    def _emit(self, r: Request, new: list[int], from_draft: list[bool],
              outputs: dict[int, StepOutput]) -> None:
        """Append tokens one at a time, applying stop ids / EOS, stop strings, max_new_tokens
        and the context length after each: a block of accepted draft tokens ends exactly where
        plain decoding of the same tokens would (lossless stops)."""
        sp = r.sampling
        now = time.perf_counter()
        if r.metrics.first_token is None:
            r.metrics.first_token = now
        stops = set(sp.stop_token_ids) | (set() if sp.ignore_eos else self.eos_ids)
        check_text = bool(sp.stop) and self.tokenizer is not None
        kept: list[int] = []
        reason = None
        room = self._room(r)
        for tok in new:
            kept.append(tok)
            r.tokens.append(tok)
            if tok in stops:
                reason, r.matched_stop = "stop", tok
                break
            if check_text:
                hit = self._stop_string(r)
                if hit is not None:
                    reason, r.matched_stop = "stop", hit
                    break
            if len(kept) >= room:  # max_new_tokens or the context length reached
                reason = "length"
                break
        r.emitted_from_draft.extend(from_draft[: len(kept)])
        r.metrics.token_times.extend([now] * len(kept))
        self.stats.generated_tokens += len(kept)
        prev = outputs.get(r.rid)
        delta = (prev.new_token_ids if prev else []) + kept
        if reason is not None:
            self._finish(r, reason)
        outputs[r.rid] = StepOutput(r.rid, delta, r.finished, r.finish_reason, r.error)

    def _add_output_logprobs(self, r: Request, rows: torch.Tensor) -> None:
        """Log-probabilities of the tokens the last ``_emit`` appended (it may have stopped
        early): row j of ``rows`` is the target's logits that produced its j-th token."""
        out = r.output_ids
        k = len(out) - len(r.output_logprobs)
        if k <= 0:
            return
        sp = r.sampling
        t = 1.0 if sp.greedy or sp.temperature <= 0 else float(sp.temperature)
        lp = torch.log_softmax(rows[:k].float() / t, dim=-1)
        toks = torch.tensor(out[len(out) - k:], device=lp.device)
        r.output_logprobs.extend(lp.gather(1, toks[:, None])[:, 0].tolist())
        assert r.logprobs is not None
        if r.logprobs.top_k:
            r.output_top_logprobs.extend(_top_logprobs(lp, r.logprobs.top_k))

    def _add_input_logprobs(self, r: Request, s: int, e: int, hidden: torch.Tensor) -> None:
        """Prompt tokens' log-probabilities from a prefill chunk covering positions [s, e):
        position p's raw logits score the token at p + 1 (from ``logprobs.start`` on). A
        re-prefill after preemption finds its positions done and adds nothing."""
        assert r.logprobs is not None and r.logprobs.start is not None
        assert self.target is not None
        start, n_prompt = r.logprobs.start, len(r.prompt_ids)
        # token index j = p + 1 is next in line when j - start == len(input_logprobs)
        first = start + len(r.input_logprobs) - 1
        lo, hi = max(s, first), min(e, n_prompt - 1)
        if lo >= hi:
            return
        logits = self.target.logits(hidden[lo - s : hi - s])
        lp = torch.log_softmax(logits.float(), dim=-1)
        toks = torch.tensor(r.prompt_ids[lo + 1 : hi + 1], device=lp.device)
        r.input_logprobs.extend(lp.gather(1, toks[:, None])[:, 0].tolist())
        if r.logprobs.top_k:
            r.input_top_logprobs.extend(_top_logprobs(lp, r.logprobs.top_k))

    def _stop_string(self, r: Request) -> str | None:
        """The stop string the newest token completes, if any. A new match ends in the newest
        token's text, so decoding a tail of the output suffices: a string of L characters spans
        at most 4L tokens (a byte-level token carries at least one UTF-8 byte), plus a margin so
        the tail's first token (whose decoding may differ, e.g. a leading space) is not part of
        it."""
        stops = r.sampling.stop
        out = r.output_ids
        window = 4 * max(len(s) for s in stops) + 8
        tail = self.tokenizer.decode(out[-window:])
        for s in stops:
            if s in tail:
                return s
        return None

    def _finish(self, r: Request, reason: str) -> None:
        assert self.scheduler is not None
        r.finish_reason = reason
        r.metrics.finished = time.perf_counter()
        self.scheduler.finish(r)
        if self.trace.enabled:
            m = r.metrics
            self.trace.emit(ev.RequestFinished(
                t=time.perf_counter(), rid=r.rid, reason=reason, prompt_len=len(r.prompt_ids),
                output_len=len(r.output_ids), verify_ct=m.verify_ct,
                accept_lengths=list(m.accept_lengths), ttft_s=m.ttft if m.ttft else 0.0,
                e2e_s=m.e2e or 0.0, error=r.error or ""))

    # -- tracing helpers (only called when a tracer or hook is active) -------------------------
    def _trace_draft_step(self, reqs: list[Request]) -> Callable[..., None]:
        rids = [r.rid for r in reqs]

        def on_step(depth: int, tokens: torch.Tensor, probs: torch.Tensor,
                    parents: torch.Tensor) -> None:
            self.trace.emit(ev.DraftStep(t=time.perf_counter(), step=self.step_id, rids=rids,
                                         depth=depth, tokens=tokens.tolist(),
                                         probs=probs.tolist(), parents=parents.tolist()))
        return on_step

    def _trace_verify(self, r: Request, tree: Any, i: int, res: Any, logits: torch.Tensor,
                      new: list[int]) -> None:
        now = time.perf_counter()
        self.trace.emit(ev.TreeBuilt(t=now, step=self.step_id, rid=r.rid,
                                     tokens=tree.tokens[i].tolist(),
                                     parents=tree.parents[i].tolist(),
                                     depth=tree.depth[i].tolist(),
                                     scores=tree.scores[i].tolist(),
                                     draft_probs=tree.draft_probs[i].tolist()))
        probs = torch.softmax(logits, -1)
        par = tree.parents[i].clamp(min=0)
        tp = probs[par, tree.tokens[i]]
        tp[0] = 1.0
        m = int(res.accept_len[i])
        self.trace.emit(ev.Verified(t=now, step=self.step_id, rid=r.rid,
                                    target_tokens=res.target_tokens[i].tolist(),
                                    target_probs=tp.tolist(),
                                    accepted_path=res.accept_index[i, : m + 1].tolist(),
                                    accepted_tokens=new, accept_length=len(new),
                                    bonus_token=int(res.bonus[i])))


def hold_back_stops(text: str, stops: tuple[str, ...]) -> str:
    """``text`` without its longest suffix that begins one of ``stops``: what a stream may show
    before the request finishes (the rest may turn out to be a stop string, trimmed at the
    end)."""
    cut = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), cut, -1):
            if text.endswith(s[:k]):
                cut = k
                break
    return text[: len(text) - cut] if cut else text


def _top_logprobs(lp: torch.Tensor, k: int) -> list[TopLogprobs]:
    """Each row's ``k`` most likely tokens as (token id, logprob), most likely first."""
    vals, ids = lp.topk(min(k, lp.shape[-1]), dim=-1)
    return [list(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), vals.tolist(),
                                                          strict=True)]


def _count_depths(counts: list[int], accepted: int) -> None:
    """counts[d] += 1 for every accepted depth d < ``accepted`` (growing the list as needed)."""
    counts.extend([0] * (accepted - len(counts)))
    for depth in range(accepted):
        counts[depth] += 1


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1e3
