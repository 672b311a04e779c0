"""The web stack ``workbench serve`` runs on: the ``serve`` extra (fastapi, uvicorn, httpx).

Every serve module that needs it takes these names from here, so a missing extra is one clear
ImportError naming the install command, whichever serve module is imported first.
"""

from __future__ import annotations

try:
    import h11
    import uvicorn
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException
    from starlette.requests import ClientDisconnect
    from uvicorn.protocols.http.h11_impl import H11Protocol
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("the server needs the serve extra: pip install -e '.[serve]' "
                      f"(fastapi, uvicorn, httpx): {e}") from e

__all__ = ["ClientDisconnect", "FastAPI", "H11Protocol", "JSONResponse", "PlainTextResponse",
           "Request", "Response", "StarletteHTTPException", "StreamingResponse", "h11", "uvicorn"]
