"""SGLang ``--export-metrics-to-file`` records → the ``requests`` frame, on records written with
SGLang 0.5.23's own writer code (``sglang_records.py``)."""

from __future__ import annotations

import importlib.util
import math
import os
from pathlib import Path

import pytest
from sglang_records import SAMPLE_NAME, load_writer, meta_info, request_params, sample_run

import workbench as wb
from workbench.remote.records import EXTRA_COLUMNS, read_request_metrics, record_row
from workbench.trace.frame import FRAME_COLUMNS

SAMPLE = Path(__file__).parents[2] / "data" / "sglang" / SAMPLE_NAME
# skipped only outside `make test`: there (WORKBENCH_SGLANG_CLIENT set) a missing sglang fails
needs_sglang = pytest.mark.skipif(
    importlib.util.find_spec("sglang") is None and not os.environ.get("WORKBENCH_SGLANG_CLIENT"),
    reason="sglang is not installed: `make test` installs sglang==0.5.23 (--no-deps); the "
           "fixtures are built from its writer's source")


@needs_sglang
def test_writer_records_read_into_the_requests_frame(tmp_path: Path) -> None:
    w = load_writer()
    length = {"type": "length", "length": 12}
    spec = meta_info("a1", 30, [3, 0, 5, 1], completion=13, finish=length,
                     num_draft_tokens=6, e2e=0.5, sent_ts=1000.5, ttft=0.1, received_ts=1000.0)
    plain = meta_info("b2", 20, [0] * 11, completion=12, finish=length, num_draft_tokens=6,
                      e2e=0.9, sent_ts=1001.0)  # above the threshold: steps-0 rounds only
    baseline = meta_info("c3", 10, [], completion=4,
                         finish={"type": "stop", "matched": 2}, num_draft_tokens=6, e2e=0.2,
                         sent_ts=999.0, cached=8)
    abort = meta_info("d4", 10, [], completion=0, finish={
        "type": "abort", "message": "client disconnected", "status_code": 499,
        "err_type": None}, num_draft_tokens=6, e2e=0.05, sent_ts=1002.0)
    (tmp_path / "sglang-request-metrics-20261130_08.log").write_text(
        w.line(request_params("a1", "hi", 12), spec) + "\n" +
        w.line(request_params("b2", "yo", 12), plain))
    (tmp_path / "sglang-request-metrics-20261130_09.log").write_text(
        w.line(request_params("c3", "x", 4), baseline) + w.line(request_params("d4", "y", 4),
                                                                abort))
    df = read_request_metrics(tmp_path)
    assert list(df.columns) == [*FRAME_COLUMNS["requests"], *EXTRA_COLUMNS]
    assert list(df.rid) == ["c3", "a1", "b2", "d4"]  # finish order across the hourly files
    r = df.set_index("rid")
    assert r.loc["a1", "accept_lengths"] == [1, 2, 4, 6] and r.loc["a1", "verify_ct"] == 4
    assert r.loc["a1", "tau"] == pytest.approx(13 / 4)  # 1 + correct drafts / rounds
    assert r.loc["a1", "sglang_accept_length"] == pytest.approx(13 / 4)
    assert r.loc["a1", "ttft_s"] == pytest.approx(0.1) and r.loc["a1", "t"] == 1000.5
    assert r.loc["a1", "max_new_tokens"] == 12 and r.loc["a1", "temperature"] == 0.0
    # plain rounds under adaptive count as SGLang counts them: accept length 1 each
    assert r.loc["b2", "accept_lengths"] == [1] * 11 and r.loc["b2", "tau"] == 1.0
    assert math.isnan(r.loc["b2", "ttft_s"])  # no --enable-metrics
    assert r.loc["c3", "verify_ct"] == 0 and math.isnan(r.loc["c3", "tau"])
    assert r.loc["c3", "reason"] == "stop" and r.loc["c3", "cached_tokens"] == 8
    assert r.loc["d4", "reason"] == "abort" and r.loc["d4", "error"] == "client disconnected"
    assert (r.loc["a1", "prompt_len"], r.loc["a1", "output_len"], r.loc["a1", "e2e_s"]) == \
        (30, 13, 0.5)


@needs_sglang
def test_committed_sample_is_what_the_writer_writes() -> None:
    assert SAMPLE.read_text() == sample_run(load_writer())


def test_sample_run_reads_back() -> None:
    df = read_request_metrics(SAMPLE.parent)
    assert len(df) == 40 and df.output_len.eq(64).all() and df.reason.eq("length").all()
    drafting = df[df.tau > 1]
    assert len(drafting) == 8 and (df[df.tau == 1].verify_ct == 63).all()
    for lengths, ct in zip(df.accept_lengths, df.verify_ct, strict=True):
        assert len(lengths) == ct and sum(lengths) == 63  # the prefill token is not a round


def test_reader_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no such record file"):
        read_request_metrics(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="--export-metrics-to-file"):
        read_request_metrics(tmp_path)
    bad = tmp_path / "sglang-request-metrics-20261130_10.log"
    bad.write_text('{"id": "x", "completion_tokens": 1, "finish_reason": null}\n\n[1]\n')
    with pytest.raises(wb.RequestFailed, match=r"_10.log:3: expected a JSON object"):
        read_request_metrics(tmp_path)
    bad.write_text("{oops\n")
    with pytest.raises(wb.RequestFailed, match=r"_10.log:1: not a JSON record"):
        read_request_metrics(bad)
    with pytest.raises(wb.RequestFailed, match="missing field 'completion_tokens'"):
        record_row({"id": "x", "finish_reason": None})
