"""Compile the Triton kernels ahead of time for sm_90 (H100/H200) on a machine without a GPU.

The interpreter accepts programs the GPU compiler rejects (loop-carried type changes, layouts,
shared-memory limits), so CPU CI also lowers each kernel to a cubin with the ptxas that ships in
the triton wheel. Run with TRITON_INTERPRET unset: ``python tests/kernels/aot_compile.py``.
Constexprs come from the wrappers' own launch helpers where they have one.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("aot_compile.py needs TRITON_INTERPRET unset (interpreted kernels do not compile)")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from workbench.kernels import triton_compact_kv as compact  # noqa: E402
from workbench.kernels import triton_greedy_accept as greedy  # noqa: E402
from workbench.kernels import triton_tree_attention as attention  # noqa: E402
from workbench.kernels import triton_tree_sample as sample  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)


def compile_kernel(fn: Any, types: dict[str, str], constexprs: dict[str, Any]) -> float:
    """Lower ``fn`` to a cubin; ``types`` maps every runtime argument to a Triton type string."""
    names = fn.arg_names
    signature = {n: "constexpr" if n in constexprs else types[n] for n in names}
    src = ASTSource(fn=fn, signature=signature,
                    constexprs={(names.index(k),): v for k, v in constexprs.items()})
    start = time.perf_counter()
    triton.compile(src, target=TARGET)
    return time.perf_counter() - start


def attention_variant(dtype: str, group: int, max_q: int, head_dim: int, has_mask: bool) -> float:
    group_pad, block_m, rows, head_dim_pad = attention._launch_config(group, max_q, head_dim)
    ptr = f"*{dtype}"
    types = dict(q_ptr=ptr, k_ptr=ptr, v_ptr=ptr, o_ptr=ptr, qo_indptr_ptr="*i64",
                 kv_indices_ptr="*i64", kv_lens_ptr="*i64",
                 mask_ptr="*u8" if has_mask else "*i64", qk_scale="fp32")
    for name in ("stride_qt", "stride_qh", "stride_ks", "stride_kh", "stride_vs", "stride_vh",
                 "stride_ot", "stride_oh", "stride_ib", "stride_mb", "stride_mq", "lk_max",
                 "head_dim"):
        types[name] = "i32"
    return compile_kernel(attention._tree_attention_kernel, types, dict(
        GROUP=group, GROUP_PAD=group_pad, BLOCK_M=block_m, ROWS=rows, BLOCK_N=64,
        HEAD_DIM=head_dim_pad, HAS_MASK=has_mask, IEEE=dtype == "fp32"))


def main() -> int:
    jobs: list[tuple[str, Any]] = [
        ("attention bf16 tree g4 hd128 N64", lambda: attention_variant("bf16", 4, 64, 128, True)),
        ("attention fp16 decode g1 hd64", lambda: attention_variant("fp16", 1, 1, 64, False)),
        ("attention fp32 tree g8 hd128 N16", lambda: attention_variant("fp32", 8, 16, 128, True)),
        ("attention bf16 prefill g3 hd80", lambda: attention_variant("bf16", 3, 40, 80, False)),
    ]
    i64 = "*i64"
    greedy_types = dict(cand_ptr=i64, parents_ptr=i64, predict_ptr=i64, accept_index_ptr=i64,
                        accept_len_ptr=i64, bonus_ptr=i64, n_nodes="i32", stride_cb="i32",
                        stride_pb="i32", stride_tb="i32", stride_ab="i32")
    jobs.append(("greedy_accept N64", lambda: compile_kernel(
        greedy._greedy_accept_kernel, greedy_types, dict(BLOCK_N=64))))
    sample_types = dict(cand_ptr=i64, parents_ptr=i64, probs_ptr="*fp32", coins_ptr="*fp32",
                        final_u_ptr="*fp32", accept_index_ptr=i64, accept_len_ptr=i64,
                        bonus_ptr=i64, n_nodes="i32", vocab="i32", stride_cb="i32",
                        stride_pb="i32", stride_sb="i32", stride_sn="i32", stride_sv="i32",
                        stride_kb="i32", stride_ab="i32")
    for block_n, block_v in ((16, 1024), (64, 256)):
        jobs.append((f"tree_sample N{block_n} V{block_v}", lambda n=block_n, v=block_v:
                     compile_kernel(sample._tree_sample_kernel, sample_types,
                                    dict(BLOCK_N=n, BLOCK_V=v))))
    for src_indexed in (True, False):
        compact_types = dict(src_k_ptr="*bf16", src_v_ptr="*bf16", dst_k_ptr="*bf16",
                             dst_v_ptr="*bf16", src_rows_ptr=i64, dst_rows_ptr=i64,
                             n_rows="i32", row_elems="i32", src_stride_l="i64",
                             src_stride_s="i32", dst_stride_l="i32", dst_stride_s="i32")
        jobs.append((f"compact_kv src_indexed={src_indexed}", lambda s=src_indexed, t=compact_types:
                     compile_kernel(compact._copy_rows_kernel, t, dict(
                         SRC_INDEXED=s, DST_INDEXED=not s, BLOCK_R=4, BLOCK_C=1024))))
    for name, job in jobs:
        print(f"{name}: compiled for sm_90 in {job():.1f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
