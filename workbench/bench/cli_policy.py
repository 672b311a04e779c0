"""``bench concurrency --policy P,... [--prompts-file F.jsonl] [--json]``: named policies for
real, side by side, the run ``lab replay`` predicts.

The arms are ``baseline`` (the lossless reference), ``never`` (the ratio's base: a speculative
engine that never drafts) and one arm per policy name, built as ``lab replay`` builds them
(:mod:`workbench.lab.arms`) at ``--spec``'s shape with ``draft_state="auto"``; a policy that
needs this machine's numbers (``threshold:auto``, ``goodput``) gets a cost model calibrated
now and the accept length measured on the prompts, as ``default_arms`` gives the bench's own
threshold and goodput arms. ``--json`` prints one JSON object per (arm, level) on stdout (the
tables go to stderr); the full table is saved as usual (``--out``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from workbench.bench import cli_args as args
from workbench.bench.cli_output import finish, json_records, saved_flags, show, stamp
from workbench.bench.concurrency import summarize
from workbench.engine.calibrate import calibrate, measure_tau
from workbench.errors import ConfigError
from workbench.lab.arms import ArmInputs, make_policy, split_policies

if TYPE_CHECKING:
    from workbench.engine.engine import Engine

NEEDS_MACHINE = ("threshold:auto", "goodput")


def policy_arms(engine: Engine, ns: argparse.Namespace, spec: Any,
                prompts: list[str]) -> dict[str, Any]:
    """baseline, never and one arm per ``--policy`` name (module doc); prints each basis."""
    names = split_policies(ns.policy)
    if "oracle" in names:
        raise ConfigError("--policy oracle: the hindsight oracle exists only in a replay "
                          "(`lab replay`); a real run cannot know acceptance in advance")
    if engine.runner.draft is None:
        raise ConfigError("--policy: needs a draft model (--draft)")
    shape = (spec.num_steps, spec.topk, int(spec.num_draft_tokens))
    cm = acc = None
    if any(n in NEEDS_MACHINE for n in names):
        cm = calibrate(engine, shape=shape)
        acc = measure_tau(engine, prompts, shape, max_new_tokens=args.max_new(ns))
        print(f"cost model calibrated now; τ {acc.tau:.2f} measured on the prompts at "
              f"{args.max_new(ns)} tokens")
    inputs = ArmInputs(shape, cm, acc, engine.config.max_batch_size)
    off = dataclasses.replace(spec, draft_state="auto")
    arms: dict[str, Any] = {"baseline": None}
    for name in dict.fromkeys(["never", *names]):
        policy = make_policy(name, inputs)
        arms[name] = dataclasses.replace(off, policy=policy)
        basis = getattr(policy, "basis", None)
        print(f"{name} arm: {policy!r}" + (f": {basis.reason()}" if basis is not None else ""))
    return arms


def bench_policies(ns: argparse.Namespace) -> int:
    levels = args.levels(ns)
    spec = args.spec(ns)
    prompts = args.prompts(ns)
    out = sys.stderr if ns.json else sys.stdout
    with contextlib.redirect_stdout(out):
        df, choices = args.sweep(ns, prompts, levels,
                                 lambda engine: policy_arms(engine, ns, spec, prompts),
                                 need_draft=True, name="concurrency_policies")
        flags = saved_flags(df)
        s = summarize(df)
        base = s[s["arm"] == "never"].set_index("concurrency")["tok_s"]
        s["vs_never"] = s["tok_s"] / s["concurrency"].map(base)
        cols = [c for c in ("arm", "concurrency", "tok_s", "tok_s_lo", "tok_s_hi", "vs_never",
                            "vs_baseline", "tau", "spec_share", "tpot_p50_ms", "tpot_p99_ms",
                            "lossless", "flags") if c in s]
        show("closed-loop concurrency sweep, named policies (greedy)", s[cols])
        stamp(Path(df.attrs["saved"]), flags, df.attrs.get("load"),
              {"engine_choices": choices}, "concurrency_policies", s[cols])
        print(f"\nresults: {df.attrs.get('saved')}")
        code = finish(ns, bool(s["lossless"].dropna().all()), flags)
    if ns.json:
        for row in json_records(s[cols]):
            print(json.dumps({"policy": row["arm"], **row}))
    return code
