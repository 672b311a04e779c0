"""Greedy EAGLE-3 output equals greedy baseline output on MoE targets: Qwen3-MoE (grouped-query
attention, softmax routing) and DeepSeek-V3 (latent attention over the latent cache, grouped
sigmoid routing, shared expert, dense first layer), each with a head trained by ``train-draft``
on it (aux hidden states from three layers, as for dense targets)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import MICRO_DRAFT_TRAINING, id_prompts, write_tokenizer  # tests/ is on sys.path
from speculative.test_lossless import CONFIGS, run_staggered

import workbench as wb
from workbench.models.synthetic_moe import write_random_moe

TARGETS = {
    "qwen3_moe": dict(std=0.1, num_experts=8, num_experts_per_tok=2, mlp_only_layers=[0]),
    # a smaller init: a more predictable random target, so the micro head accepts some drafts
    "deepseek_v3": dict(std=0.05, n_routed_experts=8, n_group=2, topk_group=1,
                        first_k_dense_replace=1, q_lora_rank=None),
}


@pytest.fixture(scope="module", params=sorted(TARGETS))
def moe_engine(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
               tiny_corpus: Path) -> Iterator[wb.Engine]:
    from workbench.train.eagle3 import DraftTrainConfig, train_draft

    root = tmp_path_factory.mktemp(f"moe-{request.param}")
    target = write_random_moe(root / "target", request.param, vocab_size=300,
                              hidden_size=64, num_hidden_layers=4, **TARGETS[request.param])
    write_tokenizer(target, tiny_corpus, 300)
    train_draft(DraftTrainConfig(target=str(target), out=str(root / "head"),
                                 work=str(root / "work"), corpus=str(tiny_corpus),
                                 **(MICRO_DRAFT_TRAINING | {"steps": 240})))
    e = wb.Engine.from_pretrained(target, draft=root / "head",
                                  config=wb.EngineConfig(kv_budget_tokens=8192))
    yield e
    e.close()


@pytest.mark.parametrize("name", ["chain S3", "S5 K4 N16", "S3 K2 N6"])
@pytest.mark.parametrize("batch", [1, 4, 13])
def test_greedy_spec_equals_baseline_on_moe(moe_engine: wb.Engine, name: str,
                                            batch: int) -> None:
    ps = id_prompts(13 if batch > 1 else 4, seed=batch, lo=2, hi=30)
    sp = wb.SamplingParams(max_new_tokens=20, ignore_eos=True)
    base = run_staggered(moe_engine, ps, sp, None, batch)
    spec = run_staggered(moe_engine, ps, sp, CONFIGS[name], batch)
    assert spec == base
    assert moe_engine.kv_usage()["used_blocks"] == 0


def test_moe_head_accepts(moe_engine: wb.Engine) -> None:
    """Guard that the suite above exercises partial and multi-token acceptance."""
    outs = moe_engine.generate(id_prompts(4, seed=9, lo=2, hi=30),
                               wb.SamplingParams(max_new_tokens=40, ignore_eos=True),
                               spec=CONFIGS["S5 K4 N16"])
    taus = [a for o in outs for a in o.metrics.accept_lengths]
    assert sum(taus) / len(taus) > 1.05 and max(taus) >= 3 and min(taus) == 1
