"""Row-invariant attention on the CPU: the host wrapper of ``csrc/row_attention.c`` and its
torch reference.

Each query row attends to an explicit list of KV slots in position order — its request's
prefix (shared by the request's rows), then its own slots (a tree node's ancestors and itself,
or nothing beyond the prefix for a causal row whose prefix already ends at itself) — and its
result depends on nothing else: not the number of rows in the call, not its place among them,
not the other rows' keys, not the thread count (the C source says how). That is what makes a
verify row bit-identical to the same token decoded alone (``EngineConfig.batch_invariant``).
"""

from __future__ import annotations

import ctypes
import math
from concurrent.futures import ThreadPoolExecutor

import torch

from workbench.kernels import cpu_build

_P = ctypes.c_void_p
_I = ctypes.c_int64
# A call of at least this many (row, head) × key dot products is split across torch's thread
# count (ctypes releases the GIL while C runs); smaller ones run on the calling thread, since
# handing work to another thread costs about what a decode row's attention does.
SPLIT_WORK = 200_000
MAX_HD, MAX_HEADS = 512, 64  # csrc/row_attention.c's buffers: head dim, (row, head) per block
_POOL: ThreadPoolExecutor | None = None  # one per process, made on the first split call


def _fn(dtype: torch.dtype) -> ctypes._CFuncPtr:  # type: ignore[name-defined]
    lib = cpu_build.load("row_attention")
    f = lib.row_attention_bf16 if dtype == torch.bfloat16 else lib.row_attention_f32
    if f.argtypes is None:
        f.argtypes = [_P, _P, _P, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, ctypes.c_float,
                      _P, _P, _I, _I, _I]
        f.restype = None
    return f


def _split_pool(workers: int) -> ThreadPoolExecutor:
    global _POOL
    if _POOL is None or _POOL._max_workers < workers:
        _POOL = ThreadPoolExecutor(workers, thread_name_prefix="row-attention")
    return _POOL


class RowPlan:
    """One forward's key lists. ``slots`` (P,): every request's prefix slots back to back;
    per row t: ``pre_off[t]``, ``pre_len[t]`` (its prefix), and ``ext[ext_off[t]:ext_off[t+1]]``
    (its own slots). All int64 on the host; ``max_keys``: the longest row's key count."""

    __slots__ = ("cache", "ext", "ext_off", "max_keys", "pre_len", "pre_off", "slots")

    def __init__(self, slots: torch.Tensor, pre_off: torch.Tensor, pre_len: torch.Tensor,
                 ext: torch.Tensor, ext_off: torch.Tensor) -> None:
        self.slots, self.pre_off, self.pre_len = slots, pre_off, pre_len
        self.ext, self.ext_off = ext, ext_off
        own = ext_off[1:] - ext_off[:-1]
        self.max_keys = int((pre_len + own).max()) if pre_len.numel() else 0
        # per (heads per KV head, KV heads, threads): the row blocks, the call's split and
        # its scratch — made by the first layer's call, reused by the others
        self.cache: dict[tuple[int, int, int], tuple[torch.Tensor, int, int, torch.Tensor]] = {}


def plan_rows(q_lens: list[int], kv_slots: list[torch.Tensor],
              tree_masks: list[torch.Tensor | None] | None) -> RowPlan:
    """Key lists for a ragged batch: request i's kv_slots are its prefix then its q_lens[i]
    new tokens. A causal row r's keys are the first (prefix + r + 1) of them; a tree row's are
    the prefix, then the new tokens its mask row marks (ancestors and itself, parents before
    children, so in position order)."""
    slots = [s.to("cpu", torch.int64) for s in kv_slots]
    flat = torch.cat(slots) if slots else torch.empty(0, dtype=torch.int64, device="cpu")
    pre_off: list[int] = []
    pre_len: list[int] = []
    ext_parts: list[torch.Tensor] = []
    ext_off = [0]
    start = 0
    for i, (q, s) in enumerate(zip(q_lens, slots, strict=True)):
        n = int(s.numel())
        pre = n - q
        tm = tree_masks[i] if tree_masks is not None else None
        if tm is None:
            pre_off.extend([start] * q)
            pre_len.extend(range(pre + 1, n + 1))
            ext_off.extend([ext_off[-1]] * q)
        else:
            tm = tm.to("cpu", torch.bool)
            new = s[pre:]
            pre_off.extend([start] * q)
            pre_len.extend([pre] * q)
            counts = tm.sum(1).tolist()
            ext_parts.append(new.expand(q, q)[tm])  # row-major: each row's marked nodes in order
            for c in counts:
                ext_off.append(ext_off[-1] + int(c))
        start += n
    ext = torch.cat(ext_parts) if ext_parts else torch.empty(0, dtype=torch.int64, device="cpu")
    return RowPlan(flat, torch.tensor(pre_off, dtype=torch.int64, device="cpu"),
                   torch.tensor(pre_len, dtype=torch.int64, device="cpu"), ext,
                   torch.tensor(ext_off, dtype=torch.int64, device="cpu"))


def row_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                  plan: RowPlan, scale: float | None = None) -> torch.Tensor:
    """q (T, H, hd) → (T, H, hdv) float32, attending each row to its planned slots of one
    layer's k_pool (S, Hkv, hd) and v_pool (S, Hkv, hdv) (float32 or bfloat16; v_pool may be
    the first hdv columns of k_pool)."""
    t, h, hd = q.shape
    _, hkv, hdv = v_pool.shape
    if k_pool.dtype not in (torch.float32, torch.bfloat16) or v_pool.dtype != k_pool.dtype:
        raise TypeError(f"row_attention: pools must be float32 or bfloat16 alike, got "
                        f"{k_pool.dtype} and {v_pool.dtype}")
    if k_pool.device.type != "cpu" or not k_pool.is_contiguous():
        raise ValueError("row_attention: k_pool must be a contiguous CPU tensor")
    if v_pool.stride(2) != 1 or v_pool.stride(1) * hkv != v_pool.stride(0) or \
            v_pool.data_ptr() < 0 or h % hkv or k_pool.shape[1] != hkv:
        raise ValueError(f"row_attention: v_pool layout {tuple(v_pool.stride())} or heads "
                         f"{h}/{hkv} not supported")
    group = h // hkv
    if hd > MAX_HD or hdv > MAX_HD or group > MAX_HEADS:
        raise ValueError(f"row_attention: head dim {hd}/{hdv} (at most {MAX_HD}) or "
                         f"{group} query heads per KV head (at most {MAX_HEADS})")
    if plan.pre_len.numel() != t:
        raise ValueError(f"row_attention: plan has {plan.pre_len.numel()} rows, q has {t}")
    qf = q.to(torch.float32).contiguous()
    out = torch.empty(t, h, hdv, dtype=torch.float32, device="cpu")
    keys = max(plan.max_keys, 1)
    key = (group, hkv, torch.get_num_threads())
    if key not in plan.cache:
        blocks = _blocks(plan.pre_off, MAX_HEADS // group)
        nb = blocks.numel() - 1
        items = nb * hkv  # (block of one request's rows, KV head)
        parts = max(1, min(key[2], items, (t * h * plan.max_keys) // SPLIT_WORK + 1))
        rows = int((blocks[1:] - blocks[:-1]).max()) if nb else 1
        pairs = -(-rows * group // 16) * 16  # (row, head) pairs of a block, padded to 16 lanes
        plan.cache[key] = (blocks, items, parts,
                           torch.empty(parts, pairs * keys, dtype=torch.float32, device="cpu"))
    blocks, items, parts, scratch = plan.cache[key]
    f = _fn(k_pool.dtype)
    args = (qf.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(), plan.slots.data_ptr(),
            plan.pre_off.data_ptr(), plan.pre_len.data_ptr(), plan.ext.data_ptr(),
            plan.ext_off.data_ptr(), blocks.data_ptr(), h, hkv, hd, hdv, v_pool.stride(1),
            scale if scale is not None else 1.0 / math.sqrt(hd), out.data_ptr())
    if parts == 1:
        f(*args, scratch.data_ptr(), keys, 0, items)
        return out
    cuts = [items * i // parts for i in range(parts + 1)]
    done = [_split_pool(parts).submit(f, *args, scratch[i].data_ptr(), keys, cuts[i],
                                      cuts[i + 1]) for i in range(parts)]
    for d in done:
        d.result()  # re-raises a worker's error here
    return out


def _blocks(pre_off: torch.Tensor, cap: int) -> torch.Tensor:
    """Row blocks (starts, then the end): runs of consecutive rows with the same prefix (one
    request's), at most ``cap`` rows each. The kernel loads a block's shared keys once."""
    starts: list[int] = []
    prev, run = None, 0
    for i, off in enumerate(pre_off.tolist()):
        if off != prev or run == cap:
            starts.append(i)
            prev, run = off, 0
        run += 1
    starts.append(int(pre_off.numel()))
    return torch.tensor(starts, dtype=torch.int64, device="cpu")


def row_attention_reference(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                            plan: RowPlan, scale: float | None = None) -> torch.Tensor:
    """The specification in torch, one row at a time (float64; equal to the kernel within
    float32 rounding, not bit for bit)."""
    t, h, hd = q.shape
    hkv = k_pool.shape[1]
    out = torch.empty(t, h, v_pool.shape[-1], dtype=torch.float64, device="cpu")
    sc = scale if scale is not None else 1.0 / math.sqrt(hd)
    for r in range(t):
        a, n = int(plan.pre_off[r]), int(plan.pre_len[r])
        keys = torch.cat([plan.slots[a : a + n], plan.ext[plan.ext_off[r] : plan.ext_off[r + 1]]])
        kk = k_pool[keys].double().repeat_interleave(h // hkv, 1)  # (n, H, hd)
        vv = v_pool[keys].double().repeat_interleave(h // hkv, 1)
        s = torch.einsum("hd,nhd->hn", q[r].double(), kk) * sc
        out[r] = torch.einsum("hn,nhd->hd", s.softmax(-1), vv)
    return out.float()
