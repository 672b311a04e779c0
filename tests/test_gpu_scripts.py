"""The GPU scripts of issue 51 stay runnable on a CPU: arguments, the time budget, the device
folder, the shell wrappers' usage errors; the whole ``gpu_real_pair.py --smoke`` run is slow
(it loads the real pair four times) and marked so."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "scripts"


def _load(name: str) -> ModuleType:
    sys.path.insert(0, str(SCRIPTS))
    try:
        spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(SCRIPTS))


pair = _load("gpu_real_pair")
device = _load("gpu_device")


def test_budget_fits_and_names_what_is_left() -> None:
    now = [100.0]
    budget = pair.Budget(60, clock=lambda: now[0])
    assert budget.fits(60) and not budget.fits(61)
    now[0] = 150.0
    assert budget.left() == 10.0 and not budget.fits(20)
    assert budget.reason(20) == "time budget: 10 s left, the part needs at least 20 s"
    with pytest.raises(ValueError, match="--budget-s"):
        pair.Budget(0)


def test_arguments_defaults_and_errors(capsys: pytest.CaptureFixture[str]) -> None:
    ns = pair.parse([])
    assert ns.budget_s == 360.0 and ns.parts == ["lossless", "spec", "peers", "sweep"]
    assert pair.parse(["--smoke"]).budget_s == 240.0
    assert pair.parse(["--only", "spec,sweep", "--budget-s", "30"]).parts == ["spec", "sweep"]
    with pytest.raises(SystemExit):
        pair.parse(["--only", "spec,bogus"])
    assert "--only: unknown part(s) ['bogus']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        pair.parse(["--budget-s", "-1"])
    assert "--budget-s: must be > 0" in capsys.readouterr().err


def test_settings_smoke_is_cpu_float32_and_real_is_both_dtypes_with_graphs() -> None:
    smoke = pair.settings(True, None)
    assert smoke["device"] == "cpu" and smoke["dtypes"] == ["float32"] and smoke["prompts"] == 2
    real = pair.settings(False, None)
    assert real["device"] == "cuda" and real["dtypes"] == ["bfloat16", "float32"]
    assert real["levels"] == "1,2,4,8,16,32,64" and real["verify_rows"] == (16, 32, 64)
    assert pair.engine_string(real, "bfloat16", True) == (
        "device=cuda,dtype=bfloat16,self_check=true,cuda_graphs=true")
    # the CPU-only row-invariant kernels never reach a CUDA engine (ConfigError there)
    assert "batch_invariant" not in pair.engine_string(real, "bfloat16", True) + real[
        "check_extra"]
    # every engine string parses into an EngineConfig field set
    from workbench.config import parse_overrides

    for cfg in (smoke, real):
        for check in (True, False):
            over = parse_overrides(pair.engine_string(cfg, cfg["dtypes"][0], check)
                                   + cfg["check_extra"], "--engine")
            assert over["self_check"] is check and over["dtype"] == cfg["dtypes"][0]


def test_device_slug_and_software_record() -> None:
    assert device.device_slug("cpu") == "cpu"
    sw = device.software("cpu")
    assert sw["device"] == "cpu" and sw["torch"] and "transformers" in sw and "gguf" in sw


@pytest.mark.parametrize("script", ["gpu_check.sh", "gpu_payload.sh"])
def test_shell_wrappers_parse_and_refuse_unknown_arguments(script: str) -> None:
    path = SCRIPTS / script
    assert subprocess.run(["bash", "-n", str(path)], timeout=30).returncode == 0
    out = subprocess.run(["bash", str(path), "--bogus"], capture_output=True, text=True,
                         timeout=60, env={**os.environ, "PY": sys.executable})
    assert out.returncode == 2 and ("unknown argument" in out.stderr or "usage" in out.stderr)


@pytest.mark.slow
def test_real_pair_smoke_runs_every_part(tmp_path: Path) -> None:
    """The whole --smoke path on the CPU (minutes on a busy 2-core machine)."""
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    out = subprocess.run([sys.executable, str(SCRIPTS / "gpu_real_pair.py"), "--smoke",
                          "--budget-s", "900", "--out", str(tmp_path)], env=env,
                         capture_output=True, text=True, timeout=1200)
    summary = json.loads((tmp_path / "gpu_real_pair.json").read_text())
    assert summary["software"]["device"] == "cpu", summary
    parts = summary["parts"]
    assert parts["lossless float32"]["built"] is True, parts
    assert parts["lossless float32"]["lossless"] is True, parts
    assert parts["lossless float32"]["verify_cost"]["rows16"]["plain_steps"] > 0
    for key in ("spec float32", "peers float32", "sweep float32"):
        assert parts[key]["exit"] == 0, (key, parts[key])
    assert out.returncode == 0, out.stdout + out.stderr
