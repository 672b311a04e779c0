"""The draft head: its config (from the target's), a fresh head, the parameters that train and
the state a checkpoint keeps, and what is measured after training: per-step KL and top-1
agreement, the temperature that ranks greedy drafts, the chain accept-length estimate."""

from __future__ import annotations

import numpy as np
import torch

from workbench.errors import ConfigError
from workbench.models.config import ModelConfig
from workbench.models.eagle3 import Eagle3Config, Eagle3Draft
from workbench.models.llama import init_weights
from workbench.models.loader import Target
from workbench.train.eagle3.config import DraftTrainConfig
from workbench.train.eagle3.ttt import target_features, ttt_forward, ttt_unroll


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


def new_draft(cfg: DraftTrainConfig, dcfg: Eagle3Config, target: Target,
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
            rows = (torch.arange(len(d2t)) + d2t).to(target.lm_head.weight.device)
            draft.lm_head.weight.copy_(target.lm_head.weight[rows])
    draft.set_embedding(target.model.embed_tokens)
    return draft


def trainable(draft: Eagle3Draft) -> list[torch.nn.Parameter]:
    return [p for n, p in draft.named_parameters() if not n.startswith("embed.")]


def head_state(draft: Eagle3Draft) -> dict[str, torch.Tensor]:
    return {k: v for k, v in draft.state_dict().items() if not k.startswith("embed.")}


@torch.no_grad()
def evaluate(draft: Eagle3Draft, target: Target, aux: tuple[int, ...],
             windows: np.ndarray, cfg: DraftTrainConfig,
             weights: np.ndarray | None = None) -> dict[str, list[float]]:
    """Per-step mean forward KL and top-1 agreement over fixed windows (seq_len each);
    ``weights`` (one row weight per draft row, as ``ttt_forward``): weighted means."""
    draft.eval()
    dev = draft.fc.weight.device
    kl_sum = torch.zeros(cfg.ttt_steps)
    acc_sum = torch.zeros(cfg.ttt_steps)
    n = 0.0
    for lo in range(0, len(windows), cfg.batch):
        x = torch.from_numpy(windows[lo : lo + cfg.batch].astype(np.int64)).to(dev)
        w = None if weights is None else torch.from_numpy(weights[lo : lo + cfg.batch]).to(dev)
        logits, taps = target_features(target, x, aux)
        _, kl, acc = ttt_forward(draft, taps, logits, x, cfg.ttt_steps, cfg.step_decay, w)
        share = float(len(x)) if w is None else float(w.sum())  # step 0's rows, as the weight
        kl_sum += kl.cpu() * share
        acc_sum += acc.cpu() * share
        n += share
    draft.train()
    n = max(n, 1e-12)
    return {"loss": (kl_sum / n).tolist(), "acc": (acc_sum / n).tolist()}


# Temperatures tried when calibrating (ranking only: see Eagle3Config.greedy_score_temperature).
TEMPERATURE_GRID = tuple(round(0.1 + 0.05 * i, 2) for i in range(39))  # 0.10 .. 2.00


@torch.no_grad()
def fit_greedy_temperature(draft: Eagle3Draft, target: Target, aux: tuple[int, ...],
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
    dev = draft.fc.weight.device
    vd = draft.config.draft_vocab_size
    target_ids = draft.draft_to_target(torch.arange(vd, device=dev))
    to_draft = torch.full((draft.config.vocab_size,), -1, dtype=torch.int64, device=dev)
    to_draft[target_ids] = torch.arange(vd, device=dev)
    grid = torch.tensor(TEMPERATURE_GRID)
    nll_sum = torch.zeros(len(grid), dtype=torch.float64, device=dev)
    count = 0
    for lo in range(0, len(windows), cfg.batch):
        x = torch.from_numpy(windows[lo : lo + cfg.batch].astype(np.int64)).to(dev)
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
