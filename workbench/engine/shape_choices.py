"""Measured choices about row counts and the draft's dtype, decided by the ``autotune`` init
stage after the GEMM path (``autotune(engine, more=(decide_rows, decide_draft_dtype))``):

* ``rows`` — the oneDNN row floor (``EngineConfig.row_floor``): GEMMs of fewer rows run padded
  to the fastest row count of 1..8 (``models/gemm.row_bucket``; docs/MEASUREMENTS.md §1);
* ``draft_dtype`` — the EAGLE-3 draft's compute dtype (``EngineConfig.draft_dtype``): bf16
  copies of its weights where oneDNN has bf16 kernels and a draft step measures faster.

Measured, cached and provisional under load like every choice of ``engine/autotune.py``.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from workbench.engine import contention
from workbench.engine.autotune import (
    BUDGET_S,
    MARGIN,
    Choice,
    _gemm_weights,
    final,
    interleaved_min_ms,
    measured_conditions,
    pick,
)
from workbench.models.gemm import FLOORS, gemm_pass, onednn_ok, prepared_gemms

if TYPE_CHECKING:
    from workbench.engine.runner import ModelRunner


def time_row_counts(target: Any, counts: tuple[int, ...], budget_s: float
                    ) -> dict[str, float]:
    """Least ms of one pass over all the target's GEMMs as it runs them (its prepared weights,
    its GEMM path, no floor) at each row count of ``counts``, the counts taking turns."""
    weights = _gemm_weights(target)
    prepared = prepared_gemms(weights, target.gemm)
    gen = torch.Generator().manual_seed(0)
    dt = weights[0][1].dtype
    passes = {f"M={m}": gemm_pass(prepared, target.gemm, m, dt, gen) for m in counts}
    with torch.inference_mode():
        return interleaved_min_ms(passes, budget_s)


def pick_floor(timings: Mapping[str, float], margin: float = MARGIN) -> int:
    """The row floor: the row count whose pass is fastest, if it beats one row by more than
    ``margin`` (else 1). Every count below it is then padded to it — measured no slower than
    each of them, since it is the least of all."""
    counts = {int(k.split("=")[1]): v for k, v in timings.items()}
    best = min(counts, key=lambda m: (counts[m], m))
    return best if counts[best] < counts[1] * (1 - margin) else 1


def decide_rows(runner: ModelRunner, cached: Mapping[str, Any] | None,
                budget_s: float = BUDGET_S / 2) -> Choice:
    """The target's oneDNN row floor (``EngineConfig.row_floor``): forced, ``1`` where the
    target runs dense GEMMs (no floor), cached, or measured (:func:`time_row_counts` over
    rows 1..8, :func:`pick_floor`). Applied to the target (``row_floor``)."""
    target = runner.target
    assert target is not None  # the autotune stage runs after load_target
    want = runner.config.row_floor
    cands = tuple(str(m) for m in FLOORS)
    if getattr(target, "gemm", "dense") != "onednn":
        choice = Choice("rows", "1", "only", ("1",),
                        note=f"{getattr(target, 'gemm', 'dense')} GEMMs: no row floor")
    elif want:
        choice = Choice("rows", str(want), "forced", (str(want),))
    elif (c := final((cached or {}).get("rows"))) is not None and c.get("choice") in cands:
        choice = Choice("rows", c["choice"], "cached", tuple(c.get("candidates", ())),
                        c.get("timings_ms", {}), c.get("seconds", 0.0),
                        note=c.get("note", ""), conditions=c.get("conditions", {}))
    else:
        t0 = time.perf_counter()
        a = contention.cpu_sample()
        timings = time_row_counts(target, FLOORS, budget_s)
        provisional, cond = measured_conditions(a, contention.cpu_sample())
        choice = Choice("rows", str(pick_floor(timings)), "measured", cands,
                        {"onednn": timings}, time.perf_counter() - t0,
                        note="GEMMs of fewer rows run padded to this many",
                        provisional=provisional, conditions=cond)
    target.row_floor = int(choice.choice)
    return choice


# a draft step's row counts and their weights: the first step runs one row, each later one
# top-K = 4 rows (the default tree), so a 5-step draft is 1 + 4 steps of 4 rows
DRAFT_SHAPES: dict[str, int] = {"M=1": 1, "M=4": 4}
DRAFT_WEIGHTS: dict[str, float] = {"M=1": 1.0, "M=4": 4.0}


def _draft_weights(draft: Any) -> list[tuple[str, torch.Tensor]]:
    """(kind, dense weight) of a draft step's GEMMs in run order (fc, qkv, o, gate/up, down,
    head): the features GEMM runs once per verify, the rest once per step."""
    lay = draft.midlayer
    a, mlp = lay.self_attn, lay.mlp
    return [("lin", draft.fc.weight),
            ("lin", torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])),
            ("add", a.o_proj.weight),
            ("lin", torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])),
            ("add", mlp.down_proj.weight), ("lin", draft.lm_head.weight)]


def time_draft_dtypes(draft: Any, same_gemm: str, budget_s: float
                      ) -> dict[str, dict[str, float]]:
    """Least ms of one pass over a draft step's GEMMs at each row count of
    :data:`DRAFT_SHAPES`: ``same`` (the parameters' dtype on ``same_gemm``) against
    ``bfloat16`` (oneDNN-packed bf16 copies), taking turns."""
    weights = [(k, w.detach(), None) for k, w in _draft_weights(draft)]
    cands = {"same": (same_gemm, weights[0][1].dtype), "bfloat16": ("onednn", torch.bfloat16)}
    prepared = {c: prepared_gemms([(k, w.to(dt), b) for k, w, b in weights], gemm)
                for c, (gemm, dt) in cands.items()}
    gen = torch.Generator().manual_seed(0)
    out: dict[str, dict[str, float]] = {c: {} for c in cands}
    for label, m in DRAFT_SHAPES.items():
        passes = {c: gemm_pass(prepared[c], gemm, m, dt, gen)
                  for c, (gemm, dt) in cands.items()}
        with torch.inference_mode():
            for c, ms in interleaved_min_ms(passes, budget_s / len(DRAFT_SHAPES)).items():
                out[c][label] = ms
    return out


def decide_draft_dtype(runner: ModelRunner, cached: Mapping[str, Any] | None,
                       budget_s: float = BUDGET_S / 4) -> Choice | None:
    """The draft's compute dtype (``EngineConfig.draft_dtype``; None without a draft): forced,
    ``same`` only where bf16 cannot help (not a float32 CPU engine, no oneDNN bf16 kernels),
    cached, or measured (:func:`time_draft_dtypes`, :func:`pick` with ``same`` the default).
    Applied by re-fusing the draft (its parameters are untouched)."""
    draft = runner.draft
    if draft is None:
        return None
    want = runner.config.draft_dtype
    w = draft.fc.weight
    kernels = onednn_ok(torch.zeros(1, dtype=torch.bfloat16, device=w.device))
    bf16_ok = kernels and w.dtype == torch.float32
    if want != "auto":
        note = "" if kernels or w.device.type != "cpu" else \
            "no oneDNN bf16 kernels here: dense bf16 GEMMs"
        choice = Choice("draft_dtype", want, "forced", (want,), note=note)
    elif not bf16_ok:
        choice = Choice("draft_dtype", "same", "only", ("same",),
                        note=f"a {w.dtype} draft on {w.device}"
                             + ("" if w.dtype != torch.float32 or w.device.type != "cpu"
                                else " without oneDNN bf16 kernels"))
    elif (c := final((cached or {}).get("draft_dtype"))) is not None \
            and c.get("choice") in ("same", "bfloat16"):
        choice = Choice("draft_dtype", c["choice"], "cached", tuple(c.get("candidates", ())),
                        c.get("timings_ms", {}), c.get("seconds", 0.0),
                        conditions=c.get("conditions", {}))
    else:
        t0 = time.perf_counter()
        a = contention.cpu_sample()
        timings = time_draft_dtypes(draft, draft.gemm, budget_s)
        provisional, cond = measured_conditions(a, contention.cpu_sample())
        choice = Choice("draft_dtype", pick(timings, "same", DRAFT_WEIGHTS), "measured",
                        ("same", "bfloat16"), timings, time.perf_counter() - t0,
                        note="a draft step's GEMMs; proposals only: outputs never change",
                        provisional=provisional, conditions=cond)
    if choice.choice == "bfloat16" and w.dtype != torch.bfloat16:
        draft.fuse("onednn" if kernels else "dense", torch.bfloat16)
    return choice
