"""The ``cuda_graphs`` init stage and the GraphRunner's static-buffer forward.

On CPU: the stage is skipped (status "ok", detail "skipped: ..."); an injected capture failure
refuses to start (EngineInitError stage "cuda_graphs") unless ``cuda_graphs_fallback=True``,
which starts an eager engine and says so in a "fallback" InitStage event. The GraphRunner's
buckets, padding and ``plan_static`` run on CPU in ``mode="eager"`` (the same static-buffer
forward, minus the CUDA graph) and must reproduce the eager backend exactly, also inside the
engine (plain and speculative greedy decoding). The ``gpu`` tests capture real graphs.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import pytest
import torch

import workbench as wb
from workbench.attention.paged import PagedAttention
from workbench.engine import cuda_graphs
from workbench.engine.cuda_graphs import GraphRunner
from workbench.engine.kv_cache import KVPool
from workbench.engine.overlap import Overlap, Pipeline, pack, run_pipelined
from workbench.trace.tracer import RecordingTracer

CUDA = torch.cuda.is_available()
CONFIG = wb.EngineConfig(kv_budget_tokens=2048, max_model_len=160, self_check=False)
SPEC = wb.SpecConfig(num_steps=3, topk=2, num_draft_tokens=6)
PROMPTS = [[5, 17, 33, 2, 90, 41, 7], [250, 3, 11], [8, 8, 9, 1, 2, 3, 4, 5, 6, 7, 60, 61]]


def greedy(n: int) -> wb.SamplingParams:
    return wb.SamplingParams(max_new_tokens=n, ignore_eos=True)


# -- the init stage ------------------------------------------------------------------------------


def test_cpu_engine_skips_the_stage(micro_target: Path) -> None:
    rec = RecordingTracer()
    with wb.Engine(micro_target, config=CONFIG, tracer=rec) as e:
        assert e.runner.graphs is None
        assert ("cuda_graphs", "ok") in [(s, st) for s, st, _ in e.init_log]
        stages: list[Any] = rec.of("InitStage")
        (ev,) = [x for x in stages if x.stage == "cuda_graphs"]
        assert ev.status == "ok" and ev.detail == "skipped: not a CUDA device"
        (ab,) = [x for x in stages if x.stage == "attention_backend"]
        assert ab.detail == "backend=torch"


def test_capture_failure_refuses_to_start_by_default(micro_target: Path) -> None:
    with wb.faults.inject("init:cuda_graphs"), pytest.raises(wb.EngineInitError) as ei:
        wb.Engine.from_pretrained(micro_target, config=CONFIG)
    assert ei.value.stage == "cuda_graphs"
    assert isinstance(ei.value.cause, wb.faults.InjectedFault)


def test_capture_failure_with_fallback_starts_eager(micro_target: Path, random_head: Path) -> None:
    rec = RecordingTracer()
    cfg = dataclasses.replace(CONFIG, cuda_graphs_fallback=True, self_check=True)
    with wb.faults.inject("init:cuda_graphs"):
        e = wb.Engine(micro_target, random_head, cfg, tracer=rec)
    with e:
        statuses = {s: st for s, st, _ in e.init_log}
        assert statuses == {s: ("fallback" if s == "cuda_graphs" else "ok")
                            for s in wb.faults.INIT_STAGES}
        events: list[Any] = rec.of("InitStage")
        (fb,) = [x for x in events if x.status == "fallback"]
        assert fb.stage == "cuda_graphs"
        assert "InjectedFault: injected fault at init:cuda_graphs" in fb.detail
        assert e.runner.graphs is None and e.runner.draft is not None and not e.baseline_only
        plain = e.generate(PROMPTS[:2], greedy(5))
        spec = e.generate(PROMPTS[:2], greedy(5), spec=SPEC)
        assert [o.token_ids for o in spec] == [o.token_ids for o in plain]


def test_fallback_does_not_cover_other_stages(micro_target: Path) -> None:
    cfg = dataclasses.replace(CONFIG, cuda_graphs_fallback=True)
    with wb.faults.inject("init:attention_backend"), pytest.raises(wb.EngineInitError) as ei:
        wb.Engine.from_pretrained(micro_target, config=cfg)
    assert ei.value.stage == "attention_backend"


def test_capture_refuses_while_requests_hold_kv(micro_target: Path) -> None:
    with wb.Engine(micro_target, config=CONFIG) as e:
        e.add_request([1, 2, 3], greedy(4))
        e.step()
        with pytest.raises(RuntimeError, match="would overwrite it"):
            cuda_graphs.capture(e.runner, e.max_model_len, mode="eager")


# -- GraphRunner on CPU (mode="eager"): buckets, padding, plan_static ------------------------------


def runner_for(e: wb.Engine, verify_nodes: tuple[int, ...] = (), overlap: bool = False
               ) -> GraphRunner:
    """The engine's runner, built on CPU: eager replay, the kernels' torch specification."""
    pool, target = e.runner.pool, e.runner.target
    assert pool is not None and e.model_config is not None and target is not None
    r = GraphRunner(target, pool.k, pool.v, num_heads=e.model_config.num_attention_heads,
                    page_size=pool.page_size, max_kv=e.max_model_len + 8,
                    aux_layers=e.runner.aux_layers, buckets=(1, 2, 4), verify_nodes=verify_nodes,
                    mode="eager", kernel="reference", overlap=overlap)
    r.capture()
    return r


def test_runner_keys_and_buckets(micro_target: Path) -> None:
    with wb.Engine(micro_target, config=CONFIG) as e:
        r = runner_for(e, verify_nodes=(6,))
        assert sorted(r.graphs) == [(1, 1), (1, 6), (2, 1), (2, 6), (4, 1), (4, 6)]
        tree: list[torch.Tensor | None] = [torch.ones(6, 6, dtype=torch.bool).tril()] * 3
        assert r.key_for([1, 1, 1], [10, 20, 30], None) == (4, 1)
        assert r.key_for([1], [10], None) == (1, 1)
        assert r.key_for([6, 6, 6], [10, 20, 30], tree) == (4, 6)
        assert r.key_for([1] * 5, [10] * 5, None) is None  # beyond the largest bucket
        assert r.key_for([3, 1], [10, 20], None) is None  # prefill chunk / mixed
        assert r.key_for([6, 6], [10, 20], None) is None  # multi-token without a tree
        assert r.key_for([5, 5], [10, 20], tree[:2]) is None  # no bucket for N=5
        assert r.key_for([1], [r.max_kv + 1], None) is None  # longer than the static buffers
        assert r.overlap.enabled is False  # CPU: the overlap stager is a no-op


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_engine_with_eager_graph_runner_equals_plain_engine(micro_target: Path, random_head: Path,
                                                            overlap: bool) -> None:
    """The static-buffer path inside the engine: padded decode buckets (3 requests → bucket 4)
    and verify buckets give the same greedy tokens as the eager engine, spec == plain."""
    with wb.Engine(micro_target, random_head, CONFIG) as e:
        want_plain = [o.token_ids for o in e.generate(PROMPTS, greedy(6))]
        want_spec = [o.token_ids for o in e.generate(PROMPTS, greedy(6), spec=SPEC)]
        assert want_spec == want_plain
        e.runner.graphs = runner_for(e, verify_nodes=(SPEC.num_draft_tokens,), overlap=overlap)
        got_plain = [o.token_ids for o in e.generate(PROMPTS, greedy(6))]
        got_spec = [o.token_ids for o in e.generate(PROMPTS, greedy(6), spec=SPEC)]
        replays = {k: g.replays for k, g in e.runner.graphs.graphs.items()}
    assert got_plain == want_plain and got_spec == want_plain
    assert replays[(4, 1)] > 0 and replays[(4, 6)] > 0, replays  # padded buckets were used


def ragged_batch(pool: KVPool, blocks: list[list[int]], starts: list[int], ends: list[int],
                 gen: torch.Generator) -> tuple[list[torch.Tensor], list[torch.Tensor], list[int],
                                                torch.Tensor, torch.Tensor]:
    """Request i's new tokens at positions [starts[i], ends[i]): write slots, kv slots, q_lens,
    random tokens and positions, as ``ModelRunner.forward`` lays them out."""
    write, kv = [], []
    for blk, s, e in zip(blocks, starts, ends, strict=True):
        sl = pool.slots(blk, 0, e)
        write.append(sl[s:])
        kv.append(sl)
    q_lens = [e - s for s, e in zip(starts, ends, strict=True)]
    toks = torch.randint(1, 299, (sum(q_lens),), generator=gen)
    pos = torch.cat([torch.arange(s, e) for s, e in zip(starts, ends, strict=True)])
    return write, kv, q_lens, toks, pos


def test_runner_forward_matches_eager_and_leaves_the_pool_identical(micro_target: Path) -> None:
    """Direct comparison: hidden states and aux taps equal the eager backend's, and padding
    rows (copies of request 0) leave the KV pool bit-identical to an eager run."""
    from workbench.models.loader import load_target

    m, c, _ = load_target(micro_target)
    m.fuse()
    pools = [KVPool(64, 4, c.num_hidden_layers, c.num_key_value_heads, c.head_dim,
                    torch.float32, "cpu") for _ in range(2)]
    eager = PagedAttention(pools[0].k, pools[0].v, c.num_attention_heads)
    r = GraphRunner(m, pools[1].k, pools[1].v, num_heads=c.num_attention_heads, page_size=4,
                    max_kv=64, aux_layers=(1, 3, 5), buckets=(4,), verify_nodes=(5,),
                    mode="eager", kernel="reference")
    r.capture()
    for p in pools:  # the warm-up scratch writes are not part of the comparison
        p.k.zero_()
        p.v.zero_()
    blocks = [[3, 9, 1, 30, 14], [12, 5, 40, 22, 15], [7, 50, 2, 11, 16]]
    lens = [6, 11, 3]
    gen = torch.Generator().manual_seed(0)
    tree = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0],
                         [1, 1, 0, 1, 1]], dtype=torch.bool)
    trees: list[torch.Tensor | None] = [tree] * 3
    with torch.inference_mode():
        for q, masks in ((None, None), (1, None), (5, trees)):
            if q is None:  # prefill both pools eagerly
                starts, ends = [0] * 3, lens
            else:
                starts, ends = lens, [n + q for n in lens]
            write, kv, q_lens, toks, pos = ragged_batch(pools[0], blocks, starts, ends, gen)
            eager.plan(torch.cat(write), q_lens, kv, masks)
            want_h, want_aux = m(toks, pos, eager, (1, 3, 5))
            if q is None:
                assert r.run(toks, pos, torch.cat(write), q_lens, kv, masks, True) is None
                pools[1].k.copy_(pools[0].k)
                pools[1].v.copy_(pools[0].v)
                continue
            out = r.run(toks, pos, torch.cat(write), q_lens, kv, masks, True)
            assert out is not None
            torch.testing.assert_close(out[0], want_h, atol=1e-5, rtol=0)
            torch.testing.assert_close(out[1], want_aux, atol=1e-5, rtol=0)
            # padded rows (copies of request 0) wrote request 0's values to its own slots
            torch.testing.assert_close(pools[1].k, pools[0].k, atol=1e-5, rtol=0)
            torch.testing.assert_close(pools[1].v, pools[0].v, atol=1e-5, rtol=0)
            lens = ends
    assert r.graphs[(4, 1)].replays == 1 and r.graphs[(4, 5)].replays == 1


# -- overlap helpers (CPU: no-op by construction) ------------------------------------------------


def test_overlap_is_a_noop_on_cpu() -> None:
    ov = Overlap("cpu", enabled=True)
    assert not ov.enabled
    dst = torch.zeros(4, dtype=torch.int64)
    ov.stage([(dst, torch.arange(4))])
    assert dst.tolist() == [0, 1, 2, 3] and ov.copies == 1


def test_pack_aligns_and_round_trips() -> None:
    slab = torch.zeros(1024, dtype=torch.uint8)
    srcs = [torch.arange(3), torch.tensor([True, False, True]), torch.randn(2, 5)]
    views = pack(srcs, slab)
    for s, v in zip(srcs, views, strict=True):
        assert torch.equal(s, v) and v.dtype == s.dtype
        assert (v.data_ptr() - slab.data_ptr()) % 64 == 0
    with pytest.raises(ValueError, match="too small"):
        pack([torch.zeros(300, dtype=torch.int64)], slab)


def test_run_pipelined_orders_prepare_before_finish_only_with_overlap() -> None:
    for overlap, want in ((False, ["p0", "l0", "f0", "p1", "l1", "f1", "p2", "l2", "f2"]),
                          (True, ["p0", "l0", "p1", "f0", "l1", "p2", "f1", "l2", "f2"])):
        log: list[str] = []

        def prepare(i: int, log: list[str] = log) -> int:
            log.append(f"p{i}")
            return i

        def launch(i: int, log: list[str] = log) -> int:
            log.append(f"l{i}")
            return i

        def finish(i: int, r: int, log: list[str] = log) -> None:
            assert i == r
            log.append(f"f{i}")

        run_pipelined(3, Pipeline(prepare, launch, finish), overlap)
        assert log == want


# -- CUDA --------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.skipif(CUDA and os.environ.get("TRITON_INTERPRET") == "1",
                    reason="TRITON_INTERPRET=1 in a CUDA run: Triton kernels would be interpreted")
@pytest.mark.parametrize("attention", ["triton", "flashinfer"])
def test_gpu_captured_graphs_match_eager(attention: str,
                                         tmp_path_factory: pytest.TempPathFactory) -> None:
    """Real CUDA graphs (decode buckets with padding, verify buckets) against the eager
    backend of the same kind on a copy of the pool, bf16, head dim 128."""
    if attention == "flashinfer":
        pytest.importorskip("flashinfer")
    from helpers import write_random_llama

    from workbench.attention import make_attention_backend
    from workbench.models.loader import load_target

    path = write_random_llama(tmp_path_factory.mktemp("graphs") / "m", hidden=256, layers=3,
                              heads=2, kv_heads=1, intermediate=512, initializer_range=0.05)
    m, c, _ = load_target(path, "bfloat16", "cuda")
    m.fuse()
    pools = [KVPool(32, 16, c.num_hidden_layers, c.num_key_value_heads, c.head_dim,
                    torch.bfloat16, "cuda") for _ in range(2)]
    eager = make_attention_backend(attention, pools[0].k, pools[0].v, c.num_attention_heads, 16)
    r = GraphRunner(m, pools[1].k, pools[1].v, num_heads=c.num_attention_heads, page_size=16,
                    max_kv=160, aux_layers=(0, 2), buckets=(1, 4), verify_nodes=(5,),
                    attention=attention, mode="cuda", overlap=True)
    r.capture()
    assert all(g.graph is not None for g in r.graphs.values())
    blocks = [[3, 9, 1, 30, 4], [12, 5, 20, 22, 6], [7, 25, 2, 11, 8]]
    lens = [40, 70, 17]
    tree = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0],
                         [1, 1, 0, 1, 1]], dtype=torch.bool)
    trees: list[torch.Tensor | None] = [tree] * 3
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for q, masks in ((None, None), (1, None), (1, None), (5, trees)):
            starts, ends = ([0] * 3, lens) if q is None else (lens, [n + q for n in lens])
            write, kv, q_lens, toks, pos = ragged_batch(pools[0], blocks, starts, ends, gen)
            eager.plan(torch.cat(write), q_lens, kv, masks)
            want_h, want_aux = m(toks.cuda(), pos.cuda(), eager, (0, 2))
            if q is None:
                pools[1].k.copy_(pools[0].k)
                pools[1].v.copy_(pools[0].v)
            else:
                out = r.run(toks, pos, torch.cat(write), q_lens, kv, masks, True)
                assert out is not None and out[1] is not None and want_aux is not None
                for a, b in ((want_h, out[0]), (want_aux, out[1])):
                    err = float((a.float() - b.float()).abs().max())
                    assert err <= 2e-2 * float(a.float().abs().max()) + 1e-3, (q, err)
                lens = ends
    assert r.graphs[(4, 1)].replays == 2 and r.graphs[(4, 5)].replays == 1
