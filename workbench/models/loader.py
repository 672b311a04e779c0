"""Load targets (HF folders of single or sharded safetensors; GGUF files, workbench/models/gguf.py)
and EAGLE-3 draft checkpoints."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from workbench.errors import CheckpointError, ConfigError
from workbench.models.config import ModelConfig
from workbench.models.ct_loader import quantization_config, read_pack_quantized
from workbench.models.eagle3 import Eagle3Config, Eagle3Draft
from workbench.models.gguf import find_gguf, hf_config, open_gguf, read_quant, read_tensors
from workbench.models.llama import LlamaForCausalLM, rope_inv_freq
from workbench.models.moe_model import MoeForCausalLM

Target = LlamaForCausalLM | MoeForCausalLM

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "float64": torch.float64}


def resolve_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise ConfigError(f"dtype: {name!r} is not one of {sorted(DTYPES)}")
    return DTYPES[name]


def resolve_path(path: str | Path) -> Path:
    """A local folder or ``.gguf`` file (a pointer folder, ``gguf.json``, resolves to the cache
    folder it names), or a hub id resolved through the local HF cache (download if online)."""
    p = Path(path)
    if p.is_file() and p.suffix == ".gguf":
        return p
    if p.is_dir():
        if (p / "gguf.json").is_file():
            from workbench.models.fetch import resolve_pointer

            return resolve_pointer(p)
        return p
    s = str(path)
    if s.count("/") == 1 and not s.startswith((".", "/")):
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError

        try:
            return Path(snapshot_download(s, allow_patterns=["*.json", "*.safetensors",
                                                             "tokenizer*"]))
        except LocalEntryNotFoundError as e:
            raise ConfigError(f"model {s!r}: not a local folder and not in the HF cache, and the "
                              f"hub cannot be reached (offline?): {e}") from e
    raise ConfigError(f"model path {s!r}: folder does not exist")


def read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    """All tensors of ``model.safetensors`` or of the shards listed in its index."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (folder / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise CheckpointError(f"{folder}: no model.safetensors or model.safetensors.index.json")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        fp = folder / f
        if not fp.is_file():
            raise CheckpointError(f"{folder}: shard {f!r} listed in the index is missing")
        with safe_open(str(fp), framework="pt") as sf:
            for k in sf.keys():
                out[k] = sf.get_tensor(k)
    return out


def load_state(module: nn.Module, tensors: dict[str, torch.Tensor], dtype: torch.dtype,
               optional: tuple[str, ...] = (), ignore_prefixes: tuple[str, ...] = ()) -> None:
    """Copy tensors into ``module``; missing or mis-shaped tensors raise naming both shapes."""
    expected = dict(module.state_dict())
    for name, param in expected.items():
        if name not in tensors:
            if name in optional:
                continue
            raise CheckpointError(f"missing tensor {name!r} (expected shape {tuple(param.shape)})")
        t = tensors[name]
        if tuple(t.shape) != tuple(param.shape):
            raise CheckpointError(f"tensor {name!r} has shape {tuple(t.shape)}, expected "
                                  f"{tuple(param.shape)}")
        with torch.no_grad():
            param.copy_(t.to(param.dtype if not param.is_floating_point() else dtype))
    unknown = [k for k in tensors if k not in expected and not k.startswith(ignore_prefixes)]
    if unknown:
        raise CheckpointError(f"unexpected tensors {unknown[:5]} (architecture mismatch?)")


def text_tensors(tensors: dict[str, torch.Tensor],
                 cfg: ModelConfig) -> tuple[dict[str, torch.Tensor], str]:
    """The text model's tensors under the runtime's names, and a note of what was skipped:
    a multimodal checkpoint's other parts (Kimi-K2.5: vision tower, projector) and layers past
    ``num_hidden_layers`` (DeepSeek-V3's multi-token-prediction layers)."""
    skipped: dict[str, int] = {}
    out: dict[str, torch.Tensor] = {}
    layer_re = re.compile(r"^model\.(?:layers|blocks)\.(\d+)\.")
    for name, t in tensors.items():
        if cfg.skipped_prefixes and name.startswith(cfg.skipped_prefixes):
            part = name.split(".")[0] if not name.startswith("model.") else ".".join(
                name.split(".")[:2])
            skipped[part] = skipped.get(part, 0) + 1
            continue
        if cfg.text_prefix:
            if not name.startswith(cfg.text_prefix):
                raise CheckpointError(f"tensor {name!r}: neither under the text model's "
                                      f"{cfg.text_prefix!r} nor a skipped part "
                                      f"{list(cfg.skipped_prefixes)}")
            name = name[len(cfg.text_prefix):]
        m = layer_re.match(name)
        if m:
            if int(m.group(1)) >= cfg.num_hidden_layers:
                skipped["layers past num_hidden_layers"] = skipped.get(
                    "layers past num_hidden_layers", 0) + 1
                continue
            name = f"model.layers.{m.group(1)}.{name[m.end():]}"
        out[name] = t
    note = ", ".join(f"{n} {k} tensors" for k, n in sorted(skipped.items()))
    return out, (f"skipped {note} (text model only)" if note else "")


def load_target(path: str | Path, dtype: str | torch.dtype = "float32",
                device: str = "cpu") -> tuple[Target, ModelConfig, Path]:
    """A target folder or GGUF file → (model, config, path), ``path`` as :func:`resolve_path`
    gives it (a pointer folder's cache folder, a GGUF file itself). Dense families build
    :class:`LlamaForCausalLM`, MoE families :class:`MoeForCausalLM`; ``model.load_note`` says
    what a multimodal checkpoint's loader skipped (empty otherwise) or which GGUF was
    dequantised."""
    folder = resolve_path(path)
    dt = resolve_dtype(dtype)
    gguf_file = find_gguf(folder)
    if gguf_file is not None:
        return _load_gguf(gguf_file, dt, device) + (folder,)
    cfg = ModelConfig.from_folder(folder)
    model: Target
    with torch.device("meta"):
        model = MoeForCausalLM(cfg) if cfg.is_moe else LlamaForCausalLM(cfg)
    model = model.to_empty(device=device).to(dt)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    raw, quant = read_safetensors(folder), {}
    qcfg = quantization_config(folder)
    if qcfg is not None:  # compressed-tensors pack-quantized: dequantised + kept packed
        raw, quant = read_pack_quantized(raw, qcfg, dt)
    tensors, note = text_tensors(raw, cfg)
    optional = ("lm_head.weight",) if cfg.tie_word_embeddings else ()
    load_state(model, tensors, dt, optional=optional,
               ignore_prefixes=("model.rotary_emb",))
    if isinstance(model, MoeForCausalLM):
        model.reset_rope(device)
    else:
        model.model.rotary_emb.inv_freq = rope_inv_freq(cfg).to(device)  # buffer, not in file
    model.load_note = note
    if quant and torch.device(device).type == "cpu":
        model.quant = text_tensors(quant, cfg)[0]  # type: ignore[arg-type]
    model.eval().requires_grad_(False)
    return model, cfg, folder


def _load_gguf(path: Path, dt: torch.dtype, device: str) -> tuple[LlamaForCausalLM, ModelConfig]:
    """A GGUF file → the runtime's Llama (workbench/models/gguf.py). The dequantised tensors
    become the parameters themselves (``assign=True`` on a model built on the meta device), so
    the weights are written once and no second copy is ever alive."""
    with open_gguf(path) as f:
        cfg = ModelConfig.from_dict(hf_config(f.metadata, f.tensors))
        tensors = read_tensors(f, cfg, dt, device)
        quant = read_quant(f, cfg) if torch.device(device).type == "cpu" else {}
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg).to(dt)
    needed = {k for k in model.state_dict() if not k.startswith("model.rotary_emb")}
    if cfg.tie_word_embeddings:
        needed.discard("lm_head.weight")
    for name in sorted(set(tensors) - needed):
        raise CheckpointError(f"{path}: GGUF tensor for {name!r}: the model has no such "
                              "parameter")
    for name in sorted(needed - set(tensors)):
        raise CheckpointError(f"{path}: no GGUF tensor for {name!r}")
    for name, t in tensors.items():
        want = model.get_parameter(name)
        if tuple(t.shape) != tuple(want.shape):
            raise CheckpointError(f"{path}: tensor {name!r} has shape {tuple(t.shape)}, "
                                  f"expected {tuple(want.shape)}")
    model.load_state_dict(tensors, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.model.rotary_emb.inv_freq = rope_inv_freq(cfg).to(device)  # buffer, not in file
    model.quant = quant  # the packed form (EngineConfig.weights; models/quant.py)
    model.load_note = f"dequantised {path.name} to {str(dt).removeprefix('torch.')}"
    model.eval().requires_grad_(False)
    return model, cfg


def load_tokenizer(path: str | Path) -> Any:
    """The tokenizer of a model path (after :func:`resolve_path`), or None when it has none: a
    folder's ``tokenizer.json`` / ``tokenizer_config.json`` (AutoTokenizer), else a GGUF file's
    own vocabulary and chat template (transformers' GGUF conversion)."""
    p = Path(path)
    if p.is_dir() and ((p / "tokenizer.json").is_file() or
                       (p / "tokenizer_config.json").is_file()):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(p))
    gguf_file = find_gguf(p)
    if gguf_file is not None:
        from workbench.models.gguf import has_tokenizer
        from workbench.models.gguf import load_tokenizer as gguf_tokenizer

        return gguf_tokenizer(gguf_file) if has_tokenizer(gguf_file) else None
    return None


def transformers_source(path: str | Path) -> tuple[str, dict[str, str]]:
    """What transformers' ``from_pretrained`` takes for a model path: the folder, plus
    ``gguf_file=<name>`` for a GGUF (``AutoModelForCausalLM.from_pretrained(folder, **kw)``
    then dequantises it with its own GGUF loader)."""
    p = resolve_path(path)
    gguf_file = find_gguf(p)
    if gguf_file is None:
        return str(p), {}
    return str(gguf_file.parent), {"gguf_file": gguf_file.name}


def load_eagle3(path: str | Path, target: Target, dtype: str | torch.dtype = "float32",
                device: str = "cpu") -> tuple[Eagle3Draft, tuple[int, ...]]:
    """Load a LlamaForCausalLMEagle3 checkpoint; refuse one made for another target."""
    folder = resolve_path(path)
    cfg = Eagle3Config.from_folder(folder)
    layers = cfg.check_target(target.config)
    dt = resolve_dtype(dtype)
    draft = Eagle3Draft(cfg).to(device=device, dtype=dt)
    tensors = read_safetensors(folder)
    own_embed = tensors.pop("embed_tokens.weight", None)
    load_state(draft, tensors, dt, ignore_prefixes=("rotary",))
    if own_embed is not None:
        emb = nn.Embedding(*own_embed.shape).to(device=device, dtype=dt)
        with torch.no_grad():
            emb.weight.copy_(own_embed.to(dt))
        draft.set_embedding(emb)
    else:
        draft.set_embedding(target.model.embed_tokens)
    if int(draft.t2d.sum()) != cfg.draft_vocab_size:
        raise CheckpointError(f"t2d marks {int(draft.t2d.sum())} target ids, expected "
                              f"draft_vocab_size {cfg.draft_vocab_size}")
    mapped = torch.arange(cfg.draft_vocab_size, device=device) + draft.d2t
    if int(mapped.min()) < 0 or int(mapped.max()) >= cfg.vocab_size:
        raise CheckpointError("d2t maps draft ids outside the target vocab")
    draft.eval().requires_grad_(False)
    return draft, layers


def save_eagle3(draft: Eagle3Draft, folder: str | Path) -> None:
    """Write the standard EAGLE-3 checkpoint (config.json + model.safetensors; docs/REFERENCE.md
    §6)."""
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(draft.config.to_hf_dict(), indent=2) + "\n")
    state = {k: v.detach().cpu().contiguous().clone() for k, v in draft.state_dict().items()
             if not k.startswith(("embed.", "rotary."))}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
