"""Frozen, validated configuration. Vary settings with ``dataclasses.replace(cfg, ...)``."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Literal

from workbench.errors import ConfigError, RequestError
from workbench.policy.policies import Always, Policy, tree_shape_problem
from workbench.stop_regex import check_patterns


@dataclass(frozen=True)
class EngineConfig:
    """Engine-wide settings.

    kv_budget_tokens sizes the preallocated paged pool (pages of ``page_size`` tokens);
    ``max_prefill_tokens`` is the chunked-prefill budget per step.
    """

    device: str = "cpu"
    dtype: str = "float32"
    max_batch_size: int = 64
    kv_budget_tokens: int = 65536
    page_size: int = 16
    max_prefill_tokens: int = 1024
    max_model_len: int | None = None
    self_check: bool = True
    allow_baseline_fallback: bool = False  # draft init failure → explicit baseline engine
    threads: int = 0  # torch intra-op threads; 0 keeps torch's default
    # "auto": flashinfer on CUDA when it imports, else triton on CUDA, else torch
    attention_backend: Literal["auto", "torch", "triton", "flashinfer", "invariant"] = "auto"
    cuda_graphs: bool = True  # capture decode CUDA graphs at init (CUDA only; CPU skips)
    cuda_graphs_fallback: bool = False  # capture failure → eager engine + "fallback" InitStage
    overlap_schedule: bool = False  # CUDA: async metadata staging (engine/overlap.py); CPU no-op
    # target GEMMs: "auto" = dense F.linear or oneDNN-packed weights, whichever is faster on
    # this machine, timed at init on the model's weights and cached (engine/autotune.py)
    gemm: Literal["auto", "onednn", "dense"] = "auto"
    # oneDNN row floor: a target GEMM of fewer rows runs padded to this many (models/gemm.py
    # row_bucket; padded rows never change the real rows). 0 = auto: the fastest row count of
    # 1..8 on this machine and model, timed at init and cached; n >= 1: forced
    row_floor: int = 0
    # a GGUF target's Q4_0/Q4_1/Q8_0 tensors: "packed" (codes and block scales kept, torch's
    # weight-only int4 kernel; models/quant.py says where a value rounds), "dequant" (float
    # weights), "auto": whichever one pass over the target's GEMMs runs faster at init
    # (engine/autotune.py, cached); a checkpoint without packed tensors runs "dequant"
    weights: Literal["auto", "packed", "dequant"] = "auto"
    # the EAGLE-3 draft's compute dtype: "same" (the engine's), "bfloat16" (bf16 copies of its
    # weights; proposals only, so outputs never change), "auto": bfloat16 where the CPU has
    # oneDNN bf16 kernels and a draft step measured faster with them at init (cached), else same
    draft_dtype: Literal["auto", "same", "bfloat16"] = "auto"
    # Inductor-compiled bs=1 decode forward (engine/compiled.py): "on" compiles at init and
    # measures it against eager, "auto" compiles only where that measurement found it faster
    # on this machine kind and model (cached verdict), "off" never
    compile: Literal["auto", "on", "off"] = "auto"
    # "adapt": on a contended CPU the thread count is measured at init and re-measured while
    # the engine runs (engine/contention.py); "off": torch's thread count throughout
    contention: Literal["adapt", "off"] = "adapt"
    # Row-invariant numerics (what SGLang's --enable-deterministic-inference and vLLM's batch
    # invariance give): every row of a forward bit-identical whatever the number of rows, its
    # place among them and the other requests beside it, so greedy speculative == greedy plain
    # in every dtype (bfloat16 included). CPU engine: the invariant attention backend (a C row
    # kernel), GEMM paths probed for row invariance at init, the compiled decode off. Off, a
    # reduced-precision engine with a draft must pass a row-invariance probe at init or refuse
    # (engine/stages.self_check). docs/REFERENCE.md §3, docs/PERFORMANCE.md §6b.
    batch_invariant: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "bfloat16", "float16", "float64"):
            raise ConfigError(f"EngineConfig.dtype: {self.dtype!r} not in float32/bfloat16/"
                              "float16/float64")
        if not isinstance(self.device, str) or not self.device:
            raise ConfigError(f"EngineConfig.device: expected a device string such as 'cpu' or "
                              f"'cuda:0', got {self.device!r}")
        import torch

        try:
            torch.device(self.device)
        except (RuntimeError, ValueError) as e:
            raise ConfigError(f"EngineConfig.device: {self.device!r} is not a torch device "
                              f"({e})") from None
        for name in ("max_batch_size", "kv_budget_tokens", "page_size", "max_prefill_tokens"):
            v = getattr(self, name)
            if not _is_int(v) or v <= 0:
                raise ConfigError(f"EngineConfig.{name}: must be a positive integer, got {v!r}")
        if self.kv_budget_tokens < self.page_size:
            raise ConfigError("EngineConfig.kv_budget_tokens: smaller than one page")
        m = self.max_model_len
        if m is not None and (not _is_int(m) or m < 2):
            raise ConfigError(f"EngineConfig.max_model_len: must be an integer >= 2 (a prompt "
                              f"token and one generated token) or None, got {m!r}")
        if not _is_int(self.threads) or self.threads < 0:
            raise ConfigError(f"EngineConfig.threads: must be an integer >= 0 (0 = torch's "
                              f"default), got {self.threads!r}")
        if self.attention_backend not in ("auto", "torch", "triton", "flashinfer", "invariant"):
            raise ConfigError(f"EngineConfig.attention_backend: {self.attention_backend!r} not "
                              "in auto/torch/triton/flashinfer/invariant")
        if self.gemm not in ("auto", "onednn", "dense"):
            raise ConfigError(f"EngineConfig.gemm: {self.gemm!r} not in auto/onednn/dense")
        if not _is_int(self.row_floor) or not 0 <= self.row_floor <= 16:
            raise ConfigError(f"EngineConfig.row_floor: must be an integer in 0..16 (0 = auto), "
                              f"got {self.row_floor!r}")
        if self.weights not in ("auto", "packed", "dequant"):
            raise ConfigError(f"EngineConfig.weights: {self.weights!r} not in "
                              "auto/packed/dequant")
        if self.draft_dtype not in ("auto", "same", "bfloat16"):
            raise ConfigError(f"EngineConfig.draft_dtype: {self.draft_dtype!r} not in "
                              "auto/same/bfloat16")
        if self.compile not in ("auto", "on", "off"):
            raise ConfigError(f"EngineConfig.compile: {self.compile!r} not in auto/on/off")
        if self.contention not in ("adapt", "off"):
            raise ConfigError(f"EngineConfig.contention: {self.contention!r} not in adapt/off")
        for name in ("self_check", "allow_baseline_fallback", "cuda_graphs",
                     "cuda_graphs_fallback", "overlap_schedule", "batch_invariant"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"EngineConfig.{name}: must be a bool, got "
                                  f"{getattr(self, name)!r}")
        if self.batch_invariant:
            if torch.device(self.device).type != "cpu":
                raise ConfigError(f"EngineConfig.batch_invariant: the row-invariant kernels run "
                                  f"on the CPU engine; device is {self.device!r}")
            if self.dtype not in ("float32", "bfloat16"):
                raise ConfigError(f"EngineConfig.batch_invariant: float32 or bfloat16 only, got "
                                  f"dtype {self.dtype!r}")
            if self.attention_backend not in ("auto", "invariant"):
                raise ConfigError(f"EngineConfig.batch_invariant: runs the 'invariant' attention "
                                  f"backend; attention_backend={self.attention_backend!r} "
                                  f"conflicts")


# torch.Generator.manual_seed accepts exactly this range
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1


def usable_device(name: str) -> Any:
    """``name`` as a ``torch.device`` this process can use; refused naming ``device`` when it is
    not a torch device, or names CUDA and this torch sees no CUDA device."""
    import torch

    try:
        dev = torch.device(name)
    except (RuntimeError, TypeError, ValueError) as e:
        raise ConfigError(f"device: {name!r} is not a torch device ({e})") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device: {name!r}, but this torch sees no CUDA device")
    return dev


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v: Any) -> bool:
    """A finite int or float (bool refused: it is an int subclass)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


LOGIT_BIAS_MAX = 100.0  # OpenAI's range: a bias in [-100, 100]


def _logit_bias(v: Any) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` as (token id, bias) pairs, from pairs or a {token id: bias} mapping."""
    if v is None:
        return ()
    items = list(v.items()) if isinstance(v, dict) else v
    if isinstance(items, (str, bytes)) or not isinstance(items, (list, tuple)):
        raise RequestError(f"logit_bias: must map token ids to biases, got {v!r}")
    out: list[tuple[int, float]] = []
    for pair in items:
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise RequestError(f"logit_bias: expected (token id, bias) pairs, got {pair!r}")
        t, b = pair
        if not _is_int(t) or t < 0:
            raise RequestError(f"logit_bias: token ids must be integers >= 0, got {t!r}")
        if not _is_real(b) or not -LOGIT_BIAS_MAX <= b <= LOGIT_BIAS_MAX:
            raise RequestError(f"logit_bias: the bias of token {t} must be a number in "
                               f"[-100, 100], got {b!r}")
        out.append((int(t), float(b)))
    if len({t for t, _ in out}) != len(out):
        raise RequestError("logit_bias: a token id appears more than once")
    return tuple(out)


def _utf8(s: str, field: str) -> None:
    """Lone surrogates (JSON "\\ud800") cannot be tokenized or returned: name the field."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RequestError(f"{field}: not valid Unicode text (lone surrogate at index "
                           f"{e.start})") from None


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling. temperature 0 is greedy; top_k 0 and top_p 1 disable them.
    ``max_new_tokens=0`` is prefill only: the prompt is run (its log-probabilities computed when
    asked for) and the request finishes with reason "length" and no output token."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    # SGLang's stop_regex: stop once the output contains a match (RE2, linear time; bounds and
    # window: workbench.stop_regex)
    stop_regex: tuple[str, ...] = ()
    ignore_eos: bool = False
    no_stop_trim: bool = False  # keep a matched stop string / stop token in the text (SGLang)
    # OpenAI's logit_bias: (token id, bias) pairs added to the target's logits before sampling
    # and verification alike (workbench.sampler.biased); a token id at most once
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 0:
            raise RequestError(f"max_new_tokens: must be an integer >= 0 (0: prefill only), "
                               f"got {self.max_new_tokens!r}")
        for name in ("temperature", "top_k", "top_p", "min_p", "seed"):
            if isinstance(getattr(self, name), bool):  # bool is an int subclass: refuse it
                raise RequestError(f"{name}: must be a number, got {getattr(self, name)!r}")
        if not _is_real(self.temperature) or self.temperature < 0:
            raise RequestError(f"temperature: must be >= 0 (and finite), got "
                               f"{self.temperature!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise RequestError(f"top_k: must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not _is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise RequestError(f"top_p: must be a number in (0, 1], got {self.top_p!r}")
        if not _is_real(self.min_p) or not 0.0 <= self.min_p < 1.0:
            raise RequestError(f"min_p: must be a number in [0, 1), got {self.min_p!r}")
        if self.seed is not None and (not _is_int(self.seed)
                                      or not SEED_MIN <= self.seed <= SEED_MAX):
            raise RequestError(f"seed: must be an integer in [-2**63, 2**64 - 1] or None, got "
                               f"{self.seed!r}")
        for name in ("ignore_eos", "no_stop_trim"):
            if not isinstance(getattr(self, name), bool):
                raise RequestError(f"{name}: must be true or false, got {getattr(self, name)!r}")
        ids = self.stop_token_ids
        if ids is None:
            ids = ()
        if isinstance(ids, (str, bytes, dict)) or not isinstance(ids, (list, tuple)):
            raise RequestError(f"stop_token_ids: must be a list of token ids, got {ids!r}")
        for t in ids:
            if not _is_int(t) or t < 0:
                raise RequestError(f"stop_token_ids: token ids must be integers >= 0, got {t!r}")
        object.__setattr__(self, "stop_token_ids", tuple(ids))
        stop = self.stop
        if stop is None:
            stop = ()
        elif isinstance(stop, str):
            stop = (stop,)
        elif not isinstance(stop, (list, tuple)):
            raise RequestError(f"stop: must be a string or a list of strings, got {stop!r}")
        for s in stop:
            if not isinstance(s, str) or not s:
                raise RequestError(f"stop: every stop string must be a non-empty str, got {s!r}")
            _utf8(s, "stop")
        object.__setattr__(self, "stop", tuple(stop))
        rx = self.stop_regex
        if rx is None:
            rx = ()
        elif isinstance(rx, str):
            rx = (rx,)
        elif not isinstance(rx, (list, tuple)):
            raise RequestError(f"stop_regex: must be a pattern or a list of patterns, got {rx!r}")
        rx = tuple(rx)
        for s in rx:
            if not isinstance(s, str) or not s:
                raise RequestError(f"stop_regex: every pattern must be a non-empty str, got "
                                   f"{s!r}")
            _utf8(s, "stop_regex")
        if rx:
            check_patterns(rx)
        object.__setattr__(self, "stop_regex", rx)
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SamplingParams:
        """From an HTTP/CLI dict; unknown fields are an error naming them."""
        names = set(cls.__dataclass_fields__)
        unknown = sorted(set(d) - names)
        if unknown:
            raise RequestError(f"sampling_params: unknown field(s) {unknown}")
        return cls(**d)


@dataclass(frozen=True)
class SpecConfig:
    """EAGLE-3 settings: S draft steps (tree depth), top-K branching, N verified nodes.

    ``num_draft_tokens`` counts the root (SGLang semantics); 0 (the default) derives it: a
    chain verifies S+1 nodes, a tree min(K·S+1, 16). ``policy`` decides per step whether and
    how much to speculate (``workbench.policy``; default :class:`Always`).
    ``simulate_accept_length`` replaces acceptance by a synthetic τ for performance studies:
    outputs are then NOT the target's (not lossless) and are marked as such.
    """

    num_steps: int = 5
    topk: int = 4
    num_draft_tokens: int = 0
    policy: Policy = field(default_factory=Always)
    # while speculation is off: "warm" extends the draft on every plain step (SGLang), "cold"
    # skips it and catches up when speculation returns, "auto" stays warm for the first
    # AUTO_WARM_STEPS plain steps of an off stretch (cheap short flips), then goes cold; its
    # warm steps extend only drafts at most catchup_window behind, so a new prompt longer than
    # that waits for its first speculative step (high load never pays for its extend).
    # Default "auto", the best measured setting: "warm" runs a draft forward on every plain
    # step (a K=0 tax against the baseline), "auto" pays it only on short flips; `bench k0`
    # measures both, figures in docs/MEASUREMENTS.md §3. Outputs never depend on it.
    draft_state: Literal["warm", "cold", "auto"] = "auto"
    # a cold draft keeps the target features of at most this many missed positions (the most
    # recent): the catch-up when speculation returns extends over them only, and older missed
    # positions become a hole the draft does not attend to (bounded switch-on cost and memory;
    # acceptance only — outputs never depend on it). None: catch up over everything missed.
    catchup_window: int | None = 32
    simulate_accept_length: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        s, k = self.num_steps, self.topk
        if not _is_int(s) or s < 1:
            raise ConfigError(f"SpecConfig.num_steps: must be >= 1, got {s!r}")
        if not _is_int(k) or k < 1:
            raise ConfigError(f"SpecConfig.topk: must be >= 1, got {k!r}")
        n = self.num_draft_tokens
        if _is_int(n) and n == 0:
            n = s + 1 if k == 1 else min(k * s + 1, 16)
            object.__setattr__(self, "num_draft_tokens", n)
        if not _is_int(n) or n < 2:
            raise ConfigError(f"SpecConfig.num_draft_tokens: must be >= 2 (or 0: derived from "
                              f"num_steps and topk), got {n!r}")
        problem = tree_shape_problem(s, k, n)
        if problem:
            raise ConfigError(f"SpecConfig.num_draft_tokens: {problem}")
        if self.draft_state not in ("warm", "cold", "auto"):
            raise ConfigError(f"SpecConfig.draft_state: {self.draft_state!r} not warm/cold/auto")
        w = self.catchup_window
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1):
            raise ConfigError(f"SpecConfig.catchup_window: must be an int >= 1 or None, got {w!r}")
        a = self.simulate_accept_length
        if a is not None and (not _is_real(a) or not 1.0 <= a <= s + 1):
            raise ConfigError(f"SpecConfig.simulate_accept_length: must be in [1, num_steps+1], "
                              f"got {a}")
        if not all(callable(getattr(self.policy, m, None)) for m in ("decide", "observe")):
            raise ConfigError(f"SpecConfig.policy: expected a Policy (workbench.policy: "
                              f"Always(), BatchThreshold(n), Goodput(), ...), got "
                              f"{self.policy!r}")
        if not isinstance(self.extra, dict):
            raise ConfigError(f"SpecConfig.extra: must be a dict, got {self.extra!r}")

    @property
    def lossless(self) -> bool:
        return self.simulate_accept_length is None

    @property
    def shape(self) -> tuple[int, int, int]:
        """(S draft steps, K top-k, N verified nodes incl. the root)."""
        return (self.num_steps, self.topk, self.num_draft_tokens)


def parse_overrides(raw: str, flag: str = "--engine") -> dict[str, Any]:
    """A command line's ``KEY=VALUE,...`` (``gemm=dense,threads=2``) → EngineConfig field
    overrides ({"gemm": "dense", "threads": 2}), each value typed like the field's default;
    errors name ``flag`` and the field."""
    out: dict[str, Any] = {}
    if not raw.strip():
        return out
    fields = EngineConfig.__dataclass_fields__
    for part in raw.strip().split(","):
        key, eq, value = part.partition("=")
        key = key.strip()
        if not eq or key not in fields:
            raise ConfigError(f"{flag}: {part!r} is not KEY=VALUE with KEY an EngineConfig "
                              f"field ({', '.join(sorted(fields))})")
        v: Any = value.strip()
        default = getattr(EngineConfig(), key)
        if isinstance(default, bool):
            if v.lower() not in ("true", "false", "1", "0", "on", "off"):
                raise ConfigError(f"{flag} {key}: expected true/false, got {value!r}")
            v = v.lower() in ("true", "1", "on")
        elif isinstance(default, int) or key in ("max_model_len",):
            try:
                v = int(v)
            except ValueError:
                raise ConfigError(f"{flag} {key}: expected an integer, got {value!r}") from None
        out[key] = v
    return out


def engine_config(ns: Any, **base: Any) -> EngineConfig:
    """EngineConfig(**base) with the ``--engine KEY=VALUE,...`` overrides of a parsed command
    line (``ns.engine``; absent or empty: none) on top."""
    over = parse_overrides(str(getattr(ns, "engine", "") or ""))
    cfg = EngineConfig(**base)
    return dataclasses.replace(cfg, **over) if over else cfg
