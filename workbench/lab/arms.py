"""Policy names → the real ``Policy`` objects, for ``lab replay`` and ``bench concurrency
--policy``: every policy the engine has plus the arms none of us wrote.

``never`` · ``always`` · ``threshold:N`` · ``threshold:auto`` (n from the cost model's crossover
at the measured τ, ``BatchThreshold.from_cost_model``) · ``table:LO-HI=SHAPE,...`` (a
``StepTable``; SHAPE ``S5K4N16`` or ``off``, the last HI may be empty: ``17-=off``) ·
``goodput`` (the bench's goodput arm: the spec's shape, its chain and a 3-step chain, seeded
with the measured per-depth acceptance) · ``sglang`` / ``sglang:FILE`` (SGLang 0.5.23's own
``AdaptiveSpeculativeParams`` from the installed wheel: default tiers or a tier file; it runs
chains of the steps it picks) · ``vllm`` / ``vllm:LO-HI=K,...`` (vLLM's dynamic SD table,
batch size → K speculative tokens as a chain; default: its docs' EAGLE-3 example) · ``oracle``
(replay only: hindsight, :class:`workbench.lab.sim.Oracle`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workbench.errors import ConfigError
from workbench.policy.policies import (
    Always,
    BatchThreshold,
    Decision,
    Never,
    PolicyContext,
    Shape,
    StepTable,
    check_shape,
    spec_decision,
)

NAMES = ("never", "always", "threshold", "table", "goodput", "sglang", "vllm", "oracle")
# vLLM's docs, dynamic speculative decoding with EAGLE-3: batch size → num_speculative_tokens
VLLM_EAGLE3_TABLE = ((1, 16, 5), (17, 32, 4), (33, 64, 3), (65, 128, 1), (129, None, 0))


@dataclass(frozen=True)
class ArmInputs:
    """What building a policy may need: the SpecConfig's shape, a cost model (threshold:auto,
    goodput), the measured acceptance (``costmodel.Acceptance``: τ, context, per-depth seed),
    the engine's max batch, and the shapes the oracle may choose from."""

    shape: Shape
    cost_model: Any = None
    acceptance: Any = None
    max_batch: int = 64
    oracle_shapes: tuple[Shape, ...] = ()


def split_policies(text: str) -> list[str]:
    """``"always,threshold:auto,table:1-4=S5K4N16,5-=off"`` → the policy names; a comma
    inside ``table:``/``vllm:`` belongs to its table (a part that is a range follows it).
    Unknown names raise ConfigError naming them."""
    out: list[str] = []
    for part in (p.strip() for p in str(text).split(",")):
        if not part:
            continue
        if out and part[:1].isdigit() and out[-1].split(":")[0] in ("table", "vllm"):
            out[-1] += "," + part
            continue
        out.append(part)
    if not out:
        raise ConfigError(f"--policy: no policy named in {text!r}")
    for p in out:
        base = p.split(":")[0]
        if base not in NAMES:
            raise ConfigError(f"--policy: unknown policy {p!r} (known: {', '.join(NAMES)})")
    return out


def parse_shape(text: str, where: str) -> Shape | None:
    """``S5K4N16`` → (5, 4, 16); ``off`` → None."""
    t = text.strip().upper()
    if t == "OFF":
        return None
    try:
        s, rest = t[1:].split("K")
        k, n = rest.split("N")
        if not t.startswith("S"):
            raise ValueError
        return check_shape((int(s), int(k), int(n)), where)
    except ValueError:
        raise ConfigError(f"{where}: expected a shape like S5K4N16 or 'off', got "
                          f"{text!r}") from None


def _ranges(body: str, where: str) -> list[tuple[int, int | None, str]]:
    rows = []
    for part in body.split(","):
        rng, eq, val = part.partition("=")
        lo, dash, hi = rng.partition("-")
        try:
            if not eq or not dash:
                raise ValueError
            rows.append((int(lo), int(hi) if hi.strip() else None, val.strip()))
        except ValueError:
            raise ConfigError(f"{where}: {part!r} is not LO-HI=VALUE (HI may be empty for the "
                              "last range)") from None
    return rows


def step_table(body: str) -> StepTable:
    """``1-4=S5K4N16,5-16=S3K1N4,17-=off`` → StepTable."""
    where = f"--policy table:{body}"
    return StepTable({(lo, hi): parse_shape(v, where) for lo, hi, v in _ranges(body, where)})


def vllm_table(body: str | None = None) -> StepTable:
    """vLLM's dynamic SD table as a StepTable of chains (K tokens → (K, 1, K+1), 0 → off)."""
    where = f"--policy vllm:{body}"
    rows = VLLM_EAGLE3_TABLE if not body else [(lo, hi, int(v)) if v.strip().isdigit() else
                                               _bad_k(where, v)
                                               for lo, hi, v in _ranges(body, where)]
    return StepTable({(lo, hi): (None if int(k) == 0 else (int(k), 1, int(k) + 1))
                      for lo, hi, k in rows})


def _bad_k(where: str, v: str) -> tuple[int, int | None, int]:
    raise ConfigError(f"{where}: {v!r} is not a number of speculative tokens >= 0")


class SGLangAdaptive:
    """SGLang 0.5.23's adaptive controller, as its own code: an
    ``sglang.srt.speculative.adaptive_spec_params.AdaptiveSpeculativeParams`` (default tiers,
    or the tier file ``config``) routes each decode batch to its tier's current step count; 0
    decodes plainly, S > 0 drafts a chain (S, 1, S+1). After every round it gets the per-request
    correct drafts (``on_verify_complete``; a steps-0 round counts with zeros, as SGLang counts
    it). ``initial_steps`` is ``--speculative-num-steps``; ``capture_bs`` the
    ``--cuda-graph-bs-decode`` list the router pads to (None: raw batch sizes)."""

    def __init__(self, initial_steps: int, config: str | Path | None = None,
                 capture_bs: Sequence[int] | None = None) -> None:
        if config is not None and not Path(config).is_file():
            raise ConfigError(f"--policy sglang:{config}: no tier file there")
        self.initial_steps, self.config = initial_steps, config
        self.capture_bs = list(capture_bs) if capture_bs else None
        self.reset()

    def reset(self) -> None:
        from sglang.srt.speculative.adaptive_spec_params import AdaptiveSpeculativeParams

        try:
            self.params = AdaptiveSpeculativeParams(
                self.initial_steps, None if self.config is None else str(self.config))
        except (ValueError, KeyError, OSError) as e:  # SGLang's own validation
            raise ConfigError(f"--policy sglang:{self.config}: SGLang refuses the tier file: "
                              f"{e}") from None
        self.params.set_cuda_graph_bs(self.capture_bs)
        self._batch = 0

    def __repr__(self) -> str:
        return f"SGLangAdaptive(initial_steps={self.initial_steps}, config={self.config})"

    @property
    def candidate_steps(self) -> list[int]:
        return list(self.params.candidate_steps)

    def decide(self, ctx: PolicyContext) -> Decision:
        self._batch = ctx.decode_batch
        steps = self.params.get_steps_for_batch(ctx.decode_batch)
        why = f"sglang adaptive: {steps} steps at batch {ctx.decode_batch}"
        return Decision(False, reason=why) if steps == 0 else \
            spec_decision((steps, 1, steps + 1), why)

    def observe(self, decision: Decision, measured_ms: float, accepted: list[int]) -> None:
        correct = list(accepted) if decision.speculate else [0] * max(self._batch, 1)
        self.params.on_verify_complete(correct, self._batch)


def goodput_candidates(shape: Shape) -> list[Shape]:
    """The bench's goodput arm candidates (``bench.concurrency.default_arms``)."""
    return list(dict.fromkeys([shape, (shape[0], 1, shape[0] + 1), (3, 1, 4)]))


def make_policy(name: str, inputs: ArmInputs) -> Any:
    """One policy from its name (module doc); errors name the policy."""
    base, _, arg = name.partition(":")
    shape = inputs.shape
    if base == "never":
        return Never()
    if base == "always":
        return Always()
    if base == "threshold":
        if arg == "auto":
            acc = _need(inputs, name, acceptance=True)
            return BatchThreshold.from_cost_model(inputs.cost_model, shape, acc.tau,
                                                  context=acc.context, draft_state="auto",
                                                  max_batch=inputs.max_batch)
        if not arg.isdigit():
            raise ConfigError(f"--policy {name}: expected threshold:auto or threshold:N (N >= 0)")
        return BatchThreshold(int(arg))
    if base == "table":
        if not arg:
            raise ConfigError(f"--policy {name}: expected table:LO-HI=SHAPE,...")
        return step_table(arg)
    if base == "goodput":
        from workbench.policy.goodput import Goodput

        acc = _need(inputs, name, acceptance=False)
        return Goodput(inputs.cost_model.copy(), candidates=goodput_candidates(shape),
                       accept_seed=acc.seed() if acc is not None else None)
    if base == "sglang":
        return SGLangAdaptive(shape[0], arg or None)
    if base == "vllm":
        return vllm_table(arg or None)
    if base == "oracle":
        from workbench.lab.sim import Oracle

        if not inputs.oracle_shapes:
            raise ConfigError(f"--policy {name}: the hindsight oracle needs a recorded run "
                              "(lab replay only)")
        return Oracle(inputs.oracle_shapes)
    raise ConfigError(f"--policy: unknown policy {name!r} (known: {', '.join(NAMES)})")


def _need(inputs: ArmInputs, name: str, acceptance: bool) -> Any:
    if inputs.cost_model is None:
        raise ConfigError(f"--policy {name}: needs a cost model (none recorded/calibrated)")
    if acceptance and inputs.acceptance is None:
        raise ConfigError(f"--policy {name}: needs the measured accept length")
    return inputs.acceptance


def policy_shapes(policy: Any, spec_shape: Shape, max_batch: int = 1024) -> list[Shape]:
    """Every shape ``policy`` may ask for (to check them against a recording up front)."""
    if isinstance(policy, (Always, BatchThreshold)):
        return [spec_shape]
    if isinstance(policy, StepTable):
        return sorted({s for s in (policy.lookup(lo) for lo, _ in policy.tiers)
                       if s is not None})
    if isinstance(policy, SGLangAdaptive):
        return [(s, 1, s + 1) for s in policy.candidate_steps if s > 0]
    cands = getattr(policy, "candidates", None)
    if cands:
        return list(cands)
    return [] if isinstance(policy, Never) else [spec_shape]

