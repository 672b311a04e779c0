"""One definition of SGLang's per-request rounds (``spec_verify_ct``): ``/generate`` sends what
SGLang 0.5.23 would send for the same rounds — every verify step, and every plain decode step a
speculating engine takes (policy off, one token left: SGLang's steps-0 rounds, 0 correct
drafts) — and the remote client reads the same rounds back (both sides:
:func:`workbench.remote.sglang.sglang_spec_meta` and ``round_accept_lengths``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from helpers import id_prompts
from serve.serving import SPEC, greedy, parse_metrics, serving

import workbench as wb
from workbench.core import RequestMetrics
from workbench.remote.sglang import round_accept_lengths, sglang_accept_lengths, sglang_spec_meta
from workbench.serve.responses import meta_info
from workbench.serve.server import ServerHandle

N_NEW = 20
NODES = SPEC.num_draft_tokens
assert NODES is not None


def flip(seed: int) -> wb.SpecConfig:
    return dataclasses.replace(SPEC, policy=wb.RandomFlip(p=0.5, seed=seed))


def test_sglang_spec_meta_by_hand() -> None:
    # two verify rounds (accept lengths 4 and 2) and three plain steps of a speculating engine
    m = RequestMetrics(verify_ct=2, accept_lengths=[4, 2], correct_drafts=[3, 1],
                       plain_steps=3, spec_plain_steps=3)
    meta = sglang_spec_meta(m, completion_tokens=10, num_draft_tokens=6)
    assert meta == {"spec_accept_rate": 4 / 25, "spec_accept_length": 10 / 5,
                    "spec_num_correct_drafts": 4, "spec_num_proposed_drafts": 5 * 5,
                    "spec_verify_ct": 5, "spec_correct_drafts_histogram": [3, 1, 0, 1]}
    # the client reads back the rounds the server counted
    assert sorted(round_accept_lengths({**meta, "completion_tokens": 10})) == \
        sorted(sglang_accept_lengths(m)) == [1, 1, 1, 2, 4]
    # a baseline engine's plain steps are no rounds: no spec fields (SGLang without speculation)
    assert sglang_spec_meta(RequestMetrics(plain_steps=9), 10, 6) == {}
    assert meta_info("r", 3, list(range(10)), "length", 0.1,
                     output=wb.RequestOutput(rid=0, prompt_ids=[1, 2, 3],
                                             token_ids=list(range(10)), text="",
                                             finish_reason="length", metrics=m),
                     num_draft_tokens=0).keys().isdisjoint(meta)


def check_meta(meta: dict, m: RequestMetrics, n: int) -> None:
    """``meta``: a finished request's meta_info; ``m``: the engine's metrics of that request."""
    ct = meta["spec_verify_ct"]
    hist = meta["spec_correct_drafts_histogram"]
    assert ct == m.verify_ct + m.spec_plain_steps == sum(hist)
    assert hist[0] >= m.spec_plain_steps  # each plain step: a round with 0 correct drafts
    correct = sum(m.correct_drafts)
    assert meta["spec_num_correct_drafts"] == correct == sum(k * h for k, h in enumerate(hist))
    assert meta["spec_num_proposed_drafts"] == ct * (NODES - 1)
    assert meta["spec_accept_rate"] == pytest.approx(correct / (ct * (NODES - 1)))
    assert meta["spec_accept_length"] == pytest.approx(n / ct)
    assert sorted(round_accept_lengths({**meta, "completion_tokens": n})) == \
        sorted(sglang_accept_lengths(m))


def test_flipping_policy_counts_every_round(reference_engine: wb.Engine) -> None:
    spec = flip(seed=7)
    outs = reference_engine.generate(id_prompts(4, seed=5, lo=2, hi=24), greedy(N_NEW), spec=spec)
    flipped = 0
    for out in outs:
        m = out.metrics
        assert m.spec_plain_steps == m.plain_steps  # the engine speculated throughout
        meta = meta_info("r", len(out.prompt_ids), out.token_ids, out.finish_reason, 0.1,
                         output=out, num_draft_tokens=NODES)
        check_meta(meta, m, N_NEW)
        flipped += m.verify_ct > 0 and m.spec_plain_steps > 0
    assert flipped, "the policy never flipped within a request"
    # the same engine without speculation: plain steps, no rounds, no spec fields
    base = reference_engine.generate(id_prompts(1, seed=5, lo=2, hi=24), greedy(N_NEW),
                                     spec=None)[0]
    assert base.metrics.plain_steps > 0 and base.metrics.spec_plain_steps == 0
    meta = meta_info("r", 1, base.token_ids, "length", 0.1, output=base, num_draft_tokens=0)
    assert not [k for k in meta if k.startswith("spec_")]


@pytest.fixture(scope="module")
def flip_server(micro_target: Path, random_head: Path) -> Iterator[ServerHandle]:
    with serving(micro_target, random_head, spec=flip(seed=11)) as handle:
        yield handle


def generate(url: str, prompt: list[int]) -> dict:
    r = httpx.post(url + "/generate", json={"input_ids": prompt, "sampling_params": {
        "max_new_tokens": N_NEW, "temperature": 0, "ignore_eos": True}}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["meta_info"]


def test_generate_counts_rounds_as_sglang(flip_server: ServerHandle) -> None:
    """One request at a time, so the server's counters move by that request's own steps."""
    url, flipped = flip_server.url, 0
    for prompt in id_prompts(4, seed=6, lo=2, hi=24):
        before = parse_metrics(httpx.get(url + "/metrics").text)
        meta = generate(url, prompt)
        after = parse_metrics(httpx.get(url + "/metrics").text)
        verify = after["vllm:spec_decode_num_drafts_total"] - \
            before["vllm:spec_decode_num_drafts_total"]
        plain = after["workbench:plain_steps_total"] - before["workbench:plain_steps_total"]
        accepted = after["vllm:spec_decode_num_accepted_tokens_total"] - \
            before["vllm:spec_decode_num_accepted_tokens_total"]
        hist = meta["spec_correct_drafts_histogram"]
        assert meta["spec_verify_ct"] == verify + plain == sum(hist)
        assert meta["spec_num_correct_drafts"] == accepted == \
            sum(k * h for k, h in enumerate(hist))
        assert hist[0] >= plain
        assert meta["spec_accept_length"] == pytest.approx(N_NEW / (verify + plain))
        flipped += verify > 0 and plain > 0
    assert flipped, "the policy never flipped within a request"


def test_policy_off_is_steps0_rounds(flip_server: ServerHandle) -> None:
    """A speculating server whose policy never speculates answers as SGLang does with an
    adaptive ``[0]`` tier: every decode step a round with 0 correct drafts."""
    never = dataclasses.replace(SPEC, policy=wb.Never())
    previous = flip_server.call(lambda e: e.spec)
    flip_server.call(lambda e: e.set_spec(never))
    try:
        meta = generate(flip_server.url, id_prompts(1, seed=9, lo=2, hi=24)[0])
    finally:
        flip_server.call(lambda e: e.set_spec(previous))
    rounds = N_NEW - 1  # the first token comes from the prefill, no round
    assert meta["spec_verify_ct"] == rounds
    assert meta["spec_correct_drafts_histogram"] == [rounds]
    assert meta["spec_num_correct_drafts"] == 0 and meta["spec_accept_rate"] == 0.0
    assert meta["spec_num_proposed_drafts"] == rounds * (NODES - 1)
    assert meta["spec_accept_length"] == pytest.approx(N_NEW / rounds)


def test_a_block_cut_inside_its_drafts_is_filed_under_the_drafts_it_kept() -> None:
    # the last verify kept 3 tokens, all drafts (max_new_tokens cut the block before its bonus):
    # it emitted 3 tokens (our τ) but SGLang files it under 3 correct drafts (accept length 4)
    m = RequestMetrics(verify_ct=2, accept_lengths=[4, 3], correct_drafts=[3, 3])
    assert sglang_accept_lengths(m) == [4, 4]
    meta = sglang_spec_meta(m, completion_tokens=8, num_draft_tokens=6)
    assert meta["spec_correct_drafts_histogram"] == [0, 0, 0, 2]
    assert meta["spec_num_correct_drafts"] == 6
    assert meta["spec_accept_length"] == 8 / 2
    with pytest.raises(ValueError, match="RequestMetrics.correct_drafts: 1 entries for 2"):
        sglang_accept_lengths(RequestMetrics(verify_ct=2, accept_lengths=[4, 3],
                                             correct_drafts=[3]))
