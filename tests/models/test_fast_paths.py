"""The engine fast paths' op-count trims compute the very values of the formulas they replace
(bit-identical: decode, verify and draft steps must keep agreeing exactly for losslessness)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from workbench.attention.paged import PagedAttention
from workbench.models.config import ModelConfig
from workbench.models.eagle3 import Eagle3Config, Eagle3Draft
from workbench.models.llama import LlamaForCausalLM, Rotary, init_weights, rolled_rope_tables

CFG = ModelConfig(family="llama", vocab_size=96, hidden_size=32, intermediate_size=48,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=8, rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None,
                  max_position_embeddings=512)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_rolled_equals_rolled_tables(dtype: torch.dtype) -> None:
    rot = Rotary(CFG)
    for positions in (torch.tensor([0]), torch.tensor([5, 5, 5, 5]), torch.arange(300),
                      torch.tensor([700, 3, 41])):  # 300 and 700 grow the table
        cos, sin = rot.rolled(positions, dtype)
        ref_cos, ref_sin = rolled_rope_tables(*rot.cos_sin(positions, dtype))
        assert cos.shape == ref_cos.shape == (positions.numel(), 1, CFG.head_dim)
        assert torch.equal(cos, ref_cos) and torch.equal(sin, ref_sin)


def test_rotary_rolled_honours_a_shadowing_cos_sin() -> None:
    """engine.cuda_graphs.static_rotary shadows cos_sin with fixed tables: rolled uses them."""
    rot = Rotary(CFG)
    fixed = torch.full((16, CFG.head_dim), 2.0)

    def cos_sin(positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        return fixed[positions], fixed[positions]

    rot.cos_sin = cos_sin  # type: ignore[method-assign]
    cos, sin = rot.rolled(torch.tensor([1, 2]), torch.float32)
    assert torch.equal(cos, torch.full((2, 1, CFG.head_dim), 2.0))
    half = CFG.head_dim // 2
    assert torch.equal(sin[..., :half], torch.full((2, 1, half), -2.0))
    assert torch.equal(sin[..., half:], torch.full((2, 1, half), 2.0))


def _draft() -> Eagle3Draft:
    cfg = Eagle3Config(hidden_size=32, target_hidden_size=32, intermediate_size=48,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=96,
                       draft_vocab_size=40)
    draft = Eagle3Draft(cfg, nn.Embedding(96, 32))
    init_weights(draft, seed=3)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():  # non-trivial norm weights: the stacked norm must apply each its own
        for norm in (draft.midlayer.input_layernorm, draft.midlayer.hidden_norm):
            norm.weight.copy_(torch.rand(32, generator=g) + 0.5)
    return draft


def test_draft_stacked_input_norms_equal_two_norms() -> None:
    draft = _draft()
    draft.fuse("dense")
    assert draft._fast is not None
    lay, eps = draft.midlayer, draft.config.rms_norm_eps
    g = torch.Generator().manual_seed(5)
    for t in (1, 4, 16):
        tokens = torch.randint(0, 96, (t,), generator=g)
        hidden = torch.randn(t, 32, generator=g) * 3
        emb = F.embedding(tokens, draft.embed.weight)  # type: ignore[union-attr]
        ref = torch.cat([F.rms_norm(emb, (32,), lay.input_layernorm.weight, eps),
                         F.rms_norm(hidden, (32,), lay.hidden_norm.weight, eps)], dim=-1)
        got = F.rms_norm(torch.stack([emb, hidden], 1), (32,), None,
                         eps).mul(draft._fast["norms"]).flatten(1)
        assert torch.equal(got, ref)


@pytest.mark.parametrize("gemm", ["dense", "onednn"])
def test_draft_fast_forward_matches_module_path(gemm: str) -> None:
    """The fused-weight step (stacked norms, cached rope tables) against the module path."""
    if gemm == "onednn" and not torch.backends.mkldnn.is_available():
        pytest.skip("no mkldnn")
    draft = _draft()
    ctx = 12
    pool = torch.zeros(1, 64, 2, 8)
    g = torch.Generator().manual_seed(6)
    tokens = torch.randint(0, 96, (ctx,), generator=g)
    hidden = torch.randn(ctx, 32, generator=g)
    positions = torch.arange(ctx)
    slots = torch.arange(ctx)
    outs = []
    for fast in (False, True):
        if fast:
            draft.fuse(gemm)
        k, v = pool.clone(), pool.clone()
        attn = PagedAttention(k, v, 4)
        attn.plan(slots, [ctx], [slots])
        with torch.inference_mode():
            outs.append(draft(tokens, hidden, positions, attn, logit_rows=torch.tensor([ctx - 1])))
    (ref_logits, ref_out), (logits, out) = outs
    assert logits.shape == (1, 40) and out.shape == (ctx, 32)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-5)


def test_target_forward_embedding_and_rope_unchanged() -> None:
    """forward (F.embedding, cached rope tables) equals layers_forward fed the module
    embedding and rolled_rope_tables(cos_sin) — bit for bit."""
    model = LlamaForCausalLM(CFG)
    init_weights(model, seed=7)
    model.fuse("dense")
    tokens = torch.tensor([3, 17, 60, 2, 95])
    positions = torch.arange(5)
    slots = torch.arange(5)
    outs = []
    for fast in (True, False):
        k = torch.zeros(CFG.num_hidden_layers, 16, 2, 8)
        attn = PagedAttention(k, torch.zeros_like(k), 4)
        attn.plan(slots, [5], [slots])
        with torch.inference_mode():
            if fast:
                outs.append(model(tokens, positions, attn, (0, 1)))
            else:
                x = model.model.embed_tokens(tokens)
                cos, sin = rolled_rope_tables(*model.model.rotary_emb.cos_sin(positions, x.dtype))
                outs.append(model.layers_forward(x, cos, sin, attn, (0, 1)))
    assert torch.equal(outs[0][0], outs[1][0])
    assert outs[0][1] is not None and outs[1][1] is not None
    assert torch.equal(outs[0][1], outs[1][1])


@pytest.mark.parametrize("tied", [False, True])
def test_target_fuses_in_any_gemm_order(tied: bool) -> None:
    """fuse('dense') then fuse('onednn') (what autotune does when oneDNN wins): the head stays
    a plain attribute, never a registered parameter, so the second fuse can hold a packed copy
    and the state dict names only the checkpoint's tensors."""
    if not torch.backends.mkldnn.is_available():
        pytest.skip("no mkldnn")
    import dataclasses

    model = LlamaForCausalLM(dataclasses.replace(CFG, tie_word_embeddings=tied))
    init_weights(model, seed=3)
    names = set(model.state_dict())
    logits = []
    for gemm in ("dense", "onednn", "dense"):
        model.fuse(gemm)
        assert set(model.state_dict()) == names and "_head" not in dict(model.named_parameters())
        with torch.inference_mode():
            logits.append(model.logits(torch.randn(2, 32, generator=torch.Generator()
                                                           .manual_seed(1))))
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-4, atol=1e-5)
    assert torch.equal(logits[2], logits[0])
