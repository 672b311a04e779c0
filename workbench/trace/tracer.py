"""Tracers, hooks and profiler ranges: where events go after the engine builds them.

The engine holds one object satisfying :class:`Tracer` (``engine.tracer``; default
:data:`NULL_TRACER`) and guards every event with ``if self.tracer.enabled:`` so that, when nothing
listens, no event is built and the cost is one attribute read. Composition:

- :class:`RecordingTracer` keeps events in a list (optionally only some types) for
  ``.frame(kind)`` and ``.to_jsonl()``; :func:`trace` installs one on an engine for a block.
- :class:`Hooks` calls user callbacks per event type; :class:`Dispatcher` feeds one tracer and one
  ``Hooks`` from a single ``emit``; :class:`MultiTracer` fans out to several tracers.

Hook error policy — a raising hook is **isolated**: the exception is caught, recorded in
``Hooks.errors`` as ``(callback name, event type name, repr(exception))``, the hook is unregistered
(it will not see later events), a :class:`HookError` warning is issued, and dispatch continues with
the remaining hooks, so the engine step completes and its state stays consistent (events are
emitted after the state they describe is committed). A hook registered with ``fatal=True`` is
recorded and unregistered the same way, but instead of warning, :meth:`Hooks.dispatch` raises
:class:`HookFailed` (chained to the original exception) and the remaining hooks do not see that
event; use it in tests and debugging when a hook's failure must stop the run. Only ``Exception``
is caught; ``KeyboardInterrupt`` and other ``BaseException`` propagate untouched.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from workbench import faults
from workbench.errors import WorkbenchError
from workbench.trace.events import EVENT_TYPES, Event, event_from_dict, event_to_dict

if TYPE_CHECKING:
    import pandas as pd

DEFAULT_TRACE_DIR = Path("data/traces")

EventTypes = Iterable["type[Event] | str"]
HookCallback = Callable[[Event], Any]


def resolve_event_types(event_types: EventTypes) -> tuple[type[Event], ...]:
    """Event classes from classes or class names; ValueError names an unknown one."""
    out: list[type[Event]] = []
    for et in event_types:
        if isinstance(et, str):
            if et not in EVENT_TYPES:
                raise ValueError(f"event type {et!r} unknown; known: {sorted(EVENT_TYPES)}")
            out.append(EVENT_TYPES[et])
        elif isinstance(et, type) and issubclass(et, Event):
            out.append(et)
        else:
            raise ValueError(f"event type {et!r} is neither an Event subclass nor its name")
    return tuple(out)


# ---- tracers ----------------------------------------------------------------------------------


@runtime_checkable
class Tracer(Protocol):
    """What the engine talks to. Check ``enabled`` before building an event; then ``emit`` it.

    A tracer may also define ``wants(kind) -> bool`` (is an event of this class recorded?):
    the engine then skips building the events it would drop (building some, e.g. ``Verified``
    with its target probabilities, costs a large share of a step). Without it: every kind."""

    @property
    def enabled(self) -> bool: ...

    def emit(self, event: Event) -> None: ...


def tracer_wants(tracer: Tracer, kind: type[Event]) -> bool:
    """Does ``tracer`` record events of ``kind``? (its ``wants``; else whenever enabled)"""
    if not tracer.enabled:
        return False
    wants = getattr(tracer, "wants", None)
    return True if wants is None else bool(wants(kind))


class NullTracer:
    """The default tracer: disabled, and ``emit`` does nothing."""

    __slots__ = ()
    enabled = False

    def emit(self, event: Event) -> None:
        """Drop ``event``."""

    def wants(self, kind: type[Event]) -> bool:
        return False

    def __repr__(self) -> str:
        return "NullTracer()"


NULL_TRACER = NullTracer()


class RecordingTracer:
    """Keeps emitted events in ``.events`` (in emission order), optionally only some types.

    ``events``: event classes or class names to record; ``None`` records everything.
    """

    enabled = True

    def __init__(self, events: EventTypes | None = None) -> None:
        self.events: list[Event] = []
        self.types: tuple[type[Event], ...] | None = (
            None if events is None else resolve_event_types(events)
        )

    def emit(self, event: Event) -> None:
        """Append ``event`` if it passes the type filter."""
        if self.types is None or isinstance(event, self.types):
            self.events.append(event)

    def wants(self, kind: type[Event]) -> bool:
        """Would an event of ``kind`` be kept (the type filter)?"""
        return self.types is None or issubclass(kind, self.types)

    def of(self, event_type: type[Event] | str) -> list[Event]:
        """The recorded events of one type (class or class name)."""
        (cls,) = resolve_event_types([event_type])
        return [e for e in self.events if isinstance(e, cls)]

    def frame(self, kind: str) -> pd.DataFrame:
        """A tidy DataFrame of the recorded events; see :func:`workbench.trace.frame.frame`."""
        from workbench.trace.frame import frame

        return frame(self.events, kind)

    def to_jsonl(self, path: str | Path | None = None) -> Path:
        """Write the recorded events as JSON lines; returns the path written."""
        return write_jsonl(self.events, path)

    def clear(self) -> None:
        """Forget the recorded events."""
        self.events.clear()

    def __len__(self) -> int:
        return len(self.events)

    def __repr__(self) -> str:
        kinds = None if self.types is None else [c.__name__ for c in self.types]
        return f"RecordingTracer(events={kinds}, recorded={len(self.events)})"


class MultiTracer:
    """Fans each event out to several tracers; enabled iff any of them is."""

    def __init__(self, *tracers: Tracer) -> None:
        self.tracers: tuple[Tracer, ...] = tracers

    @property
    def enabled(self) -> bool:
        return any(t.enabled for t in self.tracers)

    def emit(self, event: Event) -> None:
        """Forward ``event`` to each enabled tracer, in order."""
        for t in self.tracers:
            if t.enabled:
                t.emit(event)

    def wants(self, kind: type[Event]) -> bool:
        return any(tracer_wants(t, kind) for t in self.tracers)

    def __repr__(self) -> str:
        return f"MultiTracer{self.tracers!r}"


# ---- hooks ------------------------------------------------------------------------------------


class HookError(RuntimeWarning):
    """Warning category issued when a non-fatal hook raised and was unregistered."""


class HookFailed(WorkbenchError, RuntimeError):
    """A hook registered with ``fatal=True`` raised; ``__cause__`` is its exception."""

    def __init__(self, hook: str, event_type: str, cause: BaseException) -> None:
        self.hook = hook
        self.event_type = event_type
        self.cause = cause
        super().__init__(f"hook {hook!r} failed on {event_type}: {cause!r}")


@dataclass(frozen=True, slots=True)
class HookHandle:
    """Returned by :meth:`Hooks.register`; pass it to :meth:`Hooks.unregister`."""

    id: int
    name: str


@dataclass(frozen=True, slots=True)
class _Hook:
    handle: HookHandle
    callback: HookCallback
    types: tuple[type[Event], ...] | None
    fatal: bool


def _callback_name(cb: Callable[..., Any]) -> str:
    return getattr(cb, "__qualname__", None) or getattr(cb, "__name__", None) or repr(cb)


class Hooks:
    """Callbacks called with each matching event, in registration order (error policy: module doc).

    ``errors`` lists ``(callback name, event type name, repr(exception))`` for every hook failure.
    """

    def __init__(self) -> None:
        self._hooks: dict[int, _Hook] = {}
        self._ids = itertools.count()
        self.errors: list[tuple[str, str, str]] = []

    def register(
        self,
        callback: HookCallback,
        event_types: EventTypes | None = None,
        *,
        fatal: bool = False,
    ) -> HookHandle:
        """Call ``callback(event)`` for events of ``event_types`` (classes or names; None = all)."""
        if not callable(callback):
            raise TypeError(f"hook {callback!r} is not callable")
        types = None if event_types is None else resolve_event_types(event_types)
        handle = HookHandle(next(self._ids), _callback_name(callback))
        self._hooks[handle.id] = _Hook(handle, callback, types, fatal)
        return handle

    def unregister(self, handle: HookHandle) -> bool:
        """Remove a hook; True if it was registered (unregistering twice is harmless)."""
        return self._hooks.pop(handle.id, None) is not None

    def wants(self, kind: type[Event]) -> bool:
        """Would any registered hook be called with an event of ``kind``?"""
        return any(h.types is None or issubclass(kind, h.types) for h in self._hooks.values())

    def dispatch(self, event: Event) -> None:
        """Call every matching hook with ``event``; a raising hook is isolated (module doc)."""
        # iterate over a snapshot: hooks may (un)register hooks, including themselves
        for hook in list(self._hooks.values()):
            if hook.types is not None and not isinstance(event, hook.types):
                continue
            try:
                hook.callback(event)
            except Exception as exc:  # noqa: BLE001 (the one broad except: see module doc)
                # hook isolation: recorded, reported, unregistered
                self._isolate(hook, event, exc)

    def _isolate(self, hook: _Hook, event: Event, exc: Exception) -> None:
        name, etype = hook.handle.name, type(event).__name__
        self.errors.append((name, etype, repr(exc)))
        self._hooks.pop(hook.handle.id, None)
        if hook.fatal:
            raise HookFailed(name, etype, exc) from exc
        warnings.warn(
            f"hook {name!r} raised {exc!r} on {etype}; it was unregistered",
            HookError,
            stacklevel=3,
        )

    def __len__(self) -> int:
        return len(self._hooks)

    def __bool__(self) -> bool:
        return bool(self._hooks)

    def __contains__(self, handle: object) -> bool:
        return isinstance(handle, HookHandle) and handle.id in self._hooks

    def __repr__(self) -> str:
        return f"Hooks({[h.handle.name for h in self._hooks.values()]})"


class Dispatcher:
    """One tracer plus one :class:`Hooks`, behind a single ``emit``.

    ``enabled`` is true iff the tracer is enabled or any hook is registered.
    """

    def __init__(self, tracer: Tracer | None = None, hooks: Hooks | None = None) -> None:
        self.tracer: Tracer = NULL_TRACER if tracer is None else tracer
        self.hooks: Hooks = Hooks() if hooks is None else hooks

    @property
    def enabled(self) -> bool:
        return self.tracer.enabled or bool(self.hooks._hooks)

    def wants(self, *kinds: type[Event]) -> bool:
        """Is an event of any of ``kinds`` recorded or hooked? Check it before building events
        that cost real work (tensor → list conversions); ``enabled`` says whether any is."""
        if not self.hooks._hooks and not self.tracer.enabled:  # the default: nothing listens
            return False
        return any(tracer_wants(self.tracer, k) or self.hooks.wants(k) for k in kinds)

    def emit(self, event: Event) -> None:
        """Record ``event``, then run the hooks (a fatal hook's HookFailed propagates)."""
        if self.tracer.enabled:
            self.tracer.emit(event)
        if self.hooks._hooks:
            faults.check("step:hook")  # an injected hook-dispatch fault is a step fault
            self.hooks.dispatch(event)

    def __repr__(self) -> str:
        return f"Dispatcher(tracer={self.tracer!r}, hooks={self.hooks!r})"


class Traceable(Protocol):
    """What :func:`trace` needs of an engine (the trace layer sits below the engine)."""

    @property
    def tracer(self) -> Any: ...

    def set_tracer(self, tracer: Any) -> None: ...


@contextlib.contextmanager
def trace(engine: Traceable, events: EventTypes | None = None) -> Iterator[RecordingTracer]:
    """Record ``engine``'s events for the duration of the block.

    Installs a :class:`RecordingTracer` with ``engine.set_tracer`` — alongside the engine's current
    tracer unless that is a NullTracer, so e.g. a Dispatcher's hooks keep firing and nested
    ``trace`` blocks each record — and restores the previous tracer on exit, exceptions included.
    ``events`` restricts recording to those types (classes or names).
    """
    rec = RecordingTracer(events)
    prev = engine.tracer
    keep_prev = prev is not None and not isinstance(prev, NullTracer)
    engine.set_tracer(MultiTracer(prev, rec) if keep_prev else rec)
    try:
        yield rec
    finally:
        engine.set_tracer(prev)


# ---- JSON lines -------------------------------------------------------------------------------


def write_jsonl(events: Iterable[Event], path: str | Path | None = None) -> Path:
    """Write one JSON object per line (standard JSON: no NaN literals); returns the path.

    ``path=None`` writes ``data/traces/trace-<YYYYmmdd-HHMMSS>.jsonl``; parent folders are created.
    """
    import json

    if path is None:
        path = DEFAULT_TRACE_DIR / f"trace-{time.strftime('%Y%m%d-%H%M%S')}.jsonl"
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for ev in events:
            f.write(json.dumps(event_to_dict(ev), allow_nan=False))
            f.write("\n")
    return path


def read_jsonl(path: str | Path) -> list[Event]:
    """Read events written by :func:`write_jsonl`; ValueError names the bad line."""
    import json

    out: list[Event] = []
    with Path(path).open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                out.append(event_from_dict(json.loads(line)))
            except ValueError as e:  # json.JSONDecodeError is a ValueError
                raise ValueError(f"{path}:{lineno}: {e}") from e
    return out


# ---- profiler ranges --------------------------------------------------------------------------

_NULL_RANGE = contextlib.nullcontext()


@functools.lru_cache(maxsize=1)
def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


@contextlib.contextmanager
def _profiled_range(name: str) -> Iterator[None]:
    import torch

    nvtx = _cuda_available()
    if nvtx:
        torch.cuda.nvtx.range_push(name)
    try:
        with torch.profiler.record_function(name):
            yield
    finally:
        if nvtx:
            torch.cuda.nvtx.range_pop()


def phase(name: str, enabled: bool = False) -> contextlib.AbstractContextManager[None]:
    """A named profiler range around a block: ``with phase("verify", enabled=True): ...``.

    For notebooks and scripts profiling their own code next to the engine's (the engine's step
    does not open these ranges itself: its phases are timed by ``StepTiming`` events).

    Disabled (the default): returns one shared ``nullcontext`` — no allocation, no torch call.
    Enabled: a ``torch.profiler.record_function`` range (shows in torch.profiler traces, CPU or
    GPU), plus an NVTX range (``torch.cuda.nvtx.range_push/pop``) when CUDA is available, for
    Nsight Systems.
    """
    if not enabled:
        return _NULL_RANGE
    return _profiled_range(name)
