"""MoE targets agree with transformers on random checkpoints it wrote itself: Mixtral,
Qwen3-MoE, DeepSeek-V3 (MLA over the latent cache) and Kimi-K2.5 — prefill, every decode step,
chunked prefill, a tree verify, and greedy generate; unsupported options refused at load."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import workbench as wb
from workbench.attention.paged import PagedAttention
from workbench.engine.kv_cache import KVPool
from workbench.models.loader import load_target
from workbench.models.moe import SparseMoe
from workbench.models.moe_model import MoeForCausalLM
from workbench.models.synthetic_moe import write_random_moe

transformers = pytest.importorskip("transformers")

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 128, "mscale": 1.0, "mscale_all_dim": 1.0,
        "beta_fast": 32, "beta_slow": 1}
GEOMETRIES: dict[str, dict[str, Any]] = {
    "mixtral E4 k2": dict(family="mixtral"),
    "mixtral E8 k3 gqa3": dict(family="mixtral", hidden_size=48, num_attention_heads=6,
                               num_key_value_heads=2, num_local_experts=8,
                               num_experts_per_tok=3),
    "qwen3moe sparse-step 2 + mlp-only": dict(family="qwen3_moe", num_hidden_layers=4,
                                              decoder_sparse_step=2, mlp_only_layers=[3],
                                              norm_topk_prob=False),
    "qwen3moe norm_topk E16 k4": dict(family="qwen3_moe", num_experts=16, num_experts_per_tok=4,
                                      norm_topk_prob=True),
    "dsv3 q_lora None, 1 group": dict(family="deepseek_v3", q_lora_rank=None, n_group=1,
                                      topk_group=1),
    "dsv3 4 groups top2, yarn": dict(family="deepseek_v3", n_routed_experts=16, n_group=4,
                                     topk_group=2, num_experts_per_tok=4, n_shared_experts=2,
                                     first_k_dense_replace=2, num_hidden_layers=4,
                                     rope_parameters=YARN),
    "dsv3 non-interleaved rope": dict(family="deepseek_v3", rope_interleave=False,
                                      routed_scaling_factor=1.0, norm_topk_prob=False),
    "kimi-k2.5": dict(family="kimi_k25", num_experts_per_tok=3, n_group=1, topk_group=1),
}


def hf_ref(folder: Path) -> Any:
    cfg = json.loads((folder / "config.json").read_text())
    if cfg["model_type"] == "kimi_k25":
        return transformers.Kimi_K25ForConditionalGeneration.from_pretrained(str(folder)).eval()
    return transformers.AutoModelForCausalLM.from_pretrained(str(folder)).eval()


@pytest.fixture(scope="module", params=sorted(GEOMETRIES))
def folder(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    spec = dict(GEOMETRIES[request.param])
    return write_random_moe(tmp_path_factory.mktemp("moe"), spec.pop("family"), **spec)


def paged(model: MoeForCausalLM) -> tuple[KVPool, PagedAttention]:
    cfg = model.config
    heads, k_dim, v_dim = cfg.kv_cache_shape()
    pool = KVPool(16, 8, cfg.num_hidden_layers, heads, k_dim, torch.float32, "cpu",
                  v_dim=v_dim if v_dim != k_dim else None)
    return pool, PagedAttention(pool.k, pool.v, cfg.num_attention_heads)


def logits_of(ref: Any, seq: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return ref(input_ids=torch.tensor([seq])).logits[0]


def test_prefill_decode_chunked_and_verify_match_transformers(folder: Path) -> None:
    ref = hf_ref(folder)
    model, cfg, _ = load_target(folder)
    assert isinstance(model, MoeForCausalLM)
    model.fuse()
    pool, attn = paged(model)
    if cfg.mla is not None:  # the cache holds latent + rope key, not expanded K/V
        assert pool.k.shape[2:] == (1, cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim)
        assert pool.v.data_ptr() == pool.k.data_ptr() and pool.v.shape[-1] == cfg.mla.kv_lora_rank
    blocks: list[int] = []
    pool.reserve(blocks, 64)
    g = torch.Generator().manual_seed(1)
    seq = torch.randint(0, cfg.vocab_size, (11,), generator=g).tolist()
    # chunked prefill: 4 + 4 + 3 tokens, each chunk attending to the cached ones
    with torch.no_grad():
        for s, e in ((0, 4), (4, 8), (8, 11)):
            slots = pool.slots(blocks, 0, e)
            attn.plan(slots[s:], [e - s], [slots])
            h, _ = model(torch.tensor(seq[s:e]), torch.arange(s, e), attn)
            torch.testing.assert_close(model.logits(h), logits_of(ref, seq)[s:e], atol=1e-4,
                                       rtol=1e-4)
    ours = model.logits(h)
    assert model.routing(), "MoE layers record what they routed"
    for _ in range(12):  # every decode step against a full recompute by transformers
        seq.append(int(ours[-1].argmax()))
        n = len(seq)
        slots = pool.slots(blocks, 0, n)
        attn.plan(slots[-1:], [1], [slots])
        with torch.no_grad():
            h, _ = model(torch.tensor(seq[-1:]), torch.tensor([n - 1]), attn)
        ours = model.logits(h)
        torch.testing.assert_close(ours, logits_of(ref, seq)[-1:], atol=1e-4, rtol=1e-4)
    # a tree verify: nodes 0 (root) → 1 → 3, 0 → 2; each node's row = the path's next logits
    n0 = len(seq)
    tree = [5, 9, 17, 33]
    parent = [-1, 0, 0, 1]
    depth = [0, 1, 1, 2]
    mask = torch.zeros(4, 4, dtype=torch.bool)
    for i in range(4):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parent[j]
    slots = pool.slots(blocks, 0, n0 + 4)
    attn.plan(slots[n0:], [4], [slots], [mask])
    with torch.no_grad():
        h, _ = model(torch.tensor(tree), torch.tensor([n0 + d for d in depth]), attn)
    rows = model.logits(h)
    for i in range(4):
        path, j = [], i
        while j >= 0:
            path.insert(0, tree[j])
            j = parent[j]
        torch.testing.assert_close(rows[i], logits_of(ref, seq + path)[-1], atol=1e-4, rtol=1e-4)


def test_greedy_generate_matches_transformers(folder: Path) -> None:
    ref = hf_ref(folder)
    prompt = [5, 17, 3, 44, 8, 61, 2]
    with torch.no_grad():
        out = ref.generate(input_ids=torch.tensor([prompt]), max_new_tokens=24, do_sample=False,
                           eos_token_id=None, pad_token_id=0, min_new_tokens=24)
    expected = out[0, len(prompt):].tolist()
    for chunk in (1024, 3):  # whole prompt, then chunked prefill 3 tokens a step
        engine = wb.Engine.from_pretrained(folder, config=wb.EngineConfig(
            kv_budget_tokens=256, max_prefill_tokens=chunk))
        got = engine.generate([prompt], wb.SamplingParams(max_new_tokens=24, ignore_eos=True))
        assert got[0].token_ids == expected, f"max_prefill_tokens={chunk}"
        assert engine.kv_usage()["used_blocks"] == 0
        stages = {name: status for name, status, _ in engine.init_log}
        assert stages["compile"] == "ok" and engine.choices["gemm"]["choice"] == "dense"
        engine.close()


def test_kimi_engine_says_vision_is_skipped(tmp_path: Path) -> None:
    folder = write_random_moe(tmp_path / "kimi", "kimi_k25", n_group=1, topk_group=1)
    seen: list[str] = []
    engine = wb.Engine.from_pretrained(folder, config=wb.EngineConfig(kv_budget_tokens=128))
    for name, status, _ in engine.init_log:
        seen.append(f"{name}:{status}")
    engine.close()
    model, cfg, _ = load_target(folder)
    assert "vision_tower" in model.load_note and "text model only" in model.load_note
    assert cfg.text_prefix == "language_model." and "load_target:ok" in seen


@pytest.mark.parametrize("family,field,overrides", [
    ("deepseek_v3", "scoring_func", dict(scoring_func="softmax")),
    ("deepseek_v3", "topk_method", dict(topk_method="greedy")),
    ("deepseek_v3", "hidden_act", dict(hidden_act="gelu")),
    ("deepseek_v3", "n_group", dict(n_group=3)),
    ("deepseek_v3", "rope_scaling", dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0})),
    ("mixtral", "sliding_window", dict(sliding_window=4096)),
    ("qwen3_moe", "sliding_window", dict(use_sliding_window=True, sliding_window=64)),
    ("qwen3_moe", "num_experts_per_tok", dict(num_experts_per_tok=9)),
])
def test_unsupported_options_refused_naming_the_field(tmp_path: Path, family: str, field: str,
                                                      overrides: dict[str, Any]) -> None:
    folder = write_random_moe(tmp_path / "m", family)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(overrides)
    if "rope_scaling" in overrides:
        cfg.pop("rope_parameters", None)
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(wb.ConfigError, match=rf"config\.{field}"):
        load_target(folder)
    with pytest.raises(wb.EngineInitError, match=rf"config\.{field}"):
        wb.Engine.from_pretrained(folder)


@pytest.mark.parametrize("family", ["deepseek_v3", "mixtral"])
def test_thread_timing_pass_runs_on_a_moe_target(tmp_path: Path, family: str) -> None:
    """engine.contention times thread counts on a busy machine with one GEMM pass per shape:
    a MoE target gives its own — the GEMMs of a forward of m rows (attention, router, the
    experts m tokens touch under uniform routing, dense and shared MLPs, head), and nothing
    else: no coverage record or KV touched."""
    from workbench.engine.contention import gemm_pass

    model, cfg, _ = load_target(write_random_moe(tmp_path / "m", family))
    assert isinstance(model, MoeForCausalLM) and cfg.moe is not None
    calls: list[tuple[int, ...]] = []  # (rows, in, out, weight's data_ptr)
    real_mm = torch.mm

    def counting_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        calls.append((a.shape[0], *b.shape, b.data_ptr()))
        return real_mm(a, b)

    for m in (1, 16):
        run = gemm_pass(model, m)
        calls.clear()
        torch.mm = counting_mm  # type: ignore[assignment]
        try:
            run()
        finally:
            torch.mm = real_mm  # type: ignore[assignment]
        assert not model.routing()  # the pass routes nothing: the coverage record is untouched
        e, k = cfg.moe.num_experts, cfg.moe.top_k
        touched = min(e, m * k)
        moes = [f for f in (layer.ffn for layer in model.model.decoder_layers())
                if isinstance(f, SparseMoe)]
        gate_ups = {gu.data_ptr() for moe in moes for gu, _ in moe.mm_weights}
        expert_calls = [c for c in calls if c[3] in gate_ups]
        assert len(expert_calls) == touched * len(moes)  # one gate/up GEMM per touched expert
        assert {c[0] for c in expert_calls} == {-(-m * k // touched)}  # m·k rows spread
        assert calls[-1][:3] == (m, cfg.hidden_size, cfg.vocab_size)  # the head, last
