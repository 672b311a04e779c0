"""The target trainer on a micro corpus: learns, exports an HF folder, resumes, names bad input."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from workbench.errors import ConfigError
from workbench.models.loader import load_target
from workbench.train.target import TargetTrainConfig, train_target

MICRO = dict(vocab_size=300, layers=2, hidden=32, heads=4, kv_heads=2, intermediate=64,
             seq_len=32, batch=8, lr=5e-3, warmup=3, ckpt_every=10, eval_batches=2, threads=1)


def micro_cfg(tmp_path: Path, corpus: Path, **kw: object) -> TargetTrainConfig:
    settings: dict[str, object] = dict(MICRO, out=str(tmp_path / "out"),
                                       work=str(tmp_path / "work"), corpus=str(corpus), steps=30)
    settings.update(kw)
    return TargetTrainConfig(**settings)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory,
            tiny_corpus: Path) -> tuple[Path, dict[str, object]]:
    tmp = tmp_path_factory.mktemp("target_train")
    summary = train_target(micro_cfg(tmp, tiny_corpus))
    return tmp / "out", summary


def test_loss_falls(trained: tuple[Path, dict[str, object]]) -> None:
    _, s = trained
    history = s["history"]
    assert isinstance(history, list) and len(history) == 3
    uniform = math.log(300)
    assert float(s["train_loss"]) < uniform - 1.0  # type: ignore[arg-type]
    assert float(s["heldout_loss"]) < uniform - 0.5  # type: ignore[arg-type]
    assert history[-1]["train_loss"] < history[0]["train_loss"]


def test_folder_loads_in_workbench_and_transformers(
        trained: tuple[Path, dict[str, object]]) -> None:
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, _ = trained
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json", "training_summary.json"} <= {p.name for p in out.iterdir()}
    model, cfg, _ = load_target(out)
    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    hf_tok = AutoTokenizer.from_pretrained(str(out))
    text = "def insort(a, x, lo=0):\n    return bisect(a, x)\n"
    ids = hf_tok(text)["input_ids"]
    assert ids == Tokenizer.from_file(str(out / "tokenizer.json")).encode(text).ids
    x = torch.tensor([ids])
    with torch.no_grad():
        ours, _ = model.forward_dense(x)
        theirs = hf(input_ids=x).logits
    assert ours.shape == (1, len(ids), cfg.vocab_size)
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


def test_resume_continues_from_checkpoint(tmp_path: Path, tiny_corpus: Path) -> None:
    first = train_target(micro_cfg(tmp_path, tiny_corpus, steps=10, ckpt_every=5))
    state = torch.load(tmp_path / "work" / "ckpt.pt", weights_only=False)
    assert state["step"] == 10
    second = train_target(micro_cfg(tmp_path, tiny_corpus, steps=20, ckpt_every=5))
    assert second["steps"] == 20
    assert [h["step"] for h in second["history"]] == [5, 10, 15, 20]  # type: ignore[index]
    # The first two records come from the checkpoint, not from a re-run.
    assert second["history"][:2] == first["history"]  # type: ignore[index]
    summary = json.loads((tmp_path / "out" / "training_summary.json").read_text())
    assert summary["tokens_seen"] == 20 * MICRO["batch"] * MICRO["seq_len"]


def test_missing_corpus_names_folder(tmp_path: Path) -> None:
    missing = tmp_path / "no_such_corpus"
    with pytest.raises(ConfigError, match="no_such_corpus"):
        train_target(micro_cfg(tmp_path, missing))


def test_empty_corpus_names_folder(tmp_path: Path) -> None:
    empty = tmp_path / "empty_corpus"
    empty.mkdir()
    (empty / "notes.txt").write_text("not python\n")
    with pytest.raises(ConfigError, match="empty_corpus"):
        train_target(micro_cfg(tmp_path, empty))


def test_bad_shape_names_field() -> None:
    with pytest.raises(ConfigError, match="heads"):
        TargetTrainConfig(hidden=30, heads=4)
