"""Exception types. Every error names the field or stage it is about."""

from __future__ import annotations


class WorkbenchError(Exception):
    """Base class of every error the workbench raises on purpose."""


class ConfigError(WorkbenchError, ValueError):
    """A configuration value is invalid; the message names the field."""


class RequestError(WorkbenchError, ValueError):
    """A request is invalid; the message names the field. Other requests are unaffected."""


class CheckpointError(WorkbenchError, ValueError):
    """A checkpoint is missing, incomplete or mis-shaped; names the tensor and shapes."""


class EngineInitError(WorkbenchError, RuntimeError):
    """An init stage failed. No engine object escapes; what was allocated is freed."""

    def __init__(self, stage: str, cause: BaseException | str) -> None:
        self.stage = stage
        self.cause = cause
        super().__init__(f"engine init failed at stage {stage!r}: {cause}")


class RequestFailed(WorkbenchError, RuntimeError):
    """A request failed at run time (e.g. non-finite logits); the engine keeps serving."""


class KVExhausted(WorkbenchError, RuntimeError):
    """The KV pool has fewer free blocks than a reservation needs. The scheduler checks
    ``KVPool.can_fit`` first (and preempts), so reaching this is a caller's bug."""

    def __init__(self, need: int, free: int) -> None:
        self.need = need
        self.free = free
        super().__init__(f"KVPool.reserve: pool exhausted, need {need} blocks, {free} free")
