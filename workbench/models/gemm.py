"""The engine's GEMM paths: fused inference weights (:func:`fuse_linears`), plain dense
``F.linear`` or oneDNN-packed weights (:func:`pack`, :func:`onednn_linear`), and the choice
between them (:func:`resolve_gemm`; measured per machine by ``workbench.engine.autotune``)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from workbench.models.quant import packed_linear, packed_linear_add


def fuse_linears(linears: Sequence[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One (sum(out), in) weight for ``linears`` (and bias), each linear's parameter becoming a
    view of it, so there is one copy of the weights and in-place updates reach both.

    On CPU the storage is transposed — (in, out) contiguous, the weight a ``.t()`` view — because
    MKL reads that layout much faster for the engine's small-M GEMMs (the 18 layers of wb-target
    on the 2-core EPYC: 1.9 ms vs 3.5 ms per token at T=1, 3.2 vs 3.9 ms at T=6, equal at T=16).
    On CUDA the layout stays (out, in) (cuBLAS reads both)."""
    ws = [lin.weight.detach() for lin in linears]
    cpu = ws[0].device.type == "cpu"
    with torch.no_grad():
        if cpu:
            store = torch.cat([w.t() for w in ws], dim=1).contiguous()  # (in, sum out)
            w = store.t()
        else:
            w = torch.cat(ws).contiguous() if len(ws) > 1 else ws[0]
        o = 0
        for lin in linears:
            n = lin.weight.shape[0]
            lin.weight.data = w[o : o + n]
            o += n
        b = None
        if linears[0].bias is not None:
            b = torch.cat([lin.bias.detach() for lin in linears]).contiguous()
            o = 0
            for lin in linears:
                n = lin.bias.shape[0]
                lin.bias.data = b[o : o + n]
                o += n
    return w, b


GEMMS = ("auto", "onednn", "dense")


def onednn_ok(weight: torch.Tensor) -> bool:
    """Can oneDNN pack this weight? (float32 on a CPU with mkldnn; bfloat16 where oneDNN has
    bf16 kernels: AVX-512-bf16 / AMX. Each row is computed the same way at every M in both,
    checked in tests/models/test_fast_paths.py.)"""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if weight.dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return weight.dtype == torch.float32


def resolve_gemm(kind: str, weight: torch.Tensor) -> str:
    """``onednn``: weights packed once by oneDNN (CPU float32; what Inductor's freezing pass
    does); ``dense``: plain ``F.linear``. ``auto`` here is ``dense`` (views, no packing): which
    path is faster depends on the machine — oneDNN won 1.6-2.5x at small M on a 2-core EPYC and
    lost 1.57x on a 2-core Xeon — so the engine times both at init on the real weights and
    re-fuses with the winner (``workbench.engine.autotune``)."""
    if kind not in GEMMS:
        raise ValueError(f"gemm: {kind!r} not in {GEMMS}")
    if kind == "onednn" and not onednn_ok(weight):
        raise ValueError(f"gemm='onednn' needs a float32 (or, with bf16 kernels, bfloat16) "
                         f"CPU model with mkldnn; got "
                         f"{weight.dtype} on {weight.device} (mkldnn available: "
                         f"{torch.backends.mkldnn.is_available()})")
    return "onednn" if kind == "onednn" else "dense"


# Packing batch hint: the oneDNN kernel chosen for M=16 serves M=1 as fast as the GEMV and
# M=6..64 2-2.5x faster than MKL's small-M path on the 2-core EPYC (wb-target's 18 layers:
# T=1 1.6 vs 2.7 ms, T=6 1.9 vs 4.9 ms, T=16 2.5 vs 6.6 ms, T=300 19 vs 42 ms).
PACK_HINT = 16
# oneDNN builds (JIT-compiles) and caches one primitive per input shape, and RSS grows with
# the number of distinct row counts M it has seen (the 18 layers of wb-target: +430 MB after
# M = 65..199). So rows are used as they come up to EXACT_M (decode batches, chain and N<=16
# tree verifies at bs=1, draft steps: padding those would cost ~0.7 ms per chain verify), then
# padded up to a power of two up to M_BUCKET, then to a multiple of M_BUCKET: at most
# EXACT_M + 2 + max_rows / 64 shapes, so a long-running engine stops growing once it has seen
# them. Padded rows are zeros and never change the real rows' results (oneDNN computes each row
# the same way at every M; the lossless and oracle tests run through these paths).
EXACT_M = 16
M_BUCKET = 64


def pack(w: torch.Tensor) -> torch.Tensor:
    """oneDNN-packed copy of a (out, in) float32 or bfloat16 weight (an opaque ``_mkldnn``
    tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(w.detach().contiguous(), PACK_HINT)


# A row floor F (measured per machine and model by the engine's autotune stage, 1 = none): a
# GEMM of m < F rows runs as F rows. On the 2-core EPYC oneDNN's one-row kernel (a GEMV)
# streams float32 weights more slowly than its few-row kernel: one pass over SmolLM2-135M's
# GEMMs took 23.4 ms at M=1 and 20.0 ms at M=6, and a bs=1 decode gained ~8 %.
FLOORS = (1, 2, 3, 4, 5, 6, 7, 8)


def row_bucket(m: int, floor: int = 1) -> int:
    """The padded row count for ``m`` rows (``floor`` if fewer, 1..16 as is, 32, 64, 128,
    192, ...)."""
    if m < floor:
        return floor
    if m <= EXACT_M:
        return m
    if m <= M_BUCKET:
        return 1 << (m - 1).bit_length()
    return -(-m // M_BUCKET) * M_BUCKET


def onednn_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
                  floor: int = 1) -> torch.Tensor:
    """x (M, in) · packed wᵀ (+ b), rows padded to :func:`row_bucket` (``floor``)."""
    m = x.shape[0]
    mb = row_bucket(m, floor)
    if mb == m:
        return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
    xp = F.pad(x, (0, 0, 0, mb - m))
    return torch.ops.mkldnn._linear_pointwise(xp, w, b, "none", [], "")[:m]


def onednn_linear_add(x: torch.Tensor, w: torch.Tensor, res: torch.Tensor,
                      floor: int = 1) -> torch.Tensor:
    """res + x·wᵀ in one oneDNN call (post-op add), rows padded as :func:`onednn_linear`."""
    m = x.shape[0]
    mb = row_bucket(m, floor)
    if mb == m:
        return torch.ops.mkldnn._linear_pointwise.binary(x, res, w, None, "add")
    xp, rp = F.pad(x, (0, 0, 0, mb - m)), F.pad(res, (0, 0, 0, mb - m))
    return torch.ops.mkldnn._linear_pointwise.binary(xp, rp, w, None, "add")[:m]


def dense_linear_add(x: torch.Tensor, w: torch.Tensor, res: torch.Tensor) -> torch.Tensor:
    return torch.addmm(res, x, w.t())


Linear = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]
LinearAdd = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def gemm_ops(gemm: str, floor: int = 1) -> tuple[Linear, LinearAdd]:
    """(linear(x, w, b), linear_add(x, w, residual)) for fused weights prepared for ``gemm``;
    ``floor``: the oneDNN row floor (:func:`row_bucket`; dense ignores it)."""
    if gemm == "packed":  # models/quant.py: int4-packed weights (dense ones as F.linear)
        return packed_linear, packed_linear_add
    if gemm == "onednn":
        if floor > 1:
            return (functools.partial(onednn_linear, floor=floor),
                    functools.partial(onednn_linear_add, floor=floor))
        return onednn_linear, onednn_linear_add
    return F.linear, dense_linear_add


def prepare_weight(w: torch.Tensor, gemm: str) -> torch.Tensor:
    """The weight as ``gemm_ops(gemm)`` reads it: a packed copy (onednn) or ``w`` itself."""
    return pack(w) if gemm == "onednn" else w


GemmList = list[tuple[str, Any, Any, tuple[int, int]]]  # (kind, weight as read, bias, (out, in))


def gemm_pass(gemms: GemmList, gemm: str, m: int, dtype: torch.dtype,
              gen: torch.Generator) -> Callable[[], None]:
    """One pass over ``gemms`` at ``m`` rows through path ``gemm``'s ops: random inputs per
    input width and residuals per output width (``dtype``), drawn once, reused by every call.
    The engine's autotune timings (GEMM path, row floor, draft dtype) all time this pass."""
    lin, lin_add = gemm_ops(gemm)
    xs: dict[int, torch.Tensor] = {}
    res: dict[int, torch.Tensor] = {}
    for _, _, _, (n_out, n_in) in gemms:
        xs.setdefault(n_in, torch.randn(m, n_in, generator=gen, device=gen.device).to(dtype))
        res.setdefault(n_out, torch.randn(m, n_out, generator=gen, device=gen.device).to(dtype))

    def one_pass() -> None:
        for kind, w, b, (n_out, n_in) in gemms:
            if kind == "add":
                lin_add(xs[n_in], w, res[n_out])
            else:
                lin(xs[n_in], w, b)

    return one_pass


def prepared_gemms(weights: list[tuple[str, torch.Tensor, torch.Tensor | None]],
                   gemm: str) -> GemmList:
    """``weights`` ((kind, dense weight, bias), as :func:`_gemm_weights`) prepared for path
    ``gemm``, each with its (out, in) shape."""
    return [(k, prepare_weight(w.detach(), gemm), b, (w.shape[0], w.shape[1]))
            for k, w, b in weights]
