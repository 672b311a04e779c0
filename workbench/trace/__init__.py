"""Instrumentation: typed events → tracer / hooks → tidy DataFrames.

``with trace(engine) as tr: ...; tr.frame("verify")``. Nothing here imports torch or pandas until
it is used, so the engine can import this package for free.
"""

from __future__ import annotations

from workbench.trace.events import (
    EVENT_TYPES,
    STEP_PHASES,
    DraftExtended,
    DraftStep,
    Event,
    ExpertRouting,
    InitStage,
    KVUsage,
    PolicyDecision,
    Prefill,
    RequestAdmitted,
    RequestFinished,
    StepTiming,
    TreeBuilt,
    Verified,
    event_from_dict,
    event_to_dict,
)
from workbench.trace.frame import FRAME_COLUMNS, FRAME_KINDS, TIMING_PHASES, frame
from workbench.trace.tracer import (
    DEFAULT_TRACE_DIR,
    NULL_TRACER,
    Dispatcher,
    HookError,
    HookFailed,
    HookHandle,
    Hooks,
    MultiTracer,
    NullTracer,
    RecordingTracer,
    Tracer,
    phase,
    read_jsonl,
    trace,
    write_jsonl,
)

__all__ = [
    "DEFAULT_TRACE_DIR",
    "EVENT_TYPES",
    "FRAME_COLUMNS",
    "FRAME_KINDS",
    "NULL_TRACER",
    "STEP_PHASES",
    "TIMING_PHASES",
    "Dispatcher",
    "DraftExtended",
    "DraftStep",
    "Event",
    "ExpertRouting",
    "HookError",
    "HookFailed",
    "HookHandle",
    "Hooks",
    "InitStage",
    "KVUsage",
    "MultiTracer",
    "NullTracer",
    "PolicyDecision",
    "Prefill",
    "RecordingTracer",
    "RequestAdmitted",
    "RequestFinished",
    "StepTiming",
    "Tracer",
    "TreeBuilt",
    "Verified",
    "event_from_dict",
    "event_to_dict",
    "frame",
    "phase",
    "read_jsonl",
    "trace",
    "write_jsonl",
]
