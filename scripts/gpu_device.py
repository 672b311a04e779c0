"""The device a GPU run measures, as a folder name and as a record of its software.

``python scripts/gpu_device.py`` prints the slug (``nvidia-h100-80gb-hbm3``; ``cpu`` without
CUDA): the folder under ``data/results/gpu/`` that the GPU scripts write to. ``software()`` is
the record every result file of those scripts carries (device, torch, CUDA, Triton,
transformers, gguf, FlashInfer versions; ``None`` for a package that is not installed).
"""

from __future__ import annotations

import importlib
import platform
import re
import sys
from typing import Any

import torch


def device_name(device: str | torch.device | None = None) -> str:
    """The CUDA device's name (``torch.cuda.get_device_name``), else ``cpu``."""
    dev = torch.device(device) if device is not None else torch.device(
        "cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    return "cpu"


def device_slug(device: str | torch.device | None = None) -> str:
    """``NVIDIA H100 80GB HBM3`` → ``nvidia-h100-80gb-hbm3`` (lower case, runs of anything
    but letters and digits made one ``-``)."""
    slug = re.sub(r"[^a-z0-9]+", "-", device_name(device).lower()).strip("-")
    if not slug:
        raise ValueError(f"device_slug: device {device!r} has no usable name")
    return slug


def software(device: str | torch.device | None = None) -> dict[str, Any]:
    """Device and software versions of this process (for every result file)."""
    out: dict[str, Any] = {"device": device_name(device), "device_slug": device_slug(device),
                           "python": platform.python_version(), "torch": torch.__version__,
                           "cuda": torch.version.cuda, "hostname": platform.node()}
    for name in ("triton", "transformers", "gguf", "flashinfer", "numpy"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            out[name] = None
            continue
        out[name] = getattr(module, "__version__", "installed")
    if device_name(device) != "cpu":
        props = torch.cuda.get_device_properties(torch.device(device or "cuda"))
        out.update(capability=f"{props.major}.{props.minor}",
                   gpu_memory_gib=round(props.total_memory / 2**30, 1))
    return out


if __name__ == "__main__":
    print(device_slug(sys.argv[1] if len(sys.argv) > 1 else None))
