"""scripts/gpu_check.{sh,py} stay runnable: shell syntax, and the Python helper in smoke mode."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_shell_script_parses() -> None:
    out = subprocess.run(["bash", "-n", str(REPO / "scripts" / "gpu_check.sh")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def test_python_helper_smoke(tmp_path: Path) -> None:
    """Tiny shapes on CPU (reference path only): every section runs and the JSON is complete."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET",
                                                             "WORKBENCH_KERNELS")}
    env["OMP_NUM_THREADS"] = "1"
    summary_path = tmp_path / "gpu_check.json"
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_check.py"), "--smoke",
                          "--out", str(summary_path), "--budget-s", "60"],
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    summary = json.loads(summary_path.read_text())
    assert summary["errors"] == []
    assert summary["tree_attention"][0]["reference"]["median_ms"] > 0
    rows = summary["decode_bandwidth"]["rows"]
    assert [r["tokens"] for r in rows] == [1, 4] and all(r["weights_tb_s"] > 0 for r in rows)
