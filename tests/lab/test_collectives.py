"""The box's all-reduces priced by message size per path: a table read log-log and carried
past its last row by its own slope, fusion switching the path (never the table), and the
size-blind forms refused."""

from __future__ import annotations

import math

import pytest

from workbench.errors import ConfigError
from workbench.lab.boxmodel import forward, level
from workbench.lab.boxspec import load_box, set_field
from workbench.lab.collectives import AllReducePath, choose, parse_path, paths

SIXK = ((4096.0, 45.0), (65536.0, 344.0))  # 8 x RTX 6000D, sgl-project/sglang PR 32479


@pytest.fixture(scope="module")
def seeds_box() -> dict:
    return load_box("seeds")


def test_table_rows_reproduced_and_past_the_last_row_by_its_slope() -> None:
    p = AllReducePath("nccl", rows=SIXK)
    assert p.time_us(4096, 8) == pytest.approx(45.0)
    assert p.time_us(65536, 8) == pytest.approx(344.0)
    k = math.log(344 / 45) / math.log(16)  # ~0.73
    # 256 KB: four times the last row's size, so 4**k times its time — a clamped table
    # (np.interp's last value) would say 344
    assert p.time_us(4 * 65536, 8) == pytest.approx(344 * 4**k)
    assert p.time_us(4 * 65536, 8) > 2.5 * 344
    assert p.time_us(14336, 8) == pytest.approx(45 * 3.5**k)  # inside: log-log
    assert p.time_us(8, 8) == pytest.approx(45.0)  # below the first row: its latency floor
    assert p.slope(4096, 65536, 8) == pytest.approx(k)


def test_form_path_grows_with_the_message() -> None:
    p = AllReducePath("fused", latency_us=9.0, bus_gbps=30.0)
    assert p.time_us(57344, 8) - p.time_us(14336, 8) == pytest.approx(
        (57344 - 14336) * 2 * 7 / 8 / 30e3)


def test_size_blind_links_are_refused() -> None:
    with pytest.raises(ConfigError, match="one row gives no slope"):
        parse_path("nccl", {"table": [[4096, 45]]}, "link.paths.nccl")
    with pytest.raises(ConfigError, match="sizes must increase"):
        parse_path("nccl", {"table": [[4096, 45], [4096, 50]]}, "link.paths.nccl")
    with pytest.raises(ConfigError, match="not both"):
        parse_path("nccl", {"table": list(SIXK), "latency_us": 9, "bus_gbps": 30}, "x")
    with pytest.raises(ConfigError, match="link.allreduce_us: .*per path by message size"):
        paths({"allreduce_us": 24.0, "paths": {}}, 8)
    with pytest.raises(ConfigError, match="link.paths.nccl"):
        paths({"paths": {}}, 8)


def test_the_seeds_verify_pays_more_than_a_plain_step(seeds_box: dict) -> None:
    """Unfused, a 4-token verify's 57 KB all-reduces cost what the public table says, not
    what a one-token step's 14 KB ones do: a size-independent link fails here."""
    off = set_field(seeds_box, "server.allreduce_fusion=false")
    plain = forward(off, 1, 1, 1536)["collectives"]
    verify = forward(off, 4, 1, 1536)["collectives"]
    table = paths(off["link"], 8)["nccl"]
    assert verify / plain == pytest.approx(table.time_us(57344, 8) / table.time_us(14336, 8))
    assert verify / plain > 2.5


def test_fusion_switches_the_path_not_the_table(seeds_box: dict) -> None:
    """A new NCCL table changes the unfused forward only; the fused one keeps its path."""
    g = 7168
    assert choose(seeds_box, 4, g, fusion=True, custom=False) == "fused"
    assert choose(seeds_box, 4096, g, fusion=True, custom=False) == "nccl"  # past 2,048 tokens
    assert choose(seeds_box, 4, g, fusion=False, custom=False) == "nccl"
    assert choose(seeds_box, 4, g, fusion=False, custom=True) == "custom"
    slow = set_field(seeds_box, "link.paths.nccl.table=[[4096, 90], [65536, 700]]")
    assert forward(slow, 4, 1, 1536) == forward(seeds_box, 4, 1, 1536)  # fused: unchanged
    off, slow_off = (set_field(b, "server.allreduce_fusion=false") for b in (seeds_box, slow))
    assert forward(slow_off, 4, 1, 1536)["collectives"] > \
        1.5 * forward(off, 4, 1, 1536)["collectives"]


def test_custom_allreduce_follows_sglangs_rule(seeds_box: dict) -> None:
    """SGLang refuses its custom all-reduce on more than two PCIe-only GPUs: the seeds' box
    takes NCCL unfused unless the server is told otherwise."""
    from workbench.lab.boxspec import rules

    assert rules(seeds_box)["custom_allreduce"] is False
    off = set_field(seeds_box, "server.allreduce_fusion=false")
    on = set_field(off, "server.custom_allreduce=true")
    assert level(on, 1)["plain_tok_s"] > level(off, 1)["plain_tok_s"]
