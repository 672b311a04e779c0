"""Backpressure: a stream whose client does not read stops costing engine steps.

A streaming request's chunks wait in its sink until the HTTP writer takes them; the writer
stops taking them once the connection's buffers are full (the client is not reading). Each
time the engine loop comes round it asks every live stream's sink how many chunks are unread
(``Sink.unread()``, where a sink offers it) and how many bytes its client has not read
(``Sink.unread_bytes()``: uvicorn's buffer + the kernel's send queue; the kernel's buffers take
a whole small stream, so the writer alone never notices): above ``hold_at`` chunks or
``HOLD_BYTES`` bytes the request is *held* —
``Request.held``: the scheduler leaves it out of decode batches and it takes no batch slot or
fan-out share, keeping its KV and its place, so its output is unchanged — and it is released
once both are down to ``resume_at`` / ``RESUME_BYTES``. A client that never reads is still
ended by the server's write timeout (its request is then aborted and its KV freed).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class Backpressure:
    """Which requests are held (loop thread only); ``holds_total`` counts holds since start."""

    HOLD_AT = 16  # unread chunks above which a stream is held
    RESUME_AT = 4  # unread chunks at or below which a held stream runs again
    HOLD_BYTES = 64 << 10  # bytes the client has not read above which a stream is held
    RESUME_BYTES = 16 << 10

    def __init__(self, hold_at: int = HOLD_AT, resume_at: int = RESUME_AT) -> None:
        if not isinstance(hold_at, int) or hold_at < 1:
            raise ValueError(f"hold_at: must be an integer >= 1, got {hold_at!r}")
        if not isinstance(resume_at, int) or not 0 <= resume_at < hold_at:
            raise ValueError(f"resume_at: must be an integer in [0, hold_at), got {resume_at!r}")
        self.hold_at, self.resume_at = hold_at, resume_at
        self.held: set[int] = set()  # rids
        self.holds_total = 0

    def update(self, live: Mapping[int, Any], requests: Mapping[int, Any]) -> None:
        """Hold or release each live stream (``live``: rid → the loop's Ticket) by its sink's
        backlog; ``requests``: the engine's rid → Request."""
        for rid, t in live.items():
            unread = getattr(t.sink, "unread", None) if t.stream else None
            req = requests.get(rid)
            if unread is None or req is None:
                continue
            n, b = unread(), t.sink.unread_bytes()
            if rid in self.held and n <= self.resume_at and b <= self.RESUME_BYTES:
                self.held.discard(rid)
                req.held = False
            elif rid not in self.held and (n > self.hold_at or b > self.HOLD_BYTES):
                self.held.add(rid)
                req.held = True
                self.holds_total += 1

    def snapshot(self) -> dict[str, int]:
        """``/server_info``'s ``backpressure``: streams held now, holds since start."""
        return {"held": len(self.held), "holds_total": self.holds_total}

    def forget(self, rid: int) -> None:
        """``rid`` finished."""
        self.held.discard(rid)
