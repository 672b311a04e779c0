"""Random-weight pairs in the real formats, and the shape study built on them."""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors import safe_open

import workbench as wb
from workbench.bench.shapes import run_shapes
from workbench.models.eagle3 import Eagle3Config
from workbench.models.synthetic import TargetShape, random_pair

MICRO = TargetShape(layers=2, hidden=64, intermediate=96, heads=4, kv_heads=2, vocab=300)


@pytest.mark.parametrize("field,kwargs", [
    ("layers", dict(layers=0)), ("hidden", dict(hidden=True)), ("vocab", dict(vocab=2.5)),
])
def test_shape_refuses_bad_fields(field: str, kwargs: dict) -> None:
    args = dict(layers=2, hidden=64, intermediate=96, heads=4, kv_heads=2) | kwargs
    with pytest.raises(wb.ConfigError, match=f"^TargetShape.{field}"):
        TargetShape(**args)
    with pytest.raises(wb.ConfigError, match="heads"):
        TargetShape(2, 64, 96, heads=3, kv_heads=1)


def test_random_pair_real_formats_and_cache(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    target, draft = random_pair(tmp_path / "pair", MICRO, draft_vocab=50)
    hf = AutoModelForCausalLM.from_pretrained(str(target))
    assert hf.config.num_hidden_layers == 2 and hf.config.hidden_size == 64
    with safe_open(str(target / "model.safetensors"), "pt") as f:
        numel = sum(f.get_tensor(k).numel() for k in f.keys() if "norm" not in k)
    assert numel == MICRO.params  # the formula counts the GEMM weights + tied embedding
    cfg = Eagle3Config.from_folder(draft)
    assert (cfg.hidden_size, cfg.draft_vocab_size, cfg.vocab_size) == (64, 50, 300)
    stamp = (target / "model.safetensors").stat().st_mtime_ns
    assert random_pair(tmp_path / "pair", MICRO, draft_vocab=50) == (target, draft)
    assert (target / "model.safetensors").stat().st_mtime_ns == stamp  # reused, not rewritten
    wider = TargetShape(2, 128, 96, 4, 2, vocab=300)
    t2, _ = random_pair(tmp_path / "pair", wider, draft_vocab=50)
    assert AutoModelForCausalLM.from_pretrained(str(t2)).config.hidden_size == 128


def test_run_shapes_rows(tmp_path: Path, micro_target: Path) -> None:
    from workbench.models.synthetic import write_random_head

    head = write_random_head(micro_target, tmp_path / "head")
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    spec = wb.SpecConfig(num_steps=3, topk=2, num_draft_tokens=6)
    with pytest.raises(wb.ConfigError, match="--tau 5"):
        run_shapes(prompts, {"micro": MICRO}, tau=5.0, spec=spec, work=tmp_path / "w")
    df = run_shapes(prompts, {"micro": MICRO}, tau=3.0, spec=spec, max_new_tokens=12,
                    work=tmp_path / "w", pairs={"trained micro": (micro_target, head)})
    assert list(df["shape"]) == ["trained micro", "micro"]
    assert list(df["random"]) == [False, True]
    assert (df["speedup"] > 0).all() and (df["plain_ms"] > 0).all()
    assert ((df["tau"] >= 1.0) & (df["tau"] <= 4.0)).all()
    row = df.iloc[1]
    assert row["verify_ratio"] == pytest.approx(row["verify_ms"] / row["plain_ms"])
    assert row["bound"] == pytest.approx(row["tau"] / row["verify_ratio"])
    assert df.attrs["config"]["simulated"] is True
    # one run: the interval comes from the two prompts' paired ratios; step samples kept
    assert (df["speedup_lo"] <= df["speedup"]).all() and (df["speedup"] <= df["speedup_hi"]).all()
    assert set(df.attrs["steps"]) == {"trained micro", "micro"}
    assert len(df.attrs["steps"]["micro"]["plain_ms"]) > 1
