"""The Triton kernels lower to sm_90 cubins (no GPU needed): catches what the interpreter allows."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def test_kernels_compile_for_sm90(triton_ready: None) -> None:
    pytest.importorskip("triton.backends.nvidia", reason="triton without its NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["OMP_NUM_THREADS"] = "1"
    out = subprocess.run([sys.executable, str(HERE / "aot_compile.py")], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr[-4000:]
    assert out.stdout.count("compiled for sm_90") == 9, out.stdout
