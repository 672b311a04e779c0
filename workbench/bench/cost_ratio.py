"""The verify/decode cost ratio, measured against the cost model's prediction (issue 30's goal:
within ±15 % at B = 1, 4, 16).

For each target: ``calibrate`` fits the cost model on this machine (forwards of B requests × 1
and × N new tokens at one context; ``per_request=True`` so the per-request term is fitted, and
for a MoE target the touched-expert bytes and the sorted-dispatch terms); then, separately, a
decode forward (B requests × 1 token, + LM head) and a verify forward (B × N) are timed at each
batch, each the least of ``repeats`` runs taken in alternation (a busy machine only ever adds
time; alternating keeps a slow stretch from landing on one side). The measured ratio
verify ÷ decode is compared with the model's ``target_ms(B·N, requests=B) / target_ms(B)``.

``python scripts/bench_moe_ratio.py`` prints the table (pass/fail per batch, the machine, the
load before and after) and records it in ``data/results/wb-moe/<machine kind>.json`` under
``cost_ratio``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from workbench.engine.calibrate import calibrate, time_forward
from workbench.errors import ConfigError

if TYPE_CHECKING:
    from workbench.engine.engine import Engine
    from workbench.policy.costmodel import CostModel

TOLERANCE = 0.15


def cost_ratios(engine: Engine, name: str, batches: Sequence[int] = (1, 4, 16),
                num_draft_tokens: int = 4, context: int = 64, repeats: int = 7,
                calibrate_batches: Sequence[int] = (1, 2, 4, 8, 16),
                tolerance: float = TOLERANCE,
                steps: bool = False) -> tuple[list[dict[str, Any]], CostModel]:
    """Rows (one per batch) of measured and predicted verify/decode ratios, and the fitted
    model (module doc). ``name`` labels the rows' ``target``; ``steps``: ``calibrate`` also
    fits the step overheads (chain S = N − 1, for ``crossover``; the ratio does not use them)."""
    if num_draft_tokens < 2:
        raise ConfigError(f"cost_ratios.num_draft_tokens: need >= 2, got {num_draft_tokens}")
    if repeats < 1 or not batches or min(batches) < 1:
        raise ConfigError(f"cost_ratios: need repeats >= 1 and batches >= 1, got {repeats}, "
                          f"{list(batches)}")
    n = num_draft_tokens
    model = calibrate(engine, batch_sizes=tuple(calibrate_batches), repeats=repeats,
                      context=context, shape=(n - 1, 1, n), steps=steps, per_request=True)
    rows = []
    for b in batches:
        dec = ver = float("inf")
        for _ in range(repeats):
            dec = min(dec, time_forward(engine.runner, b, 1, context, 1, False))
            ver = min(ver, time_forward(engine.runner, b, n, context, 1, False))
        pred = model.target_ms(b * n, context, b) / model.target_ms(b, context, b)
        err = pred / (ver / dec) - 1.0
        rows.append({"target": name, "batch": b, "num_draft_tokens": n, "context": context,
                     "decode_ms": dec, "verify_ms": ver, "ratio": ver / dec,
                     "predicted": pred, "error": err, "within": abs(err) <= tolerance})
    return rows, model


def model_terms(model: CostModel) -> dict[str, float]:
    """The fitted target terms, for the table's caption (ms; per GB; per MoE layer)."""
    t = model.target
    out = {"a_ms": t.a, "b_ms_per_token": t.b, "r_ms_per_request": t.r}
    if model.weights is not None:
        out |= {"gamma": model.weights.gamma, "ms_per_gb": model.ms_per_gb,
                "ms_sorted_per_layer": model.ms_sorted}
    return out
