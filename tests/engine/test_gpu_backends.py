"""Attention backends behind PagedAttention's plan/run: Triton, FlashInfer, and their selection.

On CPU the Triton backend runs under the interpreter (TRITON_INTERPRET=1, set by
tests/conftest.py) and must give the torch backend's logits within 1e-4 for prefill, decode and a
tree verify; FlashInfer needs CUDA and is only selected/refused here. The ``gpu`` tests compare
FlashInfer (eager and graphed) with the fp32 torch reference on a CUDA device.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import workbench as wb
from workbench.attention import backend_name, make_attention_backend, resolve_backend
from workbench.attention.paged import PagedAttention
from workbench.attention.triton_backend import TritonTreeAttention, ragged_plan
from workbench.engine.kv_cache import KVPool
from workbench.models.llama import LlamaForCausalLM

CUDA = torch.cuda.is_available()
TREE = torch.tensor([[1, 0, 0, 0, 0],  # root, two children, a grandchild under each
                     [1, 1, 0, 0, 0],
                     [1, 0, 1, 0, 0],
                     [1, 1, 0, 1, 0],
                     [1, 0, 1, 0, 1]], dtype=torch.bool)


def load(path: Path, dtype: str = "float32", device: str = "cpu") -> LlamaForCausalLM:
    from workbench.models.loader import load_target

    model, _, _ = load_target(path, dtype, device)
    model.fuse()
    return model.eval()


def new_pool(m: LlamaForCausalLM, dtype: torch.dtype = torch.float32, device: str = "cpu",
             page_size: int = 4, blocks: int = 48) -> KVPool:
    c = m.config
    return KVPool(blocks, page_size, c.num_hidden_layers, c.num_key_value_heads, c.head_dim,
                  dtype, device)


class Driver:
    """One model over one pool and backend; requests own fixed, shuffled block lists."""

    def __init__(self, model: LlamaForCausalLM, pool: KVPool, attn: object,
                 blocks: list[list[int]]) -> None:
        self.m, self.pool, self.attn, self.blocks = model, pool, attn, blocks

    @torch.inference_mode()
    def forward(self, starts: list[int], ends: list[int], tokens: torch.Tensor,
                masks: list[torch.Tensor | None] | None = None) -> torch.Tensor:
        write, kv = [], []
        for blk, s, e in zip(self.blocks, starts, ends, strict=True):
            slots = self.pool.slots(blk, 0, e)
            write.append(slots[s:])
            kv.append(slots)
        self.attn.plan(torch.cat(write), [e - s for s, e in zip(starts, ends, strict=True)],  # type: ignore[attr-defined]
                       kv, masks)
        dev = self.pool.k.device
        pos = torch.cat([torch.arange(s, e) for s, e in zip(starts, ends, strict=True)])
        hidden, _ = self.m(tokens.to(dev), pos.to(dev), self.attn)
        return self.m.logits(hidden).float().cpu()


def steps(drive: Callable[..., torch.Tensor], lens: list[int], seed: int = 0
          ) -> list[torch.Tensor]:
    """Prefill in two chunks (the second over a prefix), one plain decode, one tree verify:
    the logits of each forward. Every length must be >= 2."""
    g = torch.Generator().manual_seed(seed)
    b = len(lens)
    toks = torch.randint(1, 299, (sum(lens) + b * (1 + len(TREE)),), generator=g)
    out, used = [], 0

    def take(n: int) -> torch.Tensor:
        nonlocal used
        used += n
        return toks[used - n : used]

    first = [min(3, n - 1) for n in lens]  # every request has tokens left for chunk 2
    out.append(drive([0] * b, first, take(sum(first))))  # prefill chunk 1
    out.append(drive(first, lens, take(sum(lens) - sum(first))))  # chunk 2: over a prefix
    out.append(drive(lens, [n + 1 for n in lens], take(b)))  # plain decode
    n = len(TREE)
    masks: list[torch.Tensor | None] = [TREE] * b
    out.append(drive([k + 1 for k in lens], [k + 1 + n for k in lens], take(b * n), masks))
    return out


BLOCKS = [[13, 2, 40, 7, 21, 5], [30, 1, 9, 44, 17, 3]]  # shuffled pages, page_size 4


def test_triton_backend_matches_torch_on_micro_target(micro_target: Path) -> None:
    m = load(micro_target)
    c = m.config
    ref_pool, tri_pool = new_pool(m), new_pool(m)
    ref = Driver(m, ref_pool, PagedAttention(ref_pool.k, ref_pool.v, c.num_attention_heads),
                 BLOCKS)
    tri = Driver(m, tri_pool, TritonTreeAttention(tri_pool.k, tri_pool.v,
                                                  c.num_attention_heads), BLOCKS)
    lens = [9, 6]
    for phase, a, b in zip(("prefill", "chunk", "decode", "verify"), steps(ref.forward, lens),
                           steps(tri.forward, lens), strict=True):
        torch.testing.assert_close(b, a, atol=1e-4, rtol=0, msg=f"{phase}: logits differ")
    # Both backends wrote the same K/V into the same slots.
    torch.testing.assert_close(tri_pool.k, ref_pool.k, atol=1e-5, rtol=0)
    torch.testing.assert_close(tri_pool.v, ref_pool.v, atol=1e-5, rtol=0)


def test_reference_kernel_backend_awkward_batch(micro_target: Path) -> None:
    """Same contract through the kernels' torch specification (fast): 5 requests, page 3,
    lengths 2..17, then a verify batch where two requests have no tree mask (causal block)."""
    m = load(micro_target)
    c = m.config
    gen = torch.Generator().manual_seed(1)
    blocks = torch.randperm(60, generator=gen)[:50].view(5, 10).tolist()
    ref_pool, alt_pool = new_pool(m, page_size=3, blocks=60), new_pool(m, page_size=3, blocks=60)
    ref = Driver(m, ref_pool, PagedAttention(ref_pool.k, ref_pool.v, c.num_attention_heads),
                 blocks)
    alt = Driver(m, alt_pool, TritonTreeAttention(alt_pool.k, alt_pool.v, c.num_attention_heads,
                                                  kernel="reference"), blocks)
    lens = [2, 17, 4, 9, 3]
    for a, b in zip(steps(ref.forward, lens, seed=2), steps(alt.forward, lens, seed=2),
                    strict=True):
        torch.testing.assert_close(b, a, atol=1e-4, rtol=0)
    n = len(TREE)
    start = [k + 1 + n for k in lens]
    masks: list[torch.Tensor | None] = [TREE, None, TREE, None, TREE]
    toks = torch.randint(1, 299, (5 * n,), generator=gen)
    torch.testing.assert_close(alt.forward(start, [s + n for s in start], toks, masks),
                               ref.forward(start, [s + n for s in start], toks, masks),
                               atol=1e-4, rtol=0)


def test_plan_contract_errors() -> None:
    with pytest.raises(ValueError, match="write_slots has 3 slots for 2 new tokens"):
        ragged_plan(torch.arange(3), [1, 1], [torch.arange(2), torch.arange(3)])
    with pytest.raises(ValueError, match="need 1 <= q_len <= kv_len"):
        ragged_plan(torch.arange(4), [4], [torch.arange(3)])
    with pytest.raises(ValueError, match="tree mask 0 has shape"):
        ragged_plan(torch.arange(2), [2], [torch.arange(5)], [torch.ones(3, 3, dtype=torch.bool)])


# -- FlashInfer glue on CPU, against a stub with FlashInfer's documented semantics ---------------


class _StubPaged:
    """What FlashInfer's paged wrappers compute, per their documentation: request b owns pages
    indices[indptr[b]:indptr[b+1]] (NHD), the last one holding last_page_len[b] entries; the
    prefill mask is custom (row-major (q_b, kv_b) blocks), causal (bottom-right) or none."""

    def __init__(self, workspace: torch.Tensor, layout: str = "NHD", *, decode: bool = False,
                 use_cuda_graph: bool = False, use_tensor_cores: bool = False,
                 paged_kv_indptr_buffer: torch.Tensor | None = None,
                 paged_kv_indices_buffer: torch.Tensor | None = None,
                 paged_kv_last_page_len_buffer: torch.Tensor | None = None) -> None:
        assert layout == "NHD" and workspace.dtype == torch.uint8
        self.decode, self.graph = decode, use_cuda_graph
        self.bufs = (paged_kv_indptr_buffer, paged_kv_indices_buffer,
                     paged_kv_last_page_len_buffer)
        self.plans = 0

    def plan(self, *args: object, **kw: object) -> None:
        if self.decode:
            indptr, indices, last, h, hkv, hd, ps = args
            qo = torch.arange(len(last) + 1)  # type: ignore[arg-type]
            mask, causal = None, False
        else:
            qo, indptr, indices, last, h, hkv, hd, ps = args
            mask, causal = kw.get("custom_mask"), bool(kw.get("causal", False))
        for name in ("q_data_type", "kv_data_type", "sm_scale"):
            assert name in kw, name
        if self.graph:  # cuda-graph mode: the plan rewrites the fixed buffers in place
            ib, xb, lb = self.bufs
            assert ib is not None and xb is not None and lb is not None
            assert len(last) == len(lb), "batch must equal the buffers' batch"  # type: ignore[arg-type]
            ib.copy_(indptr)  # type: ignore[arg-type]
            xb[: len(indices)].copy_(indices)  # type: ignore[arg-type]
            lb.copy_(last)  # type: ignore[arg-type]
            indptr, indices, last = ib, xb, lb
        self.state = (torch.as_tensor(qo).cpu().long(), indptr, indices, last, int(ps),  # type: ignore[call-overload]
                      None if mask is None else torch.as_tensor(mask).cpu(), causal,
                      float(kw["sm_scale"]))  # type: ignore[arg-type]
        self.plans += 1

    def run(self, q: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        from workbench.kernels.reference import tree_attention

        qo, indptr, indices, last, ps, flat, causal, scale = self.state
        indptr, indices, last = (t.cpu().long() for t in (indptr, indices, last))
        k_pages, v_pages = kv
        b = len(last)
        kv_lens = [int((indptr[i + 1] - indptr[i] - 1) * ps + last[i]) for i in range(b)]
        lk, q_lens = max(kv_lens), (qo[1:] - qo[:-1]).tolist()
        kv_idx = torch.zeros(b, lk, dtype=torch.int64)
        for i in range(b):
            pages = indices[indptr[i] : indptr[i + 1]]
            slots = (pages[:, None] * ps + torch.arange(ps)).flatten()
            kv_idx[i, : kv_lens[i]] = slots[: kv_lens[i]]
        mask = None
        if flat is not None or not causal:
            mask = torch.zeros(b, max(q_lens), lk, dtype=torch.bool)
            off = 0
            for i, (nq, nk) in enumerate(zip(q_lens, kv_lens, strict=True)):
                if flat is None:
                    mask[i, :nq, :nk] = True
                else:
                    mask[i, :nq, :nk] = flat[off : off + nq * nk].view(nq, nk)
                    off += nq * nk
            assert flat is None or off == flat.numel()
        flat_k = k_pages.reshape(-1, *k_pages.shape[2:])
        flat_v = v_pages.reshape(-1, *v_pages.shape[2:])
        return tree_attention(q, flat_k, flat_v, qo, kv_idx, torch.tensor(kv_lens), mask, scale)


@pytest.fixture
def stub_flashinfer(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU stand-in for ``flashinfer`` (its two paged wrappers), CUDA checks switched off."""
    import types

    from workbench.attention import flashinfer_backend

    mod = types.ModuleType("flashinfer")
    mod.BatchPrefillWithPagedKVCacheWrapper = _StubPaged  # type: ignore[attr-defined]
    mod.BatchDecodeWithPagedKVCacheWrapper = (  # type: ignore[attr-defined]
        lambda *a, **k: _StubPaged(*a, decode=True, **k))
    monkeypatch.setitem(sys.modules, "flashinfer", mod)
    monkeypatch.setattr(flashinfer_backend, "_require_cuda", lambda pool, what: None)


def test_flashinfer_glue_matches_torch_on_a_stub(micro_target: Path,
                                                 stub_flashinfer: None) -> None:
    """Page tables (shuffled pages, page 4), decode vs prefill choice, causal flag and the
    custom-mask layout, checked through a stub that computes what FlashInfer documents."""
    from workbench.attention.flashinfer_backend import FlashInferAttention

    m = load(micro_target)
    c = m.config
    ref_pool, fi_pool = new_pool(m), new_pool(m)
    ref = Driver(m, ref_pool, PagedAttention(ref_pool.k, ref_pool.v, c.num_attention_heads),
                 BLOCKS)
    attn = FlashInferAttention(fi_pool.k, fi_pool.v, c.num_attention_heads, 4)
    fi = Driver(m, fi_pool, attn, BLOCKS)
    modes = []

    def drive(*args: object) -> torch.Tensor:
        out = fi.forward(*args)  # type: ignore[arg-type]
        modes.append(attn.mode)
        return out

    for a, b in zip(steps(ref.forward, [9, 6]), steps(drive, [9, 6]), strict=True):
        torch.testing.assert_close(b, a, atol=1e-4, rtol=0)
    assert modes == ["causal", "causal", "decode", "tree"]
    with pytest.raises(ValueError, match="not page-aligned"):
        attn.plan(torch.tensor([5]), [1], [torch.tensor([1, 2, 3, 5])])


def test_flashinfer_decode_graph_buckets_on_a_stub(micro_target: Path,
                                                   stub_flashinfer: None) -> None:
    """GraphRunner(attention="flashinfer") decode buckets through FlashInferDecodeGraph's
    fixed buffers (eager replay): 3 requests padded to 4 equal the eager torch backend."""
    from workbench.attention.flashinfer_backend import FlashInferDecodeGraph
    from workbench.engine.cuda_graphs import GraphRunner

    m = load(micro_target)
    c = m.config
    ref_pool, fi_pool = new_pool(m), new_pool(m)
    blocks = BLOCKS + [[41, 42, 43, 44, 45, 46]]
    ref = Driver(m, ref_pool, PagedAttention(ref_pool.k, ref_pool.v, c.num_attention_heads),
                 blocks)
    r = GraphRunner(m, fi_pool.k, fi_pool.v, num_heads=c.num_attention_heads, page_size=4,
                    max_kv=24, buckets=(4,), attention="flashinfer", mode="eager",
                    kernel="reference")
    r.capture()
    assert isinstance(r.graphs[(4, 1)].attn, FlashInferDecodeGraph)
    lens = [9, 6, 13]
    gen = torch.Generator().manual_seed(3)
    toks = torch.randint(1, 299, (sum(lens),), generator=gen)
    ref.forward([0] * 3, lens, toks)
    fi_pool.k.copy_(ref_pool.k)
    fi_pool.v.copy_(ref_pool.v)
    for _ in range(2):
        step = torch.randint(1, 299, (3,), generator=gen)
        want = ref.forward(lens, [n + 1 for n in lens], step)
        kv = [fi_pool.slots(blk, 0, n + 1) for blk, n in zip(blocks, lens, strict=True)]
        out = r.run(step, torch.tensor(lens), torch.cat([s[-1:] for s in kv]), [1, 1, 1], kv)
        assert out is not None
        torch.testing.assert_close(m.logits(out[0]), want, atol=1e-4, rtol=0)
        lens = [n + 1 for n in lens]
    torch.testing.assert_close(fi_pool.k, ref_pool.k, atol=1e-5, rtol=0)


def test_engine_on_flashinfer_stub_spec_equals_plain(micro_target: Path,
                                                     stub_flashinfer: None,
                                                     tmp_path: Path) -> None:
    """The engine's target and draft backends on the FlashInfer glue (stubbed kernels):
    chunked prefill, decode, draft extend and tree verify give the torch engine's tokens."""
    from workbench.attention.flashinfer_backend import FlashInferAttention
    from workbench.models.synthetic import write_random_head

    head = write_random_head(micro_target, tmp_path / "head")
    base = wb.EngineConfig(kv_budget_tokens=1024, max_model_len=128, self_check=False,
                           max_prefill_tokens=8)
    prompts = [[5, 17, 33, 2, 90, 41, 7, 8, 9, 10, 11], [250, 3, 11]]
    sp = wb.SamplingParams(max_new_tokens=5, ignore_eos=True)
    spec = wb.SpecConfig(num_steps=3, topk=2, num_draft_tokens=6)
    with wb.Engine.from_pretrained(micro_target, draft=head, config=base) as e:
        want = [o.token_ids for o in e.generate(prompts, sp)]
    cfg = dataclasses.replace(base, attention_backend="flashinfer")
    with wb.Engine.from_pretrained(micro_target, draft=head, config=cfg) as e:
        assert isinstance(e.runner.attn, FlashInferAttention)
        assert isinstance(e.runner.draft_attn, FlashInferAttention)
        assert [o.token_ids for o in e.generate(prompts, sp)] == want
        assert [o.token_ids for o in e.generate(prompts, sp, spec=spec)] == want


# -- selection ---------------------------------------------------------------------------------


def test_resolve_backend_on_cpu() -> None:
    cpu = torch.device("cpu")
    assert resolve_backend("auto", cpu) == "torch"
    for name in ("torch", "triton", "flashinfer"):
        assert resolve_backend(name, cpu) == name
    with pytest.raises(ValueError, match="attention_backend"):
        resolve_backend("xformers", cpu)
    with pytest.raises(wb.ConfigError, match="EngineConfig.attention_backend"):
        wb.EngineConfig(attention_backend="xformers")  # type: ignore[arg-type]
    for field in ("cuda_graphs", "cuda_graphs_fallback", "overlap_schedule"):
        with pytest.raises(wb.ConfigError, match=f"EngineConfig.{field}: must be a bool"):
            wb.EngineConfig(**{field: 1})  # type: ignore[arg-type]


def test_make_backend_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    k = torch.zeros(2, 16, 2, 16)
    assert isinstance(make_attention_backend("auto", k, k.clone(), 4, 4), PagedAttention)
    if os.environ.get("TRITON_INTERPRET") == "1":  # tests/conftest.py sets it for CPU runs
        tri = make_attention_backend("triton", k, k.clone(), 4, 4)
        assert isinstance(tri, TritonTreeAttention) and backend_name(tri) == "triton"
    had_flashinfer = "flashinfer" in sys.modules
    with pytest.raises(RuntimeError, match="flashinfer attention backend needs a CUDA device"):
        make_attention_backend("flashinfer", k, k.clone(), 4, 4)
    assert ("flashinfer" in sys.modules) == had_flashinfer  # refused before importing it
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="needs TRITON_INTERPRET=1"):
        make_attention_backend("triton", k, k.clone(), 4, 4)


def test_engine_refuses_flashinfer_on_cpu_at_the_backend_stage(micro_target: Path) -> None:
    cfg = wb.EngineConfig(attention_backend="flashinfer", kv_budget_tokens=1024,
                          self_check=False)
    with pytest.raises(wb.EngineInitError) as ei:
        wb.Engine.from_pretrained(micro_target, config=cfg)
    assert ei.value.stage == "attention_backend"
    assert "needs a CUDA device" in str(ei.value)


def test_engine_with_triton_backend_equals_torch(micro_target: Path) -> None:
    base = wb.EngineConfig(kv_budget_tokens=1024, max_model_len=128, self_check=False)
    prompts = [[5, 17, 33, 2, 90, 41, 7], [250, 3, 11]]
    sp = wb.SamplingParams(max_new_tokens=3, ignore_eos=True)
    with wb.Engine.from_pretrained(micro_target, config=base) as e:
        want = [o.token_ids for o in e.generate(prompts, sp)]
    tri_cfg = wb.EngineConfig(kv_budget_tokens=1024, max_model_len=128, self_check=False,
                              attention_backend="triton")
    with wb.Engine.from_pretrained(micro_target, config=tri_cfg) as e:
        assert isinstance(e.runner.attn, TritonTreeAttention)
        assert [o.token_ids for o in e.generate(prompts, sp)] == want


# -- CUDA ------------------------------------------------------------------------------------------

gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
# tests/conftest.py sets TRITON_INTERPRET=1 unless the environment already has it: on a GPU box
# that would interpret the Triton kernels on CUDA tensors (slow, not capturable).
triton_compiled = pytest.mark.skipif(
    CUDA and os.environ.get("TRITON_INTERPRET") == "1",
    reason="TRITON_INTERPRET=1 in a CUDA run: Triton kernels would be interpreted")


@pytest.fixture(scope="module")
def hd128_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 4-layer Llama with FlashInfer's usual head dim (128), GQA group 2, vocab 300."""
    from helpers import write_random_llama

    return write_random_llama(tmp_path_factory.mktemp("hd128") / "model", hidden=256, layers=4,
                              heads=2, kv_heads=1, intermediate=512, initializer_range=0.05)


def close_to(ref: torch.Tensor, got: torch.Tensor, rel: float = 3e-2) -> None:
    """Reduced-precision logits vs the fp32 reference: max error within rel of their scale."""
    err = float((ref - got).abs().max())
    assert err <= rel * float(ref.abs().max()) + 1e-3, err


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("backend", ["flashinfer", pytest.param("triton", marks=triton_compiled)])
def test_gpu_backend_matches_fp32_torch(backend: str, dtype: str, hd128_target: Path) -> None:
    if backend == "flashinfer":
        pytest.importorskip("flashinfer")
    blocks = [[9, 2, 14], [4, 11, 0]]
    m = load(hd128_target)
    pool = new_pool(m, page_size=16, blocks=16)
    heads = m.config.num_attention_heads
    ref = steps(Driver(m, pool, PagedAttention(pool.k, pool.v, heads), blocks).forward, [20, 33])
    mg = load(hd128_target, dtype, "cuda")
    gpool = new_pool(mg, getattr(torch, dtype), "cuda", page_size=16, blocks=16)
    attn = make_attention_backend(backend, gpool.k, gpool.v, heads, gpool.page_size)
    assert backend_name(attn) == backend
    got = steps(Driver(mg, gpool, attn, blocks).forward, [20, 33])
    for a, b in zip(ref, got, strict=True):
        close_to(a, b)


def first_divergence_is_a_near_tie(path: Path, prompt: list[int], a: list[int], b: list[int],
                                   margin: float = 0.05) -> None:
    """Greedy outputs of two numerically different runs may part only where the fp32
    reference's top-2 logits are within ``margin`` (a tie at reduced precision)."""
    j = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
    if j is None:
        assert len(a) == len(b)
        return
    m = load(path)
    with torch.inference_mode():
        logits, _ = m.forward_dense(torch.tensor([prompt + a[:j]]))
    top = logits[0, -1].float().topk(2).values
    assert float(top[0] - top[1]) < margin, (j, a, b, top.tolist())


@pytest.mark.gpu
@gpu
def test_gpu_engine_flashinfer_greedy_spec_equals_plain(
        hd128_target: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """The engine on CUDA (FlashInfer backend, decode graphs): greedy speculative decoding
    reproduces plain decoding (up to reduced-precision ties)."""
    pytest.importorskip("flashinfer")
    from workbench.models.synthetic import write_random_head

    head = write_random_head(hd128_target, tmp_path_factory.mktemp("hd128_head"))
    cfg = wb.EngineConfig(device="cuda", dtype="bfloat16", attention_backend="flashinfer",
                          kv_budget_tokens=4096, max_model_len=256, self_check=False,
                          overlap_schedule=True)
    prompts = [[5, 17, 33, 2, 90, 41, 7], [250, 3, 11], list(range(40, 80))]
    sp = wb.SamplingParams(max_new_tokens=24, ignore_eos=True)
    with wb.Engine.from_pretrained(hd128_target, draft=head, config=cfg) as e:
        assert backend_name(e.runner.attn) == "flashinfer" and e.runner.graphs is not None
        plain = [o.token_ids for o in e.generate(prompts, sp)]
        spec = [o.token_ids for o in e.generate(
            prompts, sp, spec=wb.SpecConfig(num_steps=3, topk=2, num_draft_tokens=6))]
        assert sum(g.replays for g in e.runner.graphs.graphs.values()) > 0
    for p, a, b in zip(prompts, plain, spec, strict=True):
        first_divergence_is_a_near_tie(hd128_target, p, a, b)
