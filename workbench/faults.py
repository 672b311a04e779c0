"""Fault injection for reliability tests and the partial-init notebook.

Name a point to fail: an init stage (``init:load_draft``, ``init:attention_backend`` …) or a
step phase (``step:draft``, ``step:verify``, ``step:accept``, ``step:commit``, ``step:extend``,
``step:sampler``, ``step:hook``). Two ways, both explicit:

    with wb.faults.inject("init:attention_backend"): ...        # in code
    WORKBENCH_FAULTS=init:attention_backend,step:verify python ...  # from the environment

``step:*`` faults accept ``@rid`` to hit one request only, e.g. ``step:nan_logits@3``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

INIT_STAGES = ("load_config", "load_target", "load_draft", "autotune", "allocate_kv",
               "attention_backend", "draft_attention_backend", "cuda_graphs", "compile",
               "policy_costmodel", "self_check")
STEP_PHASES = ("schedule", "prefill", "draft", "verify", "accept", "commit", "extend", "sampler",
               "hook", "nan_logits")

_active: set[str] = set()


class InjectedFault(RuntimeError):
    """Raised at an injected point; the message names it."""


def _env() -> set[str]:
    raw = os.environ.get("WORKBENCH_FAULTS", "")
    return {p.strip() for p in raw.split(",") if p.strip()}


def active(point: str) -> bool:
    return point in _active or point in _env()


def check(point: str) -> None:
    """Raise InjectedFault if ``point`` is armed (cheap set lookup when nothing is armed)."""
    if (_active or "WORKBENCH_FAULTS" in os.environ) and active(point):
        raise InjectedFault(f"injected fault at {point}")


@contextmanager
def inject(*points: str) -> Iterator[None]:
    for p in points:
        kind, _, name = p.partition(":")
        base = name.split("@")[0]
        valid = INIT_STAGES if kind == "init" else STEP_PHASES if kind == "step" else ()
        if base not in valid:
            raise ValueError(f"faults.inject: unknown point {p!r}; init stages {INIT_STAGES}, "
                             f"step phases {STEP_PHASES}")
    added = [p for p in points if p not in _active]
    _active.update(added)
    try:
        yield
    finally:
        _active.difference_update(added)
