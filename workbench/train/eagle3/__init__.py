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
folder (docs/REFERENCE.md §6) plus ``training_summary.json``.

One module per part: ``config`` (DraftTrainConfig), ``ttt`` (vocabulary, mask, unroll, loss,
target features: pure tensor functions), ``data`` (corpus and regenerated windows, batches),
``head`` (build, evaluate, calibrate the head), ``trainer`` (``train_draft``). Every name is
importable from here.
"""

from __future__ import annotations

from workbench.train.eagle3.config import RESUME_FIELDS, DraftTrainConfig
from workbench.train.eagle3.data import (
    answer_masks,
    corpus_tokens,
    eval_answer_windows,
    eval_windows,
    generate_windows,
    regenerated,
    sample_answer_batch,
    sample_batch,
)
from workbench.train.eagle3.head import (
    TEMPERATURE_GRID,
    draft_config,
    est_accept_length,
    evaluate,
    fit_greedy_temperature,
    head_state,
    new_draft,
    trainable,
)
from workbench.train.eagle3.trainer import train_draft
from workbench.train.eagle3.ttt import (
    build_draft_vocab,
    target_features,
    ttt_forward,
    ttt_mask,
    ttt_unroll,
)
from workbench.train.loop import lr_at

__all__ = [
    "DraftTrainConfig", "RESUME_FIELDS", "TEMPERATURE_GRID", "answer_masks", "build_draft_vocab",
    "corpus_tokens", "draft_config", "est_accept_length", "eval_answer_windows", "eval_windows",
    "evaluate", "fit_greedy_temperature", "generate_windows", "head_state", "lr_at", "new_draft",
    "regenerated", "sample_answer_batch", "sample_batch", "target_features", "train_draft",
    "trainable", "ttt_forward", "ttt_mask", "ttt_unroll",
]
