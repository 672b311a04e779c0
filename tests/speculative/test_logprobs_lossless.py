"""Logprobs: under speculation the output logprobs come from the target's verify logits and
equal the baseline's (max abs difference <= 1e-4, float32), across tree configs x batch sizes;
prompt (input) logprobs from the prefill match a dense forward, chunked prefill included."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import id_prompts, make_engine

import workbench as wb
from workbench.core import LogprobParams

TOL = 1e-4
CONFIGS = {
    "chain S3": wb.SpecConfig(num_steps=3, topk=1),
    "S3 K2 N6": wb.SpecConfig(num_steps=3, topk=2, num_draft_tokens=6),
    "S5 K4 N16": wb.SpecConfig(num_steps=5, topk=4, num_draft_tokens=16),
}
TOP_K = 3


@pytest.fixture(scope="module")
def engine(micro_target: Path, trained_head: Path) -> wb.Engine:
    # max_prefill_tokens 16: the longer prompts prefill in chunks (input logprobs per chunk)
    e = make_engine(micro_target, trained_head, kv_budget_tokens=8192, dtype="float32",
                    max_prefill_tokens=16)
    yield e
    e.close()


def run(engine: wb.Engine, ps: list[list[int]], spec: wb.SpecConfig | None, batch: int,
        lp: LogprobParams) -> list[wb.RequestOutput]:
    """At most ``batch`` requests in flight; new ones join as others finish."""
    engine.set_spec(spec)
    sp = wb.SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    try:
        queue = list(enumerate(ps))
        live: dict[int, int] = {}
        out: dict[int, wb.RequestOutput] = {}
        while queue or live:
            while queue and len(live) < batch:
                i, p = queue.pop(0)
                live[engine.add_request(p, sp, logprobs=lp)] = i
            engine.step()
            for rid in [r for r in live if engine.requests[r].finished]:
                out[live.pop(rid)] = engine.output(rid)
        return [out[i] for i in range(len(ps))]
    finally:
        engine.set_spec(None)


def _max_diff(a: list[float], b: list[float]) -> float:
    return float((torch.tensor(a) - torch.tensor(b)).abs().max()) if a else 0.0


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_spec_logprobs_equal_baseline(engine: wb.Engine, name: str, batch: int) -> None:
    ps = id_prompts(6, seed=batch, lo=3, hi=24)
    lp = LogprobParams(top_k=TOP_K)
    base = run(engine, ps, None, batch, lp)
    spec = run(engine, ps, CONFIGS[name], batch, lp)
    assert sum(o.metrics.verify_ct for o in spec) > 0, "nothing speculated"
    assert any(any(o.from_draft) for o in spec), "no draft token accepted"
    for b, s in zip(base, spec, strict=True):
        assert s.token_ids == b.token_ids
        assert b.output_logprobs is not None and s.output_logprobs is not None
        assert len(s.output_logprobs) == len(s.token_ids) == len(b.output_logprobs)
        assert _max_diff(s.output_logprobs, b.output_logprobs) <= TOL
        assert b.output_top_logprobs is not None and s.output_top_logprobs is not None
        for tb, ts in zip(b.output_top_logprobs, s.output_top_logprobs, strict=True):
            assert _max_diff([v for _, v in ts], [v for _, v in tb]) <= TOL
            # greedy: the emitted token is the most likely one, its logprob the top value
        assert all(abs(t[0][1] - v) <= TOL for t, v in zip(s.output_top_logprobs,
                                                           s.output_logprobs, strict=True))


def test_logprobs_match_a_dense_forward(engine: wb.Engine) -> None:
    """Input logprobs (from logprob_start_len, chunked prefill) and output logprobs equal the
    log-softmax of one dense forward over prompt + output."""
    ps = id_prompts(3, seed=7, lo=3, hi=24) + [list(range(5, 45))]  # 40 tokens: 3 prefill chunks
    for start in (0, 2):
        outs = run(engine, ps, CONFIGS["S3 K2 N6"], 2, LogprobParams(top_k=2, start=start))
        for p, o in zip(ps, outs, strict=True):
            seq = torch.tensor([p + o.token_ids])
            with torch.inference_mode():
                logits, _ = engine.runner.target.forward_dense(seq)
            ref = torch.log_softmax(logits[0].float(), -1)
            full = seq[0]
            want_out = ref[len(p) - 1 : -1].gather(1, full[len(p):, None])[:, 0].tolist()
            assert o.output_logprobs is not None
            assert _max_diff(o.output_logprobs, want_out) <= TOL
            assert o.logprob_start == start and o.input_logprobs is not None
            assert len(o.input_logprobs) == len(p) - start
            got_in = o.input_logprobs
            if start == 0:
                assert got_in[0] is None and o.input_top_logprobs[0] is None
                got_in = got_in[1:]
            first = max(start, 1)
            want_in = ref[first - 1 : len(p) - 1].gather(1, full[first:len(p), None])[:, 0]
            assert _max_diff(got_in, want_in.tolist()) <= TOL


def test_logprob_params_are_checked(engine: wb.Engine) -> None:
    with pytest.raises(wb.RequestError, match="logprob_start_len"):
        engine.add_request([1, 2, 3], logprobs=LogprobParams(start=4))
    with pytest.raises(wb.RequestError, match="top_logprobs_num"):
        LogprobParams(top_k=-1)
    rid = engine.add_request([1, 2, 3], wb.SamplingParams(max_new_tokens=2))
    while not engine.requests[rid].finished:
        engine.step()
    out = engine.output(rid)
    assert out.output_logprobs is None and out.input_logprobs is None  # not asked for
