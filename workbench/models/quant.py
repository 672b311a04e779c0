"""Packed 4- and 8-bit weights: the file's quantised values kept as codes and block scales
(:class:`QuantTensor`) and run by torch's weight-only int4 kernel (:class:`PackedWeight`,
:func:`packed_linear`).

**What the file holds.** Every supported format is ``w[n, k] = scale[n, b] · c[n, k] +
offset[n, b]`` over blocks ``b = k // group`` of one row: GGUF Q4_0 (``c = q - 8`` in -8..7,
no offset), Q4_1 (``c = q`` in 0..15, offset the block's min ``m``), Q8_0 (``c`` int8), with
float16 scales and mins and group 32; compressed-tensors' pack-quantized INT4 (``c`` in -8..7,
its own scale dtype, group 32). :class:`QuantTensor` keeps ``c`` exactly and the scales as
float32 (float16 and bfloat16 widen exactly); :meth:`QuantTensor.dequantize` is the file's own
dequantisation (float32 ``scale·c + offset``, bit-equal to ``gguf.quants.dequantize``).

**What the kernel computes.** ``torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group,
scales_and_zeros)`` computes ``x · Wᵀ`` with ``W[n, k] = (q4 - 8)·s + z``, ``q4`` in 0..15,
per-group ``(s, z)`` in x's dtype. Its vectorised path is bfloat16 only (on the 2-core AMD EPYC,
one 1×(576→1536) GEMM: bf16 29 µs, float32 746 µs, float16 816 µs), so a packed GEMM casts x
to bfloat16, accumulates in float32 inside the kernel and returns bfloat16, widened to the
model's dtype. Where a value changes on the way in (the only places; bounds tested in
tests/models/test_quant.py; on SmolLM2-135M-Instruct.Q4_1.gguf the largest change of a weight
is 0.0215 (0.046 of its block scale) over the 210 Q4_1 tensors and 0.0039 (0.49 of its block
scale: a code of ±127 times the scale's rounding) in the Q8_0 embedding/head):

* every block scale is rounded to bfloat16 (8 significant bits; float16 has 11): relative
  change at most 2⁻⁸ of the scale (bf16's unit roundoff);
* Q4_1: ``d·q + m`` becomes ``(q - 8)·s + z`` with ``s = bf16(d)`` and ``z = bf16(m + 8d)``
  (the sum in float32, then rounded): the weight changes by at most ``|8·Δs| + |Δz|``;
* Q8_0 has 8-bit codes and the kernel 4-bit ones: each code is split exactly,
  ``c = 16·hi + lo`` (``hi`` in -8..7, ``lo`` in 0..15), into two 4-bit planes laid side by
  side along K (``W = [16·s·hi | s·lo]``, the input doubled ``[x | x]``), so the codes stay the
  file's and only the scale's bf16 rounding changes a value (``bf16(16d) = 16·bf16(d)``).

**Rows.** Each output row of the kernel is computed the same way whatever the number of rows
M and the row's place (checked at every M in 1..64 and larger in tests/models/test_quant.py):
the plain step and a verify of any width give a row the same bits, which speculative decoding
needs to stay lossless. Both use the same packed weight (one format per weight).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

GROUP = 32
KINDS = ("Q4_0", "Q4_1", "Q8_0", "INT4")  # INT4: compressed-tensors pack-quantized, symmetric
PACKABLE = ("Q4_0", "Q4_1", "Q8_0")  # the GGUF types kept packed


@dataclass(frozen=True)
class QuantTensor:
    """One (N, K) weight as the file stores it: ``w = scale·codes + offset`` per group.

    Shape: codes (N, K) int8; scale, offset (N, K / group) float32 (offset None: zero)."""

    kind: str
    codes: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor | None = None
    group: int = GROUP

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"QuantTensor.kind: {self.kind!r} not in {KINDS}")
        n, k = self.codes.shape
        if k % self.group or tuple(self.scale.shape) != (n, k // self.group):
            raise ValueError(f"QuantTensor: codes {tuple(self.codes.shape)} and scale "
                             f"{tuple(self.scale.shape)} do not match group {self.group}")

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.codes.shape[0]), int(self.codes.shape[1]))

    def dequantize(self) -> torch.Tensor:
        """The file's values, float32 (N, K): ``scale·c`` then ``+ offset``, each rounded once
        as the reference dequantisers do."""
        n, k = self.shape
        c = self.codes.view(n, k // self.group, self.group).float()
        w = self.scale.unsqueeze(-1) * c
        if self.offset is not None:
            w = w + self.offset.unsqueeze(-1)
        return w.view(n, k)

    def rows(self, index: torch.Tensor) -> QuantTensor:
        """The rows ``index`` (a permutation of the output rows, e.g. the Q/K unpermute)."""
        return QuantTensor(self.kind, self.codes[index], self.scale[index],
                           None if self.offset is None else self.offset[index], self.group)


def cat_rows(parts: Sequence[QuantTensor]) -> QuantTensor | None:
    """Stack weights along N (q/k/v, gate/up); None when their kinds or widths differ."""
    first = parts[0]
    if any(p.kind != first.kind or p.shape[1] != first.shape[1] or p.group != first.group
           for p in parts):
        return None
    off = None if first.offset is None else torch.cat([p.offset for p in parts])  # type: ignore[misc]
    return QuantTensor(first.kind, torch.cat([p.codes for p in parts]),
                       torch.cat([p.scale for p in parts]), off, first.group)


# -- GGUF blocks -> QuantTensor ---------------------------------------------------------------

def _nibbles(qs: np.ndarray) -> np.ndarray:
    """(blocks, 16) bytes → (blocks, 32) codes 0..15: low nibbles are values 0..15 of the
    block, high nibbles 16..31 (ggml's layout)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


def from_gguf_blocks(raw: np.ndarray, kind: str, shape: tuple[int, int]) -> QuantTensor:
    """A GGUF tensor's bytes (rows, row_bytes) of type ``kind`` (Q4_0, Q4_1, Q8_0) → its
    codes and float32 scales (shape (N, K) row-major)."""
    n, k = shape
    nb = k // GROUP
    blocks = np.ascontiguousarray(raw).reshape(n * nb, -1)
    offset = None
    if kind == "Q4_0":  # d f16, 16 bytes of nibbles
        d = blocks[:, :2].view(np.float16)
        c = _nibbles(blocks[:, 2:]).astype(np.int8) - np.int8(8)
    elif kind == "Q4_1":  # d f16, m f16, 16 bytes of nibbles
        d, m = blocks[:, :2].view(np.float16), blocks[:, 2:4].view(np.float16)
        c = _nibbles(blocks[:, 4:]).astype(np.int8)
        offset = torch.from_numpy(m.astype(np.float32).reshape(n, nb))
    elif kind == "Q8_0":  # d f16, 32 int8
        d = blocks[:, :2].view(np.float16)
        c = blocks[:, 2:].view(np.int8)
    else:
        raise ValueError(f"from_gguf_blocks: {kind!r} is not Q4_0, Q4_1 or Q8_0")
    return QuantTensor(kind, torch.from_numpy(np.ascontiguousarray(c).reshape(n, k)),
                       torch.from_numpy(d.astype(np.float32).reshape(n, nb)), offset)


# -- QuantTensor -> the kernel's layout -------------------------------------------------------

@dataclass(frozen=True)
class PackedWeight:
    """A weight in ``_weight_int4pack_mm_for_cpu``'s layout. Shape: packed (N', K'/2) uint8,
    scales_zeros (K'/group, N', 2) bfloat16; K' = K (4-bit) or 2K (8-bit split in two planes:
    the input is doubled), N' = N rounded up to 16 (zero rows, sliced off the output)."""

    packed: torch.Tensor
    scales_zeros: torch.Tensor
    n: int
    k: int
    split: bool
    group: int
    kind: str

    def effective(self) -> torch.Tensor:
        """The float32 (N, K) weights the kernel multiplies by (the planes summed)."""
        rows = int(self.packed.shape[0])  # N padded to a multiple of 16
        q4 = unpack_codes(self.packed, rows, self.k * (2 if self.split else 1))[: self.n]
        sz = self.scales_zeros[:, : self.n].float()
        g = self.group
        w = (q4.view(self.n, -1, g).float() - 8) * sz[:, :, 0].t().unsqueeze(-1) \
            + sz[:, :, 1].t().unsqueeze(-1)
        w = w.view(self.n, -1)
        return w[:, : self.k] + w[:, self.k :] if self.split else w


def unpack_codes(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The 0..15 codes (N, K) int32 of a packed weight (through the kernel itself: its
    product with the identity over unit scales, so no assumption about the layout)."""
    eye = torch.eye(k, dtype=torch.bfloat16, device=packed.device)
    sz = torch.zeros(k // GROUP, n, 2, dtype=torch.bfloat16, device=packed.device)
    sz[:, :, 0] = 1
    sz[:, :, 1] = 8  # (q - 8)·1 + 8 = q
    return torch.ops.aten._weight_int4pack_mm_for_cpu(eye, packed, GROUP, sz).t().round().int()


def _planes(qt: QuantTensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q4 (N, K') int32 in 0..15, s (N, K'/g) float32, z (N, K'/g) float32) with
    ``(q4 - 8)·s + z`` = the file's weight in exact arithmetic."""
    c, s = qt.codes.to(torch.int32), qt.scale
    off = qt.offset if qt.offset is not None else torch.zeros_like(s)
    if qt.kind in ("Q4_0", "INT4"):  # c in -8..7
        return c + 8, s, off
    if qt.kind == "Q4_1":  # c in 0..15: (c - 8)·s + (off + 8s)
        return c, s, off + 8 * s
    hi, lo = c >> 4, c & 15  # Q8_0: c = 16·hi + lo, hi in -8..7, lo in 0..15
    return (torch.cat([hi + 8, lo], 1), torch.cat([16 * s, s], 1),
            torch.cat([off, 8 * s], 1))


def pack(qt: QuantTensor) -> PackedWeight:
    """``qt`` in the int4 kernel's layout (the one place values round: scales and zeros to
    bfloat16; see the module docstring)."""
    q4, s, z = _planes(qt)
    n, k = qt.shape
    if int(q4.min()) < 0 or int(q4.max()) > 15:
        raise ValueError(f"pack: {qt.kind} codes out of the 4-bit range")
    pad = -n % 16  # the kernel takes N in multiples of 16: zero rows (scale 0), sliced off
    if pad:
        q4 = torch.cat([q4, q4.new_full((pad, q4.shape[1]), 8)])
        zeros = s.new_zeros(pad, s.shape[1])
        s, z = torch.cat([s, zeros]), torch.cat([z, zeros])
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q4.contiguous(), 1)
    sz = torch.stack([s.t(), z.t()], dim=-1).to(torch.bfloat16).contiguous()
    return PackedWeight(packed, sz, n, k, qt.kind == "Q8_0", qt.group, qt.kind)


def packed_or(quant: dict[str, QuantTensor], names: Sequence[str],
              dense: torch.Tensor) -> PackedWeight | torch.Tensor:
    """The weights ``names`` stacked along N and packed, when ``quant`` holds all of them in
    one kind; else ``dense`` (the same weights as float)."""
    parts = [quant.get(n) for n in names]
    if any(p is None for p in parts):
        return dense
    qt = cat_rows([p for p in parts if p is not None])
    return dense if qt is None else pack(qt)


def packed_mm(x: torch.Tensor, w: PackedWeight) -> torch.Tensor:
    """x (M, K) · Wᵀ → (M, N) in x's dtype (bfloat16 inside the kernel)."""
    xb = x.to(torch.bfloat16).contiguous()
    if w.split:
        xb = torch.cat([xb, xb], dim=-1)
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(xb, w.packed, w.group, w.scales_zeros)
    return (y if y.shape[1] == w.n else y[:, : w.n]).to(x.dtype)


def packed_linear(x: torch.Tensor, w: PackedWeight | torch.Tensor,
                  b: torch.Tensor | None) -> torch.Tensor:
    """``x·wᵀ + b`` for a packed weight, or ``F.linear`` for a dense one (a layer may mix
    them: a tensor of a type without a packed form stays dense)."""
    if isinstance(w, torch.Tensor):
        return torch.nn.functional.linear(x, w, b)
    y = packed_mm(x, w)
    return y if b is None else y + b


def packed_linear_add(x: torch.Tensor, w: PackedWeight | torch.Tensor,
                      res: torch.Tensor) -> torch.Tensor:
    """``res + x·wᵀ`` (packed or dense ``w``)."""
    if isinstance(w, torch.Tensor):
        return torch.addmm(res, x, w.t())
    return res + packed_mm(x, w)
