"""The switch and the checks around it: ``EngineConfig.batch_invariant`` validated naming the
field; the GEMM probe catches a path whose rows depend on the row count; the self-check of a
reduced-precision engine without the switch refuses, naming it, when rows differ, and a
float32 engine passes and says how far its logprobs differ."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import workbench as wb
from workbench.engine import invariance
from workbench.errors import ConfigError, EngineInitError
from workbench.models.llama import LlamaForCausalLM


@pytest.mark.parametrize("kw, match", [
    (dict(batch_invariant="yes"), "batch_invariant: must be a bool"),
    (dict(batch_invariant=True, dtype="float16"), "float32 or bfloat16 only"),
    (dict(batch_invariant=True, attention_backend="torch"), "conflicts"),
    (dict(batch_invariant=True, device="cuda"), "CPU engine"),
])
def test_config_refuses_naming_the_field(kw: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        wb.EngineConfig(**kw)


def test_gemm_probe_catches_row_count_dependence(micro_target: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    e = wb.Engine.from_pretrained(micro_target, config=wb.EngineConfig(
        self_check=False, batch_invariant=True, gemm="onednn"))
    try:
        target = e.runner.target
        assert invariance.gemm_rows_problem(target) is None

        def skewed(gemm: str, floor: int = 1):  # a GEMM whose rows see how many rows there are
            def lin(x, w, b):
                y = torch.nn.functional.linear(x, w if w.dtype == x.dtype else w, b)
                return y + (x.shape[0] > 7) * 1e-3

            return lin, lambda x, w, r: r + lin(x, w, None)

        monkeypatch.setattr(invariance, "gemm_ops", skewed)
        target.fuse("dense")
        problem = invariance.gemm_rows_problem(target)
        assert problem is not None and "dense qkv: rows of a 1-row call differ" in problem
    finally:
        e.close()


def test_a_forced_dense_path_is_refused_under_the_switch(micro_target: Path) -> None:
    """Dense bf16 ``addmm`` rounds a row by the call's row count (seen on the 2-core EPYC:
    row 16 of an 18-row call vs the row alone), so the switch needs oneDNN-packed GEMMs."""
    with pytest.raises(EngineInitError, match="gemm='dense' is not row-invariant"):
        wb.Engine.from_pretrained(micro_target, config=wb.EngineConfig(
            dtype="bfloat16", gemm="dense", batch_invariant=True))
    e = wb.Engine.from_pretrained(micro_target, config=wb.EngineConfig(
        dtype="bfloat16", batch_invariant=True, self_check=False))
    try:
        assert e.runner.target.gemm == "onednn"
    finally:
        e.close()


def _skew_verify_rows(monkeypatch: pytest.MonkeyPatch, eps: float) -> None:
    """Logits of forwards of more than one row move by ``eps``: what a kernel whose rows
    depend on the row count does."""
    real = LlamaForCausalLM.logits

    def logits(self: LlamaForCausalLM, hidden: torch.Tensor) -> torch.Tensor:
        out = real(self, hidden)
        tilt = eps * torch.linspace(0, 1, out.shape[-1])  # not a constant: log_softmax drops those
        return out + tilt if hidden.shape[0] > 3 else out  # verifies, not plain bs <= 3

    monkeypatch.setattr(LlamaForCausalLM, "logits", logits)


def test_bf16_without_the_switch_refuses_when_rows_differ(
        micro_target: Path, random_head: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _skew_verify_rows(monkeypatch, 1e-2)
    with pytest.raises(EngineInitError, match=r"batch_invariant=True") as err:
        wb.Engine.from_pretrained(micro_target, draft=random_head,
                                  config=wb.EngineConfig(dtype="bfloat16", compile="off"))
    assert err.value.stage == "self_check"


def test_float32_without_the_switch_says_how_far_rows_differ(
        micro_target: Path, random_head: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _skew_verify_rows(monkeypatch, 1e-6)
    e = wb.Engine.from_pretrained(micro_target, draft=random_head,
                                  config=wb.EngineConfig(compile="off"))
    try:
        detail = e.init_details["self_check"]
        assert "logprobs differ by up to" in detail
        assert "batch_invariant=True" in detail
    finally:
        e.close()


def test_with_the_switch_the_self_check_sees_bit_identical_rows(
        micro_target: Path, random_head: Path) -> None:
    e = wb.Engine.from_pretrained(micro_target, draft=random_head, config=wb.EngineConfig(
        dtype="bfloat16", batch_invariant=True))
    try:
        assert e.init_details["self_check"].startswith("rows invariant")
    finally:
        e.close()


def test_with_the_switch_a_broken_row_is_a_bug_not_a_hint(
        micro_target: Path, random_head: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _skew_verify_rows(monkeypatch, 1e-2)
    with pytest.raises(EngineInitError, match="row-invariance bug"):
        wb.Engine.from_pretrained(micro_target, draft=random_head, config=wb.EngineConfig(
            dtype="bfloat16", batch_invariant=True))
