"""Workbench policies → SGLang adaptive speculation tiers, and how SGLang routes a batch to them.

SGLang 0.5.23 stops drafting above a batch size without a patch: ``--speculative-adaptive
--speculative-adaptive-config FILE`` gives each decode batch a *tier* of candidate step counts,
and a tier of ``[0]`` decodes plainly. This module is the pure part of that mapping (no I/O):

1. :func:`tiers_for_policy` turns ``Always`` / ``BatchThreshold(n)`` / ``StepTable`` into
   :class:`Tiers` (``BatchThreshold(8)``, S=5 → ``{"1": [5], "9": [0]}``).
2. :meth:`Tiers.route` is SGLang's routing, re-implemented from
   ``srt/speculative/adaptive_spec_params.py`` (``AdaptiveSpeculativeParams._route``): pad the
   batch size up to the next size of the *adaptive router's* capture list (``bisect_left``; a
   batch above the list's largest size is not padded), then take the largest tier key <= it
   (the first tier if none). A single-candidate tier runs that step count; a tier with several
   candidates starts at the launch's ``--speculative-num-steps`` when it is a candidate, else at
   the middle candidate, and then adapts from acceptance.
3. Which capture list? ``EAGLEWorkerV2`` hands the router ``--cuda-graph-bs-decode`` as given
   on the command line (``get_exec().graph.cuda_graph_bs_decode``), or nothing when the decode
   CUDA graph is disabled. Without that flag the router gets ``None`` and routes the raw batch
   size: every threshold is exact. Only an explicit ``--cuda-graph-bs-decode`` list makes a
   batch pad past a tier boundary (threshold 9 with the spec list 1–8, 10, 12, … → batch 9 pads
   to 10 and stops drafting); :func:`threshold_differences` and :func:`nearest_exact_thresholds`
   compute that with the list the launch uses. The CUDA-graph *runner* still pads every batch
   for replay; that changes the graph used, not the tier.

The tests route every plan's batch sizes through SGLang's own ``AdaptiveSpeculativeParams``
loaded from the plan's config file and assert this module agrees.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from workbench.errors import ConfigError
from workbench.policy.policies import Always, BatchThreshold, Never, StepTable

# SGLang 0.5.23 is the version this mapping was read from and is tested against. Adaptive
# steps landed upstream in sgl-project/sglang PR #21599 and per-batch-size tiers in #24055;
# older releases (the seeds' box ran 0.5.9) have neither.
VERIFIED_VERSION = "0.5.23"
EAGLE3_DEFAULT_MAX_RUNNING = 48  # _handle_eagle_family: max_running_requests when not given


def parse_version(version: str) -> tuple[int, ...]:
    """``"0.5.23"`` → ``(0, 5, 23)``; a suffix (``0.5.9.post1``, ``0.5.23rc1``) is ignored."""
    parts: list[int] = []
    for piece in str(version).lstrip("v").split("."):
        digits = ""
        for ch in piece:
            if not ch.isdigit():
                break
            digits += ch
        if not digits:
            break
        parts.append(int(digits))
    if len(parts) < 2:
        raise ConfigError(f"sglang_version: expected 'MAJOR.MINOR[.PATCH]', got {version!r}")
    return tuple(parts)


def has_adaptive_tiers(version: str) -> bool:
    """Whether ``version`` has per-batch-size adaptive tiers (verified from 0.5.23 on)."""
    return parse_version(version) >= parse_version(VERIFIED_VERSION)


def spec_decode_capture_sizes(max_bs: int) -> list[int]:
    """SGLang 0.5.23's default decode capture sizes with speculation on, up to ``max_bs``
    (``generate_decode_cuda_graph_batch_sizes``): 1–8, 10–32 step 2, 40–64 step 4, 72–256
    step 8, then step 16, plus ``max_bs`` itself. Pass it as ``cuda_graph_bs_decode=`` to pin
    the list (the adaptive router then pads to it)."""
    if not isinstance(max_bs, int) or max_bs < 1:
        raise ConfigError(f"max_bs: must be a positive integer, got {max_bs!r}")
    sizes = (list(range(1, 9)) + list(range(10, 33, 2)) + list(range(40, 65, 4))
             + list(range(72, 257, 8)) + list(range(272, max_bs + 1, 16)))
    sizes = [s for s in sizes if s <= max_bs]
    if max_bs not in sizes:
        sizes.append(max_bs)
    return sizes


def pad_to_capture(batch_size: int, capture_bs: Sequence[int] | None) -> int:
    """The batch size SGLang's adaptive router looks up: the next capture size >= it, or the
    batch size itself above the list (or with no list)."""
    if not capture_bs:
        return batch_size
    sizes = sorted(capture_bs)
    i = bisect.bisect_left(sizes, batch_size)
    return sizes[i] if i < len(sizes) else batch_size


@dataclass(frozen=True)
class Route:
    """Where SGLang sends one decode batch: padded size, tier key, candidates, steps run."""

    batch_size: int
    padded: int
    tier: int
    candidates: tuple[int, ...]
    steps: int  # the step count it runs (a multi-candidate tier: the one it starts at)

    @property
    def adaptive(self) -> bool:
        return len(self.candidates) > 1


@dataclass(frozen=True)
class Tiers:
    """SGLang adaptive tiers: ``{batch-size key: candidate steps}``, keys >= 1, steps >= 0.

    ``tuning`` holds the file's non-tier keys (``ema_alpha``, ``update_interval``, …); SGLang
    merges them into every tier. A key that is not a known tuning key is refused here, because
    SGLang silently treats any non-digit key as tuning (a typo would be ignored).
    """

    tiers: tuple[tuple[int, tuple[int, ...]], ...]
    tuning: tuple[tuple[str, float], ...] = ()

    TUNING_KEYS = ("ema_alpha", "update_interval", "warmup_batches", "down_hysteresis",
                   "up_hysteresis", "ceiling_coeff")

    def __post_init__(self) -> None:
        if not self.tiers:
            raise ConfigError("Tiers.tiers: need at least one batch-size tier")
        keys = [k for k, _ in self.tiers]
        if keys != sorted(set(keys)) or any(not isinstance(k, int) or k < 1 for k in keys):
            raise ConfigError(f"Tiers.tiers: keys must be distinct integers >= 1 in increasing "
                              f"order, got {keys}")
        for k, steps in self.tiers:
            if not steps or any(not isinstance(s, int) or isinstance(s, bool) or s < 0
                                for s in steps):
                raise ConfigError(f"Tiers.tiers[{k}]: candidate steps must be a non-empty list "
                                  f"of integers >= 0, got {list(steps)}")
        for name, _ in self.tuning:
            if name not in self.TUNING_KEYS:
                raise ConfigError(f"Tiers.tuning: unknown key {name!r} (SGLang would silently "
                                  f"ignore it); known: {', '.join(self.TUNING_KEYS)}")

    @classmethod
    def of(cls, tiers: Mapping[int, Sequence[int]], **tuning: float) -> Tiers:
        """``Tiers.of({1: [5], 9: [0]})``."""
        return cls(tuple((int(k), tuple(v)) for k, v in sorted(tiers.items())),
                   tuple(sorted(tuning.items())))

    def config_text(self) -> str:
        """The config file's text, one tier per line."""
        cfg = self.config()
        return "{\n" + ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}"
                                   for k, v in cfg.items()) + "\n}\n"

    def config(self) -> dict[str, Any]:
        """The JSON object of ``--speculative-adaptive-config``."""
        out: dict[str, Any] = {str(k): {"candidate_steps": list(v)} for k, v in self.tiers}
        out.update(dict(self.tuning))
        return out

    @property
    def candidate_steps(self) -> list[int]:
        """Union of every tier's candidates (``--speculative-num-steps`` must be one)."""
        return sorted({s for _, v in self.tiers for s in v})

    def route(self, batch_size: int, capture_bs: Sequence[int] | None = None,
              initial_steps: int | None = None) -> Route:
        """SGLang's ``_route`` (module doc); ``initial_steps`` is ``--speculative-num-steps``."""
        padded = pad_to_capture(batch_size, capture_bs)
        keys = [k for k, _ in self.tiers]
        i = max(0, bisect.bisect_right(keys, padded) - 1)
        key, cands = self.tiers[i]
        ordered = tuple(sorted(set(cands)))
        if initial_steps in ordered:
            steps = int(initial_steps)  # type: ignore[arg-type]
        else:
            steps = ordered[len(ordered) // 2]
        return Route(batch_size, padded, key, ordered, steps)


def threshold_n(policy: BatchThreshold) -> int:
    """``policy.n`` as a batch size. ``BatchThreshold("auto")`` is resolved by a local engine
    on its machine (``Engine.set_spec``), never for SGLang: refused."""
    n = policy.n
    if isinstance(n, str):
        raise ConfigError(f"spec.policy: {policy!r} is resolved by a local engine on its "
                          "machine; give SGLang a resolved policy (e.g. BatchThreshold(n))")
    return n


def tiers_for_policy(policy: Any, num_steps: int) -> Tiers | None:
    """Adaptive tiers that make SGLang follow ``policy`` at ``num_steps`` draft steps.

    ``None`` means no tiers are needed (``Always``: static speculation does it) or none can be
    built (``Never``, ``BatchThreshold(0)``, a ``StepTable`` that is off everywhere: launch
    without speculation). Raises ConfigError for policies SGLang cannot express (goodput
    controllers, random flips) and for ``StepTable`` tiers that are not chains (topk 1).
    """
    if policy is None or isinstance(policy, Always) or isinstance(policy, Never):
        return None
    if isinstance(policy, BatchThreshold):
        n = threshold_n(policy)
        if n == 0:
            return None
        return Tiers.of({1: [num_steps], n + 1: [0]})
    if isinstance(policy, StepTable):
        tiers: dict[int, list[int]] = {}
        last: int | None = None
        for lo in sorted(key[0] for key in policy.tiers):
            shape = policy.lookup(lo)
            if shape is not None and shape[1] != 1:
                raise ConfigError(f"StepTable tier starting at {lo}: topk {shape[1]} — SGLang's "
                                  "adaptive tiers only run chains (topk 1); use shapes (S, 1, S+1)")
            steps = 0 if shape is None else shape[0]
            if steps != last:  # merge neighbouring tiers that run the same step count
                tiers[lo] = [steps]
                last = steps
        if all(v == [0] for v in tiers.values()):
            return None
        return Tiers.of(tiers)
    raise ConfigError(f"policy {policy!r}: SGLang's adaptive tiers are a fixed table by batch "
                      "size; this policy decides at run time and has no upstream equivalent")


def policy_steps(policy: Any, batch_size: int, num_steps: int) -> int | None:
    """The workbench policy's decision at a decode batch of ``batch_size``: draft steps, 0 for
    plain decoding, None when the policy decides at run time (goodput, random)."""
    if policy is None or isinstance(policy, Always):
        return num_steps
    if isinstance(policy, Never):
        return 0
    if isinstance(policy, BatchThreshold):
        return num_steps if batch_size <= threshold_n(policy) else 0
    if isinstance(policy, StepTable):
        shape = policy.lookup(batch_size)
        return 0 if shape is None else shape[0]
    return None


def threshold_differences(n: int, capture_bs: Sequence[int] | None,
                          max_batch: int) -> list[int]:
    """Batch sizes 1..max_batch where SGLang's tiers for ``BatchThreshold(n)`` decide otherwise
    than the policy (padding past the ``n+1`` tier boundary)."""
    tiers = Tiers.of({1: [1], n + 1: [0]})
    return [b for b in range(1, max_batch + 1)
            if (tiers.route(b, capture_bs).steps > 0) != (b <= n)]


def nearest_exact_thresholds(n: int, capture_bs: Sequence[int] | None,
                             max_batch: int) -> list[int]:
    """The thresholds closest to ``n`` (at most one below and one above) that SGLang follows
    exactly with this capture list; ``[n]`` when ``n`` is exact already."""
    def exact(m: int) -> bool:
        return not threshold_differences(m, capture_bs, max(max_batch, m + 1))

    if exact(n):
        return [n]
    below = next((m for m in range(n - 1, 0, -1) if exact(m)), None)
    above = next((m for m in range(n + 1, max(max_batch, n + 1) + 1) if exact(m)), None)
    return [m for m in (below, above) if m is not None]


def routing_rows(tiers: Tiers | None, launched_steps: int, policy: Any, spec_steps: int,
                 max_batch: int, capture_bs: Sequence[int] | None) -> list[dict[str, Any]]:
    """One row per decode batch 1..max_batch: what SGLang runs beside the policy's decision.

    ``launched_steps`` is ``--speculative-num-steps`` (0: launched without speculation);
    ``tiers=None`` runs it statically at every batch. ``spec_steps`` is the SpecConfig's S the
    policy speculates with. Columns: batch_size, padded, tier, candidates, sglang_steps,
    adaptive, policy_steps, agree (policy_steps None — decided at run time — never agrees).
    """
    rows = []
    for b in range(1, max_batch + 1):
        if tiers is None:
            r = Route(b, b, 1, (launched_steps,), launched_steps)
        else:
            r = tiers.route(b, capture_bs, launched_steps)
        want = policy_steps(policy, b, spec_steps)
        rows.append({"batch_size": b, "padded": r.padded, "tier": r.tier,
                     "candidates": list(r.candidates), "sglang_steps": r.steps,
                     "adaptive": r.adaptive, "policy_steps": want,
                     "agree": want is not None and want == r.steps and not r.adaptive})
    return rows


def auto_max_running(tiers: Tiers) -> int:
    """A ``--max-running-requests`` that reaches every tier: twice the largest tier's key
    minus one (as many batch sizes above the last boundary as below it), at least 64."""
    top = tiers.tiers[-1][0]
    return max(64, 2 * (top - 1))
