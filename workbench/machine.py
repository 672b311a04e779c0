"""Machine facts stamped into every benchmark result (honest reporting).

:func:`machine_info` says *which* machine a figure came from (CPU model, instruction-set flags
that decide the fast kernels, cache sizes, cores, torch version, git commit, load average);
:func:`machine_kind` turns it into a short file-name slug (``data/results/<kind>/``), so
results from different kinds of machine never overwrite each other. Everything here reads
``/proc`` and ``/sys`` (Linux); elsewhere the fields are ``None``, never guessed.
"""

from __future__ import annotations

import os
import platform
import re
import subprocess
import time
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from workbench.data_io import REPO_ROOT

# Instruction-set flags that change which CPU kernels are fastest (oneDNN, Inductor, MKL).
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
             "avx512_fp16", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8")


@lru_cache(maxsize=1)
def _cpuinfo() -> dict[str, str]:
    """First processor block of /proc/cpuinfo ({} where it does not exist)."""
    out: dict[str, str] = {}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return out
    for line in text.splitlines():
        if not line.strip():
            if out:
                break
            continue
        key, _, value = line.partition(":")
        out.setdefault(key.strip(), value.strip())
    return out


def cpu_model() -> str:
    """The CPU's model name ("AMD EPYC", "Intel(R) Xeon(R) Platinum 8581C CPU @ 2.10GHz"...)."""
    return _cpuinfo().get("model name") or platform.processor() or platform.machine()


def cpu_family() -> int | None:
    """The CPU family number (/proc/cpuinfo ``cpu family``: 25 Zen 3/4, 26 Zen 5, 6 Intel...),
    or None where it is not known."""
    raw = _cpuinfo().get("cpu family", "")
    return int(raw) if raw.isdigit() else None


def cpu_flags() -> list[str]:
    """The ISA flags of :data:`ISA_FLAGS` this CPU has, in that order."""
    have = set(_cpuinfo().get("flags", "").split())
    return [f for f in ISA_FLAGS if f in have]


def _size_bytes(text: str) -> int | None:
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]?)B?\s*", text, flags=re.IGNORECASE)
    if m is None:
        return None
    return int(m.group(1)) * {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[m.group(2).upper()]


def cache_sizes() -> dict[str, int | None]:
    """Per-instance cache sizes in bytes seen by cpu0: ``{"l1d": .., "l2": .., "l3": ..}``.

    L2 is usually per core and L3 shared; ``None`` where /sys does not say.
    """
    out: dict[str, int | None] = {"l1d": None, "l2": None, "l3": None}
    base = Path("/sys/devices/system/cpu/cpu0/cache")
    for idx in sorted(base.glob("index*")):
        try:
            level = (idx / "level").read_text().strip()
            kind = (idx / "type").read_text().strip()
            size = _size_bytes((idx / "size").read_text())
        except OSError:
            continue
        if level == "1" and kind == "Data":
            out["l1d"] = size
        elif level in ("2", "3") and kind == "Unified":
            out[f"l{level}"] = size
    return out


@lru_cache(maxsize=1)
def git_commit(root: str | Path = REPO_ROOT) -> str | None:
    """Short commit of the checkout, with ``+dirty`` when tracked files are modified.

    ``None`` outside a git checkout (an installed wheel) or without git.
    """
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain",
                                "--untracked-files=no"], capture_output=True, text=True,
                               timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def loadavg() -> list[float] | None:
    """``[1-min, 5-min, 15-min]`` load average, or ``None`` where the OS has none."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def machine_info() -> dict[str, Any]:
    """Facts about this machine, for a result file's ``"machine"`` entry.

    Keys: ``cpu`` (model name), ``kind`` (:func:`machine_kind`), ``flags`` (ISA flags present,
    see :data:`ISA_FLAGS`), ``l1d`` / ``l2`` / ``l3`` (bytes per instance), ``cores``
    (``os.cpu_count()``), ``torch_threads``, ``torch``, ``python``, ``cuda`` (GPU name or None),
    ``commit`` (short, ``+dirty`` if modified), ``loadavg`` (1/5/15-min, now) and ``time``.
    The load *during* a benchmark is recorded separately (``workbench.bench.sanity``).
    """
    cpu = cpu_model()
    caches = cache_sizes()
    return {
        "cpu": cpu, "family": cpu_family(), "kind": machine_kind(cpu, cpu_family()),
        "flags": cpu_flags(),
        "l1d": caches["l1d"], "l2": caches["l2"], "l3": caches["l3"],
        "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__, "python": platform.python_version(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "commit": git_commit(), "loadavg": loadavg(),
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def machine_kind(cpu: str | None = None, family: int | None = None) -> str:
    """A short slug naming the kind of machine, from its CPU model: ``"intel-xeon-platinum-
    8581c"``, ``"amd-epyc-9b14"``... (trademarks, clock speed and "CPU" dropped). Used to keep
    one results file per machine kind. A generic name without a model number (what a
    hypervisor shows: "AMD EPYC") names different CPUs — family 25 (AVX2 only) and 26
    (AVX-512) measured far apart — so it takes the CPU ``family`` (this machine's when ``cpu``
    is None): ``"amd-epyc-family-26"``."""
    if cpu is None:
        cpu, family = cpu_model(), cpu_family() if family is None else family
    name = re.sub(r"\((r|tm)\)", "", cpu, flags=re.IGNORECASE)
    name = re.sub(r"@.*$", "", name)
    name = re.sub(r"\b(cpu|processor|\d+-core)\b", "", name, flags=re.IGNORECASE)
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    if slug and family is not None and not re.search(r"\d", slug):
        slug += f"-family-{family}"
    return slug or "unknown"


def format_machine(info: dict[str, Any]) -> str:
    """One line for a table caption: "AMD EPYC · 2 cores · L2 1 MiB · L3 32 MiB · avx2,…"."""
    def mib(b: int | None) -> str:
        return "?" if b is None else f"{b / (1 << 20):g} MiB"

    flags = ",".join(info.get("flags") or []) or "no AVX flags"
    return (f"{info.get('cpu')} · {info.get('cores')} cores · L2 {mib(info.get('l2'))} · "
            f"L3 {mib(info.get('l3'))} · {flags} · torch {info.get('torch')} · "
            f"commit {info.get('commit')}")
