"""The MoE weight-bytes term: coverage curve, byte counts against real checkpoints, the cost
model fitted with it, the what-if for a box's geometry, and calibration on a MoE engine."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from safetensors import safe_open

import workbench as wb
from workbench.models.config import ModelConfig
from workbench.models.synthetic_moe import write_random_moe
from workbench.policy.costmodel import CostModel, CostSample, LinearCost
from workbench.policy.moe_cost import (
    KIMI_K25_INT4,
    ExpertBytes,
    Geometry,
    fit_gamma,
    uniform_coverage,
    what_if,
)


def test_uniform_coverage_and_gamma_fit() -> None:
    assert uniform_coverage(8, 2, 1) == pytest.approx(2.0)  # one token: exactly k experts
    assert uniform_coverage(384, 8, 0) == 0.0
    assert uniform_coverage(384, 8, 10_000) == pytest.approx(384.0)
    pts = [1, 2, 4, 8, 16, 64]
    assert fit_gamma(pts, [uniform_coverage(64, 4, t, 0.37) for t in pts], 64, 4) == \
        pytest.approx(0.37, rel=1e-3)
    with pytest.raises(wb.ConfigError, match="fit_gamma"):
        fit_gamma([], [], 8, 2)
    with pytest.raises(wb.ConfigError, match="ExpertBytes.top_k"):
        ExpertBytes(1.0, 1.0, 1, 4, 5)


@pytest.mark.parametrize("family,kw", [
    ("qwen3_moe", dict(mlp_only_layers=[1])),
    ("deepseek_v3", dict(q_lora_rank=None)),
    ("deepseek_v3", dict(n_shared_experts=2, first_k_dense_replace=2, num_hidden_layers=4)),
    ("mixtral", {}),
])
def test_geometry_counts_the_checkpoint(tmp_path: Path, family: str, kw: dict) -> None:
    """dense + moe_layers·E·expert params = every tensor of the checkpoint but the embedding
    and the norms (32-bit: bytes = 4·params)."""
    folder = write_random_moe(tmp_path / "m", family, **kw)
    cfg = ModelConfig.from_folder(folder)
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        n = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys()
                if "norm" not in k and "embed" not in k and "e_score_correction_bias" not in k)
    g = Geometry.from_config(cfg, 32, 32)
    assert g.dense_params + g.moe_layers * g.num_experts * g.expert_params == n
    wbytes = ExpertBytes.from_config(cfg)
    assert wbytes.expert_gb(10**6) == pytest.approx(
        g.moe_layers * g.num_experts * g.expert_params * 4 / 1e9)


def test_costmodel_fits_and_keeps_the_bytes_term() -> None:
    w = ExpertBytes(dense_bytes=1e6, expert_bytes=2e6, moe_layers=4, num_experts=16, top_k=2)
    truth = LinearCost(a=1.5, b=0.02)
    per_gb = 40.0
    samples = [CostSample("target", t, truth(t) + per_gb * w.expert_gb(t))
               for t in (1, 2, 4, 8, 16, 32, 64)]
    cm = CostModel.fit(samples, weights=w)
    assert cm.ms_per_gb == pytest.approx(per_gb, rel=1e-6)
    assert cm.target_ms(16) == pytest.approx(truth(16) + per_gb * w.expert_gb(16), rel=1e-6)
    back = CostModel.from_dict(cm.to_dict())
    assert back.weights == w and back.target_ms(16) == pytest.approx(cm.target_ms(16))
    # the bytes term is what makes a 16-token verify costlier than 16x less work suggests
    assert cm.target_ms(16) / cm.target_ms(1) > truth(16) / truth(1)
    linear = CostModel.fit(samples)  # no bytes term: a line through a concave curve
    assert abs(linear.target_ms(1) - samples[0].ms) > abs(cm.target_ms(1) - samples[0].ms)
    cross = cm.crossover((3, 1, 4), tau=2.5, max_batch=64)
    assert cross.model is not None and cross.model["weights"]["num_experts"] == 16


def test_what_if_kimi_k25_int4() -> None:
    g = KIMI_K25_INT4
    total = g.dense_params + g.moe_layers * g.num_experts * g.expert_params
    active = g.dense_params + g.moe_layers * g.top_k * g.expert_params
    assert 1.0e12 < total < 1.1e12 and 30e9 < active < 34e9  # the published 1T / 32B
    df = what_if(g, [1, 4, 16, 64], num_draft_tokens=16, hbm_gbps=4800, tp=8)
    assert list(df["batch"]) == [1, 4, 16, 64]
    assert df["decode_experts"].iloc[0] == pytest.approx(8.0)
    # a verify always reads more; the ratio first grows (a 4-token decode still touches few
    # experts, its 64-token verify most), then falls as both approach all 384 experts
    r = list(df["ratio"])
    assert min(r) > 1 and r[1] > r[0] and r[3] < r[2] < r[1]
    # B=1: a 16-token verify touches ~ 384·(1 − (1 − 8/384)^16) = 110 experts per layer
    assert df["verify_experts"].iloc[0] == pytest.approx(uniform_coverage(384, 8, 16))
    assert df["verify_ms"].iloc[0] == pytest.approx(
        g.bytes_model().total_gb(16) / (4800 * 8) * 1e3)
    with pytest.raises(wb.ConfigError, match="what_if"):
        what_if(g, [1], 16, hbm_gbps=0)


def test_calibrate_fits_the_bytes_term_on_a_moe_engine(tmp_path: Path) -> None:
    from workbench.engine.calibrate import calibrate

    folder = write_random_moe(tmp_path / "m", "qwen3_moe", num_experts=16, num_experts_per_tok=2)
    e = wb.Engine.from_pretrained(folder, config=wb.EngineConfig(kv_budget_tokens=2048))
    cm = calibrate(e, batch_sizes=(1, 2, 4, 8), repeats=1, context=16, shape=(3, 1, 4),
                   steps=False)
    e.close()
    assert cm.weights is not None and cm.weights.num_experts == 16
    assert 0 < cm.weights.gamma <= 4 and cm.weights.moe_layers == 3
    assert cm.target_ms(4) > 0
