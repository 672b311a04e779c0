"""workbench.kernels dispatch: backend choice, WORKBENCH_KERNELS, and life without triton."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from kernel_cases import make_attention_case

import workbench.kernels as K
from workbench.kernels import reference

REPO = Path(__file__).resolve().parents[2]


def test_cpu_defaults_to_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WORKBENCH_KERNELS", raising=False)
    assert K.backend_for(torch.device("cpu")) == "reference"


def test_env_forces_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORKBENCH_KERNELS", "reference")
    assert K.backend_for(torch.device("cuda")) == "reference"
    assert K.backend_for(torch.device("cpu")) == "reference"


def test_cuda_defaults_to_triton_when_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WORKBENCH_KERNELS", raising=False)
    want = "triton" if K.triton_available() else "reference"
    assert K.backend_for(torch.device("cuda")) == want


def test_bad_env_value(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORKBENCH_KERNELS", "cuda")
    with pytest.raises(ValueError, match="WORKBENCH_KERNELS"):
        K.backend_for(torch.device("cpu"))


def test_forced_triton_on_cpu_without_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("triton")
    monkeypatch.setenv("WORKBENCH_KERNELS", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        K.backend_for(torch.device("cpu"))


@pytest.mark.parametrize("mode", ["reference", "triton"])
def test_every_entry_point_dispatches(mode: str, monkeypatch: pytest.MonkeyPatch,
                                      request: pytest.FixtureRequest) -> None:
    """The four public functions give the reference's answer through either backend."""
    if mode == "triton":
        request.getfixturevalue("triton_ready")
        if not torch.cuda.is_available():
            assert os.environ.get("TRITON_INTERPRET") == "1"
    monkeypatch.setenv("WORKBENCH_KERNELS", mode)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    kw = make_attention_case([3, 1], [5, 2], 4, 2, 64, 4, torch.float32, tree=True,
                             device=device).kwargs
    torch.testing.assert_close(K.tree_attention(**kw), reference.tree_attention(**kw))

    cand = torch.tensor([[5, 1, 2, 3]], device=device)
    parents = torch.tensor([[-1, 0, 1, 1]], device=device)
    predict = torch.tensor([[1, 3, 0, 0]], device=device)
    got = K.greedy_accept(cand, parents, predict)
    assert got[0].tolist() == [[0, 1, 3, -1]] and got[1].tolist() == [2]
    assert got[2].tolist() == [0]

    probs = torch.full((1, 4, 4), 0.25, device=device)
    coins = torch.zeros(1, 4, device=device)  # coin 0 accepts any token with mass
    final_u = torch.tensor([0.6], device=device)
    got = K.tree_speculative_sample(cand, parents, probs, coins, final_u)
    assert got[0].tolist() == [[0, 1, 2, -1]] and got[2].tolist() == [2]

    pool = torch.arange(2 * 6 * 2, dtype=torch.float32, device=device).reshape(2, 6, 1, 2)
    k, v = pool.clone(), -pool.clone()
    K.compact_kv(k, v, torch.tensor([3, 4], device=device), torch.tensor([1, 3], device=device))
    assert torch.equal(k[:, 1], pool[:, 3]) and torch.equal(k[:, 3], pool[:, 4])
    assert torch.equal(v[:, 3], -pool[:, 4])


def test_import_and_run_without_triton() -> None:
    """With triton unimportable, the package imports and the reference path runs."""
    code = textwrap.dedent("""
        import sys
        sys.modules["triton"] = None  # any `import triton` now raises ImportError
        import torch
        import workbench.kernels as K
        assert not K.triton_available()
        assert K.backend_for(torch.device("cuda")) == "reference"
        c = torch.tensor([[0, 1]]); p = torch.tensor([[-1, 0]])
        idx, n, bonus = K.greedy_accept(c, p, torch.tensor([[1, 7]]))
        assert n.tolist() == [1] and bonus.tolist() == [7]
        assert not any(m.startswith("workbench.kernels.triton_") for m in sys.modules)
        print("ok")
    """)
    env = {k: v for k, v in os.environ.items() if k != "WORKBENCH_KERNELS"}
    env["OMP_NUM_THREADS"] = "1"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_package_import_does_not_import_triton() -> None:
    code = ("import sys, workbench.kernels; "
            "print('triton' in sys.modules, "
            "any(m.startswith('workbench.kernels.triton_') for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.stdout.split() == ["False", "False"], out.stderr
