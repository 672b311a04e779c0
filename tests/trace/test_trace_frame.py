"""Tidy DataFrames from events: documented columns and hand-checked values."""

from __future__ import annotations

import math

import pytest
from trace_samples import tree_step1, tree_step2, unverified_tree

from workbench.trace import FRAME_COLUMNS, FRAME_KINDS, TIMING_PHASES, Event, frame
from workbench.trace.frame import _BUILDERS


def test_every_kind_has_a_builder() -> None:
    assert set(_BUILDERS) == set(FRAME_COLUMNS) == set(FRAME_KINDS)


@pytest.mark.parametrize("kind", FRAME_KINDS)
def test_columns_are_documented_even_when_empty(kind: str, sample_events: list[Event]) -> None:
    empty = frame([], kind)
    assert list(empty.columns) == list(FRAME_COLUMNS[kind]) and len(empty) == 0
    full = frame(sample_events, kind)
    assert list(full.columns) == list(FRAME_COLUMNS[kind]) and len(full) > 0


def test_unknown_kind_lists_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="'verfiy' unknown; valid kinds: events, init"):
        frame([], "verfiy")


def test_verify_frame(sample_events: list[Event]) -> None:
    df = frame(sample_events, "verify")
    assert list(df["step"]) == [1, 2] and list(df["rid"]) == [7, 7]
    assert list(df["accept_length"]) == [3, 1]
    assert list(df["n_nodes"]) == [7, 3] and list(df["n_drafted"]) == [6, 2]
    assert list(df["bonus_token"]) == [99, 5]
    assert df["accepted_tokens"].iloc[0] == [11, 13, 99]
    assert df["accepted_path"].iloc[0] == [0, 1, 3]


def test_tree_frame_joins_verification(sample_events: list[Event]) -> None:
    df = frame(sample_events, "tree")
    assert len(df) == 7 + 3 + 2
    t1 = df[df["step"] == 1].set_index("node")
    assert list(t1["token"]) == [10, 11, 12, 13, 14, 15, 16]
    assert list(t1["parent"]) == [-1, 0, 0, 1, 1, 2, 3]
    assert list(t1["depth"]) == [0, 1, 1, 2, 2, 2, 3]
    assert list(t1["accepted"]) == [True, True, False, True, False, False, False]
    assert t1["verified"].all()
    assert t1.loc[3, "target_prob"] == 0.7 and t1.loc[3, "target_token"] == 99
    assert t1.loc[6, "score"] == -0.9 and t1.loc[6, "draft_prob"] == 0.5
    t2 = df[df["step"] == 2]
    assert list(t2["accepted"]) == [True, False, False]
    lone = df[df["rid"] == 8]
    assert not lone["verified"].any() and not lone["accepted"].any()
    assert lone["target_prob"].isna().all() and list(lone["target_token"]) == [-1, -1]


def test_accept_by_depth_on_a_known_tree() -> None:
    t1, v1 = tree_step1()
    t2, v2 = tree_step2()
    df = frame([t1, v1, t2, v2, unverified_tree()], "accept_by_depth").set_index("depth")
    # depth 1: step 1 drafts nodes 1,2 (1 accepted), step 2 drafts node 1 (rejected)
    # depth 2: step 1 drafts 3,4,5 (3 accepted), step 2 drafts node 2; depth 3: node 6 (rejected)
    # the unverified tree of rid 8 is not counted
    assert list(df.index) == [1, 2, 3]
    assert list(df["drafted"]) == [3, 4, 1]
    assert list(df["accepted"]) == [1, 1, 0]
    assert list(df["rate"]) == pytest.approx([1 / 3, 1 / 4, 0.0])
    assert list(df["trees"]) == [2, 2, 1]
    assert list(df["tree_rate"]) == pytest.approx([0.5, 0.5, 0.0])
    # consistency with the per-node table
    nodes = frame([t1, v1, t2, v2], "tree")
    drafted = nodes[nodes["depth"] > 0].groupby("depth")["accepted"].agg(["count", "sum"])
    assert list(drafted["count"]) == list(df["drafted"])
    assert list(drafted["sum"]) == list(df["accepted"])


def test_plain_steps_have_no_drafted_depths() -> None:
    t1, v1 = tree_step1()
    root_only = type(t1)(
        step=9, rid=1, tokens=[4], parents=[-1], depth=[0], scores=[0.0], draft_probs=[1.0], t=0.0
    )
    ver = type(v1)(
        step=9,
        rid=1,
        target_tokens=[8],
        target_probs=[1.0],
        accepted_path=[0],
        accepted_tokens=[8],
        accept_length=1,
        bonus_token=8,
        t=0.0,
    )
    assert len(frame([root_only, ver], "accept_by_depth")) == 0


def test_timing_frames(sample_events: list[Event]) -> None:
    wide = frame(sample_events, "timing")
    assert len(wide) == 1 and wide["mode"].iloc[0] == "spec"
    assert wide["verify_ms"].iloc[0] == 2.0 and wide["total_ms"].iloc[0] == 4.0
    long = frame(sample_events, "timing_long")
    assert list(long["phase"]) == list(TIMING_PHASES)
    assert long["ms"].sum() == pytest.approx(
        wide[[f"{p}_ms" for p in TIMING_PHASES]].sum(axis=1)[0]
    )


def test_policy_kv_requests_draft_frames(sample_events: list[Event]) -> None:
    pol = frame(sample_events, "policy")
    assert pol["speculate"].tolist() == [True] and pol["predicted_ms"].iloc[0] == 3.0
    assert math.isnan(pol["measured_ms"].iloc[0])

    kv = frame(sample_events, "kv")
    assert kv["utilization"].iloc[0] == pytest.approx(0.25)

    req = frame(sample_events, "requests").set_index("rid")
    assert req.loc[7, "tau"] == pytest.approx(2.0) and req.loc[7, "accept_lengths"] == [3, 1]
    assert math.isnan(req.loc[8, "tau"]) and req.loc[8, "error"] == "client went away"
    assert req.loc[8, "reason"] == "abort"

    draft = frame(sample_events, "draft")
    assert len(draft) == 4
    assert list(draft["depth"]) == [0, 0, 1, 1] and list(draft["cand"]) == [0, 1, 0, 1]
    assert list(draft["token"]) == [11, 12, 13, 14]
    assert list(draft["prob"]) == [0.9, 0.1, 0.8, 0.2] and list(draft["parent"]) == [0, 0, 1, 1]


def test_small_frames(sample_events: list[Event]) -> None:
    ev = frame(sample_events, "events")
    assert len(ev) == len(sample_events)
    assert ev["type"].iloc[0] == "InitStage" and ev["step"].iloc[0] == -1
    init = frame(sample_events, "init")
    assert list(init["status"]) == ["ok", "fallback"]
    assert frame(sample_events, "admitted")["max_new_tokens"].iloc[0] == 16
    pre = frame(sample_events, "prefill")
    assert pre["num_requests"].iloc[0] == 1 and pre["rids"].iloc[0] == [7]


def test_expert_coverage_frame(sample_events: list[Event]) -> None:
    df = frame(sample_events, "expert_coverage")
    assert list(df["layer"]) == [1, 3] and list(df["distinct"]) == [3, 1]
    assert list(df["num_experts"]) == [4, 4] and list(df["max_load"]) == [5, 14]
    assert list(df["kind"]) == ["verify", "verify"] and list(df["tokens"]) == [7, 7]
    # E·(1 − (1 − k/E)^tokens) = 4·(1 − 0.5^7)
    assert df["expected_uniform"].iloc[0] == pytest.approx(4 * (1 - 0.5**7))
    assert df["counts"].iloc[1] == [0, 0, 14, 0]
