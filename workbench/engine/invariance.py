"""Row invariance at init: the probes behind ``EngineConfig.batch_invariant`` and the
self-check's refusal.

* :func:`gemm_rows_problem` — does the target's GEMM path give a row the same bits at every row
  count and position? One weight of each distinct shape (the kernel a library picks depends on
  the shape, not the values), rows compared at :data:`PROBE_ROWS` against the widest call.
* :func:`decide_invariance` — the autotune stage's decider under ``batch_invariant``: the
  chosen GEMM path if it passes, else the other path if that one does, else the engine does
  not start (naming the paths and the row counts that differed).

Measured on AMD EPYC family 25 model 17 with torch 2.13: oneDNN float32 and bfloat16 and dense
bfloat16 pass; dense float32 (MKL) differs from two rows on. docs/REFERENCE.md §3.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from workbench.engine.autotune import Choice, apply_gemm
from workbench.models.gemm import gemm_ops, onednn_ok

if TYPE_CHECKING:
    from workbench.engine.runner import ModelRunner

# row counts probed: every count up to 40 (decode batches, chain and tree verifies, prefill
# chunks beside decodes), then padded buckets and beyond; every row of the 40-row call also alone
PROBE_ROWS = (*range(1, 41), 64, 65, 130)
# the paths whose rows are invariant by construction on the CPU (oneDNN packs the weight once
# and computes every row with the kernel chosen for PACK_HINT rows; the int4 weight-only
# kernel loops rows alike). Dense bf16 ``addmm`` is not: measured on AMD EPYC family 25 model
# 17, one row of an 18-row call with a residual differs from the row alone (tests/engine/
# test_batch_invariant.py keeps the case), and random inputs alone rarely show it.
INVARIANT_PATHS = ("onednn", "packed")


def gemm_rows_problem(target: Any, rows: tuple[int, ...] = PROBE_ROWS) -> str | None:
    """None when the target's installed GEMMs (its first layer's and the LM head, as the
    forward runs them: ``target.gemm`` and its row floor) give each row the same bits at every
    count of ``rows`` and alone; else what differed. Inputs are embedding rows (the scale a
    forward sees) and residuals of the same."""
    lin, lin_add = gemm_ops(target.gemm, int(getattr(target, "row_floor", 1)))
    f, head = target._fast[0], target._head
    emb = target.model.embed_tokens.weight.detach()
    gen = torch.Generator().manual_seed(0)
    m_max = max(rows)
    d = emb.shape[1]
    gemms = [("qkv", "lin", f.qkv, f.qkv_bias, d), ("o", "add", f.o, None, f.h * f.hd),
             ("gate_up", "lin", f.gate_up, f.gate_up_bias, d),
             ("down", "add" if f.down_bias is None else "lin", f.down, f.down_bias,
              target.config.intermediate_size), ("lm_head", "lin", head, None, d)]
    with torch.inference_mode():
        for name, kind, w, b, k in gemms:
            pick = torch.randint(0, emb.shape[0], (m_max, -(-k // d)), generator=gen)
            x = emb[pick].flatten(1)[:, :k].contiguous()
            res = emb[pick[:, 0]].contiguous()  # a residual GEMM's output is (M, D)

            def run(lo: int, hi: int, kind: str = kind, w: Any = w, b: Any = b,
                    x: torch.Tensor = x, res: torch.Tensor = res) -> torch.Tensor:
                if kind == "add":
                    return lin_add(x[lo:hi], w, res[lo:hi])
                return lin(x[lo:hi], w, b)

            full = run(0, m_max)
            for m in rows:
                if not torch.equal(run(0, m), full[:m]):
                    return (f"{target.gemm} {name}: rows of a {m}-row call differ from the "
                            f"same rows in a {m_max}-row call")
            for r in range(max(r for r in rows if r <= 40)):
                if not torch.equal(run(r, r + 1)[0], full[r]):
                    return f"{target.gemm} {name}: row {r} alone differs from the same row " \
                           f"of a {m_max}-row call"
    return None


def decide_invariance(runner: ModelRunner, cached: Mapping[str, Any] | None) -> Choice | None:
    """Under ``EngineConfig.batch_invariant``: the target's GEMMs must run on a path of
    :data:`INVARIANT_PATHS` (a measured ``dense`` choice is replaced by ``onednn``; a forced
    one, or a CPU without oneDNN kernels for the dtype, is refused) and pass
    :func:`gemm_rows_problem` on this machine, else the engine does not start (RuntimeError
    naming what differed). None when the switch is off. Never cached: about a second of GEMMs
    at every init."""
    target = runner.target
    if not runner.config.batch_invariant or target is None:
        return None
    note = ""
    if target.gemm not in INVARIANT_PATHS:
        w = target.lm_head.weight
        if runner.config.gemm == "dense":
            raise RuntimeError("EngineConfig.batch_invariant: gemm='dense' is not row-invariant "
                               "(bf16 addmm rounds a row by the call's row count); use "
                               "gemm='auto' or 'onednn'")
        if "onednn" not in target.gemm_paths or not onednn_ok(w):
            raise RuntimeError(f"EngineConfig.batch_invariant: needs oneDNN-packed GEMMs, "
                               f"which this CPU or model does not offer ({w.dtype} on "
                               f"{w.device}, mkldnn {torch.backends.mkldnn.is_available()})")
        note = f"{target.gemm} replaced by onednn (row-invariant); "
        apply_gemm(runner, "onednn")
    problem = gemm_rows_problem(target)
    if problem is not None:
        raise RuntimeError(f"EngineConfig.batch_invariant: the {target.gemm} GEMMs are not "
                           f"row-invariant on this machine: {problem}")
    return Choice("row_invariance", target.gemm, "measured", INVARIANT_PATHS,
                  note=note + "rows bit-identical at 1..40, 64, 65, 130 rows and alone")
