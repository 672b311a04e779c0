"""GGUF checkpoints (llama.cpp's single-file format) read into the workbench's Llama.

A GGUF file holds a header (magic ``GGUF``, version, tensor and key-value counts), typed
key-value metadata (``general.architecture``, ``llama.block_count``, the tokenizer's vocabulary,
merges and chat template ...), one record per tensor (name, dims with the fastest-varying first,
ggml type, offset) and, after padding to ``general.alignment``, the tensor data. This module
parses the header itself (a stream of length-prefixed records; the tokenizer's 100 k strings
are read in well under a second) so that a truncated or corrupt file fails with the byte offset
and field that are wrong, maps the metadata to an HF config dict (``ModelConfig.from_dict``
reads it), and dequantises each
tensor with the ``gguf`` package's reference kernels (``gguf.quants.dequantize``, the same code
transformers' GGUF loader runs) to the engine's dtype.

Two llama.cpp conventions are undone on the way in:

* **names**: ``token_embd`` / ``blk.N.attn_q`` / ``ffn_gate`` / ``output_norm`` / ``output`` →
  the HF names the runtime uses (``model.embed_tokens``, ``model.layers.N.self_attn.q_proj``
  ...). A file without ``output.weight`` ties the LM head to the embedding.
* **the Q/K row permutation**: llama.cpp's converter reorders each head's rows of ``attn_q`` and
  ``attn_k`` from HF's rotate-half rope layout (first half / second half of the head) to
  interleaved pairs (row ``2i`` and ``2i+1`` rotate together). With ``d`` the head dim, the
  file's row ``2i + j`` (``j`` in {0, 1}) of a head is HF's row ``i + j*d/2``; reading the head's
  rows as a ``(d/2, 2)`` grid and transposing it to ``(2, d/2)`` restores HF's order.

Supported: ``general.architecture`` ``llama`` (Llama, SmolLM, Mistral-as-llama; no experts, no
rope scaling), tensor types F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0. Anything else is
refused naming the field or the tensor and its type.
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from workbench.errors import CheckpointError, ConfigError
from workbench.models.quant import PACKABLE, QuantTensor, from_gguf_blocks

if TYPE_CHECKING:
    from workbench.models.config import ModelConfig

SUFFIX = ".gguf"
MAGIC = b"GGUF"
VERSIONS = (2, 3)
ARCHITECTURES = ("llama",)
DEFAULT_ALIGNMENT = 32

# ggml tensor types this loader dequantises (name → ggml type id); gguf.GGMLQuantizationType
# numbers them the same way.
TENSOR_TYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8,
                "BF16": 30}

# GGUF metadata value types: id → (name, struct format of a scalar, or None)
_SCALARS = {0: ("uint8", "<B"), 1: ("int8", "<b"), 2: ("uint16", "<H"), 3: ("int16", "<h"),
            4: ("uint32", "<I"), 5: ("int32", "<i"), 6: ("float32", "<f"), 7: ("bool", "<?"),
            10: ("uint64", "<Q"), 11: ("int64", "<q"), 12: ("float64", "<d")}
_NP = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
       6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9

# per-layer tensor names: GGUF suffix → runtime suffix
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
              "output_norm.weight": "model.norm.weight",
              "output.weight": "lm_head.weight"}


@dataclass(frozen=True)
class TensorInfo:
    """One tensor record: ``dims`` as the file gives them (fastest-varying first)."""

    name: str
    dims: tuple[int, ...]
    type_id: int
    offset: int  # from the start of the data section

    @property
    def shape(self) -> tuple[int, ...]:
        """The row-major (torch / numpy) shape: the dims reversed."""
        return tuple(reversed(self.dims))

    @property
    def type_name(self) -> str:
        from gguf import GGMLQuantizationType

        try:
            return GGMLQuantizationType(self.type_id).name
        except ValueError:
            return f"unknown type {self.type_id}"


@dataclass
class GGUFFile:
    """A parsed GGUF file: its metadata, tensor records and the mapped data section."""

    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]
    data_start: int
    size: int
    _buf: mmap.mmap | None = field(default=None, repr=False)

    def close(self) -> None:
        """Unmap the file. While a numpy view of its bytes is alive (a caller's ``raw()``, an
        error's traceback frame) the map cannot close: it then closes when the last view goes,
        and the error being raised is not masked by this one."""
        buf, self._buf = self._buf, None
        if buf is not None:
            _unmap(buf)

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def raw(self, t: TensorInfo) -> np.ndarray:
        """The tensor's bytes as uint8 rows (one row per dims[1:] index); CheckpointError when
        the row length is not whole blocks or the data runs past the end of the file."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(t.type_id)]
        row = t.dims[0]
        if row % block:
            raise CheckpointError(f"{self.path}: tensor {t.name!r} ({t.type_name}): row length "
                                  f"{row} is not a multiple of the block size {block}")
        rows = math.prod(t.dims[1:])  # Python ints: absurd dims cannot wrap around
        row_bytes = row // block * type_size
        start = self.data_start + t.offset
        end = start + rows * row_bytes
        if end > self.size:
            raise CheckpointError(f"{self.path}: truncated: tensor {t.name!r} needs bytes "
                                  f"[{start}, {end}) but the file has {self.size} bytes")
        assert self._buf is not None, "GGUFFile.raw after close()"
        return np.frombuffer(self._buf, dtype=np.uint8, count=end - start,
                             offset=start).reshape(rows, row_bytes)

    def tensor(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """One tensor dequantised (``gguf.quants.dequantize``) to ``dtype``, in row-major shape."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        t = self.tensors[name]
        if t.type_id not in TENSOR_TYPES.values():
            raise CheckpointError(
                f"{self.path}: tensor {t.name!r} has type {t.type_name}; supported: "
                f"{', '.join(TENSOR_TYPES)}")
        # float32, one row per record row
        values = dequantize(self.raw(t), GGMLQuantizationType(t.type_id))
        if not values.flags.writeable:  # F32 comes back as a view of the mapped file: own it
            values = values.copy()
        return torch.from_numpy(values.reshape(t.shape)).to(dtype)


def _unmap(buf: mmap.mmap) -> None:
    """Close ``buf`` unless numpy views of it are alive; those then keep it until they go."""
    try:
        buf.close()
    except BufferError:
        del buf  # the views hold the map; dropping this reference leaves it to them


class _Cursor:
    """Reads little-endian records from a buffer; every short read names what it was reading."""

    def __init__(self, path: Path, buf: mmap.mmap) -> None:
        self.path, self.buf, self.pos = path, buf, 0

    def take(self, fmt: str, what: str) -> Any:
        n = struct.calcsize(fmt)
        if self.pos + n > len(self.buf):
            raise CheckpointError(f"{self.path}: truncated at byte {self.pos} while reading "
                                  f"{what} (file has {len(self.buf)} bytes)")
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return v

    def string(self, what: str) -> str:
        n = self.take("<Q", f"the length of {what}")
        if self.pos + n > len(self.buf):
            raise CheckpointError(f"{self.path}: truncated at byte {self.pos} while reading "
                                  f"{what} ({n} bytes; file has {len(self.buf)} bytes)")
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise CheckpointError(f"{self.path}: {what} is not UTF-8 ({e})") from None

    def value(self, vtype: int, what: str) -> Any:
        if vtype in _SCALARS:
            return self.take(_SCALARS[vtype][1], what)
        if vtype == _STRING:
            return self.string(what)
        if vtype == _ARRAY:
            etype = self.take("<I", f"the element type of {what}")
            count = self.take("<Q", f"the length of {what}")
            if etype in _NP:  # a numeric array: one read
                item = np.dtype(_NP[etype]).itemsize
                if self.pos + count * item > len(self.buf):
                    raise CheckpointError(f"{self.path}: truncated at byte {self.pos} while "
                                          f"reading {what} ({count} items)")
                arr: np.ndarray = np.frombuffer(self.buf, dtype=_NP[etype], count=count,
                                                offset=self.pos)
                self.pos += count * item
                return arr.tolist()
            return [self.value(etype, f"{what}[{i}]") for i in range(count)]
        raise CheckpointError(f"{self.path}: {what}: unknown GGUF value type {vtype} at byte "
                              f"{self.pos}")


def open_gguf(path: str | Path) -> GGUFFile:
    """Parse a GGUF file's header, metadata and tensor records (the data stays mapped, read
    when a tensor is asked for). CheckpointError on a file that is not GGUF, of another
    version, truncated or with overlapping/out-of-file tensors."""
    p = Path(path)
    if not p.is_file():
        raise CheckpointError(f"GGUF file {str(p)!r} does not exist")
    with open(p, "rb") as fh:
        size = p.stat().st_size
        if size < 24:
            raise CheckpointError(f"{p}: truncated: {size} bytes, shorter than a GGUF header")
        buf = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        return _parse(p, buf, size)
    except BaseException:
        _unmap(buf)
        raise


def _parse(p: Path, buf: mmap.mmap, size: int) -> GGUFFile:
    cur = _Cursor(p, buf)
    if bytes(buf[:4]) != MAGIC:
        raise CheckpointError(f"{p}: not a GGUF file (magic {bytes(buf[:4])!r}, expected "
                              f"{MAGIC!r})")
    cur.pos = 4
    version = cur.take("<I", "the version")
    if version not in VERSIONS:
        raise CheckpointError(f"{p}: GGUF version {version} (supported: {VERSIONS})")
    n_tensors = cur.take("<Q", "the tensor count")
    n_kv = cur.take("<Q", "the metadata count")
    if n_tensors > size // 24 or n_kv > size // 12:  # each record takes at least that many bytes
        raise CheckpointError(f"{p}: corrupt header: {n_tensors} tensors, {n_kv} metadata "
                              f"entries in a {size}-byte file")
    meta: dict[str, Any] = {}
    for i in range(n_kv):
        key = cur.string(f"metadata key #{i}")
        vtype = cur.take("<I", f"the type of metadata {key!r}")
        meta[key] = cur.value(vtype, f"metadata {key!r}")
    tensors: dict[str, TensorInfo] = {}
    for i in range(n_tensors):
        name = cur.string(f"tensor name #{i}")
        n_dims = cur.take("<I", f"the dim count of tensor {name!r}")
        if not 1 <= n_dims <= 4:
            raise CheckpointError(f"{p}: tensor {name!r}: {n_dims} dims (GGUF allows 1-4)")
        dims = tuple(cur.take("<Q", f"dim {d} of tensor {name!r}") for d in range(n_dims))
        type_id = cur.take("<I", f"the type of tensor {name!r}")
        offset = cur.take("<Q", f"the offset of tensor {name!r}")
        if name in tensors:
            raise CheckpointError(f"{p}: tensor {name!r} appears twice")
        tensors[name] = TensorInfo(name, dims, type_id, offset)
    align = meta.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(align, int) or align <= 0 or align & (align - 1):
        raise CheckpointError(f"{p}: general.alignment: {align!r} is not a power of two")
    data_start = -(-cur.pos // align) * align
    if data_start > size and tensors:
        raise CheckpointError(f"{p}: truncated: the data section starts at byte {data_start} "
                              f"but the file has {size} bytes")
    return GGUFFile(p, version, meta, tensors, data_start, size, buf)


def find_gguf(path: str | Path) -> Path | None:
    """The GGUF file ``path`` names: the file itself, or the only ``.gguf`` in a folder that
    holds no safetensors; None for anything else (a folder with safetensors is an HF folder,
    whatever else lies in it). A folder of several GGUF files and no safetensors is ambiguous:
    ConfigError naming them."""
    p = Path(path)
    if p.is_file():
        return p if p.suffix == SUFFIX else None
    if not p.is_dir() or any(p.glob("*.safetensors")):
        return None
    ggufs = sorted(p.glob(f"*{SUFFIX}"))
    if len(ggufs) > 1:
        raise ConfigError(f"model path {str(p)!r}: several GGUF files "
                          f"({', '.join(g.name for g in ggufs)}); name one of them")
    return ggufs[0] if ggufs else None


def _field(meta: dict[str, Any], key: str, kind: type | tuple[type, ...],
           default: Any = ...) -> Any:
    if key not in meta:
        if default is ...:
            raise ConfigError(f"GGUF metadata {key!r}: missing")
        return default
    v = meta[key]
    if isinstance(v, bool) or not isinstance(v, kind):
        raise ConfigError(f"GGUF metadata {key!r}: expected {kind}, got {v!r}")
    return v


def _positive(meta: dict[str, Any], key: str, default: Any = ...) -> int:
    v = _field(meta, key, int, default)
    if v <= 0:
        raise ConfigError(f"GGUF metadata {key!r}: expected a positive integer, got {v!r}")
    return int(v)


def hf_config(meta: dict[str, Any], tensors: dict[str, TensorInfo]) -> dict[str, Any]:
    """A GGUF file's metadata (llama family) as the HF ``config.json`` dict it stands for
    (``ModelConfig.from_dict`` reads it); ConfigError naming the field for another
    architecture, experts, rope scaling or inconsistent head sizes."""
    arch = _field(meta, "general.architecture", str)
    if arch not in ARCHITECTURES:
        raise ConfigError(f"GGUF metadata 'general.architecture': {arch!r} is not supported "
                          f"(supported: {', '.join(ARCHITECTURES)})")
    a = f"{arch}."
    experts = _field(meta, a + "expert_count", int, 0)
    if experts:
        raise ConfigError(f"GGUF metadata {a + 'expert_count'!r}: {experts} (mixture-of-experts "
                          "GGUF files are not supported)")
    scaling = _field(meta, a + "rope.scaling.type", str, "none")
    if scaling != "none":
        raise ConfigError(f"GGUF metadata {a + 'rope.scaling.type'!r}: {scaling!r} (only "
                          "unscaled rope is supported)")
    if "rope_freqs.weight" in tensors:
        raise CheckpointError("GGUF tensor 'rope_freqs.weight': per-frequency rope factors "
                              "(Llama-3.1-style scaling) are not supported")
    hidden = _positive(meta, a + "embedding_length")
    heads = _positive(meta, a + "attention.head_count")
    kv = _positive(meta, a + "attention.head_count_kv", heads)
    if heads % kv:
        raise ConfigError(f"GGUF metadata {a + 'attention.head_count_kv'!r}: {kv} does not "
                          f"divide {a + 'attention.head_count'!r} {heads}")
    if hidden % heads and a + "attention.key_length" not in meta:
        raise ConfigError(f"GGUF metadata {a + 'attention.head_count'!r}: {heads} does not "
                          f"divide {a + 'embedding_length'!r} {hidden}")
    head_dim = _positive(meta, a + "attention.key_length", hidden // heads)
    v_dim = _positive(meta, a + "attention.value_length", head_dim)
    if v_dim != head_dim:
        raise ConfigError(f"GGUF metadata {a + 'attention.value_length'!r}: {v_dim} differs "
                          f"from the key length {head_dim}")
    if head_dim % 2:
        raise ConfigError(f"GGUF metadata {a + 'attention.key_length'!r}: head dim {head_dim} "
                          "is odd (rope rotates pairs)")
    rope_dims = _positive(meta, a + "rope.dimension_count", head_dim)
    if rope_dims != head_dim:
        raise ConfigError(f"GGUF metadata {a + 'rope.dimension_count'!r}: {rope_dims} differs "
                          f"from the head dim {head_dim} (partial rotary is not supported)")
    tokens = meta.get("tokenizer.ggml.tokens")
    embd = tensors.get("token_embd.weight")
    vocab_default = (len(tokens) if isinstance(tokens, list) else
                     embd.dims[-1] if embd is not None else ...)
    vocab = _positive(meta, a + "vocab_size", vocab_default)
    eos: list[int] = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"):
        tid = _field(meta, key, int, None)
        if tid is not None and tid not in eos:
            eos.append(tid)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": _positive(meta, a + "feed_forward_length"),
        "num_hidden_layers": _positive(meta, a + "block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": head_dim,
        "rms_norm_eps": float(_field(meta, a + "attention.layer_norm_rms_epsilon", float)),
        "rope_theta": float(_field(meta, a + "rope.freq_base", (float, int), 10000.0)),
        "max_position_embeddings": _positive(meta, a + "context_length", 2048),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": False,
        "mlp_bias": False,
        "hidden_act": "silu",
        "bos_token_id": _field(meta, "tokenizer.ggml.bos_token_id", int, None),
        "eos_token_id": eos,
        "torch_dtype": "float32",
    }


def read_hf_config(path: str | Path) -> dict[str, Any]:
    """:func:`hf_config` of a file (metadata only; the tensors are not read)."""
    with open_gguf(path) as f:
        return hf_config(f.metadata, f.tensors)


def runtime_name(name: str, n_layers: int) -> str:
    """A GGUF tensor name → the runtime's; CheckpointError for a name the runtime has no
    place for (another architecture's tensor, a bias, a layer past ``block_count``)."""
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
        if int(parts[1]) >= n_layers:
            raise CheckpointError(f"GGUF tensor {name!r}: layer {parts[1]} past block_count "
                                  f"{n_layers}")
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    raise CheckpointError(f"GGUF tensor {name!r}: not a llama tensor the runtime loads")


def unpermute_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row order: each head's rows ``(d/2, 2)`` → ``(2, d/2)``."""
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise CheckpointError(f"Q/K weight with {rows} rows: not {n_head} heads of an even "
                              "head dim")
    d2 = rows // n_head // 2
    return w.reshape(n_head, d2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def read_tensors(f: GGUFFile, cfg: ModelConfig, dtype: torch.dtype,
                 device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Every tensor of ``f`` dequantised to ``dtype`` on ``device`` under the runtime's names,
    Q/K rows in HF order. A tensor the runtime expects but the file lacks raises naming both
    names; a tensor it has no place for raises naming it."""
    expected = {f"model.layers.{i}.{hf}": f"blk.{i}.{g}"
                for i in range(cfg.num_hidden_layers) for g, hf in _LAYER_NAMES.items()}
    expected.update({hf: g for g, hf in _TOP_NAMES.items()})
    if cfg.tie_word_embeddings:
        expected.pop("lm_head.weight")
    missing = [(g, hf) for hf, g in expected.items() if g not in f.tensors]
    if missing:
        g, hf = missing[0]
        raise CheckpointError(f"{f.path}: GGUF tensor {g!r} ({hf}) is missing"
                              + (f" ({len(missing)} missing in all)" if len(missing) > 1 else ""))
    out: dict[str, torch.Tensor] = {}
    for name in f.tensors:
        hf = runtime_name(name, cfg.num_hidden_layers)
        t = f.tensor(name, dtype)
        if name.endswith(".attn_q.weight"):
            t = unpermute_rows(t, cfg.num_attention_heads)
        elif name.endswith(".attn_k.weight"):
            t = unpermute_rows(t, cfg.num_key_value_heads)
        out[hf] = t.to(device)
    return out


def read_quant(f: GGUFFile, cfg: ModelConfig) -> dict[str, QuantTensor]:
    """The file's Q4_0 / Q4_1 / Q8_0 tensors kept quantised (codes and block scales,
    ``models/quant.py``) under the runtime's names, Q/K rows in HF order; other types are left
    out (they run dequantised)."""
    out: dict[str, QuantTensor] = {}
    for name, t in f.tensors.items():
        if t.type_name not in PACKABLE or len(t.shape) != 2:
            continue
        qt = from_gguf_blocks(f.raw(t), t.type_name, (t.shape[0], t.shape[1]))
        heads = {".attn_q.weight": cfg.num_attention_heads,
                 ".attn_k.weight": cfg.num_key_value_heads}
        for suffix, n_head in heads.items():
            if name.endswith(suffix):
                qt = qt.rows(unpermute_rows(torch.arange(t.shape[0]), n_head))
        out[runtime_name(name, cfg.num_hidden_layers)] = qt
    return out


def has_tokenizer(path: str | Path) -> bool:
    """Whether the file carries a tokenizer (``tokenizer.ggml.model``)."""
    with open_gguf(path) as f:
        return "tokenizer.ggml.model" in f.metadata


def load_tokenizer(path: str | Path) -> Any:
    """The file's tokenizer (vocabulary, merges, special tokens, chat template) converted by
    transformers' GGUF tokenizer conversion (``AutoTokenizer.from_pretrained(folder,
    gguf_file=name)``)."""
    from transformers import AutoTokenizer

    p = Path(path)
    with open_gguf(p) as f:
        if "tokenizer.ggml.model" not in f.metadata:
            raise ConfigError(f"{p}: GGUF metadata 'tokenizer.ggml.model': missing (the file "
                              "carries no tokenizer)")
    return AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
