"""Build and load the project's C kernels for the CPU (``kernels/csrc/*.c``) with the
machine's C compiler, once per machine: the shared object is cached under
``~/.cache/workbench/kernels/`` keyed by the source, the flags, the compiler and the CPU, and
loaded with :mod:`ctypes` (no torch headers, about a second to build).

Flags: ``-O3 -march=native`` (vector lanes of this CPU), ``-ffp-contract=off`` (no fused
multiply-add formed at the compiler's discretion) and no ``-ffast-math`` (no reassociation):
every reduction runs in the order the source writes. A missing compiler or a failed build
raises, naming what failed; nothing falls back silently.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
from pathlib import Path

CSRC = Path(__file__).parent / "csrc"
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fPIC", "-shared",
         "-std=gnu11", "-Wall", "-Werror")
_LOADED: dict[str, ctypes.CDLL] = {}


def cache_dir() -> Path:
    return Path(os.environ.get("WORKBENCH_CACHE", Path.home() / ".cache" / "workbench")) / "kernels"


def _cpu_identity() -> str:
    """What -march=native compiles for: the CPU's model line and flags (Linux), else the
    platform string."""
    info = Path("/proc/cpuinfo")
    if info.exists():
        keep = [ln for ln in info.read_text().splitlines()
                if ln.startswith(("model name", "flags", "cpu family", "model\t"))]
        return "\n".join(sorted(set(keep)))
    return platform.processor() or platform.machine()


def compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise RuntimeError("no C compiler (gcc or cc, or $CC) found: the CPU row-invariant "
                           "kernels (EngineConfig.batch_invariant) are built with one")
    return cc


def load(name: str) -> ctypes.CDLL:
    """``csrc/<name>.c`` built for this machine (cached) and loaded."""
    lib = _LOADED.get(name)
    if lib is not None:
        return lib
    src = CSRC / f"{name}.c"
    cc = compiler()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True,
                             check=True).stdout.splitlines()[0]
    key = hashlib.sha256("\0".join([src.read_text(), " ".join(FLAGS), version,
                                    _cpu_identity()]).encode()).hexdigest()[:16]
    out = cache_dir() / f"{name}-{key}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(f".{os.getpid()}.tmp")
        done = subprocess.run([cc, *FLAGS, "-o", str(tmp), str(src), "-lm"],
                              capture_output=True, text=True)
        if done.returncode != 0:
            tmp.unlink(missing_ok=True)
            raise RuntimeError(f"building {src.name} with {cc} failed "
                               f"(exit {done.returncode}):\n{done.stderr.strip()}")
        os.replace(tmp, out)  # atomic: a concurrent build of the same key wins or loses whole
    lib = ctypes.CDLL(str(out))
    _LOADED[name] = lib
    return lib
