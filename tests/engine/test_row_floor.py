"""The oneDNN row floor (``EngineConfig.row_floor``, ``models/gemm.row_bucket``): GEMMs of
fewer rows run padded, which never changes a real row — plain and speculative outputs are the
same at every floor — and ``auto`` is measured on the model's weights, cached, and applied."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import workbench as wb
from workbench.engine import autotune, shape_choices
from workbench.errors import ConfigError
from workbench.models.gemm import FLOORS, gemm_ops, onednn_ok, pack, row_bucket

REPO = Path(__file__).resolve().parents[2]
ONEDNN = onednn_ok(torch.zeros(1, 1))
needs_onednn = pytest.mark.skipif(not ONEDNN, reason="oneDNN packing unavailable here")


def test_row_bucket_pads_up_to_the_floor_only() -> None:
    assert [row_bucket(m, 6) for m in range(1, 9)] == [6, 6, 6, 6, 6, 6, 7, 8]
    assert [row_bucket(m) for m in (1, 5, 16, 17, 65)] == [1, 5, 16, 32, 128]
    assert row_bucket(3, 1) == 3 and row_bucket(20, 8) == 32


@needs_onednn
@pytest.mark.parametrize("floor", [4, 6, 8])
def test_padded_rows_leave_every_real_row_bit_identical(floor: int) -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 96, generator=g)
    pw = pack(w)
    lin1, add1 = gemm_ops("onednn")
    linf, addf = gemm_ops("onednn", floor)
    for m in range(1, floor + 2):
        x, res = torch.randn(m, 96, generator=g), torch.randn(m, 300, generator=g)
        a, b = lin1(x, pw, None), linf(x, pw, None)
        assert b.shape == (m, 300) and torch.equal(a, b), m
        assert torch.equal(add1(x, pw, res), addf(x, pw, res)), m
    # dense GEMMs ignore the floor
    x = torch.randn(2, 96, generator=g)
    assert torch.equal(gemm_ops("dense", floor)[0](x, w, None), gemm_ops("dense")[0](x, w, None))


def test_pick_floor_takes_the_fastest_count_beyond_the_margin() -> None:
    t = {f"M={m}": v for m, v in zip(FLOORS, (23.4, 25.6, 24.0, 20.4, 21.0, 20.0, 26.0, 24.0),
                                     strict=True)}
    assert shape_choices.pick_floor(t) == 6
    # within the margin of one row: no floor
    assert shape_choices.pick_floor({**t, "M=1": 20.3}) == 1
    # a tie goes to the fewer rows
    assert shape_choices.pick_floor({"M=1": 30.0, "M=4": 20.0, "M=6": 20.0}) == 4


@pytest.mark.parametrize("bad", [-1, 17, True, 2.0, "6"])
def test_a_bad_row_floor_is_refused_naming_the_field(bad: object) -> None:
    with pytest.raises(ConfigError, match="row_floor"):
        wb.EngineConfig(row_floor=bad)  # type: ignore[arg-type]


@needs_onednn
def test_outputs_are_the_same_at_every_floor_plain_and_speculative() -> None:
    target, draft = REPO / "data/models/wb-target", REPO / "data/models/wb-eagle3"
    prompts = [[5, 6, 7, 8, 9], [11, 12], [40, 41, 42, 43, 44, 45, 46]]
    sp = wb.SamplingParams(max_new_tokens=12, ignore_eos=True)
    out = {}
    for floor in (1, 6, 8):
        cfg = wb.EngineConfig(gemm="onednn", row_floor=floor, compile="off")
        with wb.Engine(target, draft=draft, config=cfg) as e:
            assert e.choices["rows"]["choice"] == str(floor)
            assert e.runner.target.row_floor == floor
            plain = [o.token_ids for o in e.generate(prompts, sp)]
            spec = [o.token_ids for o in e.generate(prompts[:1], sp,
                                                      spec=wb.SpecConfig(5, 4, 16))]
        out[floor] = (plain, spec)
        assert spec[0] == plain[0]  # lossless at this floor
    assert out[1] == out[6] == out[8]


@needs_onednn
def test_auto_is_measured_on_the_weights_then_read_from_the_cache(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, micro_target: Path) -> None:
    cache = tmp_path / "autotune.json"
    monkeypatch.setenv(autotune.ENV_CACHE, str(cache))
    with wb.Engine(micro_target, config=wb.EngineConfig(gemm="onednn")) as e:
        rows = e.choices["rows"]
        assert rows["source"] == "measured"
        assert set(rows["timings_ms"]["onednn"]) == {f"M={m}" for m in FLOORS}
        assert rows["choice"] == str(shape_choices.pick_floor(rows["timings_ms"]["onednn"]))
        assert e.runner.target.row_floor == int(rows["choice"])
        first = e.generate([[5, 6, 7]], wb.SamplingParams(max_new_tokens=5))[0].token_ids
    if rows["provisional"]:  # measured while the machine was busy: never cached
        assert not cache.exists() or "rows" not in next(iter(json.loads(
            cache.read_text())["entries"].values()), {})
        return
    with wb.Engine(micro_target, config=wb.EngineConfig(gemm="onednn")) as e:
        assert e.choices["rows"]["source"] == "cached"
        assert e.choices["rows"]["choice"] == rows["choice"]
        assert e.generate([[5, 6, 7]], wb.SamplingParams(max_new_tokens=5))[0].token_ids == first
