"""Micro-model builders shared by the tests (CPU, seconds).

* ``write_tiny_corpus``: a corpus folder of a few small standard-library files;
* ``write_tokenizer``: a byte-level BPE tokenizer (the shipped target's recipe) for that corpus;
* ``write_random_llama``: a random HF Llama folder written by transformers itself;
* ``write_trained_target``: a tiny target trained by ``workbench.train.target``;
* ``make_engine``: the one engine factory (target, optional head, an ``EngineConfig`` plus
  field overrides);
* ``id_prompts``: the one random token-id prompt generator.
"""

from __future__ import annotations

import dataclasses
import json
import random
import shutil
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

# Small, stable standard-library files (about 25 kB together).
CORPUS_FILES = ("bisect.py", "colorsys.py", "fnmatch.py", "genericpath.py", "keyword.py",
                "stat.py", "this.py")


def write_tiny_corpus(folder: Path, files: tuple[str, ...] = CORPUS_FILES) -> Path:
    """Copy ``files`` from the running interpreter's standard library into ``folder``."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    folder.mkdir(parents=True, exist_ok=True)
    for name in files:
        shutil.copy(stdlib / name, folder / name)
    return folder


def write_tokenizer(folder: Path, corpus: Path, vocab_size: int = 300) -> int:
    """tokenizer.json + tokenizer_config.json trained on ``corpus``; returns the EOS id."""
    from workbench.train.target import EOS, train_tokenizer

    texts = [f.read_text() for f in sorted(corpus.rglob("*.py"))]
    tok = train_tokenizer(texts, vocab_size)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": EOS, "eos_token": EOS,
        "unk_token": EOS, "add_bos_token": False, "clean_up_tokenization_spaces": False,
    }))
    return int(tok.token_to_id(EOS))


def write_random_llama(folder: Path, *, vocab_size: int = 300, hidden: int = 32, layers: int = 7,
                       heads: int = 4, kv_heads: int = 2, intermediate: int = 64,
                       corpus: Path | None = None, seed: int = 0, **extra: Any) -> Path:
    """A random ``LlamaForCausalLM`` saved with ``save_pretrained`` (plus a tokenizer when
    ``corpus`` is given; its vocab must fit in ``vocab_size``)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    eos = write_tokenizer(folder, corpus, vocab_size) if corpus is not None else 0
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=intermediate,
                      num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, max_position_embeddings=512,
                      bos_token_id=eos, eos_token_id=eos, pad_token_id=eos, **extra)
    torch.manual_seed(seed)
    LlamaForCausalLM(cfg).save_pretrained(str(folder))
    return folder


def write_trained_target(out: Path, corpus: Path, work: Path, **overrides: Any) -> dict[str, Any]:
    """Train a tiny target (8 layers x 64, vocab 300) with the shipped recipe; returns its
    training summary."""
    from workbench.train.target import TargetTrainConfig, train_target

    settings: dict[str, Any] = dict(
        out=str(out), work=str(work), corpus=str(corpus), vocab_size=300, layers=8, hidden=64,
        heads=4, kv_heads=2, intermediate=128, seq_len=64, batch=8, steps=200, lr=3e-3, warmup=5,
        ckpt_every=100, eval_batches=2, threads=1, seed=0)
    settings.update(overrides)
    return train_target(TargetTrainConfig(**settings))


def busy_provisional() -> list[str]:
    """The choices a start on a busy CPU measures provisionally: the GEMM path, and the thread
    count too when the process has more than one thread to adapt (OMP_NUM_THREADS=2 in
    `make test`, 1 in a helper's run)."""
    from workbench.engine import contention

    threads = max(torch.get_num_threads(), contention.PROCESS_THREADS)
    return (["threads"] if threads > 1 else []) + ["gemm"]


def make_engine(target: Path, draft: Path | None = None, config: Any = None,
                **overrides: Any) -> Any:
    """The tests' one engine factory: ``target`` (with the EAGLE-3 head ``draft``), ``config``
    (an ``EngineConfig``, default one when None) with ``overrides`` replaced field by field.
    The caller closes it (``with make_engine(...) as e`` or a fixture's ``finally``)."""
    import workbench as wb

    cfg = dataclasses.replace(config if config is not None else wb.EngineConfig(), **overrides)
    return wb.Engine.from_pretrained(target, draft=draft, config=cfg)


def id_prompts(n: int, seed: int = 0, lo: int = 1, hi: int = 40,
               vocab: int = 299) -> list[list[int]]:
    """``n`` random prompts of token ids in [1, vocab), each of a random length in [lo, hi);
    the same ``seed`` gives the same prompts."""
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def small_engine(target: Path, head: Path) -> Iterator[Any]:
    """The micro target with a head, a small KV budget and 8-token prefill chunks (so steps mix
    prefill and decode): the engine the policy, calibration and concurrency tests share. A
    generator, for a fixture to ``yield from``; closed after."""
    e = make_engine(target, head, kv_budget_tokens=8192, max_prefill_tokens=8)
    try:
        yield e
    finally:
        e.close()


# Seconds on one core; regenerated (target-greedy) data makes acceptance clearly non-zero.
MICRO_DRAFT_TRAINING: dict[str, Any] = dict(
    draft_vocab_size=128, steps=80, batch=4, seq_len=48, lr=3e-3, warmup=5, ttt_steps=5,
    regenerate=True, regen_sequences=16, regen_prompt_len=16, regen_batch=16, eval_batches=2,
    ckpt_every=40, threads=1)


def micro_draft_cfg(tmp: Path, target: Path, corpus: Path, **kw: Any) -> Any:
    """A ``DraftTrainConfig`` for a micro target: 60 steps of 4 × 48 tokens, 128 draft ids,
    outputs under ``tmp``; ``kw`` overrides any field."""
    from workbench.train.eagle3 import DraftTrainConfig

    settings: dict[str, Any] = dict(
        target=str(target), out=str(tmp / "head"), work=str(tmp / "work"), corpus=str(corpus),
        draft_vocab_size=128, steps=60, batch=4, seq_len=48, lr=3e-3, warmup=5, ttt_steps=5,
        regenerate=False, eval_batches=2, ckpt_every=20, threads=1)
    settings.update(kw)
    return DraftTrainConfig(**settings)
