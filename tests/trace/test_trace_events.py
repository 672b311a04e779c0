"""Event dataclasses and their lossless dict / JSON form."""

from __future__ import annotations

import dataclasses
import json
import math
import typing
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from workbench.trace import (
    EVENT_TYPES,
    Event,
    InitStage,
    PolicyDecision,
    Prefill,
    RequestFinished,
    StepTiming,
    Verified,
    event_from_dict,
    event_to_dict,
)


def _strategy(tp: Any) -> st.SearchStrategy[Any]:
    """A hypothesis strategy for an event field annotation."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Literal:
        return st.sampled_from(args)
    if origin is list:
        return st.lists(_strategy(args[0]), max_size=4)
    if tp is bool:
        return st.booleans()
    if tp is int:
        return st.integers(min_value=-(2**63), max_value=2**63)
    if tp is float:
        return st.floats(allow_nan=True, allow_infinity=True)
    if tp is str:
        return st.text(max_size=8) | st.sampled_from(["nan", "inf", "-inf", ""])
    raise AssertionError(f"no strategy for {tp!r}")


def _event_strategy(cls: type[Event]) -> st.SearchStrategy[Event]:
    hints = typing.get_type_hints(cls)
    kwargs = {f.name: _strategy(hints[f.name]) for f in dataclasses.fields(cls)}
    return st.builds(cls, **kwargs)


any_event = st.sampled_from(sorted(EVENT_TYPES.values(), key=lambda c: c.__name__)).flatmap(
    _event_strategy
)


def _json_round_trip(ev: Event) -> Event:
    line = json.dumps(event_to_dict(ev), allow_nan=False)  # standard JSON, no NaN literals
    return event_from_dict(json.loads(line))


@settings(max_examples=300, deadline=None)
@given(any_event)
def test_json_round_trip_is_lossless(ev: Event) -> None:
    back = _json_round_trip(ev)
    assert type(back) is type(ev)
    assert back == ev
    assert hash(back) == hash(ev)
    # exact, not just ==: floats keep their bits (repr distinguishes -0.0, nan, inf)
    for f in dataclasses.fields(ev):
        assert repr(_listify(getattr(back, f.name))) == repr(_listify(getattr(ev, f.name)))


def _listify(x: Any) -> Any:
    return [_listify(v) for v in x] if isinstance(x, (list, tuple)) else x


def test_registry_names_every_event_class() -> None:
    assert len(EVENT_TYPES) == 12
    for name, cls in EVENT_TYPES.items():
        assert cls.__name__ == name and issubclass(cls, Event)
        assert dataclasses.is_dataclass(cls) and hasattr(cls, "__slots__")
        t = {f.name: f for f in dataclasses.fields(cls)}["t"]
        assert t.kw_only and t.type == "float"


def test_events_are_frozen() -> None:
    ev = InitStage(stage="load_config", status="ok", seconds=0.1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        ev.stage = "x"  # type: ignore[misc]


def test_t_defaults_to_perf_counter_and_can_be_given() -> None:
    import time

    before = time.perf_counter()
    ev = InitStage(stage="s", status="ok", seconds=0.0)
    assert before <= ev.t <= time.perf_counter()
    assert InitStage(stage="s", status="ok", seconds=0.0, t=5.0).t == 5.0


def test_nan_equals_nan_and_tuples_equal_lists() -> None:
    a = PolicyDecision(
        step=1,
        batch_size=2,
        decode_batch=2,
        speculate=False,
        num_steps=0,
        topk=0,
        num_draft_tokens=1,
        reason="batch>8",
        t=0.0,
    )
    b = dataclasses.replace(a)
    assert math.isnan(a.measured_ms) and a == b and hash(a) == hash(b)
    p1 = Prefill(rids=(1, 2), num_tokens=3, chunked=True, seconds=0.5, t=1.0)
    p2 = Prefill(rids=[1, 2], num_tokens=3, chunked=True, seconds=0.5, t=1.0)
    assert p1 == p2 and hash(p1) == hash(p2)
    assert _json_round_trip(p1) == p1


def test_inequality_is_still_detected() -> None:
    base = Verified(
        step=1,
        rid=0,
        target_tokens=[1, 2],
        target_probs=[1.0, math.nan],
        accepted_path=[0],
        accepted_tokens=[1],
        accept_length=1,
        bonus_token=1,
        t=0.0,
    )
    assert base != dataclasses.replace(base, target_probs=[1.0, 0.5])
    assert base != dataclasses.replace(base, rid=1)
    assert base != dataclasses.replace(base, t=1.0)
    # same field values, different type
    a = StepTiming(step=1, batch_size=1, mode="plain", t=0.0)
    assert a != InitStage(stage="x", status="ok", seconds=0.0, t=0.0)


def test_non_finite_floats_are_strings_in_dict_form_only_for_float_fields() -> None:
    ev = RequestFinished(
        rid=1,
        reason="error",
        prompt_len=1,
        output_len=0,
        verify_ct=0,
        accept_lengths=[],
        ttft_s=math.inf,
        e2e_s=-math.inf,
        error="nan",
        t=math.nan,
    )
    d = event_to_dict(ev)
    assert d["type"] == "RequestFinished"
    assert (d["ttft_s"], d["e2e_s"], d["t"], d["error"]) == ("inf", "-inf", "nan", "nan")
    back = event_from_dict(d)
    assert back.error == "nan" and isinstance(back.error, str)  # type: ignore[attr-defined]
    assert back.ttft_s == math.inf and back.e2e_s == -math.inf  # type: ignore[attr-defined]


def test_from_dict_errors_name_the_problem() -> None:
    d = event_to_dict(InitStage(stage="s", status="ok", seconds=1.0, t=0.0))
    with pytest.raises(ValueError, match="'Nope' unknown"):
        event_from_dict({**d, "type": "Nope"})
    with pytest.raises(ValueError, match=r"unknown fields \['extra'\]"):
        event_from_dict({**d, "extra": 1})
    with pytest.raises(ValueError, match=r"missing fields \['seconds'\]"):
        event_from_dict({k: v for k, v in d.items() if k != "seconds"})
    with pytest.raises(ValueError, match=r"missing fields \['t'\]"):
        event_from_dict({k: v for k, v in d.items() if k != "t"})
    with pytest.raises(ValueError, match="InitStage.seconds"):
        event_from_dict({**d, "seconds": "fast"})
    # a field with a default may be absent (older traces)
    old = event_from_dict({k: v for k, v in d.items() if k != "detail"})
    assert old == InitStage(stage="s", status="ok", seconds=1.0, detail="", t=0.0)


# -- the emitters beside the events: tensors in, JSON-friendly events out ------------------------
def _tree_and_verify() -> tuple[Any, Any]:
    import torch

    from workbench.core import DraftTree, VerifyResult

    parents = torch.tensor([[-1, 0, 0, 1]])
    depth = torch.tensor([[0, 1, 1, 2]])
    mask = torch.tensor([[[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]]).bool()
    tree = DraftTree(tokens=torch.tensor([[5, 7, 8, 9]]), parents=parents, depth=depth,
                     positions=depth + 10, mask=mask,
                     scores=torch.tensor([[0.0, -0.5, -1.0, -0.7]]),
                     draft_probs=torch.tensor([[1.0, 0.6, 0.3, 0.8]]))
    res = VerifyResult(accept_index=torch.tensor([[0, 1, 3, -1]]), accept_len=torch.tensor([2]),
                       bonus=torch.tensor([4]), target_tokens=torch.tensor([[7, 9, 1, 4]]))
    return tree, res


def test_tree_and_verify_events_come_from_the_tensors() -> None:
    import torch

    from workbench.trace import TreeBuilt, Verified

    tree, res = _tree_and_verify()
    tb = TreeBuilt.of(3, 42, tree, 0, t=1.0)
    assert (tb.rid, tb.step, tb.tokens) == (42, 3, [5, 7, 8, 9])
    assert (tb.parents, tb.depth) == ([-1, 0, 0, 1], [0, 1, 1, 2])
    assert json.loads(json.dumps(tb.scores)) == pytest.approx([0.0, -0.5, -1.0, -0.7])
    logits = torch.zeros(4, 16)
    logits[0, 7] = logits[1, 9] = 3.0  # the target likes node 1 after the root, node 3 after node 1
    v = Verified.of(3, 42, tree, 0, res, logits, [7, 9, 4], t=1.0)
    assert v.accepted_path == [0, 1, 3] and v.accept_length == 3 and v.bonus_token == 4
    assert v.target_probs[0] == 1.0  # the root is given
    p = torch.softmax(logits, -1)
    assert v.target_probs[1:] == pytest.approx([float(p[0, 7]), float(p[0, 8]), float(p[1, 9])])


def test_step_timing_names_every_phase_and_refuses_unknown_ones() -> None:
    from workbench.trace import STEP_PHASES, StepTiming

    st_ = StepTiming.of(1, 2, "spec", {"draft": 1.5, "catchup": 0.5, "verify": 2.0}, 4.0, t=0.0)
    assert (st_.draft_ms, st_.verify_ms, st_.decode_ms, st_.total_ms) == (1.5, 2.0, 0.0, 4.0)
    assert {f.name[:-3] for f in dataclasses.fields(StepTiming) if f.name.endswith("_ms")} == \
        set(STEP_PHASES) | {"total"}
    with pytest.raises(ValueError, match="sampling"):
        StepTiming.of(1, 2, "spec", {"sampling": 1.0}, 1.0, t=0.0)
