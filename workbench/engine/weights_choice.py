"""The ``weights`` choice (``EngineConfig.weights``): a quantised checkpoint's GEMMs run on its
packed codes and block scales (torch's weight-only int4 kernel, ``models/quant.py``) or on the
dequantised float weights (the ``gemm`` path: dense or oneDNN).

Decided by the ``autotune`` init stage before the row floor (``autotune(engine,
more=(decide_weights, decide_rows, ...))``): forced, ``only`` (nothing quantised in the
checkpoint), cached, or measured — one pass over every target GEMM at the autotune shapes
(decode M=1, verify M=16, prefill M=128), both formats taking turns on the real weights, the
weighted geometric mean deciding (``autotune.pick``, dequant winning ties). Measured, cached
and provisional under load like every choice of ``engine/autotune.py``.

One format per weight for every row count: the plain step and a verify must compute a row the
same way (a packed row and a dequantised row of the same weight differ in the last bits), so
the choice is not made per M.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from workbench.engine import contention
from workbench.engine.autotune import (
    BUDGET_S,
    SHAPES,
    WEIGHTS,
    Choice,
    final,
    interleaved_min_ms,
    measured_conditions,
    pick,
)
from workbench.engine.thread_timing import gemm_pass
from workbench.errors import ConfigError

if TYPE_CHECKING:
    from workbench.engine.runner import ModelRunner

CANDIDATES = ("dequant", "packed")


def quant_note(target: Any) -> str:
    """``210 Q4_1 + 1 Q8_0 tensors`` of the target's quantised tensors."""
    kinds: dict[str, int] = {}
    for q in target.quant.values():
        kinds[q.kind] = kinds.get(q.kind, 0) + 1
    return " + ".join(f"{n} {k}" for k, n in sorted(kinds.items())) + " tensors"


def time_weights(target: Any, budget_s: float) -> dict[str, dict[str, float]]:
    """Least ms of one pass over the target's GEMMs at each autotune shape, dequantised (as
    installed now) against packed, taking turns. Leaves the packed weights installed."""
    dequant = {label: gemm_pass(target, m) for label, m in SHAPES.items()}
    target.fuse("packed")
    packed = {label: gemm_pass(target, m) for label, m in SHAPES.items()}
    out: dict[str, dict[str, float]] = {c: {} for c in CANDIDATES}
    per = budget_s / len(SHAPES)
    with torch.inference_mode():
        for label in SHAPES:
            got = interleaved_min_ms({"dequant": dequant[label], "packed": packed[label]}, per)
            for c, ms in got.items():
                out[c][label] = ms
    return out


def decide_weights(runner: ModelRunner, cached: Mapping[str, Any] | None,
                   budget_s: float = BUDGET_S / 2) -> Choice:
    """The target's weight format (see the module docstring); applied by re-fusing the target
    (``LlamaForCausalLM.fuse("packed")``). ConfigError naming the field when ``packed`` is
    forced on a checkpoint with nothing quantised."""
    target = runner.target
    assert target is not None  # the autotune stage runs after load_target
    want = runner.config.weights
    quant = getattr(target, "quant", {})
    if not quant:
        if want == "packed":
            raise ConfigError("EngineConfig.weights='packed': the target holds no packed "
                              "tensors (a GGUF's Q4_0/Q4_1/Q8_0 tensors on a CPU engine, or a "
                              "compressed-tensors pack-quantized folder)")
        return Choice("weights", "dequant", "only", ("dequant",),
                      note="no quantised tensors in the checkpoint")
    if not hasattr(target, "packed_weights"):
        return Choice("weights", "dequant", "only", ("dequant",),
                      note=f"{quant_note(target)} dequantised: a {type(target).__name__} runs "
                           "dense GEMMs only")
    note = quant_note(target)
    dense_gemm = target.gemm
    if want != "auto":
        choice = Choice("weights", want, "forced", (want,), note=note)
    elif (c := final((cached or {}).get("weights"))) is not None and c.get("choice") in \
            CANDIDATES:
        choice = Choice("weights", c["choice"], "cached", tuple(c.get("candidates", ())),
                        c.get("timings_ms", {}), c.get("seconds", 0.0), note=note,
                        conditions=c.get("conditions", {}))
    else:
        t0 = time.perf_counter()
        a = contention.cpu_sample()
        timings = time_weights(target, budget_s)
        provisional, cond = measured_conditions(a, contention.cpu_sample())
        choice = Choice("weights", pick(timings, "dequant", WEIGHTS), "measured", CANDIDATES,
                        timings, time.perf_counter() - t0,
                        note=f"{note}; dequant runs gemm={dense_gemm}",
                        provisional=provisional, conditions=cond)
    if choice.choice == "packed" and want == "auto" and runner.draft is not None \
            and not runner.config.batch_invariant:
        # packed GEMMs run bf16 activations: a speculating engine's verify rows then match its
        # plain rows only under row-invariant numerics (engine/stages.self_check), so "auto"
        # keeps the dequantised weights and says what the switch would buy
        choice = dataclasses.replace(
            choice, choice="dequant",
            note=choice.note + "; packed measured faster, but with a draft its bf16 rows are "
                               "lossless only with batch_invariant=True")
    if choice.choice == "packed" and target.gemm != "packed":
        target.fuse("packed")
    elif choice.choice == "dequant" and target.gemm == "packed":
        target.fuse(dense_gemm if dense_gemm != "packed" else "auto")
    return choice
