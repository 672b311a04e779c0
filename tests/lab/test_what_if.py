"""What-ifs on the fitted box: applied after the fit and never refitting; a no-op, a fitted
constant, a stale checkpoint size and a box whose weights do not fit are refused."""

from __future__ import annotations

import pytest

from workbench.errors import ConfigError
from workbench.lab import whatif
from workbench.lab.boxfit import fit, load_seeds
from workbench.lab.boxmodel import level
from workbench.lab.boxreport import box_report
from workbench.lab.boxspec import with_sets

UNFUSED = "server.allreduce_fusion=false"


@pytest.fixture(scope="module")
def rep() -> dict:
    return box_report("seeds", what_ifs=[UNFUSED])


def test_what_if_keeps_the_fitted_constants(rep: dict) -> None:
    fitted = rep["fitted_box"]
    row = rep["what_ifs"]["rows"][0]
    assert row["concurrency"] == 1
    kept = level(with_sets(fitted, [UNFUSED]), 1, rep["tau"])
    assert row["what_if_plain_tok_s"] == pytest.approx(kept["plain_tok_s"], rel=1e-12)
    assert row["what_if_spec_tok_s"] == pytest.approx(kept["spec_tok_s"], rel=1e-12)
    # a refitting what-if — the constants fitted again to the same fused numbers — would
    # move the change into the floor and say something else: this one does not
    refit = fit(with_sets(fitted, [UNFUSED]), load_seeds(), rep["tau"])
    assert refit["floor_ms"] < 0.8 * rep["fitted"]["floor_ms"]
    again = level(refit["box"], 1, rep["tau"])
    assert abs(again["plain_tok_s"] - row["what_if_plain_tok_s"]) > 10
    # the change the user asked about is visible: unfused plain decoding at c = 1 is slower
    assert row["what_if_plain_tok_s"] < 0.8 * row["plain_tok_s"]


def test_set_describes_the_box_before_the_fit(rep: dict) -> None:
    """--set changes the box the constants are fitted on; the same change as a what-if
    keeps them. A box described unfused cannot give the fused numbers at all."""
    slow = "link.paths.fused.latency_us=20"
    before = box_report("seeds", [slow])
    after = box_report("seeds", what_ifs=[slow])
    assert before["fitted"]["floor_ms"] < 0.9 * rep["fitted"]["floor_ms"]
    assert after["fitted"] == rep["fitted"]
    with pytest.raises(ConfigError, match="no reading of the link fits"):
        box_report("seeds", [UNFUSED])


def test_refusals_name_the_field_and_the_numbers(rep: dict) -> None:
    fitted, levels, tau = rep["fitted_box"], rep["levels"], rep["tau"]
    with pytest.raises(ConfigError, match="changes no prediction.*not offered"):
        whatif.apply(fitted, ["link.paths.fused.max_tokens=100000"], levels, tau)
    with pytest.raises(ConfigError, match="fitted constants are not a what-if"):
        whatif.apply(fitted, ["fit.floor_ms=2"], levels, tau)
    fp8 = 'model.quant={"bits": 8, "group_size": 128, "scale_bits": 32}'
    with pytest.raises(ConfigError, match="checkpoint_gb"):
        whatif.apply(fitted, [fp8], levels, tau)
    with pytest.raises(ConfigError,
                       match=r"--what-if model.quant: .* do not fit: 1\d\d\.\d GB per rank "
                             r"\(1,0\d\d GB over 8 ranks\) on 96 GB GPUs \(768 GB in all\)"):
        whatif.apply(fitted, ["model.checkpoint_gb=null", fp8], levels, tau)
