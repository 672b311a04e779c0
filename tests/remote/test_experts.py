"""SGLang's expert distribution recorder: the dump format as the 0.5.23 wheel writes it (read
from its source), the reader, the launch flags, the HTTP calls on loopback."""

from __future__ import annotations

import ast
import importlib.util
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any

import pytest
import torch

import workbench as wb
from workbench.remote.experts import (
    DIR_ENV,
    FORWARD_MODES,
    MODES,
    dump_files,
    dump_record,
    read_dump,
    start_record,
)
from workbench.remote.launch import launch_plan
from workbench.trace.frame import FRAME_COLUMNS


def wheel_source(rel: str) -> str:
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("the sglang wheel is not installed")
    return (Path(list(spec.submodule_search_locations)[0]) / rel).read_text()


def test_dump_format_is_the_wheels() -> None:
    src = wheel_source("srt/eplb/expert_distribution.py")
    tree = ast.parse(src)
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef)
               and n.name == "_DetailAccumulator")
    body = ast.unparse(cls)
    for key in ("forward_pass_id=forward_pass_id", "rank=self._rank",
                "gatherer_key=gatherer_key", "records=self._records",
                "last_physical_to_logical_map=self._expert_location_metadata."
                "physical_to_logical_map",
                "f'expert_distribution_recorder_{time.time()}_{self._rank}.pt'"):
        assert key in body, key
    assert "global_physical_count=global_physical_count" in src
    assert "SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR" in wheel_source("srt/environ.py")
    # per_token metadata keys and the ForwardMode numbering
    detail = ast.unparse(next(n for n in tree.body if isinstance(n, ast.ClassDef)
                              and n.name == "_DetailSinglePassGatherer"))
    for key in ("input_ids=", "positions=", "forward_mode=forward_batch.forward_mode.value"):
        assert key in detail
    fwd = ast.parse(wheel_source("srt/model_executor/forward_batch_info.py"))
    enum = next(n for n in fwd.body if isinstance(n, ast.ClassDef) and n.name == "ForwardMode")
    names = [t.id for n in enum.body if isinstance(n, ast.Assign) for t in n.targets
             if isinstance(t, ast.Name)]
    assert [FORWARD_MODES[i + 1] for i in range(len(names))] == [n.lower() for n in names]
    modes = wheel_source("srt/arg_groups/fields/exec_.py")
    assert 'Literal["stat", "stat_approx", "per_pass", "per_token"]' in modes
    assert MODES == ("stat", "stat_approx", "per_pass", "per_token")
    http = wheel_source("srt/entrypoints/http_server.py")
    for path in ("/start_expert_distribution_record", "/dump_expert_distribution_record"):
        assert f'"{path}", methods=["GET", "POST"]' in http


def write_dump(path: Path, records: list[dict[str, Any]], phys_to_log: torch.Tensor) -> Path:
    torch.save({"records": records, "last_physical_to_logical_map": phys_to_log}, str(path))
    return path


def test_read_dump_maps_physical_to_logical(tmp_path: Path) -> None:
    # 3 layers (layer 0 dense), 6 physical experts for 4 logical (experts 0 and 3 replicated)
    m = torch.tensor([[0, 1, 2, 3, 0, 3]] * 3)
    count = torch.tensor([[0] * 6, [2, 1, 0, 0, 1, 2], [0, 0, 6, 0, 0, 0]], dtype=torch.int32)
    recs = [{"forward_pass_id": 7, "rank": 0, "gatherer_key": "primary",
             "global_physical_count": count}]
    f = write_dump(tmp_path / "expert_distribution_recorder_1700000000.5_0.pt", recs, m)
    df = read_dump(f, top_k=2)
    assert list(df.columns) == [*FRAME_COLUMNS["expert_coverage"], "rank", "source"]
    assert list(df["layer"]) == [1, 2]  # the dense layer is left out
    assert df["counts"].iloc[0] == [3, 1, 0, 2] and df["counts"].iloc[1] == [0, 0, 6, 0]
    assert list(df["distinct"]) == [3, 1] and list(df["tokens"]) == [3, 3]  # 6 slots / k=2
    assert list(df["kind"]) == ["pass", "pass"] and list(df["step"]) == [7, 7]
    # per_token: the pass's own tokens and forward mode
    recs[0] |= {"input_ids": [5, 6, 7], "positions": [0, 1, 2], "forward_mode": 5}
    df = read_dump(write_dump(tmp_path / "expert_distribution_recorder_1700000001.0_0.pt", recs,
                              m), top_k=2)
    assert set(df["kind"]) == {"target_verify"} and set(df["tokens"]) == {3}
    assert [p.name for p in dump_files(tmp_path, since=1700000000.9)] == [
        "expert_distribution_recorder_1700000001.0_0.pt"]
    torch.save({"rank": 0, "logical_count": torch.zeros(2, 4)}, str(tmp_path / "stat.pt"))
    with pytest.raises(wb.ConfigError, match="not a per_pass/per_token"):
        read_dump(tmp_path / "stat.pt", top_k=2)


def test_launch_plan_asks_for_the_recorder() -> None:
    plan = launch_plan("moonshotai/Kimi-K2.5", "d", tp=8, expert_distribution="per_pass",
                       expert_distribution_dir="/data/experts")
    cmd = plan.command
    assert cmd[cmd.index("--expert-distribution-recorder-mode") + 1] == "per_pass"
    assert plan.env[DIR_ENV] == "/data/experts"
    assert any("/dump_expert_distribution_record" in n for n in plan.notes)
    with pytest.raises(wb.ConfigError, match="expert_distribution"):
        launch_plan("t", expert_distribution="per_layer")
    with pytest.raises(wb.ConfigError, match="expert_distribution_dir"):
        launch_plan("t", expert_distribution_dir="/x")


def test_start_and_dump_over_http() -> None:
    seen: list[str] = []

    class H(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            seen.append(self.path)
            ok = self.path.endswith("_expert_distribution_record")
            self.send_response(200 if ok else 404)
            self.end_headers()
            self.wfile.write(b"ok\n")

        def log_message(self, *args: Any) -> None:
            pass

    srv = HTTPServer(("127.0.0.1", 0), H)
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    try:
        url = f"http://127.0.0.1:{srv.server_address[1]}"
        assert start_record(url).strip() == "ok"
        assert dump_record(url) > 0
        assert seen == ["/start_expert_distribution_record", "/dump_expert_distribution_record"]
    finally:
        srv.shutdown()
        srv.server_close()
