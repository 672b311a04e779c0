"""The target runtime agrees with transformers: prefill logits, every decode step, generate."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from workbench.attention.paged import PagedAttention
from workbench.engine.kv_cache import KVPool
from workbench.models.loader import load_target

transformers = pytest.importorskip("transformers")

CONFIGS = {
    "llama_gqa_tied_llama3rope": dict(
        arch="llama", tie_word_embeddings=True,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "llama_linear_rope_sharded": dict(arch="llama", rope_scaling={"rope_type": "linear",
                                                                  "factor": 2.0}, shard=True),
    "qwen2_bias": dict(arch="qwen2"),
    "qwen3_qknorm": dict(arch="qwen3"),
}


def write_model(folder: Path, arch: str, shard: bool = False, **extra: object) -> Path:
    common = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  rms_norm_eps=1e-5, eos_token_id=96, bos_token_id=0)
    common.update(extra)
    if arch == "llama":
        cfg = transformers.LlamaConfig(**common)
        model = transformers.LlamaForCausalLM(cfg)
    elif arch == "qwen2":
        cfg = transformers.Qwen2Config(**common)
        model = transformers.Qwen2ForCausalLM(cfg)
    else:
        cfg = transformers.Qwen3Config(head_dim=16, **common)
        model = transformers.Qwen3ForCausalLM(cfg)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():  # larger init so logits are far from ties
            p.normal_(0, 0.2)
    model.save_pretrained(str(folder), max_shard_size="50KB" if shard else "5GB")
    return folder


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def hf_folder(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    spec = dict(CONFIGS[request.param])
    folder = tmp_path_factory.mktemp(request.param)
    return write_model(folder, str(spec.pop("arch")), bool(spec.pop("shard", False)), **spec)


def test_sharded_checkpoint_really_is_sharded(tmp_path: Path) -> None:
    f = write_model(tmp_path, "llama", shard=True)
    assert (f / "model.safetensors.index.json").is_file()


def test_prefill_and_every_decode_step_match_transformers(hf_folder: Path) -> None:
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(hf_folder)).eval()
    model, cfg, _ = load_target(hf_folder)
    model.fuse()
    pool = KVPool(16, 8, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim,
                  torch.float32, "cpu")
    attn = PagedAttention(pool.k, pool.v, cfg.num_attention_heads)
    blocks: list[int] = []
    g = torch.Generator().manual_seed(1)
    seq = torch.randint(0, cfg.vocab_size, (11,), generator=g).tolist()
    pool.reserve(blocks, 64)
    # Prefill.
    slots = pool.slots(blocks, 0, len(seq))
    attn.plan(slots, [len(seq)], [slots])
    with torch.no_grad():
        h, _ = model(torch.tensor(seq), torch.arange(len(seq)), attn)
        ours = model.logits(h)
        theirs = ref(torch.tensor([seq])).logits[0]
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
    # Every incremental decode step against a full recompute by transformers.
    for _ in range(20):
        nxt = int(ours[-1].argmax())
        seq.append(nxt)
        n = len(seq)
        slots = pool.slots(blocks, 0, n)
        attn.plan(slots[-1:], [1], [slots])
        with torch.no_grad():
            h, _ = model(torch.tensor([nxt]), torch.tensor([n - 1]), attn)
            ours = model.logits(h)
            theirs = ref(torch.tensor([seq])).logits[0, -1:]
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


def test_greedy_generate_matches_transformers(hf_folder: Path) -> None:
    import workbench as wb

    ref = transformers.AutoModelForCausalLM.from_pretrained(str(hf_folder)).eval()
    prompt = [5, 17, 3, 44, 8, 61, 2]
    with torch.no_grad():
        out = ref.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False,
                           eos_token_id=None, pad_token_id=0, min_new_tokens=32)
    expected = out[0, len(prompt):].tolist()
    engine = wb.Engine.from_pretrained(hf_folder, config=wb.EngineConfig(kv_budget_tokens=512))
    got = engine.generate([prompt], wb.SamplingParams(max_new_tokens=32, ignore_eos=True))
    assert got[0].token_ids == expected
    assert engine.kv_usage()["used_blocks"] == 0
    engine.close()
