"""ExpertRouting events from a MoE engine: one per target forward, per MoE layer the tokens
routed to each expert; the expert_coverage frame built from them."""

from __future__ import annotations

from pathlib import Path

import pytest

import workbench as wb
from workbench.models.synthetic import write_random_head
from workbench.models.synthetic_moe import write_random_moe
from workbench.trace import ExpertRouting, frame, trace


@pytest.fixture(scope="module")
def moe_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("cov")
    target = write_random_moe(root / "t", "deepseek_v3", n_routed_experts=16, n_group=4,
                              topk_group=2, num_experts_per_tok=2, num_hidden_layers=3)
    return target, write_random_head(target, root / "h", draft_vocab=64)


def test_routing_events_per_forward(moe_pair: tuple[Path, Path]) -> None:
    target, head = moe_pair
    e = wb.Engine.from_pretrained(target, draft=head,
                                  config=wb.EngineConfig(kv_budget_tokens=512))
    sp = wb.SamplingParams(max_new_tokens=6, ignore_eos=True)
    with trace(e, [ExpertRouting]) as tr:
        e.generate([[1, 2, 3, 4, 5], [6, 7, 8]], sp)
        e.generate([[1, 2, 3, 4, 5], [6, 7, 8]], sp,
                   spec=wb.SpecConfig(num_steps=2, topk=2, num_draft_tokens=4))
    e.close()
    evs = tr.events
    assert {ev.kind for ev in evs} == {"prefill", "decode", "verify"}
    for ev in evs:
        assert ev.layers == [1, 2]  # first_k_dense_replace=1: layer 0 is dense
        assert all(len(c) == 16 and sum(c) == ev.tokens * 2 for c in ev.counts)
    decode = [ev for ev in evs if ev.kind == "decode"]
    assert decode and {ev.tokens for ev in decode} <= {1, 2}  # one row per request
    verify = [ev for ev in evs if ev.kind == "verify"]
    assert verify and max(ev.tokens for ev in verify) == 8  # 2 trees of N=4 nodes
    df = frame(evs, "expert_coverage")
    assert len(df) == 2 * len(evs)
    assert (df["distinct"] <= df["tokens"] * df["top_k"]).all()
    assert (df["distinct"] >= df["top_k"]).all() and (df["distinct"] <= 16).all()
    by = df.groupby("kind")["distinct"].mean()
    assert by["verify"] >= by["decode"]  # 8 tokens never touch fewer experts than 2 of them


def test_dense_target_emits_no_routing(micro_target: Path) -> None:
    e = wb.Engine.from_pretrained(micro_target, config=wb.EngineConfig(kv_budget_tokens=256))
    with trace(e, [ExpertRouting]) as tr:
        e.generate([[1, 2, 3]], wb.SamplingParams(max_new_tokens=3, ignore_eos=True))
    e.close()
    assert tr.events == []
