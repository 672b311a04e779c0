"""compact_kv: gather-then-scatter semantics with overlapping source/destination slots."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import DEVICE

from workbench.kernels import reference


def _expected(pool: torch.Tensor, src: list[int], dst: list[int]) -> torch.Tensor:
    """Row-by-row oracle: snapshot every source first, then write."""
    out = pool.clone()
    rows = [pool[:, s].clone() for s in src]
    for d, row in zip(dst, rows, strict=True):
        out[:, d] = row
    return out


# (id, slots, src, dst): accepted-path packing shifts left over itself; a cycle; identity; ...
PATTERNS = [
    ("pack-accepted-path", 40, [13, 15, 19, 20], [11, 12, 13, 15]),
    ("cycle", 12, [1, 2, 3, 4], [2, 3, 4, 1]),
    ("identity", 8, [0, 3, 5], [0, 3, 5]),
    ("one", 5, [4], [0]),
    ("none", 5, [], []),
    ("many", 300, list(range(100, 233)), list(range(0, 133))),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("layers,kv_heads,head_dim", [(1, 1, 64), (3, 2, 128), (2, 8, 64)])
@pytest.mark.parametrize("pattern", PATTERNS, ids=[p[0] for p in PATTERNS])
def test_triton_and_reference_match_oracle(pattern: tuple, layers: int, kv_heads: int,
                                           head_dim: int, dtype: torch.dtype,
                                           triton_ready: None) -> None:
    from workbench.kernels.triton_compact_kv import compact_kv_triton

    _, slots, src, dst = pattern
    gen = torch.Generator().manual_seed(slots)
    k = torch.randn(layers, slots, kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    v = torch.randn(layers, slots, kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    want_k, want_v = _expected(k, src, dst), _expected(v, src, dst)
    src_t = torch.tensor(src, dtype=torch.int64, device=DEVICE)
    dst_t = torch.tensor(dst, dtype=torch.int64, device=DEVICE)
    for fn in (reference.compact_kv, compact_kv_triton):
        k2, v2 = k.clone(), v.clone()
        assert fn(k2, v2, src_t, dst_t) is None
        assert torch.equal(k2, want_k) and torch.equal(v2, want_v), fn.__name__


def test_triton_on_a_pool_view(triton_ready: None) -> None:
    """Pools cut from one (2, L, S, Hkv, hd) buffer: strided in L, contiguous per slot."""
    from workbench.kernels.triton_compact_kv import compact_kv_triton

    buf = torch.randn(2, 3, 20, 2, 64, device=DEVICE)
    k, v = buf[0], buf[1]
    want_k = _expected(k, [5, 6, 9], [2, 3, 5])
    compact_kv_triton(k, v, torch.tensor([5, 6, 9], device=DEVICE),
                      torch.tensor([2, 3, 5], device=DEVICE))
    assert torch.equal(buf[0], want_k)


@pytest.mark.parametrize("use_triton", [False, True], ids=["reference", "triton"])
def test_bad_arguments(use_triton: bool, request: pytest.FixtureRequest) -> None:
    if use_triton:
        request.getfixturevalue("triton_ready")
        from workbench.kernels.triton_compact_kv import compact_kv_triton as fn
    else:
        fn = reference.compact_kv
    k = torch.zeros(2, 10, 2, 64)
    idx = torch.tensor([1, 2])
    with pytest.raises(ValueError, match="k_pool must be 4-D"):
        fn(k[0], k[0], idx, idx)
    with pytest.raises(ValueError, match="v_pool must have shape"):
        fn(k, k[:1], idx, idx)
    with pytest.raises(ValueError, match="v_pool dtype"):
        fn(k, k.half(), idx, idx)
    with pytest.raises(ValueError, match="src_slots must have dtype"):
        fn(k, k.clone(), idx.int(), idx)
    with pytest.raises(ValueError, match="dst_slots must have shape"):
        fn(k, k.clone(), idx, idx[:1])
    if use_triton:
        with pytest.raises(ValueError, match="contiguous"):
            fn(k.transpose(2, 3), k.clone().transpose(2, 3), idx, idx)


def test_reference_checks_values() -> None:
    k = torch.zeros(1, 10, 1, 8)
    with pytest.raises(ValueError, match="src_slots must be slot ids"):
        reference.compact_kv(k, k.clone(), torch.tensor([10]), torch.tensor([0]))
    with pytest.raises(ValueError, match="dst_slots must be distinct"):
        reference.compact_kv(k, k.clone(), torch.tensor([1, 2]), torch.tensor([0, 0]))
