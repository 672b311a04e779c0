"""``EngineConfig.weights`` on a GGUF target: ``packed`` runs the file's Q4_0/Q4_1/Q8_0 codes
(``models/quant.py``) in every target GEMM, ``dequant`` the float weights; the choice is in
``engine.choices``; ``packed`` on a checkpoint with nothing quantised is refused naming the
field; and the compiled decode stays off on packed weights (it traces dense weights)."""

from __future__ import annotations

from pathlib import Path

import pytest

import workbench as wb
from workbench.errors import EngineInitError
from workbench.models.loader import load_target

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402
from test_gguf import ENGINE, LAYERS, hf_llama, write_gguf  # noqa: E402

from workbench.models.quant import PackedWeight  # noqa: E402


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0])
def test_packed_target_runs_the_files_codes(qtype: int, tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf", hf_llama(), qtype)
    model, _, _ = load_target(path)
    assert len(model.quant) == 7 * LAYERS + 1  # q k v o gate up down per layer, the tied head
    model.fuse("packed")
    assert model.gemm == "packed" and isinstance(model._head, PackedWeight)
    assert all(isinstance(f.qkv, PackedWeight) and isinstance(f.down, PackedWeight)
               for f in model._fast)  # type: ignore[union-attr]
    prompts = [[5, 77, 200, 13], [91, 260, 3, 44, 8, 9], [1, 2]]
    sp = wb.SamplingParams(max_new_tokens=12, ignore_eos=True)
    outs = {}
    for weights in ("packed", "dequant"):
        cfg = wb.EngineConfig(**ENGINE, weights=weights, max_batch_size=4)
        with wb.Engine.from_pretrained(path, config=cfg) as engine:
            c = engine.choices["weights"]
            assert (c["choice"], c["source"]) == (weights, "forced")
            assert engine.runner.target.gemm == ("packed" if weights == "packed" else "dense")
            if weights == "packed":
                assert engine.choices["compile"]["choice"] == "off"
                assert "packed weights" in engine.choices["compile"]["note"]
            outs[weights] = [o.token_ids for o in engine.generate(prompts, sp)]
            single = [engine.generate([p], sp)[0].token_ids for p in prompts]
            assert single == outs[weights]  # a row's tokens do not depend on its batch
    assert all(len(o) == 12 for o in outs["packed"])


def test_packed_without_quantised_tensors_is_refused(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "f32.gguf", hf_llama(), Q.F32)
    cfg = wb.EngineConfig(**ENGINE, weights="packed")
    with pytest.raises(EngineInitError, match="EngineConfig.weights='packed'"):
        wb.Engine.from_pretrained(path, config=cfg)
    with wb.Engine.from_pretrained(path, config=wb.EngineConfig(**ENGINE)) as engine:
        assert engine.choices["weights"]["source"] == "only"
        assert engine.choices["weights"]["choice"] == "dequant"


def test_weights_field_is_validated() -> None:
    with pytest.raises(wb.ConfigError, match="EngineConfig.weights"):
        wb.EngineConfig(weights="int4")
