"""Fixtures shared by the trace tests."""

from __future__ import annotations

import math

import pytest
from trace_samples import tree_step1, tree_step2, unverified_tree

from workbench.trace import (
    DraftStep,
    Event,
    ExpertRouting,
    InitStage,
    KVUsage,
    PolicyDecision,
    Prefill,
    RequestAdmitted,
    RequestFinished,
    StepTiming,
)


@pytest.fixture
def sample_events() -> list[Event]:
    """One of every event type, in the order an engine would emit them."""
    t1, v1 = tree_step1()
    t2, v2 = tree_step2()
    return [
        InitStage(stage="load_target", status="ok", seconds=0.5, detail="", t=0.1),
        InitStage(stage="cuda_graphs", status="fallback", seconds=0.0, detail="no GPU", t=0.2),
        RequestAdmitted(rid=7, prompt_len=4, max_new_tokens=16, temperature=0.0, t=0.3),
        Prefill(rids=[7], num_tokens=4, chunked=False, seconds=0.01, t=0.4),
        DraftStep(
            step=1,
            rids=[7],
            depth=0,
            tokens=[[11, 12]],
            probs=[[0.9, 0.1]],
            parents=[[0, 0]],
            t=0.9,
        ),
        DraftStep(
            step=1,
            rids=[7],
            depth=1,
            tokens=[[13, 14]],
            probs=[[0.8, 0.2]],
            parents=[[1, 1]],
            t=0.95,
        ),
        PolicyDecision(
            step=1,
            batch_size=1,
            decode_batch=1,
            speculate=True,
            num_steps=3,
            topk=2,
            num_draft_tokens=7,
            reason="always",
            predicted_ms=3.0,
            t=0.8,
        ),
        t1,
        v1,
        StepTiming(
            step=1,
            batch_size=1,
            mode="spec",
            schedule_ms=0.1,
            draft_ms=1.0,
            verify_ms=2.0,
            accept_ms=0.2,
            commit_ms=0.3,
            extend_ms=0.4,
            total_ms=4.0,
            t=1.2,
        ),
        KVUsage(step=1, used_blocks=3, total_blocks=12, used_tokens=40, t=1.3),
        ExpertRouting(step=1, kind="verify", tokens=7, top_k=2, layers=[1, 3],
                      counts=[[5, 0, 4, 5], [0, 0, 14, 0]], t=1.25),
        t2,
        v2,
        unverified_tree(),
        RequestFinished(
            rid=7,
            reason="length",
            prompt_len=4,
            output_len=5,
            verify_ct=2,
            accept_lengths=[3, 1],
            ttft_s=0.05,
            e2e_s=0.2,
            t=3.5,
        ),
        RequestFinished(
            rid=8,
            reason="abort",
            prompt_len=2,
            output_len=0,
            verify_ct=0,
            accept_lengths=[],
            ttft_s=math.nan,
            e2e_s=0.1,
            error="client went away",
            t=3.6,
        ),
    ]
