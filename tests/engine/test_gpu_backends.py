"""Attention backends behind PagedAttention's plan/run: Triton, FlashInfer, and their selection.

On CPU the Triton backend runs under the interpreter (TRITON_INTERPRET=1, set by
tests/conftest.py) and must give the torch backend's logits within 1e-4 for prefill, decode and a
tree verify; FlashInfer needs CUDA and is only selected/refused here. The ``gpu`` tests compare
FlashInfer (eager and graphed) with the fp32 torch reference on a CUDA device.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import workbench as wb
from workbench.engine.attention import PagedAttention
from workbench.engine.backends import backend_name, make_attention_backend, resolve_backend
from workbench.engine.kv_cache import KVPool
from workbench.engine.triton_backend import TritonTreeAttention, ragged_plan
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
        torch.testing.assert_close(b, a, atol=1e-4, rtol=0, msg=lambda s, p=phase: f"{p}: {s}")
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
    tri = make_attention_backend("triton", k, k.clone(), 4, 4)
    assert isinstance(tri, TritonTreeAttention) and backend_name(tri) == "triton"
    had_flashinfer = "flashinfer" in sys.modules
    with pytest.raises(RuntimeError, match="flashinfer attention backend needs a CUDA device"):
        make_attention_backend("flashinfer", k, k.clone(), 4, 4)
    assert ("flashinfer" in sys.modules) == had_flashinfer  # refused before importing it
    monkeypatch.delenv("TRITON_INTERPRET")
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
        assert isinstance(e.attn, TritonTreeAttention)
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
    from spec.conftest import write_random_head

    head = write_random_head(hd128_target, tmp_path_factory.mktemp("hd128_head"))
    cfg = wb.EngineConfig(device="cuda", dtype="bfloat16", attention_backend="flashinfer",
                          kv_budget_tokens=4096, max_model_len=256, self_check=False,
                          overlap_schedule=True)
    prompts = [[5, 17, 33, 2, 90, 41, 7], [250, 3, 11], list(range(40, 80))]
    sp = wb.SamplingParams(max_new_tokens=24, ignore_eos=True)
    with wb.Engine.from_pretrained(hd128_target, draft=head, config=cfg) as e:
        assert backend_name(e.attn) == "flashinfer" and e.graphs is not None
        plain = [o.token_ids for o in e.generate(prompts, sp)]
        spec = [o.token_ids for o in e.generate(
            prompts, sp, spec=wb.SpecConfig(num_steps=3, topk=2, num_draft_tokens=6))]
        assert sum(g.replays for g in e.graphs.graphs.values()) > 0
    for p, a, b in zip(prompts, plain, spec, strict=True):
        first_divergence_is_a_near_tie(hd128_target, p, a, b)
