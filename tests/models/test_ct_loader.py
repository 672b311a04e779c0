"""A compressed-tensors pack-quantized INT4 (group 32) checkpoint of a small random
DeepSeek-V3-shaped model, written by the real ``compressed-tensors`` package, loads through
``workbench/models/ct_loader.py``: every quantised weight equals compressed-tensors' own
decompression, and the workbench's logits equal those of the transformers module holding that
decompression.

Why not ``AutoModelForCausalLM.from_pretrained(folder)``: with transformers 5.25 and
compressed-tensors 0.20 that load fails on CPU for this model. transformers 5 keeps a
DeepSeek-V3 layer's routed experts as fused 3-D parameters (not ``nn.Linear``), so
compressed-tensors (``targets=["Linear"]``) leaves them float and ``save_pretrained`` writes
them per expert; on load, transformers' weight conversion for the compressed-tensors quantizer
then finds no source tensors for ``mlp.experts.gate_up_proj`` (``torch.cat(): expected a
non-empty list of Tensors``, "Ckpt contains: 0") and raises. The comparison below therefore
decompresses in memory with compressed-tensors' ``ModelCompressor.decompress_model`` on the
transformers module that was compressed and saved."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from workbench.errors import CheckpointError
from workbench.models.ct_loader import quantization_config, unpack_int4
from workbench.models.loader import load_target

ct = pytest.importorskip("compressed_tensors")
GROUP = 32


def write_pack_quantized(folder: Path) -> Any:
    """Random DeepSeek-V3 (MLA, 8 routed experts, one dense layer), its Linear weights
    quantised symmetric INT4 group 32 (scales from each group's min/max by compressed-tensors'
    ``calculate_qparams``), compressed pack-quantized and saved. Returns the compressed
    transformers module and its ModelCompressor."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils import calculate_qparams

    from workbench.models.synthetic_moe import hf_config, hf_model

    # every Linear's K a multiple of the group: hidden 64, MLA ranks 32, expert width 32
    cfg = hf_config("deepseek_v3", hidden_size=64, intermediate_size=64,
                    moe_intermediate_size=32, q_lora_rank=32, kv_lora_rank=32)
    torch.manual_seed(0)
    model = hf_model("deepseek_v3", cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if name.endswith("norm.weight") else 0.0, 0.2)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.2)
    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group",
                            group_size=GROUP)
    apply_quantization_config(model, QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args)},
        ignore=["lm_head"]))
    for module in model.modules():
        if hasattr(module, "weight_scale"):
            w = module.weight.detach()
            g = w.view(w.shape[0], -1, GROUP)
            s, zp = calculate_qparams(g.amin(-1), g.amax(-1), args)
            module.weight_scale.data.copy_(s.view(module.weight_scale.shape))
            module.weight_zero_point.data.copy_(zp.view(module.weight_zero_point.shape))
    comp = ModelCompressor.from_pretrained_model(model, quantization_format="pack-quantized")
    comp.compress_model(model)
    model.save_pretrained(str(folder))
    comp.update_config(str(folder))
    return model, comp


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    folder = tmp_path_factory.mktemp("ct") / "dsv3-int4"
    model, comp = write_pack_quantized(folder)
    comp.decompress_model(model)  # compressed-tensors' own decompression, in memory
    return folder, model.eval()


def test_unpack_matches_compressed_tensors() -> None:
    from compressed_tensors.compressors.pack_quantized.helpers import (
        pack_to_int32,
        unpack_from_int32,
    )

    codes = torch.randint(-8, 8, (48, 96), generator=torch.Generator().manual_seed(0),
                          dtype=torch.int8)
    packed = pack_to_int32(codes, 4)
    assert torch.equal(unpack_int4(packed, (48, 96)), codes)
    assert torch.equal(unpack_from_int32(packed, 4, torch.Size((48, 96))), codes)


def test_loads_as_compressed_tensors_decompresses_it(checkpoint: tuple[Path, Any]) -> None:
    folder, hf = checkpoint
    assert quantization_config(folder) is not None
    model, _, _ = load_target(folder)
    hf_params = dict(hf.named_parameters())
    assert len(model.quant) == 24  # q_a, q_b, kv_a, kv_b, o per layer; dense and shared MLPs
    for name, qt in model.quant.items():
        assert qt.kind == "INT4" and qt.group == GROUP
        assert int(qt.codes.min()) >= -8 and int(qt.codes.max()) <= 7
        assert torch.equal(qt.dequantize(), hf_params[name].detach().float()), name
        assert torch.equal(model.get_parameter(name).detach(), hf_params[name].detach())
    ids = torch.randint(0, 128, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        ours, _ = model.forward_dense(ids)
        theirs = hf(ids).logits
    # the same weights through two fp32 implementations (MLA, routing): the MoE oracle's bound
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


def test_other_formats_are_refused_naming_the_field(tmp_path: Path) -> None:
    import json

    cfg = {"quantization_config": {"quant_method": "compressed-tensors", "format": "pack-quantized",
                                   "config_groups": {"g": {"weights": {
                                       "num_bits": 8, "type": "int", "symmetric": True,
                                       "strategy": "group", "group_size": 32}}}}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"config_groups\.g\.weights\.num_bits"):
        quantization_config(tmp_path)
    cfg["quantization_config"]["format"] = "float-quantized"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"quantization_config\.format"):
        quantization_config(tmp_path)
