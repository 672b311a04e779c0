"""``EngineConfig(batch_invariant=True)``: greedy speculative output equals greedy plain output
token for token AND logprob for logprob (bit for bit), in bfloat16 and float32, at bs=1 and in
staggered batches, for every tree shape and across a policy's flips — the property float32
alone only approximates (tests/speculative/test_bf16_lossless.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import id_prompts, make_engine

import workbench as wb
from tests.speculative.test_lossless import CONFIGS, run_staggered
from workbench.core import LogprobParams
from workbench.policy.policies import RandomFlip


@pytest.fixture(scope="module", params=["bfloat16", "float32"])
def engine(request: pytest.FixtureRequest, micro_target: Path, trained_head: Path) -> wb.Engine:
    e = make_engine(micro_target, trained_head, dtype=request.param, batch_invariant=True,
                    kv_budget_tokens=8192,
                    max_prefill_tokens=16)  # longer prompts prefill in chunks, beside decodes
    assert e.choices["attention"]["choice"] == "invariant"
    assert e.choices["compile"]["choice"] == "off"
    assert e.choices["row_invariance"]["choice"] in ("onednn", "dense")
    yield e
    e.close()


SP = wb.SamplingParams(max_new_tokens=20, ignore_eos=True)
LP = LogprobParams(top_k=3)


def with_logprobs(engine: wb.Engine, ps: list[list[int]],
                  spec: wb.SpecConfig | None) -> list[wb.RequestOutput]:
    """Every prompt at once, each returning its logprobs (top 3 too)."""
    return engine.generate(ps, SP, spec=spec, logprobs=LP)


def test_every_shape_bit_for_bit(engine: wb.Engine) -> None:
    ps = id_prompts(6, seed=21, lo=2, hi=30)
    base = with_logprobs(engine, ps, None)
    alone = [with_logprobs(engine, [p], None)[0] for p in ps]
    for b, a in zip(base, alone, strict=True):  # plain bs=6 == plain bs=1, logprobs too
        assert a.token_ids == b.token_ids and a.output_logprobs == b.output_logprobs
        assert a.output_top_logprobs == b.output_top_logprobs
    for name, spec in CONFIGS.items():
        out = with_logprobs(engine, ps, spec)
        for o, b in zip(out, base, strict=True):
            assert o.token_ids == b.token_ids, name
            assert o.output_logprobs == b.output_logprobs, name  # exact, not within a tolerance
            assert o.output_top_logprobs == b.output_top_logprobs, name
        ids = [b.token_ids for b in base]
        assert run_staggered(engine, ps, SP, spec, batch=3) == ids, name


@pytest.mark.parametrize("batch", [1, 4, 16])
def test_policy_flips_and_mixed_batches(engine: wb.Engine, batch: int) -> None:
    """Speculation switched on and off at random per step, riders in the verify, batches up
    to 16 with requests joining as others finish."""
    ps = id_prompts(16, seed=batch, lo=2, hi=30)
    sp = wb.SamplingParams(max_new_tokens=16, ignore_eos=True)
    base = [o.token_ids for o in engine.generate(ps, sp)]
    spec = wb.SpecConfig(num_steps=4, topk=4, num_draft_tokens=10,
                         policy=RandomFlip(0.5, seed=batch))
    assert run_staggered(engine, ps, sp, spec, batch=batch) == base


def test_a_trained_head_accepts(engine: wb.Engine) -> None:
    """Not a vacuous pass: trees are accepted beyond the root."""
    out = engine.generate(id_prompts(4, seed=5, lo=2, hi=30), wb.SamplingParams(max_new_tokens=24,
                                                               ignore_eos=True),
                          spec=CONFIGS["S5 K4 N16"])
    assert max(o.metrics.accept_length for o in out) > 1.2
