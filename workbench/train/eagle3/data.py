"""Training data: the corpus as token arrays in the target's tokenizer, the target's own
continuations (regenerated windows), both cached in ``work``; random training batches and fixed
evaluation windows."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from workbench.errors import ConfigError
from workbench.models.config import ModelConfig
from workbench.train.corpus import split_corpus
from workbench.train.eagle3.config import DraftTrainConfig


def _file_key(paths: list[Path]) -> str:
    h = hashlib.sha1()
    for p in paths:
        st = p.stat()
        h.update(f"{p.resolve()}:{st.st_size}:{st.st_mtime_ns};".encode())
    return h.hexdigest()


def _cached(meta: Path, key: str) -> dict[str, Any] | None:
    """The cache's metadata in ``meta`` if it exists and was written for ``key``, else None."""
    if not meta.is_file():
        return None
    m = json.loads(meta.read_text())
    return m if m.get("key") == key else None


def corpus_tokens(cfg: DraftTrainConfig, folder: Path,
                  mcfg: ModelConfig) -> tuple[np.ndarray, np.ndarray]:
    """Corpus train / held-out token arrays (files joined by EOS) in the target's tokenizer,
    cached in ``work`` and keyed by tokenizer and corpus file list. A ``corpus`` ending in
    ``.npz`` is already tokenized (``train`` and ``heldout`` id arrays, e.g. the chat-templated
    conversations ``workbench.train.distill.pack`` writes) and is read as is."""
    if cfg.corpus.endswith(".npz"):
        return pretokenized(cfg, mcfg)
    from tokenizers import Tokenizer

    tok_path = folder / "tokenizer.json"
    if not tok_path.is_file():
        raise ConfigError(f"target {str(folder)!r}: no tokenizer.json (needed to tokenize the "
                          "corpus)")
    split = split_corpus(cfg.corpus or None)
    work = Path(cfg.work)
    key = hashlib.sha1(tok_path.read_bytes()).hexdigest() + _file_key(
        list(split.train + split.heldout))
    meta = work / "corpus.json"
    if _cached(meta, key) is not None:
        return np.load(work / "corpus_train.npy"), np.load(work / "corpus_heldout.npy")
    tok = Tokenizer.from_file(str(tok_path))
    eos = mcfg.eos_token_id[:1]
    dtype = np.uint16 if mcfg.vocab_size <= 65536 else np.int32
    arrays = []
    for which in ("train", "heldout"):
        ids: list[int] = []
        for enc in tok.encode_batch(split.read(which)):
            ids.extend(enc.ids)
            ids.extend(eos)
        arrays.append(np.asarray(ids, dtype=dtype))
    train, held = arrays
    if min(len(train), len(held)) < cfg.seq_len + 1:
        raise ConfigError(f"corpus {str(split.root)!r}: too little text ({len(train)} train / "
                          f"{len(held)} held-out tokens) for seq_len {cfg.seq_len}")
    work.mkdir(parents=True, exist_ok=True)
    np.save(work / "corpus_train.npy", train)
    np.save(work / "corpus_heldout.npy", held)
    meta.write_text(json.dumps({"key": key, "root": str(split.root)}) + "\n")
    return train, held


def pretokenized(cfg: DraftTrainConfig, mcfg: ModelConfig) -> tuple[np.ndarray, np.ndarray]:
    """The ``train`` / ``heldout`` token arrays of the ``.npz`` file ``cfg.corpus``, checked."""
    path = Path(cfg.corpus)
    if not path.is_file():
        raise ConfigError(f"corpus: {cfg.corpus!r} is not a file")
    with np.load(path) as z:
        missing = [k for k in ("train", "heldout") if k not in z.files]
        if missing:
            raise ConfigError(f"corpus {cfg.corpus!r}: no array {missing[0]!r} (has {z.files})")
        train, held = z["train"], z["heldout"]
    for name, a in (("train", train), ("heldout", held)):
        if a.ndim != 1 or not np.issubdtype(a.dtype, np.integer):
            raise ConfigError(f"corpus {cfg.corpus!r}: {name} must be a 1-D integer array, got "
                              f"{a.dtype} {a.shape}")
        if len(a) < cfg.seq_len + 1:
            raise ConfigError(f"corpus {cfg.corpus!r}: {name} has {len(a)} tokens, fewer than "
                              f"seq_len + 1 = {cfg.seq_len + 1}")
        if int(a.max()) >= mcfg.vocab_size or int(a.min()) < 0:
            raise ConfigError(f"corpus {cfg.corpus!r}: {name} has token ids outside [0, "
                              f"{mcfg.vocab_size}) (another tokenizer than the target's?)")
    return train, held


def answer_masks(cfg: DraftTrainConfig, train: np.ndarray,
                 held: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The ``train_mask`` / ``heldout_mask`` arrays of the ``.npz`` corpus (1 where the token is
    part of an answer the head is to draft), checked against the token arrays."""
    with np.load(cfg.corpus) as z:
        out = []
        for name, ids in (("train_mask", train), ("heldout_mask", held)):
            if name not in z.files:
                raise ConfigError(f"corpus {cfg.corpus!r}: answer_loss needs an array {name!r} "
                                  f"(has {z.files})")
            m = z[name]
            if m.shape != ids.shape:
                raise ConfigError(f"corpus {cfg.corpus!r}: {name} has shape {m.shape}, its "
                                  f"tokens {ids.shape}")
            if m.size and (int(m.min()) < 0 or int(m.max()) > 1):
                raise ConfigError(f"corpus {cfg.corpus!r}: {name} must hold 0/1 only")
            if not m.any():
                raise ConfigError(f"corpus {cfg.corpus!r}: {name} marks no answer token")
            out.append(m.astype(np.float32))
    return out[0], out[1]


def row_weights(mask: np.ndarray, starts: list[int], seq_len: int) -> np.ndarray:
    """(len(starts), seq_len - 1): the weight of draft row i of the window at ``s`` is
    ``mask[s + i + 2]``, the token that row predicts (0 past the end of the array)."""
    padded = np.concatenate([mask, np.zeros(2, dtype=mask.dtype)])
    return np.stack([padded[s + 2 : s + seq_len + 1] for s in starts])


def answer_starts(mask: np.ndarray, seq_len: int, picks: np.ndarray,
                  offsets: np.ndarray) -> list[int]:
    """Window starts that put answer token ``picks[k]`` (an index into the answer positions)
    under draft row ``offsets[k]`` (clipped into the array)."""
    pos = np.flatnonzero(mask)[picks]
    return np.clip(pos - 2 - offsets, 0, len(mask) - seq_len).astype(np.int64).tolist()


@torch.no_grad()
def generate_windows(folder: Path, source: np.ndarray, n: int, cfg: DraftTrainConfig,
                     seed: int, desc: str) -> np.ndarray:
    """The target's own continuations: (n, seq_len) windows = a regen_prompt_len prompt cut from
    ``source`` + seq_len - regen_prompt_len generated tokens (HF ``generate`` with KV cache; EOS
    does not stop it, as files in the corpus run on after EOS). The first regen_greedy_frac of the
    rows are greedy, the rest sampled at regen_temperature (no top-k/top-p)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(seed)
    plen, new = cfg.regen_prompt_len, cfg.seq_len - cfg.regen_prompt_len
    starts = torch.randint(0, len(source) - plen, (n,), generator=gen).tolist()
    prompts = np.stack([source[s : s + plen].astype(np.int64) for s in starts])
    n_greedy = round(n * cfg.regen_greedy_frac)
    rows = []
    for lo in tqdm(range(0, n, cfg.regen_batch), desc=desc, unit="batch", leave=False):
        hi = min(n, lo + cfg.regen_batch)
        for a, b, greedy in ((lo, min(hi, n_greedy), True), (max(lo, n_greedy), hi, False)):
            if a >= b:
                continue
            x = torch.from_numpy(prompts[a:b])
            kw: dict[str, Any] = {"do_sample": False}
            if not greedy:
                torch.manual_seed(seed * 100_003 + a)  # HF sampling draws from the global RNG
                kw = {"do_sample": True, "temperature": cfg.regen_temperature, "top_k": 0,
                      "top_p": 1.0}
            out = model.generate(input_ids=x, attention_mask=torch.ones_like(x),
                                 max_new_tokens=new, eos_token_id=None, pad_token_id=0, **kw)
            rows.append(out[:, : cfg.seq_len].numpy())
    return np.concatenate(rows).astype(source.dtype)


def regenerated(cfg: DraftTrainConfig, folder: Path, train: np.ndarray,
                held: np.ndarray) -> tuple[np.ndarray, np.ndarray, float]:
    """Train and held-out regenerated windows (cached in ``work``) and the seconds spent."""
    weights = sorted(folder.glob("*.safetensors"))
    settings = {f: getattr(cfg, f) for f in ("seq_len", "regen_sequences", "regen_prompt_len",
                                             "regen_temperature", "regen_greedy_frac",
                                             "eval_batches", "batch", "seed")}
    key = _file_key([folder / "config.json", *weights]) + json.dumps(settings, sort_keys=True)
    work = Path(cfg.work)
    meta = work / "regen.json"
    m = _cached(meta, key)
    if m is not None:
        return (np.load(work / "regen_train.npy"), np.load(work / "regen_heldout.npy"),
                float(m["seconds"]))
    t0 = time.perf_counter()
    rt = generate_windows(folder, train, cfg.regen_sequences, cfg, cfg.seed, "regen-train")
    rh = generate_windows(folder, held, cfg.eval_batches * cfg.batch, cfg, cfg.seed + 1,
                          "regen-heldout")
    seconds = time.perf_counter() - t0
    work.mkdir(parents=True, exist_ok=True)
    np.save(work / "regen_train.npy", rt)
    np.save(work / "regen_heldout.npy", rh)
    meta.write_text(json.dumps({"key": key, "seconds": seconds}) + "\n")
    return rt, rh, seconds


def sample_batch(corpus: np.ndarray, regen: np.ndarray | None, cfg: DraftTrainConfig,
                 gen: torch.Generator) -> torch.Tensor:
    """(batch, seq_len) int64: random corpus windows, the last round(batch·regen_mix) rows drawn
    from the regenerated windows when there are any."""
    n_regen = round(cfg.batch * cfg.regen_mix) if regen is not None and len(regen) else 0
    starts = torch.randint(0, len(corpus) - cfg.seq_len + 1, (cfg.batch - n_regen,),
                           generator=gen).tolist()
    rows = [corpus[s : s + cfg.seq_len].astype(np.int64) for s in starts]
    if n_regen:
        assert regen is not None
        picks = torch.randint(0, len(regen), (n_regen,), generator=gen).tolist()
        rows += [regen[i].astype(np.int64) for i in picks]
    return torch.from_numpy(np.stack(rows))


def sample_answer_batch(corpus: np.ndarray, mask: np.ndarray, regen: np.ndarray | None,
                        cfg: DraftTrainConfig, gen: torch.Generator
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """(batch, seq_len) int64 windows and (batch, seq_len - 1) row weights: corpus windows drawn
    around a uniformly chosen answer token (at a uniform row), weighted by ``row_weights``; the
    regenerated rows (as ``sample_batch``) are the target's own text throughout: weight 1."""
    n_regen = round(cfg.batch * cfg.regen_mix) if regen is not None and len(regen) else 0
    k = cfg.batch - n_regen
    n_answer = int(np.count_nonzero(mask))
    picks = torch.randint(0, n_answer, (k,), generator=gen).numpy()
    offsets = torch.randint(0, cfg.seq_len - 1, (k,), generator=gen).numpy()
    starts = answer_starts(mask, cfg.seq_len, picks, offsets)
    rows = [corpus[s : s + cfg.seq_len].astype(np.int64) for s in starts]
    weights = [row_weights(mask, starts, cfg.seq_len)]
    if n_regen:
        assert regen is not None
        picked = torch.randint(0, len(regen), (n_regen,), generator=gen).tolist()
        rows += [regen[i].astype(np.int64) for i in picked]
        weights.append(np.ones((n_regen, cfg.seq_len - 1), dtype=np.float32))
    return torch.from_numpy(np.stack(rows)), torch.from_numpy(np.concatenate(weights))


def eval_answer_windows(data: np.ndarray, mask: np.ndarray,
                        cfg: DraftTrainConfig) -> tuple[np.ndarray, np.ndarray]:
    """Fixed windows (deterministic) around evenly spaced answer tokens, each at row 0 of its
    window, and their row weights: (eval_batches·batch or fewer, seq_len), (..., seq_len - 1)."""
    n_answer = int(np.count_nonzero(mask))
    n = min(cfg.eval_batches * cfg.batch, max(1, len(data) // cfg.seq_len))
    picks = np.linspace(0, n_answer - 1, n).astype(np.int64)
    starts = answer_starts(mask, cfg.seq_len, picks, np.zeros(n, dtype=np.int64))
    return (np.stack([data[s : s + cfg.seq_len] for s in starts]),
            row_weights(mask, starts, cfg.seq_len))


def eval_windows(data: np.ndarray, cfg: DraftTrainConfig) -> np.ndarray:
    """Fixed windows (deterministic): rows of a 2-D array, or evenly spaced windows of a 1-D one.
    Shape: (eval_batches·batch or fewer, seq_len)."""
    n = cfg.eval_batches * cfg.batch
    if data.ndim == 2:
        return data[:n]
    n = min(n, max(1, len(data) // cfg.seq_len))
    stride = max(1, (len(data) - cfg.seq_len) // n)
    return np.stack([data[j * stride : j * stride + cfg.seq_len] for j in range(n)])
