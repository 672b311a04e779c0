"""Packed 4- and 8-bit weights (``workbench/models/quant.py``) against the file's own values:
blocks written by the real ``gguf`` package (``gguf.quants.quantize``), decoded bit-equal to
``gguf.quants.dequantize``; the kernel's weights within the stated bf16 rounding of the scales;
packed GEMMs against dequantise-then-matmul; and every row bit-identical at any row count and
position (what keeps speculative decoding lossless on packed weights)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from workbench.models.quant import (
    GROUP,
    QuantTensor,
    cat_rows,
    from_gguf_blocks,
    pack,
    packed_linear,
    packed_linear_add,
    packed_mm,
    packed_or,
)

gguf = pytest.importorskip("gguf")
KINDS = ("Q4_0", "Q4_1", "Q8_0")


def quantised(kind: str, n: int, k: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(raw GGUF blocks, their dequantised float32 values) of a random (n, k) weight."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
    w[0, :GROUP] += 0.3  # a block with a large offset (Q4_1's min far from zero)
    raw = quantize(w, GGMLQuantizationType[kind])
    return raw, dequantize(raw, GGMLQuantizationType[kind]).reshape(n, k)


@pytest.mark.parametrize("kind", KINDS)
def test_codes_and_scales_are_the_files(kind: str) -> None:
    raw, ref = quantised(kind, 64, 4 * GROUP)
    qt = from_gguf_blocks(raw, kind, (64, 4 * GROUP))
    assert np.array_equal(qt.dequantize().numpy().view(np.uint32), ref.view(np.uint32))
    lo, hi = {"Q4_0": (-8, 7), "Q4_1": (0, 15), "Q8_0": (-128, 127)}[kind]
    assert lo <= int(qt.codes.min()) and int(qt.codes.max()) <= hi


@pytest.mark.parametrize("kind", KINDS)
def test_packed_weights_change_only_by_bf16_scales(kind: str) -> None:
    """The kernel's weights: the codes exactly, each scale rounded to bf16 (relative 2^-8,
    bf16's unit roundoff), Q4_1's zero m + 8d rounded to bf16 as well."""
    raw, ref = quantised(kind, 64, 4 * GROUP)
    qt = from_gguf_blocks(raw, kind, (64, 4 * GROUP))
    eff = pack(qt).effective()
    d = qt.scale.repeat_interleave(GROUP, 1).abs()
    if kind == "Q4_1":
        m = qt.offset.repeat_interleave(GROUP, 1).abs()  # type: ignore[union-attr]
        bound = 2.0**-8 * (8 * d + (m + 8 * d)) + 1e-7 * (m + 16 * d)
    else:
        bound = 2.0**-8 * d * qt.codes.abs().float()
    change = (eff - torch.from_numpy(ref)).abs()
    assert bool((change <= bound).all()), float((change - bound).max())
    if kind != "Q4_1":  # bf16(d)·c exactly
        bf = qt.scale.to(torch.bfloat16).float().repeat_interleave(GROUP, 1)
        assert torch.equal(eff, bf * qt.codes.float())


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", [(96, 576), (576, 1536), (49, 96)])
def test_packed_matmul_matches_dequantised(kind: str, shape: tuple[int, int]) -> None:
    """Packed GEMM vs the file's float32 weights: within bf16 rounding (x and the output are
    bfloat16 in the kernel, the scales bf16): |err| <= 2^-7·(|x|·|w|) row-wise bound; against
    its own effective weights with bf16 x: within one bf16 rounding of the output."""
    n, k = shape
    raw, ref = quantised(kind, n, k, seed=n + k)
    qt = from_gguf_blocks(raw, kind, shape)
    pw = pack(qt)
    x = torch.randn(7, k, generator=torch.Generator().manual_seed(1))
    y = packed_mm(x, pw)
    assert y.dtype == torch.float32 and y.shape == (7, n)
    w = torch.from_numpy(ref)
    scale = x.abs() @ w.abs().t()  # sum |x||w|: the size rounding errors scale with
    assert bool(((y - x @ w.t()).abs() <= 2.0**-7 * scale + 1e-6).all())
    own = x.to(torch.bfloat16).float() @ pw.effective().t()
    assert bool(((y - own).abs() <= 2.0**-8 * own.abs() + 2.0**-12 * scale + 1e-6).all())
    b = torch.randn(n)
    assert torch.equal(packed_linear(x, pw, b), y + b)
    r = torch.randn(7, n)
    assert torch.equal(packed_linear_add(x, pw, r), r + y)
    assert torch.equal(packed_linear(x, w, None), torch.nn.functional.linear(x, w))


# SmolLM2-135M's GEMM shapes (qkv, o, gate/up, down) and a head-sized one (Q8_0 runs K doubled)
ROW_SHAPES = [("Q4_1", 960, 576), ("Q4_1", 576, 576), ("Q4_1", 3072, 576), ("Q4_0", 576, 1536),
              ("Q8_0", 4096, 576)]
ROWS = (*range(1, 65), 65, 100, 128, 130, 200, 300)


@pytest.mark.parametrize(("kind", "n", "k"), ROW_SHAPES)
def test_rows_are_invariant_to_row_count_and_place(kind: str, n: int, k: int) -> None:
    raw, _ = quantised(kind, n, k)
    pw = pack(from_gguf_blocks(raw, kind, (n, k)))
    g = torch.Generator().manual_seed(2)
    xs = torch.randn(max(ROWS), k, generator=g)
    full = packed_mm(xs, pw)
    for m in ROWS:
        for lo in {0, max(ROWS) - m, (max(ROWS) - m) // 2}:
            got = packed_mm(xs[lo : lo + m], pw)
            assert torch.equal(got, full[lo : lo + m]), f"{kind} ({n}x{k}): M={m} at row {lo}"


def test_stacking_and_fallback() -> None:
    raw, _ = quantised("Q4_1", 64, 64)
    a = from_gguf_blocks(raw, "Q4_1", (64, 64))
    raw8, _ = quantised("Q8_0", 32, 64)
    b = from_gguf_blocks(raw8, "Q8_0", (32, 64))
    both = cat_rows([a, a])
    assert both is not None and torch.equal(both.dequantize(), torch.cat([a.dequantize()] * 2))
    assert cat_rows([a, b]) is None  # kinds differ: the GEMM stays dense
    dense = torch.zeros(96, 64)
    assert packed_or({"a": a, "b": b}, ["a", "b"], dense) is dense
    assert packed_or({"a": a}, ["a", "missing"], dense) is dense
    assert not isinstance(packed_or({"a": a}, ["a"], dense), torch.Tensor)
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(0))
    assert torch.equal(a.rows(perm).dequantize(), a.dequantize()[perm])


def test_bad_input_is_refused_naming_the_field() -> None:
    with pytest.raises(ValueError, match="QuantTensor.kind"):
        QuantTensor("Q5_0", torch.zeros(2, 32, dtype=torch.int8), torch.zeros(2, 1))
    with pytest.raises(ValueError, match="do not match group"):
        QuantTensor("Q4_0", torch.zeros(2, 32, dtype=torch.int8), torch.zeros(2, 2))
    with pytest.raises(ValueError, match="Q4_0, Q4_1 or Q8_0"):
        from_gguf_blocks(np.zeros((1, 18), np.uint8), "Q5_0", (1, 32))
