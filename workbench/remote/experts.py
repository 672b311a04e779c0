"""The box's expert coverage: SGLang 0.5.23's expert distribution recorder, read into the
``expert_coverage`` frame the workbench's own ``ExpertRouting`` events make.

On the box (format read from the 0.5.23 wheel, ``sglang/srt/eplb/expert_distribution.py``):

* launch with ``--expert-distribution-recorder-mode per_pass`` (one record per forward pass) or
  ``per_token`` (also each pass's tokens, positions and ``forward_mode``); the dump directory is
  the environment variable ``SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR`` (default ``/tmp``):
  :func:`recorder_launch` / ``launch_plan(..., expert_distribution="per_pass")``;
* ``POST /start_expert_distribution_record``, run the workload, ``POST
  /dump_expert_distribution_record`` (:func:`start_record`, :func:`dump_record`): every rank
  writes ``expert_distribution_recorder_{time}_{rank}.pt``, a ``torch.save`` of
  ``{"records": [...], "last_physical_to_logical_map": (layers, physical experts)}``; a record
  is ``{"forward_pass_id", "rank", "gatherer_key", "global_physical_count": (layers, physical
  experts)}`` (per_token adds ``input_ids``, ``positions``, ``extend_seq_lens``,
  ``forward_mode``, ``topk_ids_of_layer``, ``misc_objects``).

:func:`read_dump` maps physical experts to logical ones (the map is the last one, as SGLang
says: expert rebalancing may change it during recording) and returns one row per (pass, MoE
layer) in :data:`~workbench.trace.frame.FRAME_COLUMNS` ``["expert_coverage"]`` order, plus
``rank`` and ``source``. A pass's tokens are its routed slots / top_k (per_pass records carry no
token count); dense layers (all zeros) are left out.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from workbench.errors import ConfigError
from workbench.policy.moe_cost import uniform_coverage

if TYPE_CHECKING:
    import pandas as pd

MODES = ("stat", "stat_approx", "per_pass", "per_token")
DIR_ENV = "SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR"
# SGLang 0.5.23's ForwardMode (an IntEnum of auto() values), for per_token records
FORWARD_MODES = {1: "extend", 2: "decode", 3: "mixed", 4: "idle", 5: "target_verify",
                 6: "draft_extend_v2", 7: "prebuilt", 8: "split_prefill", 9: "dllm_extend"}


def recorder_launch(mode: str = "per_pass", dump_dir: str | None = None
                    ) -> tuple[list[str], dict[str, str], list[str]]:
    """(flags, environment, notes) that make a launch record its expert distribution."""
    if mode not in MODES:
        raise ConfigError(f"expert_distribution: {mode!r} not in {MODES}")
    flags = ["--expert-distribution-recorder-mode", mode]
    env = {DIR_ENV: dump_dir} if dump_dir else {}
    notes = [f"expert distribution ({mode}): POST /start_expert_distribution_record before the "
             "workload and /dump_expert_distribution_record after it; each rank writes "
             f"expert_distribution_recorder_<time>_<rank>.pt under {dump_dir or '/tmp'} "
             "(workbench.remote.experts.read_dump reads it)"]
    if mode in ("stat", "stat_approx"):
        notes.append(f"expert distribution {mode}: a window of summed counts, not per pass "
                     "(read_dump needs per_pass or per_token)")
    return flags, env, notes


def _post(url: str, path: str, timeout: float) -> str:
    import httpx

    r = httpx.post(url.rstrip("/") + path, timeout=timeout)
    if r.status_code != 200:
        raise ConfigError(f"{path}: HTTP {r.status_code}: {r.text[:200]}")
    return str(r.text)


def start_record(url: str, timeout: float = 60.0) -> str:
    """``POST /start_expert_distribution_record`` (clears any previous record)."""
    return _post(url, "/start_expert_distribution_record", timeout)


def dump_record(url: str, timeout: float = 600.0) -> float:
    """``POST /dump_expert_distribution_record``; returns the time the dump was asked for
    (files written after it are this dump's)."""
    t = time.time()
    _post(url, "/dump_expert_distribution_record", timeout)
    return t


def dump_files(folder: str | Path, since: float = 0.0) -> list[Path]:
    """The per-pass dump files in ``folder`` written at or after ``since`` (epoch s)."""
    out = []
    for p in sorted(Path(folder).glob("expert_distribution_recorder_*_*.pt")):
        stamp = p.stem.split("_")[-2]
        try:
            if float(stamp) >= since:
                out.append(p)
        except ValueError:
            continue  # not a per-pass/per-token dump name (e.g. a stat dump): not ours
    return out


def _logical(count: Any, phys_to_log: Any, num_logical: int) -> list[list[int]]:
    import torch

    c = torch.as_tensor(count).long()
    m = torch.as_tensor(phys_to_log).long()
    if c.shape != m.shape:
        raise ConfigError(f"dump: global_physical_count {tuple(c.shape)} does not match "
                          f"last_physical_to_logical_map {tuple(m.shape)}")
    out = torch.zeros(c.shape[0], num_logical, dtype=torch.long)
    out.scatter_add_(1, m.clamp(min=0), c * (m >= 0))
    return out.tolist()  # type: ignore[no-any-return]


def read_dump(paths: str | Path | Sequence[str | Path], top_k: int,
              num_experts: int | None = None) -> pd.DataFrame:
    """Rows of the ``expert_coverage`` frame (+ ``rank``, ``source``) from dump files.

    ``top_k``: the model's experts per token (``num_experts_per_tok``); ``num_experts``: its
    logical experts (default: the largest id in the map + 1)."""
    import pandas as pd
    import torch

    from workbench.trace.frame import FRAME_COLUMNS

    if top_k < 1:
        raise ConfigError(f"read_dump: top_k must be >= 1, got {top_k}")
    files = [Path(paths)] if isinstance(paths, (str, Path)) else [Path(p) for p in paths]
    rows: list[dict[str, Any]] = []
    for f in files:
        data = torch.load(str(f), map_location="cpu", weights_only=False)
        if not isinstance(data, dict) or "records" not in data or \
                "last_physical_to_logical_map" not in data:
            raise ConfigError(f"{f}: not a per_pass/per_token expert distribution dump (keys "
                              f"{sorted(data) if isinstance(data, dict) else type(data)})")
        m = data["last_physical_to_logical_map"]
        e = num_experts or int(torch.as_tensor(m).max()) + 1
        for rec in data["records"]:
            counts = _logical(rec["global_physical_count"], m, e)
            kind = FORWARD_MODES.get(int(rec["forward_mode"]), str(rec["forward_mode"])) \
                if "forward_mode" in rec else "pass"
            tokens = len(rec["input_ids"]) if "input_ids" in rec else \
                max(sum(c) for c in counts) // top_k
            for layer, c in enumerate(counts):
                if not any(c):
                    continue
                rows.append({
                    "t": math.nan, "step": int(rec["forward_pass_id"]),
                    "kind": kind, "tokens": tokens, "layer": layer, "num_experts": e,
                    "top_k": top_k, "distinct": sum(1 for n in c if n),
                    "expected_uniform": uniform_coverage(e, top_k, tokens),
                    "max_load": max(c), "counts": c, "rank": int(rec.get("rank", 0)),
                    "source": f.name})
    return pd.DataFrame(rows, columns=[*FRAME_COLUMNS["expert_coverage"], "rank", "source"])
