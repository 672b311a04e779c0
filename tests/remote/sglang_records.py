"""Request-metrics records built with SGLang 0.5.23's own writer code.

``sglang.srt.observability.request_metrics_exporter`` cannot be imported on a CPU machine (it
imports ``io_struct`` → ``schedule_batch`` → model configs → torchvision, which pulls a CUDA
torch), so this module reads the installed wheel's source instead: it compiles the exporter's
``RequestMetricsExporter._format_output_data`` and ``ALWAYS_EXCLUDE_FIELDS`` as they are, builds
a stand-in for ``GenerateReqInput`` with the wheel's field names and defaults (``io_struct.py``,
parsed, not imported), and writes each record as ``FileRequestMetricsExporter.write_file`` does
(``json.dump(metrics_data, fh)`` then ``"\\n"``; checked against the source). ``meta_info``
follows ``TokenizerManager._handle_batch_output`` / ``_calculate_spec_decoding_metrics`` for a
finished request (keys in the order SGLang adds them). Not reproduced: the request's
normalisation (``GenerateReqInput.normalize_batch_and_parameters``).

``python tests/remote/sglang_records.py DIR`` writes the sample run used by notebook 06
(``data/sglang/``): a BatchThreshold(8) box run of 40 requests, rounds above the threshold
plain (steps-0 rounds: 0 correct drafts).
"""

from __future__ import annotations
import __future__

import ast
import dataclasses
import importlib.util
import json
import random
import sys
from pathlib import Path
from typing import Any

EXPORTER = "srt/observability/request_metrics_exporter.py"
IO_STRUCT = "srt/managers/io_struct.py"
SAMPLE_NAME = "sglang-request-metrics-20261130_08.log"


def sglang_root() -> Path:
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("sglang is not installed")
    return Path(list(spec.submodule_search_locations)[0])


def _class(tree: ast.Module, name: str) -> ast.ClassDef:
    return next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)


def _method(cls: ast.ClassDef, name: str) -> ast.FunctionDef | ast.AsyncFunctionDef:
    return next(n for n in cls.body
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name)


@dataclasses.dataclass(frozen=True)
class Writer:
    """The wheel's writer pieces: ``format(obj, out_dict)`` and the request-input class."""

    format_output_data: Any
    request_cls: type

    def record(self, request: dict[str, Any], meta_info: dict[str, Any]) -> dict[str, Any]:
        obj = self.request_cls(**request)
        stub = type("Exporter", (), {"obj_skip_names": set(), "out_skip_names": set()})()
        out = {"text": "…", "output_ids": [], "meta_info": meta_info}
        return self.format_output_data(stub, obj, out)

    def line(self, request: dict[str, Any], meta_info: dict[str, Any]) -> str:
        return json.dumps(self.record(request, meta_info)) + "\n"  # json.dump + "\n"


def load_writer(root: Path | None = None) -> Writer:
    root = root or sglang_root()
    src = (root / EXPORTER).read_text()
    tree = ast.parse(src)
    excl = next(n for n in tree.body if isinstance(n, ast.Assign)
                and getattr(n.targets[0], "id", "") == "ALWAYS_EXCLUDE_FIELDS")
    fmt = _method(_class(tree, "RequestMetricsExporter"), "_format_output_data")
    write = ast.get_source_segment(src, _method(_class(tree, "FileRequestMetricsExporter"),
                                                "write_record")) or ""
    if "json.dump(metrics_data, self._current_file_handler)" not in write or \
            'self._current_file_handler.write("\\n")' not in write:
        raise AssertionError("FileRequestMetricsExporter.write_record no longer writes "
                             "json.dump(record) + newline: rebuild the fixtures")
    code = compile(ast.Module(body=[excl, fmt], type_ignores=[]), str(root / EXPORTER), "exec",
                   flags=__future__.annotations.compiler_flag, dont_inherit=True)
    ns: dict[str, Any] = {"dataclasses": dataclasses, "json": json}
    exec(code, ns)  # the wheel's own function, unchanged
    return Writer(ns["_format_output_data"], request_class(root))


def request_class(root: Path) -> type:
    """A dataclass with ``GenerateReqInput``'s fields and literal defaults (None otherwise)."""
    tree = ast.parse((root / IO_STRUCT).read_text())
    fields = []
    for node in _class(tree, "GenerateReqInput").body:
        if not isinstance(node, ast.AnnAssign) or not isinstance(node.target, ast.Name):
            continue
        default: Any = None
        value = node.value
        if isinstance(value, ast.Call) and getattr(value.func, "id", "") == "field":
            value = next((k.value for k in value.keywords if k.arg == "default"), None)
        if value is not None:
            try:
                default = ast.literal_eval(value)
            except ValueError:
                default = None
        fields.append((node.target.id, Any, dataclasses.field(default=default)))
    return dataclasses.make_dataclass("GenerateReqInput", fields)


def meta_info(rid: str, prompt_tokens: int, correct_drafts: list[int], *, completion: int,
              finish: dict[str, Any], num_draft_tokens: int, e2e: float, sent_ts: float,
              ttft: float | None = None, received_ts: float | None = None,
              cached: int = 0) -> dict[str, Any]:
    """A finished request's ``meta_info`` as 0.5.23 builds it. ``correct_drafts``: per verify
    round, the correct drafts (0 for a steps-0 round). ``ttft``/``received_ts`` given: the
    ``--enable-metrics`` keys too."""
    m: dict[str, Any] = {"id": rid, "finish_reason": finish, "prompt_tokens": prompt_tokens,
                         "weight_version": "default", "num_retractions": 0}
    if ttft is not None:
        m["queue_time"] = 0.0004
    m.update({"reasoning_tokens": 0, "completion_tokens": completion, "cached_tokens": cached})
    m["e2e_latency"] = e2e
    verify_ct = len(correct_drafts)
    if verify_ct > 0:  # _calculate_spec_decoding_metrics
        proposed = verify_ct * (num_draft_tokens - 1)
        correct = sum(correct_drafts)
        m["spec_accept_rate"] = correct / proposed
        m["spec_accept_length"] = completion / verify_ct
        m["spec_num_correct_drafts"] = correct
        m["spec_num_proposed_drafts"] = proposed
        m["spec_verify_ct"] = verify_ct
        hist = [0] * (max(correct_drafts) + 1)
        for k in correct_drafts:
            hist[k] += 1
        m["spec_correct_drafts_histogram"] = hist
    if ttft is not None and received_ts is not None:
        m.update({"request_received_ts": received_ts, "first_token_latency": ttft,
                  "request_finished_ts": received_ts + e2e,
                  "decode_throughput": (completion - 1) / max(e2e - ttft, 1e-9)})
    m["response_sent_to_client_ts"] = sent_ts
    return m


def request_params(rid: str, text: str, max_new_tokens: int) -> dict[str, Any]:
    return {"rid": rid, "text": text, "stream": True,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new_tokens}}


def sample_run(writer: Writer, seed: int = 0) -> str:
    """40 requests of a BatchThreshold(8) box run (S=5, N=6): 8 alone-ish at batch <= 8
    (every round drafts), 32 under load at batch 24 (every round plain: 0 correct drafts)."""
    rng = random.Random(seed)
    lines = []
    t0 = 1_796_025_600.0  # 2026-11-30 08:00 UTC
    for i in range(40):
        loaded = i >= 8
        budget = 64
        rounds, emitted = [], 1  # the prefill samples the first token
        while emitted < budget:
            k = 0 if loaded else min(5, int(rng.expovariate(0.45)))
            k = min(k, budget - emitted - 1)
            rounds.append(k)
            emitted += k + 1
        rid = f"{rng.getrandbits(128):032x}"
        ttft = rng.uniform(0.05, 0.12) if not loaded else rng.uniform(0.2, 0.6)
        per_round = 0.031 if not loaded else 0.045
        e2e = ttft + per_round * len(rounds)
        start = t0 + i * (0.5 if not loaded else 0.05)
        meta = meta_info(rid, 37 + i % 5, rounds, completion=emitted,
                         finish={"type": "length", "length": emitted}, num_draft_tokens=6,
                         e2e=e2e, sent_ts=start + e2e + 0.0003, ttft=ttft, received_ts=start)
        lines.append((meta["response_sent_to_client_ts"],
                      writer.line(request_params(rid, f"prompt {i}", budget), meta)))
    return "".join(line for _, line in sorted(lines))  # appended as requests finish


if __name__ == "__main__":
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "data/sglang")
    out.mkdir(parents=True, exist_ok=True)
    (out / SAMPLE_NAME).write_text(sample_run(load_writer()))
    print(out / SAMPLE_NAME)
