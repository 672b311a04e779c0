"""Model modules build their tensors where the module is built (issue 19, device rule)."""

from __future__ import annotations

import torch

from workbench.models.config import ModelConfig
from workbench.models.eagle3 import Eagle3Config, Eagle3Draft
from workbench.models.llama import RMSNorm, Rotary, rope_inv_freq

CFG = ModelConfig(family="llama", vocab_size=32, hidden_size=16, intermediate_size=32,
                  num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                  rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None,
                  max_position_embeddings=64)


def test_modules_built_under_a_device_context_stay_there() -> None:
    with torch.device("meta"):
        rot, norm = Rotary(CFG), RMSNorm(16, 1e-5)
        draft = Eagle3Draft(Eagle3Config(hidden_size=16, target_hidden_size=16,
                                         intermediate_size=32, num_attention_heads=2,
                                         num_key_value_heads=1, head_dim=8, vocab_size=32,
                                         draft_vocab_size=8))
    assert rot.inv_freq.device.type == "meta" and rot._cos.device.type == "meta"
    assert norm.weight.device.type == "meta"
    assert {draft.d2t.device.type, draft.t2d.device.type, draft.rotary.inv_freq.device.type} \
        == {"meta"}


def test_rotary_table_follows_inv_freq_to_its_device() -> None:
    """A table built before inv_freq moved (the loader's to_empty + reset) is rebuilt there,
    with the values a fresh module computes."""
    with torch.device("meta"):
        rot = Rotary(CFG)
    rot.inv_freq = rope_inv_freq(CFG, "cpu")
    pos = torch.tensor([0, 3, 7], device="cpu")
    cos, sin = rot.cos_sin(pos, torch.float32)
    ref_cos, ref_sin = Rotary(CFG).cos_sin(pos, torch.float32)
    assert cos.device.type == "cpu"
    assert torch.equal(cos, ref_cos) and torch.equal(sin, ref_sin)


def test_rotary_table_keeps_its_length_when_the_dtype_flips() -> None:
    """bf16 autocast training and float32 evaluation in turn (``train-draft --eval-every``)
    ask for both dtypes over and over: each rebuild keeps the length, values as a fresh
    table's; only a longer request grows it."""
    rot = Rotary(CFG)
    pos = torch.arange(200)
    for _ in range(30):
        for dt in (torch.bfloat16, torch.float32):
            cos, sin = rot.cos_sin(pos, dt)
    assert rot._cos.shape[0] == 256 and rot._cos.dtype == torch.float32
    ref_cos, ref_sin = Rotary(CFG).cos_sin(pos, torch.float32)
    assert torch.equal(cos, ref_cos) and torch.equal(sin, ref_sin)
    rot.cos_sin(torch.tensor([300]), torch.float32)
    assert rot._cos.shape[0] == 512
