"""A checkpoint in the public LlamaForCausalLMEagle3 layout loads and runs (docs/REFERENCE.md §6).

Public heads (e.g. for Llama 3.1 8B) ship bf16/fp16 tensors, ``draft_vocab_size`` with ``d2t``
offsets, and some a ``target_hidden_size`` wider than the head plus their own ``embed_tokens``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import write_random_llama
from safetensors.torch import save_file

from workbench.errors import CheckpointError
from workbench.models.loader import load_eagle3, load_target

V, VD, DT, D, HEADS, KV, HD, INTER = 300, 100, 48, 32, 4, 2, 8, 80


def public_config(**kw: object) -> dict[str, object]:
    config: dict[str, object] = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0, "hidden_act": "silu",
        "hidden_size": D, "target_hidden_size": DT, "intermediate_size": INTER,
        "num_attention_heads": HEADS, "num_key_value_heads": KV, "num_hidden_layers": 1,
        "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 256, "rope_type": "llama3"},
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
        "vocab_size": V, "draft_vocab_size": VD,
    }
    config.update(kw)
    return config


def public_tensors(seed: int = 0, own_embed: bool = True) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def w(*shape: int) -> torch.Tensor:
        return (torch.randn(shape, generator=g) * 0.05).to(torch.bfloat16)

    target_ids = torch.randperm(V, generator=g)[:VD].sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[target_ids] = True
    tensors = {
        "fc.weight": w(D, 3 * DT),
        "midlayer.input_layernorm.weight": 1 + w(D),
        "midlayer.hidden_norm.weight": 1 + w(D),
        "midlayer.post_attention_layernorm.weight": 1 + w(D),
        "midlayer.self_attn.q_proj.weight": w(HEADS * HD, 2 * D),
        "midlayer.self_attn.k_proj.weight": w(KV * HD, 2 * D),
        "midlayer.self_attn.v_proj.weight": w(KV * HD, 2 * D),
        "midlayer.self_attn.o_proj.weight": w(D, HEADS * HD),
        "midlayer.mlp.gate_proj.weight": w(INTER, D),
        "midlayer.mlp.up_proj.weight": w(INTER, D),
        "midlayer.mlp.down_proj.weight": w(D, INTER),
        "norm.weight": 1 + w(D),
        "lm_head.weight": w(VD, D),
        "d2t": target_ids - torch.arange(VD),
        "t2d": t2d,
    }
    if own_embed:
        tensors["embed_tokens.weight"] = w(V, D)
    return tensors


def write_public_head(folder: Path, tensors: dict[str, torch.Tensor]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(public_config(), indent=2))
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="module")
def target_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_llama(tmp_path_factory.mktemp("wide_target"), vocab_size=V, hidden=DT,
                              layers=7, heads=4, kv_heads=2, intermediate=96)


def test_public_layout_loads_and_runs(tmp_path: Path, target_folder: Path) -> None:
    tensors = public_tensors()
    head = write_public_head(tmp_path / "head", tensors)
    target, mcfg, _ = load_target(target_folder)
    draft, layers = load_eagle3(head, target)
    assert layers == mcfg.aux_layer_ids() == (2, 3, 4)
    assert draft.config.hidden_size == D and draft.config.target_hidden_size == DT
    assert draft.embed is not None and draft.embed is not target.model.embed_tokens
    torch.testing.assert_close(draft.embed.weight, tensors["embed_tokens.weight"].float())
    torch.testing.assert_close(draft.draft_to_target(torch.arange(VD)),
                               tensors["t2d"].nonzero().flatten())
    # the drafter's whole-vocab table: the same ids, rebuilt when d2t is written in place
    assert draft.target_ids().tolist() == draft.draft_to_target(torch.arange(VD)).tolist()
    with torch.no_grad():
        draft.d2t[0] += 1
    assert draft.target_ids()[0] == draft.draft_to_target(torch.tensor([0]))[0]

    b, t = 2, 7
    taps = torch.randn(b, t, 3 * DT)
    tokens = torch.randint(0, V, (b, t))
    causal = torch.ones(t, t).tril().bool()
    with torch.no_grad():
        logits, out, k, v = draft.forward_dense(tokens, draft.fuse_features(taps), torch.arange(t),
                                                causal)
        # One fed-back step at position t, attending to every key so far.
        logits2, _, _, _ = draft.forward_dense(tokens[:, -1:], out[:, -1:], torch.tensor([t]),
                                               torch.ones(1, t + 1, dtype=torch.bool), k, v)
    assert logits.shape == (b, t, VD) and logits2.shape == (b, 1, VD)
    assert out.shape == (b, t, D) and k.shape == (b, t, KV, HD)
    assert bool(torch.isfinite(logits).all()) and bool(torch.isfinite(logits2).all())


def test_head_without_embedding_must_match_target_width(tmp_path: Path,
                                                        target_folder: Path) -> None:
    head = write_public_head(tmp_path / "head", public_tensors(own_embed=False))
    with pytest.raises(CheckpointError, match="embed_tokens.weight"):
        load_eagle3(head, load_target(target_folder)[0])


def test_mis_shaped_tensor_is_named(tmp_path: Path, target_folder: Path) -> None:
    tensors = public_tensors()
    tensors["fc.weight"] = tensors["fc.weight"][:, :-1].contiguous()
    head = write_public_head(tmp_path / "head", tensors)
    with pytest.raises(CheckpointError, match="fc.weight"):
        load_eagle3(head, load_target(target_folder)[0])
