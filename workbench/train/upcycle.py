"""Sparse upcycling: a dense Llama target → a Mixtral-format MoE of the same attention, briefly
trained (how ``data/models/wb-moe`` was made; its model card has the figures).

Each layer's dense SwiGLU MLP (intermediate I) is cut into ``I / expert_intermediate`` slices of
its neurons; expert e is slice ``e mod slices`` (a copy plus a little noise, so copies part ways),
its down projection scaled by ``slices / top_k`` so that top-k experts of uniform weight give the
dense MLP's output in expectation. The router starts near uniform. Training: the dense target's
next-token distribution (KL, the teacher) plus the corpus' cross-entropy, plus a small
load-balancing loss (E · Σ_e f_e · p_e, Switch Transformer's) so every expert stays in use. The
result is written by transformers' own ``MixtralForCausalLM.save_pretrained``.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from workbench.errors import ConfigError
from workbench.models.loader import load_target, read_safetensors
from workbench.models.moe import SparseMoe
from workbench.train.corpus import split_corpus
from workbench.train.target import EOS, encode_all


@dataclass(frozen=True)
class UpcycleConfig:
    source: str  # a dense target folder (Llama format, e.g. data/models/wb-target)
    out: str
    corpus: str = ""  # empty: the standard library (the dense target's recipe)
    experts: int = 8
    top_k: int = 2
    expert_intermediate: int = 176
    steps: int = 120
    batch: int = 8
    seq_len: int = 128
    lr: float = 1e-3
    noise: float = 0.01  # relative std of the noise added to each expert's copy
    distill: float = 1.0  # weight of the KL to the dense teacher (CE weight: 1)
    balance: float = 0.01
    threads: int = 1
    seed: int = 0
    dtype: str = "bfloat16"  # what the checkpoint stores (the engine computes in float32)

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.experts:
            raise ConfigError(f"UpcycleConfig.top_k: {self.top_k} not in [1, {self.experts}]")
        for name in ("steps", "batch", "seq_len", "expert_intermediate"):
            if getattr(self, name) < 1:
                raise ConfigError(f"UpcycleConfig.{name}: must be >= 1")


def corpus_tokens(folder: Path, seq_len: int, corpus: str = "") -> tuple[np.ndarray, np.ndarray]:
    """The standard-library corpus split as the dense target's recipe splits it, encoded with
    the target's own tokenizer: (train, held-out) token arrays."""
    from tokenizers import Tokenizer


    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    split = split_corpus(corpus or None)
    eos = tok.token_to_id(EOS)
    if eos is None:
        raise ConfigError(f"{folder}/tokenizer.json: no {EOS!r} token")
    train, held = encode_all(tok, split.read("train"), eos), encode_all(tok, split.read("heldout"),
                                                                         eos)
    if len(held) < seq_len + 2:
        raise ConfigError("corpus: too little held-out text")
    return train, held


def mixtral_config(src: dict[str, Any], cfg: UpcycleConfig) -> Any:
    import transformers

    return transformers.MixtralConfig(
        vocab_size=src["vocab_size"], hidden_size=src["hidden_size"],
        intermediate_size=cfg.expert_intermediate, num_hidden_layers=src["num_hidden_layers"],
        num_attention_heads=src["num_attention_heads"],
        num_key_value_heads=src["num_key_value_heads"], head_dim=src["head_dim"],
        num_local_experts=cfg.experts, num_experts_per_tok=cfg.top_k,
        rms_norm_eps=src["rms_norm_eps"],
        rope_parameters={"rope_type": "default", "rope_theta": src["rope_theta"]},
        max_position_embeddings=src["max_position_embeddings"],
        tie_word_embeddings=src["tie_word_embeddings"], bos_token_id=src["bos_token_id"],
        eos_token_id=src["eos_token_id"], sliding_window=None, router_aux_loss_coef=cfg.balance)


def upcycled_state(dense: dict[str, torch.Tensor], layers: int, cfg: UpcycleConfig,
                   inter: int, hidden: int) -> dict[str, torch.Tensor]:
    """The MoE's tensors (Mixtral names) from the dense target's."""
    if inter % cfg.expert_intermediate:
        raise ConfigError(f"UpcycleConfig.expert_intermediate: {cfg.expert_intermediate} does "
                          f"not divide the dense intermediate size {inter}")
    slices = inter // cfg.expert_intermediate
    g = torch.Generator().manual_seed(cfg.seed)
    out = {k: v for k, v in dense.items() if ".mlp." not in k}
    w = cfg.expert_intermediate
    for i in range(layers):
        p = f"model.layers.{i}"
        gate, up = dense[f"{p}.mlp.gate_proj.weight"], dense[f"{p}.mlp.up_proj.weight"]
        down = dense[f"{p}.mlp.down_proj.weight"]
        for e in range(cfg.experts):
            s = slice((e % slices) * w, (e % slices + 1) * w)
            for name, t in (("w1", gate[s]), ("w3", up[s]),
                            ("w2", down[:, s] * (slices / cfg.top_k))):
                n = torch.randn(t.shape, generator=g) * t.std() * cfg.noise
                out[f"{p}.block_sparse_moe.experts.{e}.{name}.weight"] = (t + n).contiguous()
        out[f"{p}.block_sparse_moe.gate.weight"] = torch.randn(cfg.experts, hidden,
                                                              generator=g) * 0.02
    return out


def upcycle(cfg: UpcycleConfig) -> dict[str, Any]:
    """Build, train and save the MoE; returns the figures the model card reports."""
    import transformers
    from safetensors.torch import save_file


    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    src = Path(cfg.source)
    src_cfg = json.loads((src / "config.json").read_text())
    teacher, _, _ = load_target(src)
    dense = read_safetensors(src)
    if src_cfg.get("tie_word_embeddings"):
        dense.pop("lm_head.weight", None)
    hf_cfg = mixtral_config(src_cfg, cfg)
    work = Path(cfg.out).with_name(Path(cfg.out).name + ".work")
    work.mkdir(parents=True, exist_ok=True)
    hf_cfg.save_pretrained(str(work))
    save_file(upcycled_state(dense, src_cfg["num_hidden_layers"], cfg,
                             src_cfg["intermediate_size"], src_cfg["hidden_size"]),
              str(work / "model.safetensors"), metadata={"format": "pt"})
    model, _, _ = load_target(work)  # the workbench's MoeForCausalLM, trained below
    model.train().requires_grad_(True)
    moes = [m for m in model.modules() if isinstance(m, SparseMoe)]
    inputs: list[torch.Tensor] = []
    for m in moes:
        m.register_forward_hook(lambda mod, args, out: inputs.append(args[0]))
    train, held = corpus_tokens(src, cfg.seq_len, cfg.corpus)
    gen = torch.Generator().manual_seed(cfg.seed)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr,
                            betas=(0.9, 0.95), weight_decay=0.0)
    history, t_start = [], time.perf_counter()
    for step in tqdm(range(cfg.steps), desc="upcycle", unit="step"):
        starts = torch.randint(0, len(train) - cfg.seq_len - 1, (cfg.batch,), generator=gen)
        x = torch.stack([torch.from_numpy(train[s : s + cfg.seq_len + 1].astype(np.int64))
                         for s in starts.tolist()])
        with torch.no_grad():
            t_logits, _ = teacher.forward_dense(x[:, :-1])
        inputs.clear()
        logits, _ = model.forward_dense(x[:, :-1])
        ce = F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
        kl = F.kl_div(F.log_softmax(logits, -1).flatten(0, 1),
                      F.log_softmax(t_logits, -1).flatten(0, 1), log_target=True,
                      reduction="batchmean")
        bal = torch.zeros(())
        for m, h in zip(moes, inputs, strict=True):
            probs = torch.softmax(F.linear(h, m.gate.weight).float(), -1).mean(0)
            assert m.last_counts is not None
            frac = m.last_counts.float() / m.last_counts.sum()
            bal = bal + cfg.experts * (frac * probs).sum()
        loss = ce + cfg.distill * kl + cfg.balance * bal / len(moes)
        lr = cfg.lr * min(1.0, (step + 1) / 10) * (0.1 + 0.9 * (1 - step / cfg.steps))
        for pg in opt.param_groups:
            pg["lr"] = lr
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        history.append({"step": step + 1, "ce": ce.item(), "kl": kl.item(),
                        "balance": bal.item() / len(moes)})
    seconds = time.perf_counter() - t_start
    model.eval().requires_grad_(False)
    held_loss = heldout_loss(model, held, cfg)
    teacher_loss = heldout_loss(teacher, held, cfg)
    state = {k: v for k, v in model.state_dict().items()
             if not (hf_cfg.tie_word_embeddings and k == "lm_head.weight")}
    save_file({k: v.contiguous() for k, v in state.items()}, str(work / "model.safetensors"),
              metadata={"format": "pt"})
    hf = transformers.MixtralForCausalLM.from_pretrained(str(work), dtype=getattr(torch,
                                                                                   cfg.dtype))
    hf.save_pretrained(cfg.out)  # the shipped folder is transformers' own writing
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (Path(cfg.out) / name).write_bytes((src / name).read_bytes())
    summary = {"config": asdict(cfg), "parameters": sum(p.numel() for p in model.parameters()),
               "train_seconds": seconds, "tokens_seen": cfg.steps * cfg.batch * cfg.seq_len,
               "heldout_loss": held_loss, "teacher_heldout_loss": teacher_loss,
               "torch_threads": torch.get_num_threads(), "history": history}
    (Path(cfg.out) / "training_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


@torch.no_grad()
def heldout_loss(model: Any, held: np.ndarray, cfg: UpcycleConfig, windows: int = 16) -> float:
    stride = max(1, (len(held) - cfg.seq_len - 1) // windows)
    rows = [held[j * stride : j * stride + cfg.seq_len + 1].astype(np.int64)
            for j in range(windows)]
    x = torch.from_numpy(np.stack(rows))
    losses = []
    for i in range(0, windows, cfg.batch):
        logits, _ = model.forward_dense(x[i : i + cfg.batch, :-1])
        losses.append(F.cross_entropy(logits.flatten(0, 1), x[i : i + cfg.batch, 1:].flatten())
                      .item())
    return float(np.mean(losses))
