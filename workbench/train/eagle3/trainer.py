"""``train_draft``: target and data, a fresh or resumed head, the training-time-test loop with
checkpoints, evaluation, temperature calibration, export."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from workbench.config import usable_device
from workbench.errors import CheckpointError, ConfigError
from workbench.models.config import ModelConfig
from workbench.models.loader import (
    Target,
    load_target,
    read_safetensors,
    resolve_path,
    save_eagle3,
)
from workbench.train.eagle3.config import RESUME_FIELDS, DraftTrainConfig
from workbench.train.eagle3.data import (
    answer_masks,
    corpus_tokens,
    eval_answer_windows,
    eval_windows,
    regenerated,
    sample_answer_batch,
    sample_batch,
)
from workbench.train.eagle3.head import (
    draft_config,
    est_accept_length,
    evaluate,
    fit_greedy_temperature,
    head_state,
    new_draft,
    trainable,
)
from workbench.train.eagle3.ttt import build_draft_vocab, target_features, ttt_forward
from workbench.train.loop import lr_at, save_checkpoint


def _load_target_checked(cfg: DraftTrainConfig) -> tuple[Target, ModelConfig, Path]:
    try:
        target, mcfg, folder = load_target(cfg.target, dtype="float32", device=cfg.device)
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


def _init_from(draft: torch.nn.Module, folder: str) -> None:
    """Load the head weights and draft vocabulary of the exported head in ``folder``."""
    try:
        tensors = read_safetensors(resolve_path(folder))
    except (ConfigError, CheckpointError) as e:
        raise ConfigError(f"init_from: {e}") from e
    own = head_state(draft)
    extra = sorted(set(tensors) - set(own))
    missing = sorted(k for k in set(own) - set(tensors) if not k.startswith("rotary."))
    if extra or missing:
        raise ConfigError(f"init_from: {folder!r} does not fit this head (missing {missing[:3]}, "
                          f"unexpected {extra[:3]})")
    for k, v in tensors.items():
        if tuple(v.shape) != tuple(own[k].shape):
            raise ConfigError(f"init_from: {folder!r}: {k} has shape {tuple(v.shape)}, this head "
                              f"{tuple(own[k].shape)} (another target or head geometry?)")
    with torch.no_grad():
        for k, v in tensors.items():
            own[k].copy_(v)


WARM_STEPS = 5  # a run's first steps (allocator, kernel selection) are not timed for a budget


def _budget_steps(cfg: DraftTrainConfig, step: int, spent: float, rate: float) -> int:
    """The step count that fits ``cfg.time_budget``: this run has spent ``spent`` seconds on
    steps, reached ``step`` and now takes ``rate`` seconds a step."""
    left = max(cfg.time_budget - spent, 0.0)
    return max(step + 1, min(cfg.steps, step + int(left / max(rate, 1e-9))))


def train_draft(cfg: DraftTrainConfig) -> dict[str, Any]:
    """Train (or resume) a head for ``cfg.target`` and export it to ``cfg.out``. Returns the
    summary also written to ``<out>/training_summary.json``."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    dev = usable_device(cfg.device)
    torch.manual_seed(cfg.seed)
    # 1. Target, features to tap, data (corpus + regenerated windows), draft vocabulary.
    target, mcfg, folder = _load_target_checked(cfg)
    aux = mcfg.aux_layer_ids()
    train, held = corpus_tokens(cfg, folder, mcfg)
    masks = answer_masks(cfg, train, held) if cfg.answer_loss else None
    regen_train = regen_held = None
    regen_seconds = 0.0
    if cfg.regenerate and cfg.regen_sequences:
        regen_train, regen_held, regen_seconds = regenerated(cfg, folder, train, held)
    vocab_src = [train] + ([regen_train.ravel()] if regen_train is not None else [])
    d2t, t2d = build_draft_vocab(vocab_src, mcfg.vocab_size, cfg.draft_vocab_size)
    # 2. Head, optimizer, sampling generator; resume from the work checkpoint if present.
    draft = new_draft(cfg, draft_config(cfg, mcfg, aux), target, d2t, t2d).to(dev)
    ckpt = Path(cfg.work) / "ckpt.pt"
    if cfg.init_from and not ckpt.exists():
        _init_from(draft, cfg.init_from)
    params = trainable(draft)
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    gen = torch.Generator().manual_seed(cfg.seed)
    step, history, seconds = 0, [], 0.0
    selection: list[dict[str, Any]] = []  # the eval_every scores
    best: dict[str, Any] | None = None  # the best-scoring head so far (eval_every)
    if masks is not None:
        sel_windows, sel_weights = eval_answer_windows(held, masks[1], cfg)
    else:
        sel_windows, sel_weights = eval_windows(held, cfg), None
    if ckpt.exists():  # its d2t/t2d win: the vocabulary the head was trained with
        state = torch.load(ckpt, weights_only=False, map_location=dev)
        _check_resume(state, cfg, ckpt)
        missing, unexpected = draft.load_state_dict(state["model"], strict=False)
        if unexpected or any(not k.startswith("embed.") for k in missing):
            raise ConfigError(f"work: {ckpt} does not fit this head (missing "
                              f"{missing[:3]}, unexpected {unexpected[:3]}); delete it")
        opt.load_state_dict(state["opt"])
        gen.set_state(state["gen"].cpu())
        step, history, seconds = state["step"], state["history"], state["seconds"]
        selection, best = state.get("selection", []), state.get("best")
    tokens_per_step = cfg.batch * (cfg.seq_len - 1)
    # 3. Train: one target forward, the unrolled TTT loss, one optimizer step.
    bar = tqdm(total=cfg.steps, initial=step, desc="train-draft", unit="step")
    start = (step, seconds)
    probe = max(cfg.warmup, 20)  # steps before a time budget sizes the run
    budget_steps = None
    warm_at = None  # (step, seconds) once the warm steps are done
    window: list[tuple[float, list[float]]] = []

    def score(at: int, best: dict[str, Any] | None) -> dict[str, Any] | None:
        """Score the head on the held-out rows at step ``at``; the new best, or ``best``."""
        ev = evaluate(draft, target, aux, sel_windows, cfg, sel_weights)
        est = est_accept_length(ev["acc"])
        selection.append({"step": at, "acc": ev["acc"], "est_accept_length_chain": est})
        if best is not None and est <= best["est"]:
            return best
        return {"step": at, "est": est,
                "model": {k: v.detach().clone() for k, v in head_state(draft).items()}}

    if cfg.eval_every and cfg.init_from and step == 0:  # the head it starts from competes
        best = score(0, best)
    draft.train()
    while step < cfg.steps:
        t0 = time.perf_counter()
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg)
        w = None
        if masks is None:
            x = sample_batch(train, regen_train, cfg, gen)
        else:
            x, w = sample_answer_batch(train, masks[0], regen_train, cfg, gen)
            w = w.to(dev)
        x = x.to(dev)
        logits, taps = target_features(target, x, aux)
        with (torch.autocast(dev.type, dtype=torch.bfloat16) if cfg.autocast == "bfloat16"
              else contextlib.nullcontext()):
            loss, _, acc = ttt_forward(draft, taps, logits, x, cfg.ttt_steps, cfg.step_decay, w)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        window.append((loss.item(), acc.tolist()))  # waits for the step on an accelerator
        seconds += time.perf_counter() - t0
        bar.update(1)
        if step - start[0] == WARM_STEPS:
            warm_at = (step, seconds)
        if cfg.time_budget and budget_steps is None and step - start[0] >= probe:
            assert warm_at is not None
            rate = (seconds - warm_at[1]) / (step - warm_at[0])
            budget_steps = _budget_steps(cfg, step, seconds - start[1], rate)
            cfg = dataclasses.replace(cfg, steps=budget_steps)
            bar.total = cfg.steps
            bar.refresh()
        run_tok_s = (step - start[0]) * tokens_per_step / max(seconds - start[1], 1e-9)
        bar.set_postfix(loss=f"{loss.item():.3f}", acc0=f"{acc[0].item():.3f}",
                        tok_s=f"{run_tok_s:.0f}")  # the bar itself shows elapsed<ETA
        if cfg.eval_every and (step % cfg.eval_every == 0 or step == cfg.steps):
            best = score(step, best)
        if step % cfg.ckpt_every == 0 or step == cfg.steps:
            history.append({"step": step, "loss": float(np.mean([w[0] for w in window])),
                            "acc": np.mean([w[1] for w in window], axis=0).tolist(),
                            "lr": lr_at(step - 1, cfg), "seconds": seconds})
            window = []
            save_checkpoint(ckpt, {"model": head_state(draft), "opt": opt.state_dict(),
                                   "gen": gen.get_state(), "step": step, "history": history,
                                   "seconds": seconds, "config": asdict(cfg),
                                   "selection": selection, "best": best})
    bar.close()
    if best is not None and best["step"] != step:  # export the best-scoring point
        draft.load_state_dict(best["model"], strict=False)
    # 4. Evaluate (train / held-out corpus / held-out regenerated windows) and export.
    evals = {"train": evaluate(draft, target, aux, eval_windows(train, cfg), cfg),
             "heldout": evaluate(draft, target, aux, eval_windows(held, cfg), cfg)}
    if masks is not None:  # the rows the head drafts at inference: answer tokens
        for name, data, m in (("train_answers", train, masks[0]),
                              ("heldout_answers", held, masks[1])):
            windows, weights = eval_answer_windows(data, m, cfg)
            evals[name] = evaluate(draft, target, aux, windows, cfg, weights)
    if regen_held is not None:
        evals["heldout_regen"] = evaluate(draft, target, aux, eval_windows(regen_held, cfg), cfg)
    # 5. Calibrate the tree-ranking temperature for greedy requests on held-out windows (the
    # regenerated ones when there are: the target's own continuations, as at inference).
    cal_src = regen_held if regen_held is not None and len(regen_held) else held
    temp, cal = fit_greedy_temperature(draft, target, aux, eval_windows(cal_src, cfg), cfg)
    draft.config = dataclasses.replace(draft.config, greedy_score_temperature=temp)
    save_eagle3(draft, cfg.out)
    in_vocab = draft.get_buffer("t2d").cpu()[torch.from_numpy(train.astype(np.int64))]
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
        "torch_threads": torch.get_num_threads(), "device": str(dev),
        "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "steps_fitted_to_time_budget": budget_steps,
        "exported_step": step if best is None else best["step"], "selection": selection,
        "config": asdict(cfg), "history": history,
    }
    (Path(cfg.out) / "training_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary
