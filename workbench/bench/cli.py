"""``python -m workbench bench {spec,peers,concurrency,threshold,k0,shapes}``: run, print, save.

* spec: EAGLE-3 arms vs baseline at bs=1 (``workbench.bench.spec``);
* peers: transformers generate / prompt lookup / assisted vs ours (``workbench.bench.peers``);
  with ``--peer llamacpp``, llama.cpp plain and prompt lookup on the same GGUF
  (``workbench.bench.llamacpp_peer``);
* concurrency: closed-loop sweep over concurrency levels with the policy arms
  (``workbench.bench.concurrency``), or against a running server with ``--url``
  (``workbench.bench.http``); the threshold arm's n comes from the cost model calibrated on
  this machine (``--threshold auto``) unless forced;
* threshold: baseline vs eagle3 sweep → crossover batch size and a suggested BatchThreshold(n);
* k0: the K=0 tax of the default SpecConfig (BatchThreshold(0) vs baseline, interleaved);
* shapes: speedup vs target shape at a simulated accept length, random-weight pairs
  (``workbench.bench.shapes``): which pair shape this machine needs for a given speedup;
* load: baseline and EAGLE-3 at bs=1 alone and beside one competing CPU-bound process pinned
  to a core, which it starts and stops itself (``workbench.bench.load``).

Prompts come from ``data/prompts/heldout.jsonl`` (``python -m workbench make-prompts``).

Every result records the machine (``workbench.machine``), the load average before and
after, and the sanity flags of ``workbench.bench.sanity`` (load > cores, self-inconsistent
numbers); flagged rows carry the flag codes in a ``flags`` column, and ``--strict`` makes a
flagged run exit 2. ``--repeats`` adds 95 % confidence intervals; ``--engine KEY=VALUE,...``
forces EngineConfig fields (e.g. ``gemm=dense``) instead of the measured "auto" choices, whose
outcome (``Engine.choices``) is printed and saved with the results.

Layout: this module dispatches; ``cli_args`` turns flags into prompts, engines and sweeps,
``cli_output`` prints and stamps results, ``cli_bs1`` and ``cli_sweeps`` hold the subcommands.
"""

from __future__ import annotations

import argparse
from typing import Any

from workbench.bench.cli_args import engine_overrides
from workbench.bench.cli_bs1 import bench_load, bench_peers, bench_shapes, bench_spec
from workbench.bench.cli_output import COMMAND, announce_conditions
from workbench.bench.cli_sweeps import bench_concurrency, bench_http, bench_k0, bench_threshold
from workbench.bench.llamacpp_peer import PEERS, bench_llamacpp, check_args
from workbench.bench.workloads import DEFAULT_DRAFT, DEFAULT_TARGET
from workbench.errors import ConfigError

__all__ = ["COMMANDS", "add_parser", "bench_concurrency", "bench_http", "bench_k0", "bench_load",
           "bench_peers", "bench_shapes", "bench_spec", "bench_threshold", "command_of", "run"]

COMMANDS = {"spec": bench_spec, "peers": bench_peers, "concurrency": bench_concurrency,
            "threshold": bench_threshold, "shapes": bench_shapes, "k0": bench_k0,
            "load": bench_load}


def add_parser(sub: Any) -> None:
    """The ``bench`` subcommand and its flags (``python -m workbench``'s parser adds it)."""
    b = sub.add_parser("bench", help="benchmarks: " + " | ".join(COMMANDS))
    b.add_argument("which", choices=list(COMMANDS))
    b.add_argument("--model", default=DEFAULT_TARGET)
    b.add_argument("--draft", default=DEFAULT_DRAFT)
    b.add_argument("--url", default=None, help="benchmark a running server instead")
    b.add_argument("--prompts", type=int, default=8)
    b.add_argument("--max-new-tokens", type=int, default=128)
    b.add_argument("--out", default="data/results")
    b.add_argument("--quick", action="store_true")
    b.add_argument("--assistant", default="data/models/wb-assistant",
                   help="small draft LM for transformers assisted generation (peers)")
    b.add_argument("--repeats", type=int, default=1,
                   help="run every measurement this many times (concurrency/threshold: every "
                        "(level, arm) cell, arm order rotated); means with 95%% confidence "
                        "intervals reported")
    b.add_argument("--strict", action="store_true",
                   help="exit 2 when the run is flagged (load > cores, a busy machine, an "
                        "engine choice measured under contention (provisional), "
                        "self-inconsistent numbers: workbench.bench.sanity)")
    b.add_argument("--engine", default="", metavar="KEY=VALUE,...",
                   help="EngineConfig overrides, e.g. gemm=dense,compile=off,threads=2 "
                        "(forced choices instead of the measured 'auto')")
    b.add_argument("--engine-b", default="", metavar="KEY=VALUE,...",
                   help="peers: a second engine, --engine plus these overrides, run as arms "
                        "'workbench [B]' (and 'workbench eagle3 [B]') beside the first: one "
                        "change measured side by side, e.g. row_floor=1")
    b.add_argument("--tau", type=float, default=5.0,
                   help="shapes: the accept length to simulate (random-weight pairs)")
    b.add_argument("--levels", default=None, metavar="C1,C2,...",
                   help="concurrency/threshold: concurrency levels (default 1,2,4,8,16,32,64)")
    b.add_argument("--sequential", action="store_true",
                   help="concurrency: run a cell's arms back to back on one engine instead of "
                        "interleaved step by step, one engine per arm (the default)")
    b.add_argument("--spec", default="5,4,16", metavar="S,K,N",
                   help="EAGLE-3 shape for peers/concurrency/threshold: num_steps, topk, "
                        "num_draft_tokens (root included; chain: S,1,S+1)")
    b.add_argument("--threshold", default="auto", metavar="auto|N",
                   help="concurrency: the threshold arm's BatchThreshold(n); auto (default) = "
                        "the crossover the cost model calibrated on this machine predicts at "
                        "the accept length measured on the prompts")
    b.add_argument("--prompts-file", default=None, metavar="F.jsonl",
                   help='prompts from this file (one {"prompt": ...} per line, all of them) '
                        "instead of --prompts held-out ones")
    b.add_argument("--policy", default=None, metavar="P,...",
                   help="concurrency: run these named policies (never, always, threshold:N|"
                        "auto, table:..., goodput, sglang[:TIERS], vllm[:TABLE]; as `lab "
                        "replay`) beside baseline and never, instead of the default arms")
    b.add_argument("--peer", default="hf", choices=list(PEERS),
                   help="peers: hf (transformers' modes, the default) or llamacpp (llama.cpp on "
                        "the same GGUF, plain and prompt lookup, in its own process: `make "
                        "llamacpp` builds it)")
    b.add_argument("--gguf", default=None, metavar="F.gguf",
                   help="peers --peer llamacpp: the GGUF file llama.cpp loads (default: the one "
                        "--model names)")
    b.add_argument("--llamacpp-python", default=None, metavar="PYTHON",
                   help="peers --peer llamacpp: the python of llama-cpp-python's venv (default: "
                        "$WORKBENCH_LLAMACPP_PYTHON, else the `make llamacpp` venv)")
    b.add_argument("--llamacpp-threads", type=int, default=None, metavar="N",
                   help="peers --peer llamacpp: llama.cpp's threads (default: every core this "
                        "process may use)")
    b.add_argument("--lookup-tokens", type=int, default=10, metavar="N",
                   help="peers --peer llamacpp: prompt lookup's draft length (num_pred_tokens)")
    b.add_argument("--json", action="store_true",
                   help="concurrency --policy: one JSON object per arm and level on stdout")
    b.set_defaults(fn=run)


def command_of(ns: argparse.Namespace) -> str:
    """``python -m workbench bench <which> --flag value ...``: the flags that differ from the
    parser's defaults (what the user typed, in a canonical order)."""
    import shlex

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="cmd"))
    defaults = vars(parser.parse_args(["bench", ns.which]))
    parts = ["python -m workbench bench", ns.which]
    for key, value in vars(ns).items():
        if key in ("which", "fn", "cmd") or key not in defaults or value == defaults[key]:
            continue
        flag = "--" + key.replace("_", "-")
        if value is True:
            parts.append(flag)
        elif value is not False and value is not None:
            parts += [flag, shlex.quote(str(value))]
    return " ".join(parts)


def run(ns: argparse.Namespace) -> int:
    """Entry point of ``python -m workbench bench``: dispatch on ``ns.which``."""
    if ns.which not in COMMANDS:
        raise ConfigError(f"bench: unknown benchmark {ns.which!r} (one of {sorted(COMMANDS)})")
    check_args(ns)  # --peer and its flags, before anything is loaded
    if getattr(ns, "engine_b", ""):
        if ns.which != "peers" or getattr(ns, "peer", "hf") != "hf" or getattr(ns, "url", None):
            raise ConfigError("--engine-b: only for `bench peers` with the transformers peers "
                              f"(in-process), not `bench {ns.which}`"
                              + (f" --peer {ns.peer}" if getattr(ns, "peer", "hf") != "hf"
                                 else "") + (" --url" if getattr(ns, "url", None) else ""))

        engine_overrides(ns, "engine_b")  # its KEY=VALUE errors, before anything is loaded
    COMMAND["line"] = command_of(ns)
    if getattr(ns, "json", False):  # stdout carries only the JSON rows (bench_policies)
        import contextlib
        import sys

        with contextlib.redirect_stdout(sys.stderr):
            announce_conditions()
    else:
        announce_conditions()  # the first line: is the machine busy (figures provisional)?
    if ns.which == "peers" and getattr(ns, "peer", "hf") == "llamacpp":
        return bench_llamacpp(ns)
    return COMMANDS[ns.which](ns)
