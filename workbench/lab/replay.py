"""``lab replay``: every policy at every concurrency on one recorded run, scored against the
hindsight oracle.

Per (policy, level) one row: tok/s, τ (tokens per verify), spec_fraction (decode steps that
speculated), TPOT and ITL p50/p99 on the modelled clock, ``vs_never`` (tok/s over the
``never`` arm's at that level: what ``bench concurrency`` measures as a ratio) and ``regret``
= 1 − tok/s ÷ the oracle's tok/s at that level. The policies are built as the bench builds
them (:mod:`workbench.lab.arms`) from the run's cost model and an acceptance measured on the
recording the way ``measure_tau`` measures it on an engine (the first 8 prompts together,
speculating every step at the spec's shape).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd

from workbench.errors import ConfigError
from workbench.lab.arms import ArmInputs, make_policy, policy_shapes, split_policies
from workbench.lab.record import RecordedRun
from workbench.lab.sim import LevelResult, Oracle, Simulator
from workbench.policy.costmodel import Acceptance, CostModel
from workbench.policy.policies import Always, Shape, depth_rates, tree_shape_problem

Run = Any  # a RecordedRun (exact acceptance) or a box.BoxRun (modelled)

ORACLE_N = (2, 3, 4, 6, 8, 10, 12, 16, 24, 32, 48, 64)


def oracle_shapes(run: Run) -> tuple[Shape, ...]:
    """Every chain the run recorded and every tree (S <= S_rec, K <= K_rec, N from
    :data:`ORACLE_N` up to N_rec) the engine accepts."""
    s0, k0, n0 = run.shape
    out: list[Shape] = [(s, 1, s + 1) for s in range(1, run.chain_steps + 1)]
    for k in range(2, k0 + 1):
        for s in range(1, s0 + 1):
            for n in ORACLE_N:
                if n <= n0 and not tree_shape_problem(s, k, n):
                    out.append((s, k, n))
    return tuple(dict.fromkeys(out))


def load_run(path: str) -> Run:
    """A recorded run (``run.json``) or a fitted box run (``box.json``) at ``path``."""
    from pathlib import Path

    from workbench.lab.boxreplay import BoxRun

    if (Path(path) / "box.json").is_file():
        return BoxRun.load(path)
    return RecordedRun.load(path)


REPLAY_ERROR = 0.10  # the replay's stated accuracy (docs/LAB.md: within ±10 % of a real run)


def ranking(df: pd.DataFrame, error: float = REPLAY_ERROR) -> pd.DataFrame:
    """Named policies (not the never/oracle references) by mean share of the bound
    (1 − mean regret), each with the interval ±``error`` of the replay's own accuracy."""
    named = df[~df["policy"].isin(["never", "oracle"])]
    if named.empty:
        raise ConfigError("--tiers: no named policy was replayed (only never/oracle)")
    share = (1.0 - named.groupby("policy")["regret"].mean()).sort_values(ascending=False)
    return pd.DataFrame({"share": share, "lo": share * (1 - error), "hi": share * (1 + error)})


def winner(df: pd.DataFrame, error: float = REPLAY_ERROR) -> str:
    """The named policy with the least mean regret — refused (ConfigError, naming the two
    arms and their intervals) when the runner-up's interval overlaps the best's: inside the
    replay's error no arm wins."""
    r = ranking(df, error)
    if len(r) > 1 and r["lo"].iloc[0] <= r["hi"].iloc[1]:
        a, b = r.index[0], r.index[1]
        raise ConfigError(
            f"no winner: {a} ({r['share'].iloc[0]:.1%} of the bound, "
            f"[{r['lo'].iloc[0]:.1%}, {r['hi'].iloc[0]:.1%}]) and {b} "
            f"({r['share'].iloc[1]:.1%}, [{r['lo'].iloc[1]:.1%}, {r['hi'].iloc[1]:.1%}]) "
            f"overlap inside the replay's ±{error:.0%}; name one with --tiers-policy")
    return str(r.index[0])


def oracle_is_bound(df: pd.DataFrame) -> bool:
    """Whether the per-step oracle bounds every replayed arm at every level (then it may be
    called a bound; else an arm beat it and it is a per-step heuristic)."""
    return bool((df["bound"] == "oracle").all())


def cost_model_of(run: Run) -> CostModel:
    if not run.cost_model:
        raise ConfigError(f"RUN {run.path}: no cost model recorded (record with the engine's "
                          "calibration: `lab record` does)")
    from workbench.lab.stepfit import cost_model_from_dict

    return cost_model_from_dict(run.cost_model)


def measured_acceptance(run: Run, shape: Shape | None = None,
                        batch: int = 8) -> Acceptance:
    """``measure_tau`` on the recording: the first ``batch`` requests together, Always at
    ``shape`` (default: the recorded one)."""
    shape = shape or run.shape
    sim = Simulator(run, cost_model_of(run), shape)
    n = min(batch, len(run.prompt_lens))
    res = sim.run_level(Always(), n, num_requests=n)
    acc = [m for _, ms in res.accepted for m in ms]
    if not acc:
        raise ConfigError(f"RUN {run.path}: no speculative step to measure τ on")
    s, k, nn = shape
    return Acceptance(1.0 + float(np.mean(acc)),
                      float(np.mean([c for c, _ in res.accepted])), len(acc), k,
                      tuple(depth_rates(acc, min(s, nn - 1))))


def replay(run: Run, policies: str | Sequence[str], levels: Sequence[int],
           num_requests: int | None = None, max_batch: int = 64,
           progress: bool = False) -> tuple[pd.DataFrame, dict[tuple[str, int], LevelResult]]:
    """Replay ``policies`` (names or one comma-separated string) at ``levels``. Returns the
    rows (one per policy and level; the ``never`` and ``oracle`` references are rows too) and
    each run's :class:`LevelResult` (steps, acceptance) by (policy, level)."""
    from tqdm.auto import tqdm

    names = split_policies(policies) if isinstance(policies, str) else list(policies)
    if not levels or any(not isinstance(c, int) or c < 1 for c in levels):
        raise ConfigError(f"--levels: need concurrency levels >= 1, got {list(levels)!r}")
    cm = cost_model_of(run)
    acc = measured_acceptance(run)
    inputs = ArmInputs(run.shape, cm, acc, max_batch, oracle_shapes(run))
    order = list(dict.fromkeys(["never", *names, "oracle"]))
    built = {}
    for name in order:  # build (and check) every policy before the first replay
        pol = make_policy(name, inputs)
        for shape in policy_shapes(pol, run.shape):
            run.check(shape, f"--policy {name}")
        built[name] = pol
    # a box run carries its server's running-request cap; the replay honours it
    cap = int(getattr(run, "meta", {}).get("max_running_requests") or max_batch)
    sim = Simulator(run, cm, run.shape, max_batch=cap)
    results: dict[tuple[str, int], LevelResult] = {}
    rows: list[dict[str, Any]] = []
    bar = tqdm(total=len(order) * len(levels), desc="lab replay", disable=not progress)
    for c in levels:
        for name in order:
            pol = make_policy(name, inputs) if c != levels[0] else built[name]  # fresh state
            res = sim.run_level(pol, c, num_requests)
            results[(name, c)] = res
            rows.append({"policy": name, **res.row, "policy_repr": repr(pol),
                         "basis": _basis(pol), "batch_cap": cap, "capped": c > cap})
            bar.update(1)
    bar.close()
    df = pd.DataFrame(rows)
    ref = df[df["policy"] == "never"].set_index("concurrency")["tok_s"]
    best = df[df["policy"] == "oracle"].set_index("concurrency")["tok_s"]
    df["vs_never"] = df["tok_s"] / df["concurrency"].map(ref)
    df["oracle_tok_s"] = df["concurrency"].map(best)
    # the bound: the per-step oracle, or an arm that beat it over the run (the oracle picks
    # each step's best rate; a run's later batches can reward another order) — said per level
    top = df.loc[df.groupby("concurrency")["tok_s"].idxmax()].set_index("concurrency")
    df["bound"] = df["concurrency"].map(lambda c: "oracle" if top.loc[c, "tok_s"] <= best[c]
                                        else top.loc[c, "policy"])
    df["bound_note"] = df["concurrency"].map(
        lambda c: "per-step hindsight oracle" if top.loc[c, "tok_s"] <= best[c] else
        f"{top.loc[c, 'policy']} beats the per-step oracle by "
        f"{top.loc[c, 'tok_s'] / best[c] - 1:.1%} (a per-step bound, not a run's optimum): "
        f"regret is against {top.loc[c, 'policy']}")
    df["bound_tok_s"] = df["concurrency"].map(lambda c: max(top.loc[c, "tok_s"], best[c]))
    df["regret"] = 1.0 - df["tok_s"] / df["bound_tok_s"]
    df.attrs["acceptance"] = {"tau": acc.tau, "context": acc.context, "rates": list(acc.rates)}
    df.attrs["run"] = str(run.path) if run.path else None
    return df, results


def _basis(policy: Any) -> str | None:
    basis = getattr(policy, "basis", None)
    return basis.reason() if basis is not None else None


def json_rows(df: pd.DataFrame) -> list[dict[str, Any]]:
    """One JSON-ready object per (policy, level): NaN → None."""
    out = []
    for rec in df.to_dict(orient="records"):
        out.append({k: (None if isinstance(v, float) and math.isnan(v) else
                        v.item() if isinstance(v, np.generic) else v) for k, v in rec.items()})
    return out


def oracle_shares(results: dict[tuple[str, int], LevelResult]) -> pd.DataFrame:
    """Per level, the share of the oracle's decode steps at each shape (off included)."""
    rows = []
    for (name, c), res in results.items():
        if name != "oracle" or not res.steps:
            continue
        shapes = pd.Series([s[1] for s in res.steps]).value_counts(normalize=True)
        rows += [{"concurrency": c, "shape": k, "share": float(v)} for k, v in shapes.items()]
    return pd.DataFrame(rows)


__all__ = ["Oracle", "json_rows", "measured_acceptance", "oracle_shapes", "oracle_shares",
           "replay"]
