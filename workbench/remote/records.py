"""SGLang's per-request records (``--export-metrics-to-file``) → the workbench ``requests`` frame.

SGLang 0.5.23's ``FileRequestMetricsExporter`` appends one JSON object per finished request to
``DIR/sglang-request-metrics-YYYYMMDD_HH.log`` (a new file every hour): ``request_parameters``
(the ``GenerateReqInput`` fields that are not None, as a JSON *string*) and the final
``meta_info`` flattened into the same object: ``id``, ``finish_reason`` (``{"type": "length" |
"stop" | "abort", …}``), ``prompt_tokens``, ``completion_tokens``, ``cached_tokens``,
``e2e_latency``, ``response_sent_to_client_ts``, and with speculation ``spec_verify_ct``,
``spec_accept_length``, ``spec_correct_drafts_histogram``, …; ``first_token_latency`` and
``request_finished_ts`` only with ``--enable-metrics``. Health checks are not written.

:func:`read_request_metrics` reads a file or a folder of them into a DataFrame whose first
columns are the trace ``requests`` frame's (:data:`workbench.trace.frame.FRAME_COLUMNS`), so the
request-level analyses of notebooks 01–04 run on a box run. ``accept_lengths`` and ``tau`` use
SGLang's counting (:mod:`workbench.remote.sglang`: steps-0 rounds are accept length 1).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from workbench.errors import RequestFailed
from workbench.remote.sglang import round_accept_lengths
from workbench.trace.frame import FRAME_COLUMNS

if TYPE_CHECKING:
    import pandas as pd

RECORD_GLOB = "sglang-request-metrics-*.log"
# columns after the requests frame's: SGLang's own numbers, kept for cross-checks
EXTRA_COLUMNS = ("cached_tokens", "num_retractions", "sglang_accept_length", "max_new_tokens",
                 "temperature", "file")


def record_files(path: str | Path) -> list[Path]:
    """``path`` itself, or the hourly record files in folder ``path`` (sorted by name = time)."""
    p = Path(path)
    if p.is_dir():
        files = sorted(p.glob(RECORD_GLOB))
        if not files:
            raise FileNotFoundError(f"{p}: no {RECORD_GLOB} files (was the server launched with "
                                    "--export-metrics-to-file --export-metrics-to-file-dir?)")
        return files
    if not p.is_file():
        raise FileNotFoundError(f"{p}: no such record file or folder")
    return [p]


def iter_records(path: str | Path) -> Iterator[tuple[Path, dict[str, Any]]]:
    """(file, record) for every non-empty line; a line that is not a JSON object raises
    RequestFailed naming file and line."""
    for f in record_files(path):
        with f.open(encoding="utf-8") as fh:
            for i, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise RequestFailed(f"{f}:{i}: not a JSON record ({e})") from e
                if not isinstance(rec, dict):
                    raise RequestFailed(f"{f}:{i}: expected a JSON object, got "
                                        f"{type(rec).__name__}")
                yield f, rec


def _params(rec: dict[str, Any], where: str) -> dict[str, Any]:
    raw = rec.get("request_parameters")
    if raw is None:
        return {}
    try:
        params = json.loads(raw) if isinstance(raw, str) else raw
    except json.JSONDecodeError as e:
        raise RequestFailed(f"{where}: request_parameters is not JSON ({e})") from e
    return params if isinstance(params, dict) else {}


def _num(v: Any) -> float:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else math.nan


def record_row(rec: dict[str, Any], where: str = "record") -> dict[str, Any]:
    """One record → one row of the ``requests`` frame (plus :data:`EXTRA_COLUMNS`)."""
    for key in ("id", "completion_tokens", "finish_reason"):
        if key not in rec:
            raise RequestFailed(f"{where}: missing field {key!r} (not a 0.5.23 request record)")
    fr = rec["finish_reason"]
    reason = str(fr.get("type") or "") if isinstance(fr, dict) else str(fr or "")
    error = ""
    if reason == "abort" and isinstance(fr, dict):
        error = str(fr.get("message") or "abort")
    lengths = round_accept_lengths(rec)
    params = _params(rec, where)
    raw_sp = params.get("sampling_params")
    sp: dict[str, Any] = raw_sp if isinstance(raw_sp, dict) else {}
    t = rec.get("request_finished_ts", rec.get("response_sent_to_client_ts"))
    return {
        "t": _num(t),
        "rid": str(rec["id"]),
        "reason": reason,
        "prompt_len": int(rec.get("prompt_tokens") or 0),
        "output_len": int(rec["completion_tokens"] or 0),
        "verify_ct": int(rec.get("spec_verify_ct") or 0),
        "tau": sum(lengths) / len(lengths) if lengths else math.nan,
        "ttft_s": _num(rec.get("first_token_latency")),
        "e2e_s": _num(rec.get("e2e_latency")),
        "error": error,
        "accept_lengths": lengths,
        "cached_tokens": int(rec.get("cached_tokens") or 0),
        "num_retractions": int(rec.get("num_retractions") or 0),
        "sglang_accept_length": _num(rec.get("spec_accept_length")),
        "max_new_tokens": sp.get("max_new_tokens"),
        "temperature": sp.get("temperature"),
        "file": "",
    }


def read_request_metrics(path: str | Path) -> pd.DataFrame:
    """The records under ``path`` (a file or an export folder) as a ``requests`` frame, in
    finish order. ``ttft_s`` is NaN unless the server ran with ``--enable-metrics``."""
    import pandas as pd

    rows = []
    for f, rec in iter_records(path):
        row = record_row(rec, f"{f.name}")
        row["file"] = f.name
        rows.append(row)
    cols = [*FRAME_COLUMNS["requests"], *EXTRA_COLUMNS]
    df = pd.DataFrame(rows, columns=cols)
    if len(df):
        df = df.sort_values("t", kind="stable").reset_index(drop=True)
    df.attrs["source"] = str(path)
    return df
