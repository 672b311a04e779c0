"""Tracers, hooks (incl. the error policy), trace(), JSONL files and profiler ranges."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

from workbench.errors import WorkbenchError
from workbench.trace import (
    NULL_TRACER,
    Dispatcher,
    Event,
    HookError,
    HookFailed,
    Hooks,
    InitStage,
    KVUsage,
    MultiTracer,
    NullTracer,
    RecordingTracer,
    Tracer,
    Verified,
    phase,
    read_jsonl,
    trace,
    write_jsonl,
)


def kv(step: int) -> KVUsage:
    return KVUsage(step=step, used_blocks=1, total_blocks=2, used_tokens=3, t=float(step))


def init(stage: str = "s") -> InitStage:
    return InitStage(stage=stage, status="ok", seconds=0.0, t=0.0)


class FakeEngine:
    """The engine surface trace() relies on: a ``tracer`` attribute and ``set_tracer``."""

    def __init__(self) -> None:
        self.tracer: Tracer = NULL_TRACER

    def set_tracer(self, tracer: Tracer) -> None:
        self.tracer = tracer

    def step(self, step: int) -> None:
        """Emit like the real engine: build the event only when someone listens."""
        if self.tracer.enabled:
            self.tracer.emit(kv(step))


# ---- tracers ----------------------------------------------------------------------------------


def test_null_tracer_is_disabled_and_emit_is_a_noop() -> None:
    t = NullTracer()
    assert t.enabled is False and NULL_TRACER.enabled is False
    assert t.emit(kv(0)) is None
    assert isinstance(t, Tracer) and isinstance(RecordingTracer(), Tracer)
    assert not hasattr(t, "__dict__")  # nothing to accumulate into


def test_disabled_tracer_means_no_event_is_built(monkeypatch: pytest.MonkeyPatch) -> None:
    built = []
    monkeypatch.setattr(KVUsage, "__init__", lambda *a, **k: built.append(1))
    engine = FakeEngine()
    for s in range(100):
        engine.step(s)
    assert built == []


def test_recording_tracer_keeps_order_and_filters() -> None:
    rec = RecordingTracer()
    for ev in (kv(1), init(), kv(2)):
        rec.emit(ev)
    assert rec.events == [kv(1), init(), kv(2)] and len(rec) == 3
    assert rec.of(KVUsage) == [kv(1), kv(2)] and rec.of("InitStage") == [init()]
    rec.clear()
    assert rec.events == []

    only_kv = RecordingTracer(events=("KVUsage",))
    by_class = RecordingTracer(events=(KVUsage, Verified))
    for ev in (kv(1), init(), kv(2)):
        only_kv.emit(ev)
        by_class.emit(ev)
    assert only_kv.events == by_class.events == [kv(1), kv(2)]


def test_unknown_event_type_name_is_rejected() -> None:
    with pytest.raises(ValueError, match="'KV' unknown"):
        RecordingTracer(events=("KV",))
    with pytest.raises(ValueError, match="neither"):
        Hooks().register(print, event_types=(int,))  # type: ignore[arg-type]


def test_multi_tracer_forwards_to_enabled_tracers() -> None:
    a, b = RecordingTracer(), RecordingTracer()
    m = MultiTracer(a, NULL_TRACER, b)
    assert m.enabled and not MultiTracer(NULL_TRACER).enabled
    m.emit(kv(1))
    assert a.events == b.events == [kv(1)]


# ---- hooks ------------------------------------------------------------------------------------


def test_hooks_register_unregister_and_type_filter() -> None:
    hooks = Hooks()
    seen_all: list[Event] = []
    seen_kv: list[Event] = []
    h_all = hooks.register(seen_all.append)
    h_kv = hooks.register(seen_kv.append, event_types=(KVUsage,))
    assert len(hooks) == 2 and h_all in hooks and h_kv.name.endswith("append")
    hooks.dispatch(kv(1))
    hooks.dispatch(init())
    assert seen_all == [kv(1), init()] and seen_kv == [kv(1)]
    assert hooks.unregister(h_kv) is True and hooks.unregister(h_kv) is False
    hooks.dispatch(kv(2))
    assert seen_kv == [kv(1)] and seen_all[-1] == kv(2)
    with pytest.raises(TypeError):
        hooks.register(42)  # type: ignore[arg-type]


def test_hooks_run_in_registration_order_and_may_unregister_themselves() -> None:
    hooks = Hooks()
    calls: list[str] = []
    handle = None

    def once(ev: Event) -> None:
        calls.append("once")
        hooks.unregister(handle)  # type: ignore[arg-type]

    hooks.register(lambda ev: calls.append("first"))
    handle = hooks.register(once)
    hooks.register(lambda ev: calls.append("last"))
    hooks.dispatch(kv(1))
    hooks.dispatch(kv(2))
    assert calls == ["first", "once", "last", "first", "last"]


def test_raising_hook_is_isolated_reported_and_unregistered() -> None:
    hooks = Hooks()
    before: list[Event] = []
    after: list[Event] = []

    def broken(ev: Event) -> None:
        raise KeyError("boom")

    hooks.register(before.append)
    h = hooks.register(broken)
    hooks.register(after.append)
    with pytest.warns(HookError, match=r"broken.*KeyError\('boom'\).*KVUsage.*unregistered"):
        hooks.dispatch(kv(1))
    assert before == after == [kv(1)]  # the others still saw the event
    assert h not in hooks and len(hooks) == 2
    assert len(hooks.errors) == 1
    name, etype, exc = hooks.errors[0]
    assert name.endswith("broken") and etype == "KVUsage" and exc == "KeyError('boom')"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second event must not warn again
        hooks.dispatch(kv(2))
    assert after == [kv(1), kv(2)] and len(hooks.errors) == 1


def test_fatal_hook_raises_hook_failed() -> None:
    hooks = Hooks()
    later: list[Event] = []

    def strict(ev: Event) -> None:
        raise ValueError("bad event")

    h = hooks.register(strict, event_types=("KVUsage",), fatal=True)
    hooks.register(later.append)
    hooks.dispatch(init())  # filtered out: no call, no error
    with pytest.raises(HookFailed, match="bad event") as info:
        hooks.dispatch(kv(1))
    err = info.value
    assert isinstance(err, WorkbenchError) and isinstance(err.__cause__, ValueError)
    assert err.hook.endswith("strict") and err.event_type == "KVUsage"
    assert hooks.errors == [(err.hook, "KVUsage", "ValueError('bad event')")]
    assert h not in hooks and later == [init()]


def test_base_exceptions_are_not_swallowed() -> None:
    hooks = Hooks()

    def interrupt(ev: Event) -> None:
        raise KeyboardInterrupt

    hooks.register(interrupt)
    with pytest.raises(KeyboardInterrupt):
        hooks.dispatch(kv(1))
    assert hooks.errors == []


def test_dispatcher_enabled_iff_something_listens() -> None:
    d = Dispatcher()
    assert d.enabled is False
    seen: list[Event] = []
    h = d.hooks.register(seen.append)
    assert d.enabled is True
    d.emit(kv(1))
    assert seen == [kv(1)]
    d.hooks.unregister(h)
    assert d.enabled is False
    rec = RecordingTracer()
    d2 = Dispatcher(rec)
    assert d2.enabled
    d2.emit(kv(2))
    assert rec.events == [kv(2)]


def test_dispatcher_records_before_a_fatal_hook_fails() -> None:
    rec = RecordingTracer()
    d = Dispatcher(rec)
    d.hooks.register(lambda ev: 1 / 0, fatal=True)
    with pytest.raises(HookFailed):
        d.emit(kv(1))
    assert rec.events == [kv(1)]


# ---- trace() ----------------------------------------------------------------------------------


def test_trace_installs_and_restores() -> None:
    engine = FakeEngine()
    with trace(engine) as tr:
        assert engine.tracer is tr
        engine.step(1)
        engine.step(2)
    assert engine.tracer is NULL_TRACER
    engine.step(3)
    assert tr.events == [kv(1), kv(2)]
    assert list(tr.frame("kv")["step"]) == [1, 2]


def test_trace_restores_previous_tracer_on_exception() -> None:
    engine = FakeEngine()
    prev = Dispatcher()
    engine.set_tracer(prev)
    with pytest.raises(RuntimeError, match="step failed"):
        with trace(engine):
            engine.step(1)
            raise RuntimeError("step failed")
    assert engine.tracer is prev


def test_trace_keeps_existing_hooks_and_nests() -> None:
    engine = FakeEngine()
    d = Dispatcher()
    seen: list[Event] = []
    engine.set_tracer(d)
    with trace(engine, events=("KVUsage",)) as outer:
        d.hooks.register(seen.append)  # registered after entry: still fires
        engine.step(1)
        with trace(engine) as inner:
            engine.step(2)
        engine.step(3)
    assert engine.tracer is d
    assert seen == [kv(1), kv(2), kv(3)]
    assert outer.events == [kv(1), kv(2), kv(3)] and inner.events == [kv(2)]


# ---- JSONL ------------------------------------------------------------------------------------


def test_jsonl_round_trip(sample_events: list[Event], tmp_path: Path) -> None:
    path = write_jsonl(sample_events, tmp_path / "sub" / "run.jsonl")
    assert path.exists()
    lines = path.read_text().splitlines()
    assert len(lines) == len(sample_events)
    assert all(json.loads(line)["type"] for line in lines)
    assert "NaN" not in path.read_text()  # standard JSON
    assert read_jsonl(path) == sample_events
    rec = RecordingTracer()
    for ev in sample_events:
        rec.emit(ev)
    assert read_jsonl(rec.to_jsonl(tmp_path / "rec.jsonl")) == sample_events


def test_jsonl_default_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    path = write_jsonl([kv(1)])
    assert path.parent == Path("data/traces") and path.suffix == ".jsonl"
    assert read_jsonl(path) == [kv(1)]


def test_read_jsonl_names_the_bad_line(tmp_path: Path) -> None:
    path = write_jsonl([kv(1), kv(2)], tmp_path / "t.jsonl")
    path.write_text(path.read_text() + "\n{not json\n")
    with pytest.raises(ValueError, match=r"t\.jsonl:4"):
        read_jsonl(path)


# ---- profiler ranges --------------------------------------------------------------------------


def test_phase_disabled_is_a_shared_nullcontext() -> None:
    a, b = phase("draft"), phase("verify", enabled=False)
    assert a is b
    with a:
        pass


def test_phase_enabled_records_a_profiler_range() -> None:
    torch = pytest.importorskip("torch")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with phase("wb_verify", enabled=True):
            torch.ones(2) + 1
    assert any(e.key == "wb_verify" for e in prof.key_averages())
