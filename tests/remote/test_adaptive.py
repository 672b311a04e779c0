"""Adaptive tiers and SGLang's routing rules, pure (test_sglang_upstream checks them against
SGLang's own AdaptiveSpeculativeParams)."""

from __future__ import annotations

import pytest

import workbench as wb
from workbench.remote.adaptive import (
    Tiers,
    has_adaptive_tiers,
    nearest_exact_thresholds,
    pad_to_capture,
    parse_version,
    policy_steps,
    spec_decode_capture_sizes,
    threshold_differences,
    tiers_for_policy,
)

SPEC48 = spec_decode_capture_sizes(48)


def test_versions() -> None:
    assert parse_version("0.5.23") == (0, 5, 23) and parse_version("v0.5.9.post1") == (0, 5, 9)
    assert parse_version("0.5.23rc1") == (0, 5, 23)
    assert has_adaptive_tiers("0.5.23") and has_adaptive_tiers("0.6") \
        and not has_adaptive_tiers("0.5.9")
    with pytest.raises(wb.ConfigError, match="sglang_version"):
        parse_version("main")


def test_capture_sizes_and_padding() -> None:
    assert SPEC48 == [*range(1, 9), *range(10, 33, 2), 40, 44, 48]
    assert spec_decode_capture_sizes(50)[-2:] == [48, 50]  # max_bs itself is captured
    assert [pad_to_capture(b, SPEC48) for b in (1, 9, 33, 48, 49, 100)] == [1, 10, 40, 48, 49,
                                                                            100]
    assert pad_to_capture(9, None) == 9


def test_tiers_route_like_sglang() -> None:
    t = Tiers.of({1: [5], 9: [0]})
    assert t.config() == {"1": {"candidate_steps": [5]}, "9": {"candidate_steps": [0]}}
    assert t.candidate_steps == [0, 5]
    assert [t.route(b).steps for b in (1, 8, 9, 64)] == [5, 5, 0, 0]
    r = t.route(9, SPEC48, 5)
    assert (r.padded, r.tier, r.steps, r.adaptive) == (10, 9, 0, False)
    # SGLang's default tiers: multi-candidate tiers start at num_steps if a candidate, else the
    # middle candidate; a batch below the first key uses the first tier
    d = Tiers.of({1: [1, 3, 5, 7], 8: [0, 1, 3], 32: [0, 1], 64: [0]})
    assert d.route(2, None, 5).steps == 5 and d.route(2, None, 4).steps == 5
    assert d.route(8, None, 5).steps == 1 and d.route(8, None, 5).adaptive
    assert Tiers.of({4: [2]}).route(1).tier == 4
    text = Tiers.of({1: [5], 9: [0]}, ema_alpha=0.3).config_text()
    assert text.splitlines() == ["{", '  "1": {"candidate_steps": [5]},',
                                 '  "9": {"candidate_steps": [0]},', '  "ema_alpha": 0.3', "}"]


@pytest.mark.parametrize("tiers,tuning,match", [
    ({}, {}, "at least one"),
    ({0: [1]}, {}, "keys must be"),
    ({1: []}, {}, r"tiers\[1\]"),
    ({1: [-1]}, {}, r"tiers\[1\]"),
    ({1: [1]}, {"ema_alpah": 0.1}, "ema_alpah"),
])
def test_tiers_validation(tiers: dict, tuning: dict, match: str) -> None:
    with pytest.raises(wb.ConfigError, match=match):
        Tiers.of(tiers, **tuning)


def test_policies_to_tiers_and_decisions() -> None:
    assert tiers_for_policy(wb.Always(), 5) is None and tiers_for_policy(wb.Never(), 5) is None
    assert tiers_for_policy(wb.BatchThreshold(0), 5) is None
    assert tiers_for_policy(wb.BatchThreshold(3), 2) == Tiers.of({1: [2], 4: [0]})
    with pytest.raises(wb.ConfigError, match="decides at run time"):
        tiers_for_policy(wb.RandomFlip(), 5)
    assert policy_steps(wb.BatchThreshold(3), 3, 5) == 5
    assert policy_steps(wb.BatchThreshold(3), 4, 5) == 0
    assert policy_steps(wb.RandomFlip(), 4, 5) is None
    # "auto" is an engine's to resolve (workbench.engine.policy_init): refused here, named
    for call in (lambda: tiers_for_policy(wb.BatchThreshold("auto"), 5),
                 lambda: policy_steps(wb.BatchThreshold("auto"), 4, 5)):
        with pytest.raises(wb.ConfigError, match="spec.policy: .* resolved by a local engine"):
            call()


def test_threshold_differences_and_nearest_exact() -> None:
    assert threshold_differences(9, SPEC48, 48) == [9]
    assert threshold_differences(9, None, 48) == []
    assert threshold_differences(35, SPEC48, 48) == [33, 34, 35]  # 33..35 pad to 40
    assert nearest_exact_thresholds(9, SPEC48, 48) == [8, 10]
    assert nearest_exact_thresholds(35, SPEC48, 48) == [32, 40]
    assert nearest_exact_thresholds(8, SPEC48, 48) == [8]
    assert nearest_exact_thresholds(50, SPEC48, 64) == [50]  # above the list: not padded
