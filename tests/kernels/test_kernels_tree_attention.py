"""tree_attention: the reference against dense SDPA, the Triton kernel against the reference."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from kernel_cases import DEVICE, TOL, ancestor_closure, make_attention_case

from workbench.kernels import reference

fp32, fp16 = torch.float32, torch.float16

# (id, q_lens, prefix_lens, H, Hkv, hd, page_size, dtype, tree mask?)
CASES = [
    ("b1-n1-g1-hd64-ps1", [1], [5], 2, 2, 64, 1, fp32, True),
    ("b3-n6-g4-hd128-ps16-fp16", [6] * 3, [20, 0, 37], 8, 2, 128, 16, fp16, True),
    ("b17-n6-g8-hd64-ps4", [6] * 17, [(7 * i) % 41 for i in range(17)], 8, 1, 64, 4, fp32, True),
    ("b3-n16-g1-hd64-ps7-fp16", [16] * 3, [33, 1, 8], 4, 4, 64, 7, fp16, True),
    ("b1-n64-g8-hd128-ps16", [64], [70], 8, 1, 128, 16, fp32, True),
    ("b3-n64-g4-hd64-ps3-fp16", [64] * 3, [10, 0, 100], 8, 2, 64, 3, fp16, True),
    ("b17-n16-g1-hd128-ps2", [16] * 17, [(5 * i) % 23 for i in range(17)], 2, 2, 128, 2, fp32,
     True),
    ("b3-ragged-tree-g4-hd128-ps5", [0, 5, 12], [4, 9, 0], 4, 1, 128, 5, fp32, True),
    ("causal-b3-ragged-g4-hd64-ps5", [0, 5, 12], [7, 0, 30], 4, 1, 64, 5, fp32, False),
    ("causal-b17-decode-g8-hd128-ps16-fp16", [1] * 17, [(11 * i) % 80 for i in range(17)], 8, 1,
     128, 16, fp16, False),
    ("causal-b1-prefill-g3-hd80-ps8", [40], [0], 6, 2, 80, 8, fp32, False),
    ("causal-b3-n16-g8-hd64-ps1-fp16", [16, 3, 16], [2, 50, 0], 16, 2, 64, 1, fp16, False),
]

# Sweep: every (B, N) pair; head dim, GQA ratio, page size and dtype cycle through their values.
_HD, _GQA, _PS, _DT = (64, 128), ((2, 2), (8, 2), (8, 1)), (1, 16, 5, 3), (fp32, fp16)
SWEEP = [
    (f"sweep-b{b}-n{n}", [n] * b, [(13 * i + n) % 37 for i in range(b)], *_GQA[j % 3],
     _HD[j % 2], _PS[j % 4], _DT[(j // 2) % 2], True)
    for j, (b, n) in enumerate((b, n) for b in (1, 3, 17) for n in (1, 6, 16, 64))
] + [
    (f"grid-hd{hd}-g{h // hkv}-{str(dt)[6:]}", [6, 2, 6], [9, 30, 0], h, hkv, hd, 4, dt, True)
    for hd in _HD for (h, hkv) in _GQA for dt in _DT
]


def _case(params: tuple[Any, ...], seed: int = 0) -> dict[str, Any]:
    _, q_lens, prefix, heads, kv_heads, hd, page_size, dtype, tree = params
    return make_attention_case(q_lens, prefix, heads, kv_heads, hd, page_size, dtype, tree,
                               seed=seed).kwargs


@pytest.mark.parametrize("params", CASES + SWEEP, ids=[c[0] for c in CASES + SWEEP])
def test_triton_matches_reference(params: tuple[Any, ...], triton_ready: None) -> None:
    from workbench.kernels.triton_tree_attention import tree_attention_triton

    kw = _case(params)
    expected = reference.tree_attention(**kw)
    got = tree_attention_triton(**kw)
    assert got.dtype == kw["q"].dtype and got.shape == kw["q"].shape
    torch.testing.assert_close(got, expected, **TOL[kw["q"].dtype])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 is wrong under the interpreter")
def test_triton_matches_reference_bf16(triton_ready: None) -> None:
    from workbench.kernels.triton_tree_attention import tree_attention_triton

    kw = make_attention_case([16, 5, 64], [100, 7, 1000], 32, 8, 128, 16, torch.bfloat16,
                             tree=True).kwargs
    torch.testing.assert_close(tree_attention_triton(**kw), reference.tree_attention(**kw),
                               **TOL[torch.bfloat16])


def test_triton_max_q_len_hint_and_strided_q(triton_ready: None) -> None:
    """q as a slice of a fused qkv tensor (row stride > H*hd), grid sized by the hint."""
    from workbench.kernels.triton_tree_attention import tree_attention_triton

    kw = _case(CASES[8])
    t, h, hd = kw["q"].shape
    qkv = torch.randn(t, h + 2, hd, device=DEVICE)
    qkv[:, :h] = kw["q"]
    kw_strided = dict(kw, q=qkv[:, :h])
    expected = reference.tree_attention(**kw)
    torch.testing.assert_close(tree_attention_triton(**kw_strided, max_q_len=12), expected,
                               **TOL[fp32])


def _dense_sdpa(kw: dict[str, Any]) -> torch.Tensor:
    """Independent oracle: per request, torch SDPA with an explicit bool mask and GQA repeat."""
    q, k_cache, v_cache = kw["q"].float(), kw["k_cache"].float(), kw["v_cache"].float()
    heads, kv_heads = q.shape[1], k_cache.shape[1]
    out = torch.zeros_like(q)
    indptr, lens = kw["qo_indptr"].tolist(), kw["kv_lens"].tolist()
    for b in range(len(lens)):
        q0, q1 = indptr[b], indptr[b + 1]
        if q1 == q0:
            continue
        slots = kw["kv_indices"][b, : lens[b]]
        k = k_cache[slots].repeat_interleave(heads // kv_heads, 1).transpose(0, 1)
        v = v_cache[slots].repeat_interleave(heads // kv_heads, 1).transpose(0, 1)
        if kw["mask"] is None:
            n_q, n_kv = q1 - q0, lens[b]
            m = torch.ones(n_q, n_kv, dtype=torch.bool, device=q.device).tril(n_kv - n_q)
        else:
            m = kw["mask"][b, : q1 - q0, : lens[b]]
        o = F.scaled_dot_product_attention(q[q0:q1].transpose(0, 1), k, v, attn_mask=m,
                                           scale=kw["sm_scale"])
        out[q0:q1] = o.transpose(0, 1).nan_to_num(0.0)
    return out.to(kw["q"].dtype)


@pytest.mark.parametrize("params", [CASES[1], CASES[2], CASES[8], CASES[10]],
                         ids=[CASES[i][0] for i in (1, 2, 8, 10)])
def test_reference_matches_dense_sdpa(params: tuple[Any, ...]) -> None:
    kw = _case(params, seed=1)
    if kw["mask"] is not None:  # SDPA returns NaN for all-masked rows only; tree rows see self
        assert all(bool(kw["mask"][b, i, :].any()) for b in range(kw["mask"].shape[0])
                   for i in range(int(kw["qo_indptr"][b + 1] - kw["qo_indptr"][b])))
    torch.testing.assert_close(reference.tree_attention(**kw), _dense_sdpa(kw),
                               **TOL[kw["q"].dtype])


def _chain_mask(kw: dict[str, Any]) -> torch.Tensor:
    """Tree mask of a chain tree (every node the child of the previous) = causal."""
    lens, indptr = kw["kv_lens"].tolist(), kw["qo_indptr"].tolist()
    lq = max(indptr[b + 1] - indptr[b] for b in range(len(lens)))
    mask = torch.zeros(len(lens), lq, kw["kv_indices"].shape[1], dtype=torch.bool)
    for b, n_kv in enumerate(lens):
        n_q = indptr[b + 1] - indptr[b]
        mask[b, :n_q, : n_kv - n_q] = True
        mask[b, :n_q, n_kv - n_q : n_kv] = ancestor_closure([-1] + list(range(n_q - 1)))
    return mask.to(kw["q"].device)


@pytest.mark.parametrize("use_triton", [False, True], ids=["reference", "triton"])
def test_chain_tree_mask_equals_causal(use_triton: bool, request: pytest.FixtureRequest) -> None:
    kw = _case(CASES[8])
    if use_triton:
        request.getfixturevalue("triton_ready")
        from workbench.kernels.triton_tree_attention import tree_attention_triton as fn
    else:
        fn = reference.tree_attention
    torch.testing.assert_close(fn(**dict(kw, mask=_chain_mask(kw))), fn(**kw), **TOL[fp32])


def test_empty_batch_of_queries(triton_ready: None) -> None:
    from workbench.kernels.triton_tree_attention import tree_attention_triton

    kw = make_attention_case([0, 0], [3, 4], 2, 1, 64, 4, fp32, tree=True).kwargs
    assert tree_attention_triton(**kw).shape == (0, 2, 64)
    assert reference.tree_attention(**kw).shape == (0, 2, 64)


Mutation = Callable[[dict[str, Any]], dict[str, Any]]
BAD_ARGS: list[tuple[str, Mutation, str]] = [
    ("q-2d", lambda kw: dict(kw, q=kw["q"][:, 0]), "q must be 3-D"),
    ("q-int", lambda kw: dict(kw, q=kw["q"].long()), "q must have dtype"),
    ("k-dtype", lambda kw: dict(kw, k_cache=kw["k_cache"].half()), "k_cache dtype"),
    ("k-head-dim", lambda kw: dict(kw, k_cache=kw["k_cache"][..., :32]), "k_cache head dim"),
    ("gqa", lambda kw: dict(kw, k_cache=kw["k_cache"][:, :1].expand(-1, 3, -1)), "kv heads"),
    ("v-shape", lambda kw: dict(kw, v_cache=kw["v_cache"][:-1]), "v_cache must have shape"),
    ("indptr-int32", lambda kw: dict(kw, qo_indptr=kw["qo_indptr"].int()), "qo_indptr"),
    ("indices-batch", lambda kw: dict(kw, kv_indices=kw["kv_indices"][:-1]), "kv_indices"),
    ("lens-shape", lambda kw: dict(kw, kv_lens=kw["kv_lens"][:-1]), "kv_lens"),
    ("mask-dtype", lambda kw: dict(kw, mask=kw["mask"].int()), "mask must have dtype"),
    ("mask-shape", lambda kw: dict(kw, mask=kw["mask"][:, :, :-1]), "mask must have shape"),
    ("scale", lambda kw: dict(kw, sm_scale=float("nan")), "sm_scale"),
]


@pytest.mark.parametrize("use_triton", [False, True], ids=["reference", "triton"])
@pytest.mark.parametrize("mutate,message", [b[1:] for b in BAD_ARGS], ids=[b[0] for b in BAD_ARGS])
def test_bad_arguments_name_the_argument(mutate: Mutation, message: str, use_triton: bool,
                                         request: pytest.FixtureRequest) -> None:
    if use_triton:
        request.getfixturevalue("triton_ready")
        from workbench.kernels.triton_tree_attention import tree_attention_triton as fn
    else:
        fn = reference.tree_attention
    kw = make_attention_case([3, 2], [4, 1], 4, 2, 64, 4, fp32, tree=True).kwargs
    with pytest.raises(ValueError, match=message):
        fn(**mutate(kw))


@pytest.mark.parametrize(
    "mutate,message",
    [
        (lambda kw: dict(kw, kv_lens=kw["kv_lens"] + 100), r"kv_lens\[0\]"),
        (lambda kw: dict(kw, kv_lens=kw["kv_lens"] * 0), r"kv_lens\[0\]"),
        (lambda kw: dict(kw, qo_indptr=kw["qo_indptr"] - 1), r"qo_indptr\[0\]"),
        (lambda kw: dict(kw, kv_indices=kw["kv_indices"] + 10_000), r"kv_indices\[0"),
    ],
    ids=["kv-too-long", "kv-shorter-than-q", "indptr-start", "slot-out-of-pool"],
)
def test_reference_checks_values(mutate: Mutation, message: str) -> None:
    kw = make_attention_case([3, 2], [4, 1], 4, 2, 64, 4, fp32, tree=False).kwargs
    with pytest.raises(ValueError, match=message):
        reference.tree_attention(**mutate(kw))
