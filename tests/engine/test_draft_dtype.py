"""The draft's compute dtype (``EngineConfig.draft_dtype``): bf16 copies of the head's weights
propose, the float32 target verifies — outputs are the plain engine's at every setting; ``auto``
is measured on the head's weights (where oneDNN has bf16 kernels), cached, and applied."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import workbench as wb
from workbench.engine import autotune, shape_choices
from workbench.errors import ConfigError
from workbench.models.gemm import onednn_ok

REPO = Path(__file__).resolve().parents[2]
TARGET, DRAFT = REPO / "data/models/wb-target", REPO / "data/models/wb-eagle3"
BF16 = onednn_ok(torch.zeros(1, dtype=torch.bfloat16))
PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13], [40, 41, 42, 43, 44, 45]]


def _run(cfg: wb.EngineConfig) -> tuple[dict, list[list[int]], list[list[int]], list[int]]:
    sp = wb.SamplingParams(max_new_tokens=20, ignore_eos=True)
    with wb.Engine(TARGET, draft=DRAFT, config=cfg) as e:
        plain = [o.token_ids for o in e.generate(PROMPTS, sp)]
        outs = e.generate(PROMPTS, sp, spec=wb.SpecConfig(5, 4, 16))
        draft = e.runner.draft
        params = {p.dtype for p in draft.parameters()}
        info = {**e.choices["draft_dtype"], "compute": draft.compute_dtype, "params": params}
    return info, plain, [o.token_ids for o in outs], [o.metrics.verify_ct for o in outs]


@pytest.mark.parametrize("dd", ["same", "bfloat16"])
def test_speculative_output_is_the_plain_output_at_every_draft_dtype(dd: str) -> None:
    info, plain, spec, verifies = _run(wb.EngineConfig(draft_dtype=dd, compile="off"))
    assert spec == plain
    assert info["choice"] == dd and info["source"] == "forced"
    assert info["params"] == {torch.float32}  # the parameters are never cast
    assert info["compute"] == (torch.bfloat16 if dd == "bfloat16" else None)
    assert all(v < 20 for v in verifies)  # drafts are accepted: fewer verifies than tokens


def test_a_bf16_draft_proposes_about_as_well_as_a_float32_one() -> None:
    _, _, _, same = _run(wb.EngineConfig(draft_dtype="same", compile="off"))
    _, _, _, bf16 = _run(wb.EngineConfig(draft_dtype="bfloat16", compile="off"))
    # the head was trained under bf16 autocast: a last-bit difference may move a near-tie in
    # its top-k, never its acceptance by much
    assert sum(bf16) <= sum(same) * 1.25 + 2


@pytest.mark.skipif(not BF16, reason="no oneDNN bf16 kernels on this CPU")
def test_auto_is_measured_then_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(autotune.ENV_CACHE, str(tmp_path / "autotune.json"))
    info, plain, spec, _ = _run(wb.EngineConfig(compile="off"))
    assert spec == plain
    assert info["source"] == "measured" and info["candidates"] == ["same", "bfloat16"]
    assert set(info["timings_ms"]["bfloat16"]) == set(shape_choices.DRAFT_SHAPES)
    assert info["choice"] == autotune.pick(info["timings_ms"], "same", shape_choices.DRAFT_WEIGHTS)
    assert info["compute"] == (torch.bfloat16 if info["choice"] == "bfloat16" else None)
    if info["provisional"]:  # measured on a busy machine: never cached
        return
    again, _, _, _ = _run(wb.EngineConfig(compile="off"))
    assert again["source"] == "cached" and again["choice"] == info["choice"]


def test_auto_is_same_where_bf16_cannot_help(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shape_choices, "onednn_ok", lambda w: False)
    info, plain, spec, _ = _run(wb.EngineConfig(compile="off", gemm="dense"))
    assert spec == plain
    assert info["choice"] == "same" and info["source"] == "only"
    assert "without oneDNN bf16 kernels" in info["note"]


def test_no_draft_no_choice_and_a_bad_value_is_refused() -> None:
    with wb.Engine(TARGET, config=wb.EngineConfig(compile="off")) as e:
        assert "draft_dtype" not in e.choices
    for bad in ("fp16", "bf16", 1, None):
        with pytest.raises(ConfigError, match="draft_dtype"):
            wb.EngineConfig(draft_dtype=bad)  # type: ignore[arg-type]


def test_lab_record_refuses_a_draft_computing_in_another_dtype() -> None:
    """The lab replays recorded draft scores for other shapes: a bf16 draft's scores move
    between a 1-row and an N-row step, so recording one is refused, naming the fix."""
    from workbench.lab.record import record

    with wb.Engine(TARGET, draft=DRAFT, config=wb.EngineConfig(draft_dtype="bfloat16",
                                                                compile="off")) as e:
        with pytest.raises(ConfigError, match="draft_dtype='same'"):
            record(e, [[5, 6, 7]], (3, 2, 6), 4)
