"""Train the shipped target: byte-level BPE tokenizer + Llama-architecture decoder from scratch.

Resumable: ``<work>/ckpt.pt`` holds model, optimizer, step and RNG state and is rewritten every
``ckpt_every`` steps; rerunning the same command continues where it stopped. The result is an HF
folder that both ``workbench`` and ``transformers.AutoModelForCausalLM`` load.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tqdm.auto import tqdm

from workbench.errors import ConfigError
from workbench.models.config import ModelConfig
from workbench.models.llama import LlamaForCausalLM, init_weights
from workbench.train.corpus import split_corpus
from workbench.train.loop import lr_at, save_checkpoint

EOS = "<|endoftext|>"


@dataclass(frozen=True)
class TargetTrainConfig:
    out: str = "data/models/wb-target"
    work: str = "data/work/target"
    corpus: str = ""  # empty: the running interpreter's standard library
    vocab_size: int = 8192
    layers: int = 16
    hidden: int = 256
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 704
    seq_len: int = 256
    batch: int = 16
    steps: int = 2000
    lr: float = 2e-3
    warmup: int = 100
    weight_decay: float = 0.1
    ckpt_every: int = 100
    eval_batches: int = 16
    seed: int = 0
    threads: int = 0  # 0: torch default

    def __post_init__(self) -> None:
        for f in ("vocab_size", "layers", "hidden", "heads", "kv_heads", "seq_len", "batch",
                  "steps"):
            if getattr(self, f) <= 0:
                raise ConfigError(f"{f}: must be > 0, got {getattr(self, f)}")
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise ConfigError("heads/kv_heads: hidden % heads and heads % kv_heads must be 0")


def train_tokenizer(texts: list[str], vocab_size: int):  # type: ignore[no-untyped-def]
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def encode_all(tok, texts: list[str], eos_id: int) -> np.ndarray:  # type: ignore[no-untyped-def]
    ids: list[int] = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eos_id)
    return np.asarray(ids, dtype=np.uint16)


def model_config(cfg: TargetTrainConfig, eos_id: int) -> ModelConfig:
    return ModelConfig(
        family="llama", vocab_size=cfg.vocab_size, hidden_size=cfg.hidden,
        intermediate_size=cfg.intermediate, num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads, num_key_value_heads=cfg.kv_heads,
        head_dim=cfg.hidden // cfg.heads, rms_norm_eps=1e-5, rope_theta=10000.0,
        max_position_embeddings=2048, tie_word_embeddings=True,
        bos_token_id=eos_id, eos_token_id=[eos_id], torch_dtype="float32",
    )


def batches(data: np.ndarray, cfg: TargetTrainConfig, gen: torch.Generator) -> torch.Tensor:
    """Random windows of seq_len+1 tokens: (batch, seq_len+1) int64."""
    starts = torch.randint(0, len(data) - cfg.seq_len - 1, (cfg.batch,), generator=gen)
    return torch.stack([torch.from_numpy(data[s : s + cfg.seq_len + 1].astype(np.int64))
                        for s in starts.tolist()])


@torch.no_grad()
def evaluate(model: LlamaForCausalLM, data: np.ndarray, cfg: TargetTrainConfig) -> float:
    """Mean next-token loss over fixed, evenly spaced windows (deterministic)."""
    model.eval()
    n = min(cfg.eval_batches * cfg.batch, max(1, (len(data) - 1) // (cfg.seq_len + 1)))
    stride = max(1, (len(data) - cfg.seq_len - 1) // n)
    losses = []
    for i in range(0, n, cfg.batch):
        rows = [data[j * stride : j * stride + cfg.seq_len + 1].astype(np.int64)
                for j in range(i, min(n, i + cfg.batch))]
        x = torch.from_numpy(np.stack(rows))
        logits, _ = model.forward_dense(x[:, :-1])
        losses.append(F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten()).item())
    model.train()
    return float(np.mean(losses))


def prepare_data(cfg: TargetTrainConfig) -> tuple[object, np.ndarray, np.ndarray, list[str]]:
    """Tokenizer and token arrays, cached in ``work`` so a resumed run skips this."""
    from tokenizers import Tokenizer

    work = Path(cfg.work)
    work.mkdir(parents=True, exist_ok=True)
    split = split_corpus(cfg.corpus or None)
    held_names = [f.relative_to(split.root).as_posix() for f in split.heldout]
    tok_path = work / "tokenizer.json"
    if tok_path.exists() and (work / "train.npy").exists():
        tok = Tokenizer.from_file(str(tok_path))
        return tok, np.load(work / "train.npy"), np.load(work / "heldout.npy"), held_names
    train_texts, held_texts = split.read("train"), split.read("heldout")
    tok = train_tokenizer(train_texts, cfg.vocab_size)
    eos_id = tok.token_to_id(EOS)
    train, held = encode_all(tok, train_texts, eos_id), encode_all(tok, held_texts, eos_id)
    if len(train) < cfg.seq_len + 2 or len(held) < cfg.seq_len + 2:
        raise ConfigError(f"corpus: too little text ({len(train)} train / {len(held)} held-out "
                          f"tokens) for seq_len {cfg.seq_len}")
    tok.save(str(tok_path))
    np.save(work / "train.npy", train)
    np.save(work / "heldout.npy", held)
    return tok, train, held, held_names


# The chat template written into the workbench's own models' tokenizer_config.json, so chat
# clients (OpenAI chat, LangChain ChatOpenAI, LiteLLM) work against ``workbench serve``. The
# models are trained on Python source only, so a conversation is rendered as Python: every
# non-assistant message is a comment ("# user: ..."; each of its lines commented), every
# assistant turn is "# assistant:" on a line of its own and then its content as code. The
# generation prompt is that same header, so a reply is the model continuing with code.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{{ '# assistant:\\n' + message['content'] + '\\n' }}"
    "{%- else -%}"
    "{{ '# ' + message['role'] + ': ' + message['content'] | replace('\\n', '\\n# ') + '\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '# assistant:\\n' }}{%- endif -%}")


def save_hf_folder(model: LlamaForCausalLM, tok: object, out: Path, mcfg: ModelConfig) -> None:
    """config.json, model.safetensors, tokenizer files, generation_config.json."""
    out.mkdir(parents=True, exist_ok=True)
    eos = mcfg.eos_token_id[0]
    (out / "config.json").write_text(json.dumps(mcfg.to_hf_dict(), indent=2) + "\n")
    state = {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()
             if k != "lm_head.weight" or not mcfg.tie_word_embeddings}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    tok.save(str(out / "tokenizer.json"))  # type: ignore[attr-defined]
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": EOS, "eos_token": EOS,
        "unk_token": EOS, "model_max_length": mcfg.max_position_embeddings,
        "add_bos_token": False, "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": eos, "eos_token_id": eos, "do_sample": False}, indent=2) + "\n")


def train_target(cfg: TargetTrainConfig) -> dict[str, object]:
    """Train (or resume) and export. Returns the figures the model card reports."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    tok, train, held, held_names = prepare_data(cfg)
    eos_id = tok.token_to_id(EOS)  # type: ignore[attr-defined]
    mcfg = model_config(cfg, eos_id)
    model = LlamaForCausalLM(mcfg)
    init_weights(model, seed=cfg.seed)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=cfg.lr, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(cfg.seed)
    ckpt = Path(cfg.work) / "ckpt.pt"
    step, history, train_seconds = 0, [], 0.0
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        gen.set_state(state["gen"])
        step, history, train_seconds = state["step"], state["history"], state["seconds"]
    n_params = sum(p.numel() for p in model.parameters())
    tokens_per_step = cfg.batch * cfg.seq_len
    bar = tqdm(total=cfg.steps, initial=step, desc="train-target", unit="step")
    ema = None
    while step < cfg.steps:
        t0 = time.perf_counter()
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg)
        x = batches(train, cfg, gen)
        logits, _ = model.forward_dense(x[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        train_seconds += time.perf_counter() - t0
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        bar.update(1)
        bar.set_postfix(loss=f"{ema:.3f}", tok_s=f"{step * tokens_per_step / train_seconds:.0f}")
        if step % cfg.ckpt_every == 0 or step == cfg.steps:
            history.append({"step": step, "train_loss": ema, "seconds": train_seconds})
            save_checkpoint(ckpt, {"model": model.state_dict(), "opt": opt.state_dict(),
                                   "gen": gen.get_state(), "step": step, "history": history,
                                   "seconds": train_seconds, "config": asdict(cfg)})
    bar.close()
    held_loss, train_loss = evaluate(model, held, cfg), evaluate(model, train, cfg)
    save_hf_folder(model, tok, Path(cfg.out), mcfg)
    summary = {
        "parameters": n_params, "steps": step, "tokens_seen": step * tokens_per_step,
        "train_tokens": int(len(train)), "heldout_tokens": int(len(held)),
        "train_loss": train_loss, "heldout_loss": held_loss,
        "train_seconds": train_seconds,
        "tokens_per_second": step * tokens_per_step / max(train_seconds, 1e-9),
        "heldout_files": held_names, "config": asdict(cfg), "history": history,
        "torch_threads": torch.get_num_threads(),
    }
    (Path(cfg.out) / "training_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary
