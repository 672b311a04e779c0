"""The real model's prompt sets (``workbench.train.real_prompts``), the pre-tokenized corpus
``train-draft --corpus X.npz`` reads, and the bootstrap interval of the τ bench."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from workbench.data_io import load_prompt_records
from workbench.errors import ConfigError
from workbench.models.config import ModelConfig
from workbench.train.eagle3 import DraftTrainConfig
from workbench.train.eagle3.data import corpus_tokens
from workbench.train.real_prompts import KINDS, build_prompts, write_prompts


def test_prompt_sets_cover_every_kind_and_are_disjoint_by_source() -> None:
    train, held = build_prompts()
    for k in KINDS:
        assert sum(r["kind"] == k for r in train) >= 150, k
        assert sum(r["kind"] == k for r in held) >= 16, k
    assert not {r["source"].split(":")[0] for r in train} & {r["source"].split(":")[0]
                                                             for r in held}
    assert all(len(r["turns"]) == 2 for r in train + held if r["kind"] == "chat")


def test_written_files_match_the_generator(tmp_path: Path) -> None:
    counts = write_prompts(tmp_path)
    rows = [json.loads(x) for x in (tmp_path / "heldout.jsonl").read_text().splitlines()]
    assert counts["heldout"] == {k: sum(r["kind"] == k for r in rows) for k in KINDS}
    # the committed held-out file holds the same prompts (plus the chat records' messages)
    shipped = Path(__file__).resolve().parents[2] / "data" / "prompts" / "real" / "heldout.jsonl"
    assert [r["id"] for r in rows] == [json.loads(x)["id"] for x in
                                       shipped.read_text().splitlines()]


def test_prompt_records_refuse_a_multi_turn_record_without_messages(tmp_path: Path) -> None:
    p = tmp_path / "p.jsonl"
    p.write_text(json.dumps({"id": "a", "kind": "chat", "prompt": "x", "turns": ["x", "y"]})
                 + "\n")
    with pytest.raises(ConfigError, match="messages"):
        load_prompt_records(p, chat=True)
    p.write_text(json.dumps({"id": "a", "kind": "qa", "prompt": "x"}) + "\n")
    assert load_prompt_records(p, chat=True)[0]["prompt"] == [{"role": "user", "content": "x"}]
    assert load_prompt_records(p)[0]["prompt"] == "x"


def _mcfg(vocab: int = 100) -> ModelConfig:
    return ModelConfig(family="llama", vocab_size=vocab, hidden_size=8, intermediate_size=16,
                       num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                       head_dim=4, rms_norm_eps=1e-5, rope_theta=10000.0,
                       max_position_embeddings=64, tie_word_embeddings=True, bos_token_id=0,
                       eos_token_id=[0], torch_dtype="float32")


def test_pretokenized_corpus_is_read_as_is_and_checked(tmp_path: Path) -> None:
    f = tmp_path / "c.npz"
    train, held = np.arange(50, dtype=np.uint16), np.arange(30, dtype=np.uint16)
    np.savez(f, train=train, heldout=held)
    cfg = DraftTrainConfig(corpus=str(f), seq_len=16, ttt_steps=5, regenerate=False,
                           work=str(tmp_path / "w"))
    a, b = corpus_tokens(cfg, tmp_path, _mcfg())
    assert np.array_equal(a, train) and np.array_equal(b, held)
    with pytest.raises(ConfigError, match="outside"):
        corpus_tokens(cfg, tmp_path, _mcfg(vocab=40))
    np.savez(f, train=train)
    with pytest.raises(ConfigError, match="heldout"):
        corpus_tokens(cfg, tmp_path, _mcfg())


def test_tau_bench_on_the_toy_pair() -> None:
    """``run_tau_bench`` end to end on the shipped toy pair: per kind, overall, per depth."""
    import workbench as wb
    from workbench.bench.spec import run_tau_bench, tau_table

    root = Path(__file__).resolve().parents[2] / "data" / "models"
    records = [{"id": "a", "kind": "code", "prompt": "def add(a, b):\n"},
               {"id": "b", "kind": "code", "prompt": "import os\n\n\ndef main("},
               {"id": "c", "kind": "text", "prompt": "class Stack:\n    def push(self, x):\n"}]
    spec = wb.SpecConfig(num_steps=5, topk=4, num_draft_tokens=16)
    with wb.Engine.from_pretrained(root / "wb-target", draft=root / "wb-eagle3",
                                   config=wb.EngineConfig(max_batch_size=2)) as engine:
        res = run_tau_bench(engine, records, spec, max_new_tokens=12, batch=2, progress=False)
    assert set(res["by_kind"]) == {"code", "text"} and res["overall"]["prompts"] == 3
    o = res["overall"]
    assert o["lossless"] and 1.0 <= o["tau_lo"] <= o["tau"] <= o["tau_hi"] <= 6.0
    rates = [d["accept_rate"] for d in o["per_depth"]]
    assert len(rates) == 5 and rates == sorted(rates, reverse=True)
    assert list(tau_table(res)["kind"]) == ["code", "text", "overall"]
