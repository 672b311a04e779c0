"""Greedy EAGLE-3 output equals greedy baseline output, token for token."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import id_prompts, make_engine

import workbench as wb

CONFIGS = {
    "chain S1": wb.SpecConfig(num_steps=1, topk=1),
    "chain S3": wb.SpecConfig(num_steps=3, topk=1),
    "chain S5": wb.SpecConfig(num_steps=5, topk=1),
    "S5 K4 N16": wb.SpecConfig(num_steps=5, topk=4, num_draft_tokens=16),
    "S6 K8 N32": wb.SpecConfig(num_steps=6, topk=8, num_draft_tokens=32),
    "S3 K2 N6": wb.SpecConfig(num_steps=3, topk=2, num_draft_tokens=6),
}


@pytest.fixture(scope="module", params=["random_head", "trained_head"])
def engine(request: pytest.FixtureRequest, micro_target: Path) -> wb.Engine:
    head = request.getfixturevalue(request.param)
    e = make_engine(micro_target, head, kv_budget_tokens=8192)
    yield e
    e.close()


def run_staggered(engine: wb.Engine, ps: list[list[int]], sp: wb.SamplingParams,
                  spec: wb.SpecConfig | None, batch: int) -> list[list[int]]:
    """At most ``batch`` requests in flight; new ones join as others finish (staggered)."""
    engine.set_spec(spec)
    try:
        queue = list(enumerate(ps))
        live: dict[int, int] = {}
        out: dict[int, list[int]] = {}
        steps = 0
        while queue or live:
            while queue and len(live) < batch:
                i, p = queue.pop(0)
                live[engine.add_request(p, sp)] = i
                if len(live) < batch:
                    engine.step()  # stagger: the next one arrives a step later
            engine.step()
            steps += 1
            assert steps < 20 * len(ps) * sp.max_new_tokens, f"requests never finish: {live}"
            for rid in [r for r in live if engine.requests[r].finished]:
                out[live.pop(rid)] = engine.output(rid).token_ids
        return [out[i] for i in range(len(ps))]
    finally:
        engine.set_spec(None)


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("batch", [1, 4, 13])
def test_greedy_spec_equals_baseline(engine: wb.Engine, name: str, batch: int) -> None:
    ps = id_prompts(13 if batch > 1 else 4, seed=batch, lo=2, hi=30)
    sp = wb.SamplingParams(max_new_tokens=20, ignore_eos=True)
    base = run_staggered(engine, ps, sp, None, batch)
    spec = run_staggered(engine, ps, sp, CONFIGS[name], batch)
    assert spec == base
    assert engine.kv_usage()["used_blocks"] == 0


def test_trained_head_accepts(micro_target: Path, trained_head: Path) -> None:
    """Guard that the lossless tests above exercise partial and multi-token acceptance."""
    e = make_engine(micro_target, trained_head)
    outs = e.generate(id_prompts(4, seed=9, lo=2, hi=30),
                      wb.SamplingParams(max_new_tokens=40, ignore_eos=True),
                      spec=CONFIGS["S5 K4 N16"])
    taus = [a for o in outs for a in o.metrics.accept_lengths]
    assert sum(taus) / len(taus) > 1.5 and max(taus) >= 3 and min(taus) == 1
    e.close()


@pytest.mark.parametrize("temperature", [0.25, 3.0])
def test_calibrated_ranking_stays_lossless(micro_target: Path, trained_head: Path,
                                           tmp_path: Path, temperature: float) -> None:
    """A head's greedy calibration temperature reshapes its trees (ranking only): outputs stay
    the baseline's, with greedy and sampled requests mixed in one batch."""
    import json
    import shutil

    head = tmp_path / "head"
    shutil.copytree(trained_head, head)
    cfg = json.loads((head / "config.json").read_text())
    cfg["workbench"] = {"greedy_score_temperature": temperature}
    (head / "config.json").write_text(json.dumps(cfg))
    e = make_engine(micro_target, head, kv_budget_tokens=8192)
    assert e.runner.draft.config.greedy_score_temperature == temperature
    ps = id_prompts(13, seed=5, lo=2, hi=30)
    sp = wb.SamplingParams(max_new_tokens=20, ignore_eos=True)
    for name in ("S5 K4 N16", "S6 K8 N32"):
        assert run_staggered(e, ps, sp, CONFIGS[name], 4) == run_staggered(e, ps, sp, None, 4)
    spec = CONFIGS["S5 K4 N16"]
    mixed = [sp, wb.SamplingParams(max_new_tokens=20, ignore_eos=True, temperature=0.8, seed=3)]
    outs = e.generate(ps[:2], mixed, spec=spec)
    assert outs[0].token_ids == e.generate([ps[0]], sp)[0].token_ids
    assert len(outs[1].token_ids) == 20
    assert e.kv_usage()["used_blocks"] == 0
    e.close()


def test_metrics_semantics(engine: wb.Engine) -> None:
    sp = wb.SamplingParams(max_new_tokens=30, ignore_eos=True)
    out = engine.generate([id_prompts(1, lo=2, hi=30)[0]], sp, spec=CONFIGS["S5 K4 N16"])[0]
    m = out.metrics
    assert m.verify_ct == len(m.accept_lengths) > 0
    assert all(1 <= a <= 6 for a in m.accept_lengths)
    # every verify step emits τ tokens; the first token comes from prefill; a request with one
    # token left decodes it plainly (a draft cannot help), so at most one plain step
    assert m.plain_steps <= 1
    # τ counts the tokens a verify step emitted (a block cut at max_new_tokens counts what it
    # kept), so every output token is counted once: prefill's, the verifies', the plain steps'
    assert 1 + sum(m.accept_lengths) + m.plain_steps == len(out.token_ids)
    # and the accepted draft tokens counted by depth are exactly the tokens from the draft
    assert sum(m.accepted_per_depth) == sum(out.from_draft)
    assert len(out.from_draft) == len(out.token_ids)


def test_simulated_accept_length_is_marked_not_lossless(engine: wb.Engine) -> None:
    spec = wb.SpecConfig(num_steps=4, topk=1, simulate_accept_length=3.0)
    out = engine.generate([[1, 2, 3]], wb.SamplingParams(max_new_tokens=40, ignore_eos=True),
                          spec=spec)[0]
    assert out.lossless is False
    assert 2.0 <= out.metrics.accept_length <= 4.0


@pytest.mark.parametrize("kwargs", [
    {"num_steps": 0}, {"topk": 0}, {"num_steps": 3, "topk": 2, "num_draft_tokens": 8},
    {"num_steps": 5, "topk": 1, "num_draft_tokens": 16}, {"draft_state": "lukewarm"},
])
def test_bad_spec_config(kwargs: dict) -> None:
    with pytest.raises(wb.ConfigError, match="SpecConfig"):
        wb.SpecConfig(**kwargs)


@pytest.mark.parametrize("bad", ["nan", "inf", "all -inf"])
def test_an_unusable_verify_row_fails_its_request_alone(engine: wb.Engine, bad: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A NaN, a +inf or a row of -inf in one request's verify logits (any tree node, the
    greedy verify reads it off its argmax's row maxima) fails that request alone; its
    neighbour's output equals its baseline, and every KV block comes back. A -inf among finite
    logits is probability 0, not a failure: that request's output equals its baseline."""
    sp = wb.SamplingParams(max_new_tokens=16, ignore_eos=True)
    ps = id_prompts(3, seed=11, lo=2, hi=30)
    want = [o.token_ids for o in engine.generate(ps, sp)]
    accept = engine.worker._accept
    victim: list[int] = []

    def spoiled(reqs: list, tree: object, logits: torch.Tensor) -> object:
        if not victim:
            victim.append(reqs[-1].rid)
        for j, r in enumerate(reqs):
            if r.rid == victim[0]:  # a node deep in its tree, not only the root
                if bad == "all -inf":
                    logits[j, -1] = float("-inf")
                else:
                    logits[j, -1, 7] = float(bad)
            else:
                # its least likely token at the root gets probability 0: nothing to fail
                logits[j, 0, int(logits[j, 0].argmin())] = float("-inf")
        return accept(reqs, tree, logits)

    monkeypatch.setattr(engine.worker, "_accept", spoiled)
    engine.set_spec(CONFIGS["S5 K4 N16"])
    try:
        rids = [engine.add_request(p, sp) for p in ps]
        while engine.has_unfinished():
            engine.step()
    finally:
        engine.set_spec(None)
    assert victim and victim[0] in rids
    for rid, toks in zip(rids, want, strict=True):
        out = engine.output(rid)
        if rid == victim[0]:
            assert out.finish_reason == "error" and "non-finite" in (out.error or "")
        else:
            assert out.finish_reason == "length" and out.token_ids == toks
    assert engine.kv_usage()["used_blocks"] == 0
