"""HTTP serving: an SGLang-compatible server around one engine (see :mod:`.server`).

    handle = start_server(engine)          # uvicorn on a thread, a free port
    httpx.post(f"{handle.url}/generate", json={"text": "def f(", "sampling_params": {...}})
    handle.stop()

Importing this package does not import FastAPI; :func:`start_server` and :class:`ServerHandle`
load :mod:`workbench.serve.server` (the ``serve`` extra) on first use.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ServerHandle", "build_app", "start_server"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from workbench.serve import server

        return getattr(server, name)
    raise AttributeError(f"module 'workbench.serve' has no attribute {name!r}")
