"""The box's all-reduces priced by message size, per path (docs/LAB.md, "Collectives").

A box's ``link`` section names the paths a TP all-reduce can take, each priced by message
size with its provenance:

* ``nccl``: NCCL (always present on a TP > 1 box);
* ``fused``: the one-shot all-reduce fused with the residual add and RMSNorm (FlashInfer's
  Lamport kernel in SGLang), taken while the server's ``allreduce_fusion`` is on and the
  forward has at most ``max_tokens`` tokens;
* ``custom``: SGLang's custom (one-shot push) all-reduce, taken when the server allows it
  (``server.custom_allreduce``; by SGLang's rule only over NVLink or on at most two GPUs) and
  the message is at most ``max_bytes``.

Fusion switches the *path*, never the table: the NCCL table prices the forward whenever the
fused path is not taken. A path is a table of nccl-tests style rows ``[bytes, us]`` (an
optional third element names the box the row comes from, a key of ``link.boxes``) or the form
``latency_us + bytes * 2(n-1)/n / bus_gbps``. A table is read log-log piecewise linearly;
past its last row it goes on by its last segment's slope (never clamped: a verify's message
beyond the measured sizes costs more, not the last row's time); below its first row it takes
the first row's time (an all-reduce's latency floor: nccl-tests tables are flat there).
A one-row table gives no slope and is refused. ``link.readings`` holds alternative tables
for a path (a public figure from another box of the class, a derived reading), each a
candidate the report runs beside the given one; ``link.references`` public tables of other
boxes, kept for their shape (never priced).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from workbench.errors import ConfigError

PATHS = ("nccl", "fused", "custom")
BF16 = 2  # bytes per activation value in the all-reduce


@dataclass(frozen=True)
class AllReducePath:
    """One all-reduce path: a size → time table (``rows``: (bytes, µs), sizes increasing) or
    the latency-plus-bandwidth form; ``max_tokens`` / ``max_bytes`` bound where it is taken."""

    name: str
    rows: tuple[tuple[float, float], ...] = ()
    latency_us: float | None = None
    bus_gbps: float | None = None
    max_tokens: float | None = None
    max_bytes: float | None = None
    box: str = ""
    source: str = ""

    def time_us(self, size: float, ranks: int) -> float:
        """One all-reduce of ``size`` bytes over ``ranks`` ranks."""
        if self.rows:
            return _table_us(self.rows, size)
        assert self.latency_us is not None and self.bus_gbps is not None
        return self.latency_us + size * 2 * (ranks - 1) / ranks / (self.bus_gbps * 1e3)

    def slope(self, lo: float, hi: float, ranks: int) -> float:
        """d log(time) / d log(size) between two sizes (1 is bandwidth-bound, 0 latency)."""
        return math.log(self.time_us(hi, ranks) / self.time_us(lo, ranks)) / math.log(hi / lo)


def _table_us(rows: tuple[tuple[float, float], ...], size: float) -> float:
    xs = [math.log(r[0]) for r in rows]
    ys = [math.log(r[1]) for r in rows]
    x = math.log(max(size, 1.0))
    if x <= xs[0]:
        return rows[0][1]
    i = next((j for j in range(1, len(xs)) if x <= xs[j]), len(xs) - 1)
    k = (ys[i] - ys[i - 1]) / (xs[i] - xs[i - 1])  # past the last row: its own segment's slope
    return math.exp(ys[i - 1] + k * (x - xs[i - 1]))


def parse_path(name: str, d: Any, where: str) -> AllReducePath:
    """An :class:`AllReducePath` from a box's JSON; errors name the field."""
    if not isinstance(d, dict):
        raise ConfigError(f"{where}: a path is an object with a table or latency_us + bus_gbps")
    known = {"table", "latency_us", "bus_gbps", "max_tokens", "max_bytes", "box", "source"}
    extra = sorted(set(d) - known)
    if extra:
        raise ConfigError(f"{where}: unknown field(s) {', '.join(extra)} (known: "
                          f"{', '.join(sorted(known))})")
    rows: list[tuple[float, float]] = []
    for i, r in enumerate(d.get("table") or []):
        try:
            size, us = float(r[0]), float(r[1])
        except (TypeError, ValueError, IndexError):
            raise ConfigError(f"{where}.table[{i}]: expected [bytes, us(, box)], got {r!r}") \
                from None
        if size <= 0 or us <= 0:
            raise ConfigError(f"{where}.table[{i}]: bytes and us must be > 0, got {r!r}")
        if rows and size <= rows[-1][0]:
            raise ConfigError(f"{where}.table[{i}]: sizes must increase ({size:g} after "
                              f"{rows[-1][0]:g})")
        rows.append((size, us))
    lat, bus = d.get("latency_us"), d.get("bus_gbps")
    if rows and (lat is not None or bus is not None):
        raise ConfigError(f"{where}: give a table or latency_us + bus_gbps, not both")
    if len(rows) == 1:
        raise ConfigError(f"{where}.table: one row gives no slope (a size-independent "
                          "all-reduce); give two or more sizes")
    if not rows and (lat is None or bus is None or float(lat) < 0 or float(bus) <= 0):
        raise ConfigError(f"{where}: needs a table of two or more [bytes, us] rows or "
                          "latency_us >= 0 and bus_gbps > 0")
    return AllReducePath(
        name=name, rows=tuple(rows), latency_us=None if rows else float(lat),
        bus_gbps=None if rows else float(bus),
        max_tokens=None if d.get("max_tokens") is None else float(d["max_tokens"]),
        max_bytes=None if d.get("max_bytes") is None else float(d["max_bytes"]),
        box=str(d.get("box", "")), source=str(d.get("source", "")))


def paths(link: dict[str, Any], tp: int) -> dict[str, AllReducePath]:
    """The link's paths, checked (``nccl`` required on a TP > 1 box; the old size-blind keys
    refused, naming the new ones)."""
    old = [k for k in ("allreduce_us", "fused_allreduce_us", "fused_max_tokens", "table",
                       "bus_gbps") if k in link]
    if old:
        raise ConfigError(f"link.{old[0]}: the link is priced per path by message size: give "
                          "link.paths.nccl / fused / custom (a [bytes, us] table or "
                          "latency_us + bus_gbps), docs/LAB.md")
    given = link.get("paths") or {}
    bad = sorted(set(given) - set(PATHS))
    if bad:
        raise ConfigError(f"link.paths.{bad[0]}: not a path (paths: {', '.join(PATHS)})")
    out = {k: parse_path(k, v, f"link.paths.{k}") for k, v in given.items()}
    if tp > 1 and "nccl" not in out:
        raise ConfigError("link.paths.nccl: a TP > 1 box needs its NCCL path")
    for path, alts in (link.get("readings") or {}).items():
        if path not in PATHS:
            raise ConfigError(f"link.readings.{path}: not a path (paths: {', '.join(PATHS)})")
        for name, d in alts.items():
            parse_path(path, d, f"link.readings.{path}.{name}")
    for name, d in (link.get("references") or {}).items():
        parse_path(name, d, f"link.references.{name}")
    return out


def choose(box: dict[str, Any], tokens: float, hidden: int, fusion: bool,
           custom: bool) -> str:
    """The path an all-reduce of ``tokens`` rows takes: the fused one while fusion is on and
    the forward fits it, else the custom one where allowed and the message fits, else NCCL."""
    ps = paths(box["link"], int(box["layout"]["tp"]))
    f = ps.get("fused")
    if fusion and f is not None and (f.max_tokens is None or tokens <= f.max_tokens):
        return "fused"
    c = ps.get("custom")
    size = tokens * hidden * BF16
    if custom and c is not None and (c.max_bytes is None or size <= c.max_bytes):
        return "custom"
    return "nccl"


def allreduce_us(box: dict[str, Any], tokens: float, hidden: int, fusion: bool,
                 custom: bool) -> float:
    """One all-reduce of ``tokens`` rows of ``hidden`` bf16 values on the path it takes."""
    tp = int(box["layout"]["tp"])
    if tp <= 1:
        return 0.0
    path = paths(box["link"], tp)[choose(box, tokens, hidden, fusion, custom)]
    return path.time_us(tokens * hidden * BF16, tp)


def reading_names(box: dict[str, Any]) -> list[str]:
    """``given`` plus every ``link.readings`` entry as ``PATH:NAME``."""
    return ["given"] + [f"{p}:{n}" for p, alts in (box["link"].get("readings") or {}).items()
                        for n in alts]


def reading_sets(box: dict[str, Any], reading: str) -> list[str]:
    """The ``--set`` assignment that puts a reading in its path's place."""
    if reading == "given":
        return []
    import json

    path, _, name = reading.partition(":")
    try:
        d = box["link"]["readings"][path][name]
    except KeyError:
        raise ConfigError(f"reading {reading!r}: not one of {reading_names(box)}") from None
    return [f"link.paths.{path}={json.dumps(d)}"]
