"""The OutputProcessor (engine/output.py): the only place tokens reach a request. Token-id stops,
EOS, max_new_tokens and the context length are checked after every token, so a block of accepted
draft tokens ends exactly where appending the same tokens one by one ends; numeric failures fail
their request alone. (Text stops: tests/speculative/test_stop_lossless.py.)"""

from __future__ import annotations

import pytest
import torch

import workbench as wb
from workbench.core import Request, StepOutput
from workbench.engine.kv_cache import KVPool
from workbench.engine.output import OutputProcessor
from workbench.engine.scheduler import Scheduler
from workbench.engine.stats import EngineStats
from workbench.trace.tracer import Dispatcher

EOS = 2


def processor(max_model_len: int = 64) -> OutputProcessor:
    out = OutputProcessor(EngineStats(), Dispatcher())
    out.eos_ids = {EOS}
    out.max_model_len = max_model_len
    pool = KVPool(16, 4, 1, 1, 4, torch.float32, "cpu", None)
    out.scheduler = Scheduler(pool, 4, 16)
    return out


def request(rid: int = 0, prompt: tuple[int, ...] = (10, 11, 12), **sp: object) -> Request:
    return Request(rid=rid, prompt_ids=list(prompt), sampling=wb.SamplingParams(**sp))


@pytest.mark.parametrize(("sp", "block", "kept", "reason", "matched"), [
    ({"stop_token_ids": [7]}, [5, 7, 9], 2, "stop", 7),      # a stop id inside the block
    ({}, [5, EOS, 9], 2, "stop", EOS),                       # EOS
    ({"ignore_eos": True}, [5, EOS, 9], 3, None, None),      # EOS ignored: all kept
    ({"max_new_tokens": 2}, [5, 6, 9], 2, "length", None),   # max_new_tokens
    ({"max_new_tokens": 50}, [5, 6, 9, 4], 4, None, None),   # nothing stops it
])
def test_a_block_ends_where_token_by_token_ends(sp: dict, block: list[int], kept: int,
                                                reason: str | None, matched: int | None) -> None:
    out = processor()
    r = request(**sp)
    cut = out.cut(r, block)
    assert (cut.keep, cut.reason, cut.matched) == (kept, reason, matched)
    assert r.tokens == [10, 11, 12]  # cut only asks
    outputs: dict[int, StepOutput] = {}
    assert out.append_tokens(r, block, [True] * len(block), outputs) == kept
    assert r.output_ids == block[:kept] and r.emitted_from_draft == [True] * kept
    assert r.finish_reason == reason and r.matched_stop == matched
    assert outputs[0].new_token_ids == block[:kept] and outputs[0].finished == (reason is not None)
    assert out.stats.generated_tokens == kept
    # the same tokens one at a time stop at the same place, for the same reason
    one = processor()
    r1 = request(**sp)
    for tok in block:
        if r1.finished:
            break
        one.append_tokens(r1, [tok], [False], {})
    assert (r1.output_ids, r1.finish_reason, r1.matched_stop) == (r.output_ids, reason, matched)


def test_room_counts_the_context_length_too() -> None:
    out = processor(max_model_len=5)  # prompt of 3: two more tokens fit
    r = request(max_new_tokens=10)
    assert out.room(r) == 2
    out.append_tokens(r, [5, 6, 7], [False] * 3, {})
    assert r.output_ids == [5, 6] and r.finish_reason == "length"


def test_deltas_accumulate_within_a_step() -> None:
    out = processor()
    r = request()
    outputs: dict[int, StepOutput] = {}
    out.append_tokens(r, [5], [False], outputs)  # e.g. a prefill's first token
    out.append_tokens(r, [6, 7], [True, False], outputs)  # then a verified block
    assert outputs[0].new_token_ids == [5, 6, 7] and not outputs[0].finished


def test_numeric_failures_fail_their_request_alone() -> None:
    out = processor()
    bad, good, sampled = request(0), request(1), request(2)
    outputs: dict[int, StepOutput] = {}
    nan = torch.tensor([0.0, float("nan")])
    assert out.bad_logits(bad, nan, outputs)
    assert bad.finish_reason == "error" and "non-finite logits" in (bad.error or "")
    assert outputs[0].finished and outputs[0].finish_reason == "error"
    assert not out.bad_logits(good, torch.tensor([0.0, 1.0]), outputs)
    assert good.finish_reason is None and 1 not in outputs
    out.row_errors[2] = "sampling: no valid distribution at position 3"
    assert out.bad_logits(sampled, torch.tensor([0.0, 1.0]), outputs)
    assert "no valid distribution" in (sampled.error or "") and not out.row_errors


@pytest.mark.parametrize(("rows", "bad"), [
    ([[0.0, float("nan")]], True),                  # a NaN
    ([[0.0, float("inf")]], True),                  # a +inf
    ([[float("-inf"), float("-inf")]], True),       # no finite logit: no distribution
    ([[0.0, 1.0], [float("-inf")] * 2], True),      # one such row among good ones
    ([[0.0, float("-inf")]], False),                # -inf alone is probability 0
    ([[3e38, 3e38]], False),                        # a finite sum overflows: rows checked
])
def test_a_row_is_unusable_when_its_maximum_is_not_finite(rows: list, bad: bool) -> None:
    out = processor()
    r = request()
    assert out.bad_logits(r, torch.tensor(rows), {}) is bad
    assert (r.finish_reason == "error") is bad


def test_the_callers_finite_flag_is_the_answer() -> None:
    """The greedy verify read the rows' maxima already: bad_logits takes its word."""
    out = processor()
    ok, bad = request(0), request(1)
    assert not out.bad_logits(ok, torch.tensor([[0.0, float("nan")]]), {}, finite=True)
    assert out.bad_logits(bad, torch.tensor([[0.0, 1.0]]), {}, finite=False)
    assert ok.finish_reason is None and "non-finite logits" in (bad.error or "")
