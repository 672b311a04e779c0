"""Engine-wide counters with SGLang/vLLM semantics (``Engine.stats``)."""

from __future__ import annotations

from workbench.core import accept_length

# EngineStats.accept_lengths keeps at least this many of the latest verify steps and at most
# twice as many (a long-running server must not grow it without bound; trimmed in batches)
ACCEPT_HISTORY = 65536


def count_depths(counts: list[int], accepted: int) -> None:
    """counts[d] += 1 for every accepted depth d < ``accepted`` (growing the list as needed)."""
    counts.extend([0] * (accepted - len(counts)))
    for depth in range(accepted):
        counts[depth] += 1


class EngineStats:
    """Counters since the engine started (or since ``reset``); O(1) memory per step."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Zero every counter in place (holders of this object see the reset)."""
        self.steps = {"plain": 0, "spec": 0, "prefill": 0}
        self.verify_ct = 0
        self.accept_lengths: list[int] = []  # latest verify steps' τ (see ACCEPT_HISTORY)
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.verify_tokens = 0  # tokens the verify steps emitted (accepted drafts + bonuses)
        self.accepted_per_pos: list[int] = []
        self.generated_tokens = 0

    def snapshot(self) -> dict[str, object]:
        """A copy of every counter, for :meth:`restore` (calibration runs on a live engine)."""
        return {k: (dict(v) if isinstance(v, dict) else list(v) if isinstance(v, list) else v)
                for k, v in vars(self).items()}

    def restore(self, snap: dict[str, object]) -> None:
        """Put the counters back as :meth:`snapshot` saw them, in place."""
        vars(self).update(snap)

    def record_verify(self, accepted: int, drafted: int, emitted: int) -> None:
        """One request's verify round: it emitted ``emitted`` tokens, ``accepted`` of them
        draft tokens, of ``drafted`` tree nodes (``emitted`` = ``accepted`` + 1, the bonus,
        unless a stop or max_new_tokens cut the block: then what it kept)."""
        self.verify_ct += 1
        self.verify_tokens += emitted
        self.accept_lengths.append(emitted)
        if len(self.accept_lengths) > 2 * ACCEPT_HISTORY:
            del self.accept_lengths[:-ACCEPT_HISTORY]
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        count_depths(self.accepted_per_pos, accepted)

    @property
    def accept_length(self) -> float:
        """Mean τ (tokens emitted per verify step; O(1)): :func:`workbench.core.accept_length`."""
        return accept_length(self.verify_tokens - self.verify_ct, self.verify_ct)

    @property
    def accept_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0
