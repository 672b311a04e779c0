"""An Inductor-compiled bs=1 decode forward for CPU engines (``EngineConfig.compile``).

A plain bs=1 decode step runs thousands of tiny ops per token; on a CPU whose caches hold the
whole model (issue 18: a 2-core Xeon) that per-op overhead is ~60 % of the step. The usual
lever (gpt-fast) is to compile the step with fixed shapes: here ``torch.compile(fullgraph=True,
dynamic=False)`` of the target's decoder layers (``LlamaForCausalLM.layers_forward``, traced
on dense weight views: Inductor picks its own GEMM kernels) for one row (M=1), with the paged
attention as an opaque custom op (``workbench::paged_attention``) that calls back into the
engine's planned backend — so the KV pool, the plan and the ragged paths stay exactly the eager
ones, and only the norms, RoPE, SiLU·up and GEMM calls around them are traced and fused.

:class:`CompiledSteps` plugs into the runner where CUDA graphs do (``ModelRunner.graphs``): its
:meth:`~CompiledSteps.run` serves a single request's one-token forward and returns None for
anything else (prefill chunks, verifies, batches; the caller runs those eagerly).

Init (:func:`build`): compile and warm up, then time compiled vs eager on the same plan. The
stage never leaves a half-built runner: the runner is installed only after every graph compiled
and ran; a compile that raises or takes longer than its budget is dropped (eager), and the
reason is in the stage's detail. Verdicts (``on``: measured faster than eager by the margin;
``off``: not faster, failed or over budget) are cached per machine kind and model with the
other measured choices (``engine/autotune.py``); ``compile="auto"`` compiles only on a cached
``on`` verdict, since measuring means compiling (minutes on a small CPU: 154 s for the shipped
18-layer target on a loaded 2-core EPYC), far beyond a start-up budget.

Outputs: Inductor fuses the pointwise ops (RMSNorm, RoPE, SiLU·up), which can round
differently from eager in the last bit; losslessness (speculative == plain output) holds
within a compiled engine and is tested on this path (tests/engine/test_compiled.py).
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from workbench.models.gemm import onednn_linear, onednn_linear_add
from workbench.models.llama import LlamaForCausalLM

if TYPE_CHECKING:
    from workbench.attention import AttentionBackend
    from workbench.engine.autotune import Choice
    from workbench.engine.runner import ModelRunner

BUDGET_S = float(os.environ.get("WORKBENCH_COMPILE_BUDGET_S", "300"))
MARGIN = 0.03  # compiled must beat eager by this much to be kept under "auto"
# what a failing torch.compile raises (Dynamo/Inductor errors are RuntimeErrors; a missing C++
# compiler an OSError or RuntimeError; unsupported code NotImplementedError / AssertionError)
COMPILE_ERRORS = (RuntimeError, OSError, AssertionError, NotImplementedError, TypeError,
                  ValueError)

# key → the attention backend a compiled graph calls back into (weak: a closed engine's pool
# is freed even if a compiled graph outlives it in Dynamo's cache)
_BACKENDS: dict[int, weakref.ref[Any]] = {}
_KEYS = itertools.count()


@torch.library.custom_op("workbench::paged_attention", mutates_args=())
def paged_attention(key: int, layer: int, q: torch.Tensor, k: torch.Tensor,
                    v: torch.Tensor) -> torch.Tensor:
    """The planned backend's ``run(layer, q, k, v)`` (writes k/v into the pool it owns, which
    is not a graph input): opaque to Dynamo, so the compiled graph keeps the eager attention."""
    backend = _BACKENDS[key]()
    if backend is None:
        raise RuntimeError("workbench::paged_attention: the engine of this compiled step is "
                           "closed")
    out: torch.Tensor = backend.run(layer, q, k, v)
    return out.clone() if out._base is not None else out


@paged_attention.register_fake
def _paged_attention_fake(key: int, layer: int, q: torch.Tensor, k: torch.Tensor,
                          v: torch.Tensor) -> torch.Tensor:
    return q.new_empty(q.shape)


class _OpAttention:
    """An ``AttentionBackend`` whose ``run`` is the custom op (what the graph traces)."""

    def __init__(self, key: int) -> None:
        self.key = key

    def run(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.ops.workbench.paged_attention(self.key, layer, q, k, v)


@dataclass
class CompileReport:
    """What the compile stage did: ``status`` ``compiled`` / ``fallback``; ``seconds`` of
    compile + warm-up; eager and compiled median ms of one decode forward; ``reason``."""

    status: str
    seconds: float = 0.0
    eager_ms: float = float("nan")
    compiled_ms: float = float("nan")
    reason: str = ""

    @property
    def faster(self) -> bool:
        return self.compiled_ms * (1 + MARGIN) < self.eager_ms


class CompiledSteps:
    """Compiled one-row target forward; :meth:`run` matches ``GraphRunner.run``."""

    def __init__(self, attn: AttentionBackend, fn: Callable[..., Any], key: int) -> None:
        self.attn, self.fn, self.key = attn, fn, key
        self.calls = 0

    def run(self, tokens: torch.Tensor, positions: torch.Tensor, write_slots: torch.Tensor,
            q_lens: list[int], kv_slots: list[torch.Tensor],
            tree_masks: list[torch.Tensor | None] | None = None, want_aux: bool = False
            ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The forward for one request and one new token; None (→ eager) otherwise."""
        if q_lens != [1] or (tree_masks is not None and any(m is not None for m in tree_masks)):
            return None
        self.attn.plan(write_slots, q_lens, kv_slots, tree_masks)
        self.calls += 1
        hidden, aux = self.fn(tokens, positions)
        return hidden, aux if want_aux else None

    def close(self) -> None:
        _BACKENDS.pop(self.key, None)
        _PACKED.pop(self.key, None)
        _FLOOR.pop(self.key, None)


# key → the packed (oneDNN) weights and biases a compiled graph's GEMM ops read, by index
_PACKED: dict[int, list[tuple[torch.Tensor, torch.Tensor | None, int]]] = {}
# key → the target's oneDNN row floor (gemm.row_bucket), as its eager forward uses it
_FLOOR: dict[int, int] = {}


@torch.library.custom_op("workbench::packed_linear", mutates_args=())
def packed_linear(key: int, idx: int, x: torch.Tensor) -> torch.Tensor:
    """``onednn_linear`` on packed weight ``idx`` of engine ``key`` (opaque to Dynamo: packed
    tensors cannot be traced, so the graph keeps oneDNN's GEMM and fuses what is around it)."""
    w, b, _ = _PACKED[key][idx]
    return onednn_linear(x, w, b, _FLOOR.get(key, 1)).clone()


@packed_linear.register_fake
def _packed_linear_fake(key: int, idx: int, x: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], _PACKED[key][idx][2])


@torch.library.custom_op("workbench::packed_linear_add", mutates_args=())
def packed_linear_add(key: int, idx: int, x: torch.Tensor, res: torch.Tensor) -> torch.Tensor:
    """``res + x·wᵀ`` with oneDNN's fused post-op add, on packed weight ``idx``."""
    w, _, _ = _PACKED[key][idx]
    return onednn_linear_add(x, w, res, _FLOOR.get(key, 1)).clone()


@packed_linear_add.register_fake
def _packed_linear_add_fake(key: int, idx: int, x: torch.Tensor,
                            res: torch.Tensor) -> torch.Tensor:
    return res.new_empty(res.shape)


def _packed_layers(target: Any, key: int) -> tuple[list[Any], tuple[Any, Any]]:
    """The target's layers with every packed weight replaced by its index in ``_PACKED[key]``,
    and the (linear, linear_add) pair that calls the custom ops on them."""
    table: list[tuple[torch.Tensor, torch.Tensor | None, int]] = []
    layers = []

    def put(w: torch.Tensor, b: torch.Tensor | None, out: int) -> int:
        table.append((w, b, out))
        return len(table) - 1

    for f, layer in zip(target._fast, target.model.layers, strict=True):
        a, mlp = layer.self_attn, layer.mlp
        layers.append(dataclasses.replace(
            f, qkv=put(f.qkv, f.qkv_bias, a.fused[0].shape[0]),
            o=put(f.o, None, a.o_proj.weight.shape[0]),
            gate_up=put(f.gate_up, f.gate_up_bias, mlp.fused[0].shape[0]),
            down=put(f.down, f.down_bias, mlp.down_proj.weight.shape[0])))
    _PACKED[key] = table
    _FLOOR[key] = getattr(target, "row_floor", 1)

    def lin(x: torch.Tensor, w: Any, b: torch.Tensor | None) -> torch.Tensor:
        return torch.ops.workbench.packed_linear(key, w, x)  # b: read from the table

    def lin_add(x: torch.Tensor, w: Any, res: torch.Tensor) -> torch.Tensor:
        return torch.ops.workbench.packed_linear_add(key, w, x, res)

    return layers, (lin, lin_add)


def make_fn(runner: ModelRunner, key: int) -> Callable[..., Any]:
    """The compiled one-row forward (what :func:`build` compiles; a test stands in an eager
    function here to check the stage's logic without compiling): on oneDNN-packed weights the
    GEMMs are opaque custom ops (oneDNN's kernels, as eager) and Inductor fuses the norms, RoPE
    and SiLU·up around them; on dense weights Inductor traces everything (and picks its own
    GEMM kernels)."""
    target, aux = runner.target, tuple(runner.aux_layers)
    # compile_stage runs after load_target and compiles only dense-graph targets (compilable)
    assert isinstance(target, LlamaForCausalLM)
    attn = _OpAttention(key)
    compiled = torch.compile(target.layers_forward, fullgraph=True, dynamic=False)
    if target.gemm == "onednn":
        fast, ops = _packed_layers(target, key)
    else:
        fast, ops = target.dense_layers(), None

    def fn(tokens: torch.Tensor, positions: torch.Tensor) -> Any:
        x = target.model.embed_tokens(tokens)
        cos, sin = target.model.rotary_emb.rolled(positions, x.dtype)
        return compiled(x, cos, sin, attn, aux, fast, "dense", ops)

    return fn


def _decode_timer(runner: ModelRunner, fn: Callable[..., Any] | None, context: int = 64
                  ) -> Callable[[], Any]:
    """One bs=1 decode forward at ``context`` tokens (slots 0..context of the empty pool).

    ``device="cpu"`` on purpose: the compile stage runs only on CPU engines (compile_stage
    skips any other device), and slots are host plan metadata on every device."""
    slots = torch.arange(context + 1, device="cpu")
    tokens = torch.tensor([1], device="cpu")
    pos = torch.tensor([context], device="cpu")

    target, attn = runner.target, runner.attn
    assert target is not None and attn is not None  # compile_stage runs after both stages

    def eager() -> Any:
        attn.plan(slots[context:], [1], [slots])
        return target(tokens, pos, attn, runner.aux_layers)

    if fn is None:
        return eager
    compiled_fn = fn

    def compiled() -> Any:
        attn.plan(slots[context:], [1], [slots])
        return compiled_fn(tokens, pos)

    return compiled


def build(runner: ModelRunner, budget_s: float | None = None,
          measure_s: float = 2.0) -> tuple[CompiledSteps | None, CompileReport]:
    """Compile, warm up and time the one-row forward. Returns (runner or None, report); the
    runner is None when the compile raised or ran over ``budget_s`` (default: the module's
    ``BUDGET_S`` when called; nothing half-built is kept). Must run while no request holds KV
    (engine init): warm-ups write slots 0..64."""
    from workbench.engine.autotune import median_ms

    budget_s = BUDGET_S if budget_s is None else budget_s

    attn = runner.attn
    assert attn is not None  # compile_stage runs after attention_backend
    key = next(_KEYS)
    _BACKENDS[key] = weakref.ref(attn)
    t0 = time.perf_counter()
    try:
        fn = make_fn(runner, key)
        with torch.inference_mode():
            _decode_timer(runner, fn)()  # compiles
            _decode_timer(runner, fn)()
    except COMPILE_ERRORS as e:  # a compiler failure means: run eagerly, said so in the detail
        _BACKENDS.pop(key, None)
        return None, CompileReport("fallback", time.perf_counter() - t0,
                                   reason=f"compile failed: {type(e).__name__}: "
                                          f"{str(e).splitlines()[0] if str(e) else ''}")
    seconds = time.perf_counter() - t0
    if seconds > budget_s:
        _BACKENDS.pop(key, None)
        return None, CompileReport("fallback", seconds,
                                   reason=f"compile took {seconds:.0f} s > budget {budget_s:.0f} s")
    with torch.inference_mode():
        eager_ms = median_ms(_decode_timer(runner, None), measure_s / 2, max_reps=200)
        comp_ms = median_ms(_decode_timer(runner, fn), measure_s / 2, max_reps=200)
    return CompiledSteps(attn, fn, key), CompileReport("compiled", seconds, eager_ms, comp_ms)


def compile_stage(runner: ModelRunner, key: str) -> Choice:
    """The engine's ``compile`` init stage (see the module docstring): decide, maybe build and
    install ``runner.graphs``, cache the verdict under autotune's ``key``; returns the choice
    (the engine keeps it in ``choices["compile"]``)."""
    from workbench.engine import autotune, contention

    mode = runner.config.compile
    cands = ("eager", "compiled")

    if runner.device.type != "cpu":
        return autotune.Choice("compile", "off", "only", ("eager",),
                               note="CPU only (CUDA graphs serve the GPU)")
    if runner.graphs is not None:
        return autotune.Choice("compile", "off", "only", ("eager",),
                               note="another step runner is installed")
    if runner.target is not None and not runner.target.compilable:
        return autotune.Choice("compile", "off", "only", ("eager",),
                               note=f"a {type(runner.target).__name__} routes by data: "
                                    "no fixed graph to compile")
    if runner.target is not None and runner.target.gemm == "packed":
        # the compiled graph traces dense views (make_fn): its rows would not be the packed
        # kernel's that the eager verify runs, and speculative would differ from plain
        return autotune.Choice("compile", "off", "only", ("eager",),
                               note="packed weights (EngineConfig.weights): the compiled decode "
                                    "traces dense weights, not the packed kernel")
    if mode == "off":
        return autotune.Choice("compile", "off", "forced", cands)
    if runner.config.batch_invariant:
        return autotune.Choice("compile", "off", "only", ("eager",),
                               note="batch_invariant: Inductor's fused decode graph rounds "
                                    "differently from the eager verify rows")
    path = autotune.cache_path()
    cached = autotune.final(autotune.read_cache(path).get(key, {}).get("compile"))
    if mode == "auto" and (cached is None or cached.get("choice") != "on"):
        if cached is None:
            return autotune.Choice(
                "compile", "off", "auto", cands,
                note="not measured for this machine kind and model: measuring means compiling "
                     "(minutes on a small CPU); EngineConfig(compile='on') measures it once "
                     "and caches the verdict")
        return autotune.Choice("compile", "off", "cached", cands,
                               cached.get("timings_ms", {}), note=cached.get("note", ""))
    a = contention.cpu_sample()
    steps, rep = build(runner)
    # measured while the machine was contended: used now, never cached as the verdict
    provisional, cond = autotune.measured_conditions(a, contention.cpu_sample())
    timings = {} if rep.status != "compiled" else {
        "eager": {"decode M=1": rep.eager_ms}, "compiled": {"decode M=1": rep.compiled_ms}}
    verdict = "on" if rep.status == "compiled" and rep.faster else "off"
    note = rep.reason or (f"compiled in {rep.seconds:.1f} s; "
                          f"{'faster' if rep.faster else 'not faster'} than eager")
    autotune.write_cache(path, key, {"compile": autotune.Choice(
        "compile", verdict, "measured", cands, timings, rep.seconds, note,
        provisional=provisional, conditions=cond)})
    keep = steps is not None and (mode == "on" or verdict == "on")
    if steps is not None and not keep:
        steps.close()
    if keep:
        runner.graphs = steps
    source = "forced" if mode == "on" else "measured"
    status = "on" if keep else "off"
    if rep.status == "fallback":
        note = f"fallback to eager: {rep.reason}"
    return autotune.Choice("compile", status, source, cands, timings, rep.seconds, note,
                           provisional=provisional, conditions=cond)
