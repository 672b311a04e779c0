"""``logit_bias`` keeps speculation lossless: the bias is added to the target's logits in plain
sampling and in verification alike, so greedy speculative output equals the biased baseline
token for token, and seeded speculative sampling draws from the exact biased distribution."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from helpers import id_prompts, make_engine
from speculative.test_lossless import run_staggered  # tests/ is on sys.path
from speculative.test_sampling_lossless import PROMPT, SP, V, chi_square_p, tiny_vocab_pair

import workbench as wb
from workbench.models.loader import load_target
from workbench.sampler import biased, process_probs

__all__ = ["tiny_vocab_pair"]  # the fixture, imported for this module's tests
SPEC = wb.SpecConfig(num_steps=3, topk=2, num_draft_tokens=6)


@pytest.mark.parametrize("batch", [1, 5])
def test_greedy_with_bias_spec_equals_baseline(engine: wb.Engine, batch: int) -> None:
    ps = id_prompts(5, seed=11, lo=2, hi=30)
    plain = wb.SamplingParams(max_new_tokens=16, ignore_eos=True)
    unbiased = run_staggered(engine, ps, plain, None, batch)
    # the unbiased first tokens pushed down, one other token pushed up: the output changes
    firsts = sorted({out[0] for out in unbiased})
    bias = tuple((t, -100.0) for t in firsts) + ((7 if 7 not in firsts else 8, 5.0),)
    sp = wb.SamplingParams(max_new_tokens=16, ignore_eos=True, logit_bias=bias)
    base = run_staggered(engine, ps, sp, None, batch)
    spec = run_staggered(engine, ps, sp, SPEC, batch)
    assert spec == base
    assert all(out[0] not in firsts for out in base)  # the bias took effect
    assert base != unbiased
    assert engine.kv_usage()["used_blocks"] == 0


BIAS = ((1, 2.0), (3, -1.5), (4, -100.0))


def exact_biased(target: Path, sp: wb.SamplingParams) -> dict[tuple[int, ...], float]:
    model, _, _ = load_target(target)
    out: dict[tuple[int, ...], float] = {}
    with torch.no_grad():
        for seq in itertools.product(range(V), repeat=3):
            p = 1.0
            for i in range(3):
                logits, _ = model.forward_dense(torch.tensor([PROMPT + list(seq[:i])]))
                p *= float(process_probs(biased(logits[0, -1:].float(), sp), sp)[0, seq[i]])
            out[seq] = p
    return out


def test_seeded_sampling_with_bias_matches_the_biased_distribution(
        tiny_vocab_pair: tuple[Path, Path]) -> None:
    target, head = tiny_vocab_pair
    sp0 = wb.SamplingParams(logit_bias=BIAS, **SP)
    exact = exact_biased(target, sp0)
    plain = exact_biased(target, wb.SamplingParams(**SP))
    assert abs(sum(exact.values()) - 1.0) < 1e-4
    assert max(abs(exact[s] - plain[s]) for s in exact) > 0.05  # the bias matters here
    engine = make_engine(target, head, max_batch_size=256, kv_budget_tokens=256 * 16, page_size=4)
    n = 2000
    pvalues = []
    for seed in range(2):
        sps = [wb.SamplingParams(seed=seed * 100_000 + i, logit_bias=BIAS, **SP)
               for i in range(n)]
        outs = engine.generate([PROMPT] * n, sps, spec=wb.SpecConfig(num_steps=2, topk=2,
                                                                     num_draft_tokens=4))
        assert sum(o.metrics.verify_ct for o in outs) > 0
        assert sum(sum(o.from_draft) for o in outs) > 0, "no draft token was ever accepted"
        counts: dict[tuple[int, ...], int] = {}
        for o in outs:
            counts[tuple(o.token_ids)] = counts.get(tuple(o.token_ids), 0) + 1
        pvalues.append(chi_square_p(counts, exact, n))
    assert min(pvalues) > 0.01, pvalues
    assert engine.kv_usage()["used_blocks"] == 0
    engine.close()


def test_a_bias_outside_the_vocabulary_fails_its_request_alone(engine: wb.Engine) -> None:
    vocab = engine.model_config.vocab_size
    good = wb.SamplingParams(max_new_tokens=6, ignore_eos=True)
    bad = wb.SamplingParams(max_new_tokens=6, ignore_eos=True, logit_bias=((vocab, 1.0),))
    ref = engine.generate([[5, 6, 7]], good, spec=SPEC)[0].token_ids
    outs = engine.generate([[5, 6, 7], [5, 6, 7]], [bad, good], spec=SPEC)
    assert outs[0].finish_reason == "error" and "logit_bias" in (outs[0].error or "")
    assert outs[1].token_ids == ref
    assert engine.kv_usage()["used_blocks"] == 0
