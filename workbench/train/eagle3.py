"""Train an EAGLE-3 draft head for a target with the training-time test (TTT).

EAGLE-3 (Li et al., 2025, arXiv:2503.01840) trains the head on the target's own features and
distributions, unrolling several draft steps in which the head reads back its own hidden state, as
it will at inference. One training step:

1. sample token windows (B, T): corpus text and, optionally, text the target generated itself;
2. run the frozen target once: taps (B, T, 3·Dt) and logits (B, T, V);
3. unroll ``ttt_steps`` draft steps (``ttt_forward``) and sum their forward-KL losses, step j
   weighted by ``step_decay**j``;
4. AdamW step (warmup + cosine, grad clip 1.0); checkpoint every ``ckpt_every`` steps.

Resumable: ``<work>/ckpt.pt`` holds head, optimizer, sampling generator, step and history; rerunning
the same config continues where it stopped. The result is a standard ``LlamaForCausalLMEagle3``
folder (DESIGN.md §6) plus ``training_summary.json``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from workbench.errors import ConfigError
from workbench.models.config import ModelConfig
from workbench.models.eagle3 import Eagle3Config, Eagle3Draft
from workbench.models.llama import LlamaForCausalLM, init_weights
from workbench.models.loader import load_target, save_eagle3
from workbench.train.corpus import split_corpus

# A checkpoint made with other values of these fields cannot be continued.
RESUME_FIELDS = ("target", "corpus", "draft_vocab_size", "heads", "kv_heads", "head_dim",
                 "intermediate", "regenerate")


@dataclass(frozen=True)
class DraftTrainConfig:
    """Everything ``train_draft`` needs; 0 for heads/kv_heads/head_dim/intermediate: target's."""

    target: str = "data/models/wb-target"
    out: str = "data/models/wb-eagle3"
    work: str = "data/work/eagle3"
    corpus: str = ""  # empty: the running interpreter's standard library (as the target's)
    draft_vocab_size: int = 2048
    heads: int = 0
    kv_heads: int = 0
    head_dim: int = 0
    intermediate: int = 0
    steps: int = 600
    batch: int = 8
    seq_len: int = 256
    lr: float = 1e-3
    warmup: int = 30
    weight_decay: float = 0.0
    ttt_steps: int = 7
    step_decay: float = 0.8
    init_from_target: bool = True  # start norm/lm_head from the target's final norm/unembedding
    regenerate: bool = True  # also train on the target's own continuations of corpus prompts
    regen_sequences: int = 512  # generated windows of seq_len tokens (prompt included)
    regen_prompt_len: int = 32
    regen_temperature: float = 0.7
    regen_greedy_frac: float = 0.5  # this share greedy, the rest sampled at regen_temperature
    regen_mix: float = 0.5  # share of each batch drawn from the regenerated windows
    regen_batch: int = 32
    eval_batches: int = 4
    seed: int = 0
    ckpt_every: int = 50
    threads: int = 0  # 0: torch default

    def __post_init__(self) -> None:
        for f in ("draft_vocab_size", "steps", "batch", "seq_len", "ckpt_every", "eval_batches",
                  "regen_batch", "regen_prompt_len"):
            if getattr(self, f) <= 0:
                raise ConfigError(f"{f}: must be > 0, got {getattr(self, f)}")
        for f in ("heads", "kv_heads", "head_dim", "intermediate", "warmup", "threads",
                  "regen_sequences"):
            if getattr(self, f) < 0:
                raise ConfigError(f"{f}: must be >= 0 (0: default), got {getattr(self, f)}")
        if self.ttt_steps < 5:
            raise ConfigError(f"ttt_steps: must be >= 5 (the draft depth served), got "
                              f"{self.ttt_steps}")
        if self.seq_len < self.ttt_steps + 2:
            raise ConfigError(f"seq_len: {self.seq_len} leaves no position for the last of "
                              f"{self.ttt_steps} ttt_steps; need >= ttt_steps + 2")
        if not 0.0 < self.step_decay <= 1.0:
            raise ConfigError(f"step_decay: must be in (0, 1], got {self.step_decay}")
        if not self.lr > 0.0 or self.weight_decay < 0.0:
            raise ConfigError(f"lr/weight_decay: need lr > 0 and weight_decay >= 0, got "
                              f"{self.lr}/{self.weight_decay}")
        for f in ("regen_greedy_frac", "regen_mix"):
            if not 0.0 <= getattr(self, f) <= 1.0:
                raise ConfigError(f"{f}: must be in [0, 1], got {getattr(self, f)}")
        if self.regen_temperature <= 0.0 and self.regen_greedy_frac < 1.0:
            raise ConfigError(f"regen_temperature: must be > 0 when regen_greedy_frac < 1, got "
                              f"{self.regen_temperature}")
        if self.regenerate and self.regen_prompt_len >= self.seq_len:
            raise ConfigError(f"regen_prompt_len: {self.regen_prompt_len} must be < seq_len "
                              f"{self.seq_len} (the rest of each window is generated)")
        if self.regenerate and self.regen_sequences == 0 and self.regen_mix > 0:
            raise ConfigError("regen_sequences: 0 with regenerate=True and regen_mix > 0")


# -- draft vocabulary, features, masks (pure functions) ---------------------------------------


def build_draft_vocab(arrays: list[np.ndarray], vocab_size: int,
                      draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``draft_vocab_size`` most frequent ids in ``arrays`` (ties: lower id first; unseen ids
    fill up in id order). Returns d2t (Vd,) int64 with target_id = draft_id + d2t[draft_id]
    (target ids ascending, so d2t is non-decreasing and >= 0) and t2d (V,) bool."""
    if draft_vocab_size > vocab_size:
        raise ConfigError(f"draft_vocab_size {draft_vocab_size} > target vocab_size {vocab_size}")
    counts = np.zeros(vocab_size, dtype=np.int64)
    for a in arrays:
        if len(a):
            if int(a.max()) >= vocab_size:
                raise ConfigError(f"corpus: token id {int(a.max())} >= target vocab_size "
                                  f"{vocab_size} (tokenizer and model disagree)")
            counts += np.bincount(a.astype(np.int64), minlength=vocab_size)
    order = np.argsort(-counts, kind="stable")[:draft_vocab_size]
    target_ids = torch.from_numpy(np.sort(order)).to(torch.int64)
    d2t = target_ids - torch.arange(draft_vocab_size, dtype=torch.int64)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[target_ids] = True
    return d2t, t2d


@lru_cache(maxsize=64)
def ttt_mask(n: int, step: int) -> torch.Tensor:
    """Attention mask of unrolled step j=``step`` over cat(K_0, K_1, ..., K_j) along time.

    Shape: (n, (j+1)·n) bool, True = attend. Query row i sees step-0 keys at positions <= i-j and,
    for k = 1..j, the step-k key at position i-j+k: the chain a draft at inference builds when it
    starts from the target feature at i-j. Every row keeps at least its own step-j key.
    """
    i = torch.arange(n).unsqueeze(1)  # (n, 1)
    c = torch.arange(n).unsqueeze(0)  # (1, n)
    blocks = [c <= i - step] + [c == i - step + k for k in range(1, step + 1)]
    return torch.cat(blocks, dim=1)


def ttt_unroll(draft: Eagle3Draft, hidden: torch.Tensor, tokens: torch.Tensor,
               ttt_steps: int) -> Iterator[torch.Tensor]:
    """Unrolled draft steps over n rows; yields each step's draft logits (B, n, Vd).

    hidden: (B, n, D) fused target features fc(taps) of rows 0..n-1; tokens: (B, n) the token
    each row reads. Every step puts row i at rope position i. Step j >= 1 reads step j-1's pre-norm
    output at row i-1 (zeros at row 0) and attends (``ttt_mask``) to the chain of keys a draft at
    inference builds when started from the target feature at row i-j.
    """
    n = tokens.shape[1]
    pos = torch.arange(n, device=tokens.device)
    ks: list[torch.Tensor] = []
    vs: list[torch.Tensor] = []
    for j in range(ttt_steps):
        mask = ttt_mask(n, j).to(tokens.device)
        k_prev = torch.cat(ks, dim=1) if ks else None
        v_prev = torch.cat(vs, dim=1) if vs else None
        logits, out, k, v = draft.forward_dense(tokens, hidden, pos, mask, k_prev, v_prev)
        ks.append(k)
        vs.append(v)
        yield logits
        hidden = torch.cat([torch.zeros_like(out[:, :1]), out[:, :-1]], dim=1)


def ttt_forward(draft: Eagle3Draft, taps: torch.Tensor, target_logits: torch.Tensor,
                tokens: torch.Tensor, ttt_steps: int,
                step_decay: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The training-time test over one batch of windows.

    taps: (B, T, 3·Dt) hidden states entering the tapped target layers; target_logits: (B, T, V);
    tokens: (B, T) the window. Draft row i (i = 0..T-2) reads token t_{i+1} and predicts t_{i+2};
    its target is softmax(target_logits[:, i+1]) restricted to the draft vocab. Step 0 reads
    fc(taps[:, i]); step j is scored on rows i >= j (rows whose chain starts inside the window).

    Returns (loss, kl (S,), acc (S,)): loss = sum_j step_decay**j · mean forward KL(p || q_j) of
    step j (the soft cross-entropy minus the target's entropy: same gradient, 0 when perfect);
    kl/acc detached; acc = top-1 agreement of the draft (mapped to target ids) with the target's
    argmax over the full vocab, which is what greedy verification accepts.
    """
    n = tokens.shape[1] - 1
    # 1. Targets, shared by every step: restricted distribution and full-vocab argmax.
    target_ids = draft.draft_to_target(torch.arange(draft.config.draft_vocab_size,
                                                    device=tokens.device))  # (Vd,)
    p = torch.softmax(target_logits[:, 1:, target_ids].float(), dim=-1)  # (B, n, Vd)
    neg_entropy = torch.special.xlogy(p, p).sum(-1)  # (B, n): makes a perfect draft score 0
    top = target_logits[:, 1:].argmax(-1)  # (B, n)
    # 2. Unroll: rows read t_{i+1}, step 0 the fused target features of position i.
    hidden = draft.fuse_features(taps[:, :n])  # (B, n, D)
    loss = hidden.new_zeros(())
    kl_steps, acc_steps = [], []
    for j, logits in enumerate(ttt_unroll(draft, hidden, tokens[:, 1:], ttt_steps)):
        # 3. Forward KL(p || q) on the rows whose chain starts at or after position 0.
        logq = F.log_softmax(logits[:, j:].float(), dim=-1)
        kl = neg_entropy[:, j:] - (p[:, j:] * logq).sum(-1)  # (B, n-j)
        loss = loss + step_decay**j * kl.mean()
        with torch.no_grad():
            agree = draft.draft_to_target(logits[:, j:].argmax(-1)) == top[:, j:]
            kl_steps.append(kl.mean().detach())
            acc_steps.append(agree.float().mean())
    return loss, torch.stack(kl_steps), torch.stack(acc_steps)


@torch.no_grad()
def target_features(target: LlamaForCausalLM, x: torch.Tensor,
                    aux: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """x: (B, T) → target logits (B, T, V) and taps (B, T, len(aux)·Dt) in ``aux`` order.

    ``forward_dense`` concatenates taps in layer order and once per layer; small targets have
    repeated or unordered defaults (L=4: (2, 2, 1)), so ask for the distinct layers and reorder.
    """
    uniq = sorted(set(aux))
    logits, taps = target.forward_dense(x, uniq)
    assert taps is not None
    chunks = taps.chunk(len(uniq), dim=-1)
    return logits, torch.cat([chunks[uniq.index(a)] for a in aux], dim=-1)


# -- data ------------------------------------------------------------------------------------


def _file_key(paths: list[Path]) -> str:
    h = hashlib.sha1()
    for p in paths:
        st = p.stat()
        h.update(f"{p.resolve()}:{st.st_size}:{st.st_mtime_ns};".encode())
    return h.hexdigest()


def corpus_tokens(cfg: DraftTrainConfig, folder: Path,
                  mcfg: ModelConfig) -> tuple[np.ndarray, np.ndarray]:
    """Corpus train / held-out token arrays (files joined by EOS) in the target's tokenizer,
    cached in ``work`` and keyed by tokenizer and corpus file list."""
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
    if meta.is_file() and json.loads(meta.read_text()).get("key") == key:
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
    if meta.is_file() and json.loads(meta.read_text()).get("key") == key:
        m = json.loads(meta.read_text())
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


def eval_windows(data: np.ndarray, cfg: DraftTrainConfig) -> np.ndarray:
    """Fixed windows (deterministic): rows of a 2-D array, or evenly spaced windows of a 1-D one.
    Shape: (eval_batches·batch or fewer, seq_len)."""
    n = cfg.eval_batches * cfg.batch
    if data.ndim == 2:
        return data[:n]
    n = min(n, max(1, len(data) // cfg.seq_len))
    stride = max(1, (len(data) - cfg.seq_len) // n)
    return np.stack([data[j * stride : j * stride + cfg.seq_len] for j in range(n)])


# -- model -----------------------------------------------------------------------------------


def draft_config(cfg: DraftTrainConfig, mcfg: ModelConfig, aux: tuple[int, ...]) -> Eagle3Config:
    """Width = target hidden size; heads/kv heads/head_dim/intermediate default to the target's;
    rope and norm settings copied from the target."""
    heads = cfg.heads or mcfg.num_attention_heads
    kv = cfg.kv_heads or (mcfg.num_key_value_heads if heads == mcfg.num_attention_heads
                          else heads)
    if heads % kv:
        raise ConfigError(f"kv_heads: {kv} does not divide heads {heads}")
    head_dim = cfg.head_dim or (mcfg.head_dim if heads == mcfg.num_attention_heads
                                else mcfg.hidden_size // heads)
    if head_dim % 2:
        raise ConfigError(f"head_dim: {head_dim} must be even (rotary embedding)")
    return Eagle3Config(
        hidden_size=mcfg.hidden_size, target_hidden_size=mcfg.hidden_size,
        intermediate_size=cfg.intermediate or mcfg.intermediate_size,
        num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim,
        vocab_size=mcfg.vocab_size, draft_vocab_size=cfg.draft_vocab_size,
        rms_norm_eps=mcfg.rms_norm_eps, rope_theta=mcfg.rope_theta,
        rope_scaling=mcfg.rope_scaling, max_position_embeddings=mcfg.max_position_embeddings,
        aux_layer_ids=aux,
    )


def new_draft(cfg: DraftTrainConfig, dcfg: Eagle3Config, target: LlamaForCausalLM,
              d2t: torch.Tensor, t2d: torch.Tensor) -> Eagle3Draft:
    """Fresh head: GPT-style init, d2t/t2d set, the target's (frozen) embedding attached."""
    draft = Eagle3Draft(dcfg)
    init_weights(draft, seed=cfg.seed)
    with torch.no_grad():
        draft.get_buffer("d2t").copy_(d2t)
        draft.get_buffer("t2d").copy_(t2d)
        if cfg.init_from_target:
            # The head imitates the target's last hidden state; start from its read-out.
            draft.norm.weight.copy_(target.model.norm.weight)
            draft.lm_head.weight.copy_(target.lm_head.weight[torch.arange(len(d2t)) + d2t])
    draft.set_embedding(target.model.embed_tokens)
    return draft


def trainable(draft: Eagle3Draft) -> list[torch.nn.Parameter]:
    return [p for n, p in draft.named_parameters() if not n.startswith("embed.")]


def head_state(draft: Eagle3Draft) -> dict[str, torch.Tensor]:
    return {k: v for k, v in draft.state_dict().items() if not k.startswith("embed.")}


def lr_at(step: int, cfg: DraftTrainConfig) -> float:
    """Linear warmup, then cosine from lr down to lr/10."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    frac = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))


@torch.no_grad()
def evaluate(draft: Eagle3Draft, target: LlamaForCausalLM, aux: tuple[int, ...],
             windows: np.ndarray, cfg: DraftTrainConfig) -> dict[str, list[float]]:
    """Per-step mean forward KL and top-1 agreement over fixed windows (seq_len each)."""
    draft.eval()
    kl_sum = torch.zeros(cfg.ttt_steps)
    acc_sum = torch.zeros(cfg.ttt_steps)
    for lo in range(0, len(windows), cfg.batch):
        x = torch.from_numpy(windows[lo : lo + cfg.batch].astype(np.int64))
        logits, taps = target_features(target, x, aux)
        _, kl, acc = ttt_forward(draft, taps, logits, x, cfg.ttt_steps, cfg.step_decay)
        kl_sum += kl * len(x)
        acc_sum += acc * len(x)
    draft.train()
    n = max(1, len(windows))
    return {"loss": (kl_sum / n).tolist(), "acc": (acc_sum / n).tolist()}


# Temperatures tried when calibrating (ranking only: see Eagle3Config.greedy_score_temperature).
TEMPERATURE_GRID = tuple(round(0.1 + 0.05 * i, 2) for i in range(39))  # 0.10 .. 2.00


@torch.no_grad()
def fit_greedy_temperature(draft: Eagle3Draft, target: LlamaForCausalLM, aux: tuple[int, ...],
                           windows: np.ndarray, cfg: DraftTrainConfig
                           ) -> tuple[float, dict[str, float]]:
    """Temperature scaling (Guo et al., 2017) of the draft's logits against greedy acceptance.

    The head is trained to the target's *distribution* (forward KL), but greedy verification
    accepts a draft token iff it is the target's *argmax*, which happens far more often than the
    target's top probability says: the raw draft is under-confident for greedy decoding, and the
    EAGLE-2 rerank, which trusts draft probabilities, then prefers shallow side branches to deep
    likely nodes. Fit T minimising the mean NLL of the target's argmax (in the draft vocabulary)
    under softmax(logits / T), over every unrolled step of ``windows`` (held-out). Returns
    (T, {"nll_T=1": ..., "nll_best": ...})."""
    draft.eval()
    vd = draft.config.draft_vocab_size
    target_ids = draft.draft_to_target(torch.arange(vd))
    to_draft = torch.full((draft.config.vocab_size,), -1, dtype=torch.int64)
    to_draft[target_ids] = torch.arange(vd)
    grid = torch.tensor(TEMPERATURE_GRID)
    nll_sum = torch.zeros(len(grid), dtype=torch.float64)
    count = 0
    for lo in range(0, len(windows), cfg.batch):
        x = torch.from_numpy(windows[lo : lo + cfg.batch].astype(np.int64))
        logits, taps = target_features(target, x, aux)
        n = x.shape[1] - 1
        label = to_draft[logits[:, 1:].argmax(-1)]  # (B, n): -1 where the draft cannot hit it
        hidden = draft.fuse_features(taps[:, :n])
        for j, q in enumerate(ttt_unroll(draft, hidden, x[:, 1:], cfg.ttt_steps)):
            lab = label[:, j:].reshape(-1)
            ok = lab >= 0
            rows = q[:, j:].reshape(-1, vd)[ok].float()
            lab = lab[ok]
            for g, t in enumerate(grid.tolist()):
                lp = torch.log_softmax(rows / t, dim=-1)
                nll_sum[g] -= lp.gather(1, lab.unsqueeze(1)).double().sum()
            count += int(lab.numel())
    draft.train()
    nll = nll_sum / max(count, 1)
    best = int(nll.argmin())
    one = TEMPERATURE_GRID.index(1.0)
    return TEMPERATURE_GRID[best], {"nll_T=1": float(nll[one]), "nll_best": float(nll[best]),
                               "rows": count}


def est_accept_length(acc: list[float]) -> float:
    """Chain (topk=1) estimate: 1 + sum_j prod_{k<=j} acc_k (acc_k taken as conditional)."""
    return float(1.0 + np.cumprod(acc).sum())


# -- driver ----------------------------------------------------------------------------------


def _load_target_checked(cfg: DraftTrainConfig) -> tuple[LlamaForCausalLM, ModelConfig, Path]:
    try:
        target, mcfg, folder = load_target(cfg.target, dtype="float32")
    except ConfigError as e:
        raise ConfigError(f"target {cfg.target!r}: {e}") from e
    if cfg.draft_vocab_size > mcfg.vocab_size:
        raise ConfigError(f"draft_vocab_size {cfg.draft_vocab_size} > target vocab_size "
                          f"{mcfg.vocab_size} ({cfg.target})")
    if cfg.seq_len > mcfg.max_position_embeddings:
        raise ConfigError(f"seq_len {cfg.seq_len} > target max_position_embeddings "
                          f"{mcfg.max_position_embeddings} ({cfg.target})")
    return target, mcfg, folder


def _check_resume(state: dict[str, Any], cfg: DraftTrainConfig, ckpt: Path) -> None:
    old = state.get("config", {})
    for f in RESUME_FIELDS:
        if f in old and old[f] != getattr(cfg, f):
            raise ConfigError(f"{f}: {ckpt} was made with {f}={old[f]!r}, now "
                              f"{getattr(cfg, f)!r}; use another work folder or delete it")


def train_draft(cfg: DraftTrainConfig) -> dict[str, Any]:
    """Train (or resume) a head for ``cfg.target`` and export it to ``cfg.out``. Returns the
    summary also written to ``<out>/training_summary.json``."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    # 1. Target, features to tap, data (corpus + regenerated windows), draft vocabulary.
    target, mcfg, folder = _load_target_checked(cfg)
    aux = mcfg.aux_layer_ids()
    train, held = corpus_tokens(cfg, folder, mcfg)
    regen_train = regen_held = None
    regen_seconds = 0.0
    if cfg.regenerate and cfg.regen_sequences:
        regen_train, regen_held, regen_seconds = regenerated(cfg, folder, train, held)
    vocab_src = [train] + ([regen_train.ravel()] if regen_train is not None else [])
    d2t, t2d = build_draft_vocab(vocab_src, mcfg.vocab_size, cfg.draft_vocab_size)
    # 2. Head, optimizer, sampling generator; resume from the work checkpoint if present.
    draft = new_draft(cfg, draft_config(cfg, mcfg, aux), target, d2t, t2d)
    params = trainable(draft)
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    gen = torch.Generator().manual_seed(cfg.seed)
    ckpt = Path(cfg.work) / "ckpt.pt"
    step, history, seconds = 0, [], 0.0
    if ckpt.exists():  # its d2t/t2d win: the vocabulary the head was trained with
        state = torch.load(ckpt, weights_only=False)
        _check_resume(state, cfg, ckpt)
        missing, unexpected = draft.load_state_dict(state["model"], strict=False)
        if unexpected or any(not k.startswith("embed.") for k in missing):
            raise ConfigError(f"work: {ckpt} does not fit this head (missing "
                              f"{missing[:3]}, unexpected {unexpected[:3]}); delete it")
        opt.load_state_dict(state["opt"])
        gen.set_state(state["gen"])
        step, history, seconds = state["step"], state["history"], state["seconds"]
    tokens_per_step = cfg.batch * (cfg.seq_len - 1)
    # 3. Train: one target forward, the unrolled TTT loss, one optimizer step.
    bar = tqdm(total=cfg.steps, initial=step, desc="train-draft", unit="step")
    start = (step, seconds)
    window: list[tuple[float, list[float]]] = []
    draft.train()
    while step < cfg.steps:
        t0 = time.perf_counter()
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg)
        x = sample_batch(train, regen_train, cfg, gen)
        logits, taps = target_features(target, x, aux)
        loss, _, acc = ttt_forward(draft, taps, logits, x, cfg.ttt_steps, cfg.step_decay)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        seconds += time.perf_counter() - t0
        window.append((loss.item(), acc.tolist()))
        bar.update(1)
        run_tok_s = (step - start[0]) * tokens_per_step / max(seconds - start[1], 1e-9)
        bar.set_postfix(loss=f"{loss.item():.3f}", acc0=f"{acc[0].item():.3f}",
                        tok_s=f"{run_tok_s:.0f}")  # the bar itself shows elapsed<ETA
        if step % cfg.ckpt_every == 0 or step == cfg.steps:
            history.append({"step": step, "loss": float(np.mean([w[0] for w in window])),
                            "acc": np.mean([w[1] for w in window], axis=0).tolist(),
                            "lr": lr_at(step - 1, cfg), "seconds": seconds})
            window = []
            tmp = ckpt.with_suffix(".tmp")
            tmp.parent.mkdir(parents=True, exist_ok=True)
            torch.save({"model": head_state(draft), "opt": opt.state_dict(),
                        "gen": gen.get_state(), "step": step, "history": history,
                        "seconds": seconds, "config": asdict(cfg)}, tmp)
            tmp.replace(ckpt)
    bar.close()
    # 4. Evaluate (train / held-out corpus / held-out regenerated windows) and export.
    evals = {"train": evaluate(draft, target, aux, eval_windows(train, cfg), cfg),
             "heldout": evaluate(draft, target, aux, eval_windows(held, cfg), cfg)}
    if regen_held is not None:
        evals["heldout_regen"] = evaluate(draft, target, aux, eval_windows(regen_held, cfg), cfg)
    # 5. Calibrate the tree-ranking temperature for greedy requests on held-out windows (the
    # regenerated ones when there are: the target's own continuations, as at inference).
    cal_src = regen_held if regen_held is not None and len(regen_held) else held
    temp, cal = fit_greedy_temperature(draft, target, aux, eval_windows(cal_src, cfg), cfg)
    draft.config = dataclasses.replace(draft.config, greedy_score_temperature=temp)
    save_eagle3(draft, cfg.out)
    in_vocab = draft.get_buffer("t2d")[torch.from_numpy(train.astype(np.int64))]
    summary: dict[str, Any] = {
        "steps": step, "tokens": step * tokens_per_step, "seconds": seconds,
        "tokens_per_second": step * tokens_per_step / max(seconds, 1e-9),
        "parameters": sum(p.numel() for p in params),
        "aux_layer_ids": list(aux), "draft_vocab_size": cfg.draft_vocab_size,
        "draft_vocab_coverage": float(in_vocab.float().mean()),
        "train_tokens": int(len(train)), "heldout_tokens": int(len(held)),
        "regenerated_windows": 0 if regen_train is None else int(len(regen_train)),
        "regen_seconds": regen_seconds,
        **evals,
        "est_accept_length_chain": {k: est_accept_length(v["acc"]) for k, v in evals.items()},
        "greedy_score_temperature": temp, "calibration": cal,
        "torch_threads": torch.get_num_threads(), "config": asdict(cfg), "history": history,
    }
    (Path(cfg.out) / "training_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary
