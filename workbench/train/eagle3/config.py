"""``DraftTrainConfig``: every setting of an EAGLE-3 draft training run, validated."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workbench.errors import ConfigError

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
    # Loss and agreement on the rows that predict an answer token only (a ``.npz`` corpus with
    # ``train_mask`` / ``heldout_mask``, e.g. ``workbench.train.distill.pack``): at inference the
    # head drafts the target's answers, never the user's prompt; windows are drawn around answers.
    answer_loss: bool = False
    # "bfloat16": the head's unrolled forward and backward under CPU autocast (weights, optimizer
    # and the target's features stay float32; evaluation runs in float32). Faster where the CPU
    # has bf16 dot products (AVX512_BF16, AMX); measure before choosing it elsewhere.
    autocast: str = ""
    # Where the target and the head run: "cpu" or "cuda[:N]" (the corpus, the sampling and the
    # exported head stay on the host; a checkpoint resumes on any device).
    device: str = "cpu"
    # A head folder (an exported EAGLE-3 checkpoint for this target) to start from instead of a
    # fresh init: its weights and draft vocabulary, a fresh optimizer and schedule. A checkpoint
    # in ``work`` wins (that run is resumed).
    init_from: str = ""
    # Seconds of training steps this run may take (0: no limit). After the warmup (at least 20
    # steps) the step count is cut to what fits at the speed measured so far, and the schedule
    # anneals over the cut count; evaluation and export come after the budget.
    time_budget: float = 0.0
    # Every this many steps (0: never) score the held-out rows (the answer rows with
    # answer_loss) by the chain accept-length estimate; the best-scoring head is the one
    # exported, so a run that starts to over-fit keeps its best point.
    eval_every: int = 0

    def __post_init__(self) -> None:
        for f in ("draft_vocab_size", "steps", "batch", "seq_len", "ckpt_every", "eval_batches",
                  "regen_batch", "regen_prompt_len"):
            if getattr(self, f) <= 0:
                raise ConfigError(f"{f}: must be > 0, got {getattr(self, f)}")
        for f in ("heads", "kv_heads", "head_dim", "intermediate", "warmup", "threads",
                  "regen_sequences", "eval_every"):
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
        try:
            dev = torch.device(self.device)
        except (RuntimeError, TypeError) as e:
            raise ConfigError(f"device: {self.device!r} is not a torch device ({e})") from e
        if dev.type not in ("cpu", "cuda"):
            raise ConfigError(f"device: must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if not self.time_budget >= 0.0 or self.time_budget == float("inf"):
            raise ConfigError(f"time_budget: must be a finite number of seconds >= 0 (0: no "
                              f"limit), got {self.time_budget}")
        if self.autocast not in ("", "bfloat16"):
            raise ConfigError(f"autocast: must be '' (off) or 'bfloat16', got {self.autocast!r}")
        if self.answer_loss and not self.corpus.endswith(".npz"):
            raise ConfigError(f"answer_loss: needs a pre-tokenized .npz corpus with answer masks, "
                              f"got corpus={self.corpus!r}")
        if self.regenerate and self.regen_sequences == 0 and self.regen_mix > 0:
            raise ConfigError("regen_sequences: 0 with regenerate=True and regen_mix > 0")
