"""compressed-tensors ``pack-quantized`` checkpoints (the format the seeds serve: Kimi-K2.5's
INT4 experts, vLLM's and SGLang's W4A16): each quantised ``X.weight`` is stored as
``X.weight_packed`` (int32 (N, K/8): eight 4-bit codes per word, the lowest bits first, each
code ``c + 8`` for ``c`` in -8..7), ``X.weight_scale`` ((N, K/group), the model's dtype) and
``X.weight_shape``; the value is ``scale · c`` (symmetric: no zero point).

:func:`read_pack_quantized` turns those tensors into the runtime's: ``X.weight`` dequantised
(float32 ``scale·c``, then the engine's dtype: what compressed-tensors' own decompression
computes) plus, per weight, the :class:`~workbench.models.quant.QuantTensor` (kind ``INT4``)
the packed path runs. Only what the loader can run exactly is accepted: 4-bit ``int``,
symmetric, ``group`` strategy; anything else is refused naming the ``quantization_config``
field.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from workbench.errors import CheckpointError
from workbench.models.quant import QuantTensor

FORMAT = "pack-quantized"


def quantization_config(folder: Path) -> dict[str, Any] | None:
    """The folder's compressed-tensors ``quantization_config`` (None: not quantised), checked
    to be a format this loader reads; CheckpointError naming the field otherwise."""
    cfg_file = folder / "config.json"
    if not cfg_file.is_file():
        return None
    doc = json.loads(cfg_file.read_text())
    q = doc.get("quantization_config") or doc.get("text_config", {}).get("quantization_config")
    if not q:
        return None
    where = f"{cfg_file}: quantization_config"
    if q.get("quant_method") != "compressed-tensors":
        raise CheckpointError(f"{where}.quant_method: {q.get('quant_method')!r} (only "
                              "'compressed-tensors' is read)")
    if q.get("format") != FORMAT:
        raise CheckpointError(f"{where}.format: {q.get('format')!r} (only {FORMAT!r} is read)")
    for name, group in (q.get("config_groups") or {}).items():
        w = group.get("weights") or {}
        want = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group"}
        for key, value in want.items():
            if w.get(key) != value:
                raise CheckpointError(f"{where}.config_groups.{name}.weights.{key}: "
                                      f"{w.get(key)!r} (this loader reads {value!r})")
        if not isinstance(w.get("group_size"), int) or w["group_size"] <= 0:
            raise CheckpointError(f"{where}.config_groups.{name}.weights.group_size: "
                                  f"{w.get('group_size')!r}")
    return dict(q)


def unpack_int4(packed: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """(N, ceil(K/8)) int32 words → (N, K) int8 codes in -8..7 (little-endian nibbles)."""
    n, k = shape
    if packed.dtype != torch.int32 or packed.shape[0] != n or packed.shape[1] * 8 < k:
        raise CheckpointError(f"weight_packed {tuple(packed.shape)} {packed.dtype} does not "
                              f"hold a {n}x{k} 4-bit weight")
    b = packed.contiguous().view(torch.uint8).view(n, -1)  # little-endian hosts (x86, arm)
    nib = torch.stack([b & 0x0F, b >> 4], dim=-1).view(n, -1)[:, :k]
    return (nib.to(torch.int16) - 8).to(torch.int8)


def read_pack_quantized(tensors: dict[str, torch.Tensor], qcfg: dict[str, Any],
                        dtype: torch.dtype) -> tuple[dict[str, torch.Tensor],
                                                     dict[str, QuantTensor]]:
    """The checkpoint's tensors with every packed weight replaced by ``X.weight`` (dequantised,
    ``dtype``), and the quantised weights by name (``X.weight``)."""
    groups = [g["weights"]["group_size"] for g in (qcfg.get("config_groups") or {}).values()]
    out: dict[str, torch.Tensor] = {}
    quant: dict[str, QuantTensor] = {}
    for name, t in tensors.items():
        if name.endswith((".weight_scale", ".weight_shape", ".weight_zero_point")):
            continue
        if not name.endswith(".weight_packed"):
            out[name] = t
            continue
        base = name.removesuffix("_packed")
        scale, shape = tensors.get(base + "_scale"), tensors.get(base + "_shape")
        if scale is None or shape is None:
            raise CheckpointError(f"tensor {name!r}: its {base + '_scale'!r} or "
                                  f"{base + '_shape'!r} is missing")
        n, k = (int(v) for v in shape.tolist())
        group = k // int(scale.shape[1]) if scale.dim() == 2 and scale.shape[1] else 0
        if group not in groups or k % group:
            raise CheckpointError(f"tensor {base + '_scale'!r} {tuple(scale.shape)}: not "
                                  f"groups of {groups} over K={k}")
        zp = tensors.get(base + "_zero_point")
        if zp is not None and bool(zp.ne(0).any()):
            raise CheckpointError(f"tensor {base + '_zero_point'!r}: nonzero in a symmetric "
                                  "checkpoint")
        qt = QuantTensor("INT4", unpack_int4(t, (n, k)), scale.float(), None, group)
        quant[base] = qt
        out[base] = qt.dequantize().to(dtype)
    return out, quant
