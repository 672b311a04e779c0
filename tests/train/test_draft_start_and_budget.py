"""Draft training: starting from an exported head (``init_from``), a run sized to a time budget
(``time_budget``) and the ``device`` setting (refused when it names nothing this torch has)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import micro_draft_cfg
from safetensors import safe_open

from workbench.errors import ConfigError
from workbench.train.eagle3 import DraftTrainConfig, train_draft

VD = 128


def micro_cfg(tmp: Path, target: Path, corpus: Path, **kw: Any) -> DraftTrainConfig:
    short = dict(steps=6, warmup=2, eval_batches=1, ckpt_every=3)
    return micro_draft_cfg(tmp, target, corpus, **{**short, **kw})


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def test_init_from_starts_at_the_exported_head(tmp_path: Path, micro_target: Path,
                                               tiny_corpus: Path) -> None:
    train_draft(micro_cfg(tmp_path / "a", micro_target, tiny_corpus))
    src = tensors(tmp_path / "a" / "head")
    # A vanishing learning rate: the head that comes out is the head that went in.
    s = train_draft(micro_cfg(tmp_path / "b", micro_target, tiny_corpus, steps=1, lr=1e-30,
                              init_from=str(tmp_path / "a" / "head")))
    out = tensors(tmp_path / "b" / "head")
    assert set(out) == set(src)
    for k, v in src.items():
        assert torch.allclose(out[k].float(), v.float(), atol=1e-6), k
    fresh = tensors(tmp_path / "a" / "head")  # unchanged by the second run
    assert all(torch.equal(fresh[k], v) for k, v in src.items())
    assert s["steps"] == 1
    # A fresh head at the same lr differs: the weights above came from the folder.
    train_draft(micro_cfg(tmp_path / "c", micro_target, tiny_corpus, steps=1, lr=1e-30))
    other = tensors(tmp_path / "c" / "head")
    assert not torch.allclose(other["fc.weight"], src["fc.weight"])


def test_init_from_refuses_another_geometry(tmp_path: Path, micro_target: Path,
                                            tiny_corpus: Path) -> None:
    train_draft(micro_cfg(tmp_path / "a", micro_target, tiny_corpus, draft_vocab_size=VD // 2))
    with pytest.raises(ConfigError, match="init_from.*d2t|init_from.*shape"):
        train_draft(micro_cfg(tmp_path / "b", micro_target, tiny_corpus,
                              init_from=str(tmp_path / "a" / "head")))
    with pytest.raises(ConfigError, match="init_from: .*no_such_head"):
        train_draft(micro_cfg(tmp_path / "c", micro_target, tiny_corpus,
                              init_from=str(tmp_path / "no_such_head")))
    (tmp_path / "empty_head").mkdir()
    with pytest.raises(ConfigError, match="init_from: .*empty_head.*model.safetensors"):
        train_draft(micro_cfg(tmp_path / "d", micro_target, tiny_corpus,
                              init_from=str(tmp_path / "empty_head")))


def test_time_budget_cuts_the_steps_after_the_probe(tmp_path: Path, micro_target: Path,
                                                    tiny_corpus: Path) -> None:
    # 20 probe steps take far more than 1 ms, so the budget leaves one more step.
    s = train_draft(micro_cfg(tmp_path, micro_target, tiny_corpus, steps=1000,
                              time_budget=0.001, ckpt_every=50))
    assert s["steps"] == 21
    assert s["steps_fitted_to_time_budget"] == 21
    assert s["config"]["steps"] == 21  # the schedule annealed over the fitted count
    assert s["history"][-1]["step"] == 21
    unlimited = train_draft(micro_cfg(tmp_path / "u", micro_target, tiny_corpus, steps=3))
    assert unlimited["steps_fitted_to_time_budget"] is None
    assert unlimited["device"] == "cpu"


def test_device_and_budget_refusals_name_the_field(tmp_path: Path, micro_target: Path,
                                                   tiny_corpus: Path) -> None:
    for bad in ("tpu", "no such device", "meta"):
        with pytest.raises(ConfigError, match="device"):
            micro_cfg(tmp_path, micro_target, tiny_corpus, device=bad)
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ConfigError, match="time_budget"):
            micro_cfg(tmp_path, micro_target, tiny_corpus, time_budget=bad)
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="device: 'cuda'.*no CUDA"):
            train_draft(micro_cfg(tmp_path, micro_target, tiny_corpus, device="cuda"))


def test_eval_every_exports_the_best_scoring_head(tmp_path: Path, micro_target: Path,
                                                  tiny_corpus: Path) -> None:
    s = train_draft(micro_cfg(tmp_path, micro_target, tiny_corpus, steps=8, eval_every=2,
                              ckpt_every=4))
    steps = [r["step"] for r in s["selection"]]
    assert steps == [2, 4, 6, 8]
    ests = [r["est_accept_length_chain"] for r in s["selection"]]
    assert all(1.0 <= e <= 6.0 for e in ests)
    assert s["exported_step"] == steps[ests.index(max(ests))]
    state = torch.load(tmp_path / "work" / "ckpt.pt", weights_only=False)
    assert state["best"]["step"] == s["exported_step"]
    out = tensors(tmp_path / "head")
    for k, v in state["best"]["model"].items():
        if k in out:
            assert torch.equal(out[k], v), k
    # Resumed with more steps, the scores so far come from the checkpoint.
    more = train_draft(micro_cfg(tmp_path, micro_target, tiny_corpus, steps=10, eval_every=2,
                                 ckpt_every=4))
    assert [r["step"] for r in more["selection"]] == [2, 4, 6, 8, 10]
    assert more["selection"][:4] == s["selection"]
    off = train_draft(micro_cfg(tmp_path / "off", micro_target, tiny_corpus, steps=3))
    assert off["selection"] == [] and off["exported_step"] == 3
    with pytest.raises(ConfigError, match="eval_every"):
        micro_cfg(tmp_path, micro_target, tiny_corpus, eval_every=-1)


def test_eval_every_scores_the_head_it_starts_from(tmp_path: Path, micro_target: Path,
                                                   tiny_corpus: Path) -> None:
    train_draft(micro_cfg(tmp_path / "a", micro_target, tiny_corpus, steps=20))
    src = tensors(tmp_path / "a" / "head")
    # A learning rate that wrecks the head: the starting point scores best and is exported.
    s = train_draft(micro_cfg(tmp_path / "b", micro_target, tiny_corpus, steps=4, lr=5.0,
                              warmup=0, eval_every=2, init_from=str(tmp_path / "a" / "head")))
    assert [r["step"] for r in s["selection"]] == [0, 2, 4]
    assert s["exported_step"] == 0
    out = tensors(tmp_path / "b" / "head")
    for k, v in src.items():
        assert torch.equal(out[k], v), k
