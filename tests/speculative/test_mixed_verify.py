"""A batch of greedy and sampled requests verifies each kind on its own rows
(``verify.mixed_verify``): the greedy requests' speculative output equals their plain greedy
output token for token, and each seeded sampled request's output equals what it samples in a
batch of sampled requests only (its coins and distribution are its own), bias included."""

from __future__ import annotations

import random

import workbench as wb
from workbench.speculative import verify

SPEC = wb.SpecConfig(num_steps=3, topk=2, num_draft_tokens=6)


def test_mixed_batches_equal_each_kind_alone(engine: wb.Engine, monkeypatch) -> None:
    rng = random.Random(5)
    prompts = [[rng.randrange(1, 299) for _ in range(rng.randrange(3, 20))] for _ in range(9)]
    sps = []
    for i in range(9):
        if i % 3 == 0:
            sps.append(wb.SamplingParams(max_new_tokens=14, temperature=0.9, seed=40 + i,
                                         ignore_eos=True,
                                         logit_bias=((7, 2.0),) if i == 3 else ()))
        else:
            sps.append(wb.SamplingParams(max_new_tokens=14, ignore_eos=True))
    calls: list[int] = []
    real = verify.mixed_verify

    def counting(*a, **k):  # noqa: ANN002, ANN003, ANN202
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(verify, "mixed_verify", counting)
    mixed = engine.generate(prompts, sps, spec=SPEC)
    assert calls, "no step verified greedy and sampled requests together"
    g = [i for i in range(9) if i % 3]
    s = [i for i in range(9) if i % 3 == 0]
    plain = engine.generate([prompts[i] for i in g], [sps[i] for i in g], spec=None)
    assert [mixed[i].token_ids for i in g] == [o.token_ids for o in plain]
    sampled_only = engine.generate([prompts[i] for i in s], [sps[i] for i in s], spec=SPEC)
    assert [mixed[i].token_ids for i in s] == [o.token_ids for o in sampled_only]
    assert engine.kv_usage()["used_blocks"] == 0
