"""Sparse upcycling of a dense target into a Mixtral-format MoE written by transformers."""

from __future__ import annotations

import json
from pathlib import Path

import torch

import workbench as wb
from workbench.train.upcycle import UpcycleConfig, upcycle


def test_upcycle_writes_a_mixtral_that_transformers_and_the_engine_agree_on(
        tmp_path: Path, micro_target: Path, tiny_corpus: Path) -> None:
    import transformers

    out = tmp_path / "moe"
    summary = upcycle(UpcycleConfig(source=str(micro_target), out=str(out),
                                     corpus=str(tiny_corpus), experts=4, top_k=2,
                                     expert_intermediate=64, steps=3, batch=2, seq_len=16,
                                     dtype="float32"))
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["MixtralForCausalLM"] and cfg["num_local_experts"] == 4
    assert len(summary["history"]) == 3 and summary["heldout_loss"] > 0
    assert (out / "tokenizer.json").is_file()
    ref = transformers.MixtralForCausalLM.from_pretrained(str(out)).eval()
    prompt = [5, 17, 3, 44, 8]
    with torch.no_grad():
        want = ref.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                            min_new_tokens=12, eos_token_id=None, pad_token_id=0)
    e = wb.Engine.from_pretrained(out, config=wb.EngineConfig(kv_budget_tokens=256))
    got = e.generate([prompt], wb.SamplingParams(max_new_tokens=12, ignore_eos=True))
    e.close()
    assert got[0].token_ids == want[0, len(prompt):].tolist()
