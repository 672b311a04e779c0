"""What-ifs on a fitted box: applied after the fit, never refitting (docs/LAB.md, "What-ifs").

``--set`` describes the box *before* the fit (the constants are fitted on it); a what-if
(``--what-if SECTION.FIELD=VALUE``) changes the fitted box and nothing else: the floor and the
attention constant stay those fitted on the measured box, so the change the user names is the
only change. A what-if is refused when it

* names a fitted constant (``fit.*``): that is not a change to the box;
* changes the model's bytes (``model.quant``, ``model.dense_bits``, expert counts) while
  ``model.checkpoint_gb`` still states the measured checkpoint's size, unless it sets
  ``model.checkpoint_gb`` too (``null``: from the geometry);
* gives a box whose weights do not fit its GPUs (the numbers in the error:
  :func:`workbench.lab.boxspec.memory_check`);
* changes no prediction at any level (a what-if that changes nothing is not offered; the
  error says so, naming the field).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from workbench.errors import ConfigError
from workbench.lab.boxmodel import level
from workbench.lab.boxspec import with_sets

BYTES_FIELDS = ("model.quant", "model.dense_bits", "model.n_routed_experts",
                "model.moe_intermediate_size", "model.num_hidden_layers", "model.hidden_size",
                "model.intermediate_size", "model.vocab_size")
RTOL = 1e-9


def apply(fitted: dict[str, Any], assignments: Sequence[str], levels: Sequence[int],
          tau: float) -> dict[str, Any]:
    """The fitted box with ``assignments`` applied (module doc: the refusals)."""
    if not assignments:
        raise ConfigError("--what-if: give at least one SECTION.FIELD=VALUE")
    keys = [a.partition("=")[0].strip() for a in assignments]
    for k in keys:
        if k.startswith("fit."):
            raise ConfigError(f"--what-if {k}: the fitted constants are not a what-if (give "
                              "--set before the fit, or --tau)")
    if fitted["model"].get("checkpoint_gb") and "model.checkpoint_gb" not in keys:
        moved = [k for k in keys if any(k == f or k.startswith(f + ".") for f in BYTES_FIELDS)]
        if moved:
            raise ConfigError(
                f"--what-if {moved[0]}: model.checkpoint_gb "
                f"({fitted['model']['checkpoint_gb']}) states the measured checkpoint's size; "
                "set model.checkpoint_gb too (null: the weights from the geometry)")
    box = with_sets(fitted, list(assignments), "--what-if")
    if box["fit"] != fitted["fit"]:  # guards the rule above against a future --set path
        raise ConfigError("--what-if: the fitted constants changed; a what-if never refits")
    if not changes_anything(fitted, box, levels, tau):
        raise ConfigError(f"--what-if {' '.join(assignments)}: changes no prediction at "
                          f"concurrency {', '.join(map(str, levels))} (not offered)")
    return box


def changes_anything(a: dict[str, Any], b: dict[str, Any], levels: Sequence[int],
                     tau: float) -> bool:
    """Whether plain or speculative tok/s differ between two boxes at any level."""
    for c in levels:
        ra, rb = level(a, int(c), tau), level(b, int(c), tau)
        for key in ("plain_tok_s", "spec_tok_s"):
            if abs(ra[key] - rb[key]) > RTOL * abs(ra[key]):
                return True
    return False


def compare(fitted: dict[str, Any], box: dict[str, Any], levels: Sequence[int],
            tau: float) -> list[dict[str, Any]]:
    """Per level: plain and EAGLE-3 tok/s as measured (the fitted box) and under the what-if."""
    rows = []
    for c in levels:
        a, b = level(fitted, int(c), tau), level(box, int(c), tau)
        rows.append({"concurrency": int(c), "plain_tok_s": a["plain_tok_s"],
                     "spec_tok_s": a["spec_tok_s"], "gain": a["gain"],
                     "what_if_plain_tok_s": b["plain_tok_s"],
                     "what_if_spec_tok_s": b["spec_tok_s"], "what_if_gain": b["gain"]})
    return rows
