"""tree_attention against FlashInfer's paged prefill with a custom mask (CUDA only).

FlashInfer imports on CPU but every kernel needs an sm75+ GPU, so this file skips without one.
"""

from __future__ import annotations

import pytest
import torch

flashinfer = pytest.importorskip("flashinfer")

from kernel_cases import TOL, make_attention_case  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="flashinfer kernels need CUDA"),
]


def flashinfer_tree_attention(kw: dict, page_table: list[list[int]], page_size: int,
                              q_lens: list[int]) -> torch.Tensor:
    """Run the same problem through BatchPrefillWithPagedKVCacheWrapper (NHD, custom mask)."""
    q, k_cache, v_cache = kw["q"], kw["k_cache"], kw["v_cache"]
    heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = k_cache.shape[1]
    kv_lens = kw["kv_lens"].tolist()
    device = q.device
    # Our pool is (S, Hkv, hd) with slot = page * page_size + offset: a zero-copy NHD page view.
    k_pages = k_cache.view(-1, page_size, kv_heads, head_dim)
    v_pages = v_cache.view(-1, page_size, kv_heads, head_dim)
    indptr = [0]
    for pages in page_table:
        indptr.append(indptr[-1] + len(pages))
    last_page_len = [(n - 1) % page_size + 1 for n in kv_lens]
    # Custom mask: each request's (q_len, kv_len) block, flattened row-major and concatenated.
    blocks = [kw["mask"][b, :n_q, :kv_lens[b]].reshape(-1) for b, n_q in enumerate(q_lens)]
    workspace = torch.empty(128 * 1024 * 1024, dtype=torch.uint8, device=device)
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
    wrapper.plan(
        kw["qo_indptr"].to(torch.int32),
        torch.tensor(indptr, dtype=torch.int32, device=device),
        torch.tensor([p for pages in page_table for p in pages], dtype=torch.int32,
                     device=device),
        torch.tensor(last_page_len, dtype=torch.int32, device=device),
        heads, kv_heads, head_dim, page_size,
        custom_mask=torch.cat(blocks),
        sm_scale=kw["sm_scale"],
        q_data_type=q.dtype, kv_data_type=k_cache.dtype,
    )
    return wrapper.run(q, (k_pages, v_pages))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize(
    "q_lens,prefix,heads,kv_heads,head_dim,page_size",
    [
        ([16, 16, 16], [100, 7, 513], 32, 8, 128, 16),
        ([64], [2000], 32, 8, 128, 16),
        ([6] * 17, [(37 * i) % 300 for i in range(17)], 8, 1, 64, 1),
    ],
    ids=["b3-n16-llama8b", "b1-n64-long", "b17-n6-ps1"],
)
def test_tree_attention_matches_flashinfer(q_lens: list[int], prefix: list[int], heads: int,
                                           kv_heads: int, head_dim: int, page_size: int,
                                           dtype: torch.dtype) -> None:
    from workbench.kernels import tree_attention

    case = make_attention_case(q_lens, prefix, heads, kv_heads, head_dim, page_size, dtype,
                               tree=True, device=torch.device("cuda"))
    ours = tree_attention(**case.kwargs)
    theirs = flashinfer_tree_attention(case.kwargs, case.page_table, page_size, q_lens)
    tol = TOL[dtype]
    torch.testing.assert_close(ours, theirs, atol=2 * tol["atol"], rtol=2 * tol["rtol"])
