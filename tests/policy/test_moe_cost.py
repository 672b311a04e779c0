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


def test_per_request_term_is_fitted_only_when_requests_tell_it_apart() -> None:
    truth = LinearCost(a=2.0, b=0.1, r=0.3)
    # B requests × 1 token and × 4 tokens: requests and tokens vary independently
    pts = [(b * q, b) for b in (1, 2, 4, 8) for q in (1, 4)]
    fit = LinearCost.fit([t for t, _ in pts], [truth(t, 0, r) for t, r in pts],
                         requests=[r for _, r in pts])
    assert (fit.a, fit.b, fit.r) == pytest.approx((2.0, 0.1, 0.3), rel=1e-6)
    assert fit(8) == pytest.approx(2.0 + 0.4 * 8)  # requests default: one per token
    # requests always the token count: one column, r folded into b
    same = LinearCost.fit([1, 2, 4], [truth(t) for t in (1, 2, 4)], requests=[1, 2, 4])
    assert same.r == 0 and same.b == pytest.approx(0.4)
    with pytest.raises(wb.ConfigError, match="requests"):
        LinearCost.fit([1, 2], [1.0, 2.0], requests=[1])
    # the cost model prices a verify of B·N tokens as B requests, a plain step as B
    cm = CostModel(target=fit)
    assert cm.spec_step_ms(4, 3, 1, 4, scaled=False) == pytest.approx(truth(16, 0, 4))
    assert cm.plain_step_ms(4, warm=False, scaled=False) == pytest.approx(truth(4, 0, 4))
    assert CostModel.from_dict(cm.to_dict()).target.r == pytest.approx(0.3)


def test_bytes_fit_separates_the_sorted_dispatch_of_multi_token_forwards() -> None:
    """A one-token forward takes the short path (no sort/gather/scatter); every longer one
    pays ``ms_sorted`` per MoE layer on top: the fit tells it from the intercept."""
    w = ExpertBytes(dense_bytes=1e6, expert_bytes=2e6, moe_layers=4, num_experts=16, top_k=2,
                    gamma=0.5)
    truth = LinearCost(a=1.5, b=0.02, r=0.05)
    per_gb, sorted_ms = 40.0, 0.2

    def ms(t: int, r: int) -> float:
        return truth(t, 0, r) + per_gb * w.expert_gb(t) + (sorted_ms * 4 if t > 1 else 0)

    pts = [(b * q, b) for b in (1, 2, 4, 8, 16) for q in (1, 4)]
    cm = CostModel.fit([CostSample("target", t, ms(t, r), 0.0, r) for t, r in pts], weights=w)
    assert cm.ms_per_gb == pytest.approx(per_gb, rel=1e-5)
    assert cm.ms_sorted == pytest.approx(sorted_ms, rel=1e-5)
    assert cm.target.r == pytest.approx(0.05, rel=1e-5)
    for t, r in ((1, 1), (4, 1), (64, 16)):
        assert cm.target_ms(t, 0, r) == pytest.approx(ms(t, r), rel=1e-6)
    assert CostModel.from_dict(cm.to_dict()).ms_sorted == pytest.approx(sorted_ms, rel=1e-5)
    # only one-token samples, or no one-token sample: no dispatch column
    only_multi = [CostSample("target", t, ms(t, r), 0.0, r) for t, r in pts if t > 1]
    assert CostModel.fit(only_multi, weights=w).ms_sorted == 0.0


def test_cost_ratios_measure_and_predict_on_a_moe_engine(tmp_path: Path) -> None:
    from workbench.bench.cost_ratio import cost_ratios, model_terms

    folder = write_random_moe(tmp_path / "m", "mixtral", num_local_experts=8,
                              num_experts_per_tok=2)
    e = wb.Engine.from_pretrained(folder, config=wb.EngineConfig(kv_budget_tokens=2048,
                                                                 max_batch_size=4))
    try:
        rows, cm = cost_ratios(e, "tiny", batches=(1, 4), num_draft_tokens=3, context=16,
                               repeats=1, calibrate_batches=(1, 2, 4))
        with pytest.raises(wb.ConfigError, match="num_draft_tokens"):
            cost_ratios(e, "tiny", num_draft_tokens=1)
    finally:
        e.close()
    assert [r["batch"] for r in rows] == [1, 4]
    for r in rows:
        assert r["decode_ms"] > 0 and r["verify_ms"] > 0
        assert r["ratio"] == pytest.approx(r["verify_ms"] / r["decode_ms"])
        want = cm.target_ms(3 * r["batch"], 16, r["batch"]) / cm.target_ms(r["batch"], 16)
        assert r["predicted"] == pytest.approx(want)
        assert r["within"] == (abs(r["predicted"] / r["ratio"] - 1) <= 0.15)
    terms = model_terms(cm)
    assert cm.weights is not None and terms["gamma"] == cm.weights.gamma
    assert "ms_sorted_per_layer" in terms and "r_ms_per_request" in terms


def test_coverage_is_exact_at_one_token() -> None:
    """One token touches its top-k experts, whatever γ the curve was fitted at."""
    for gamma in (0.1, 0.5, 1.0, 2.0):
        assert uniform_coverage(64, 2, 1, gamma) == pytest.approx(2.0)
    assert uniform_coverage(64, 2, 8, 0.5) < uniform_coverage(64, 2, 8, 1.0)
