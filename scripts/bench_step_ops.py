"""The speculative step's overhead in CPU time and aten ops, fit for a loaded machine (#26).

Wall time on a shared 2-core machine measures the neighbours; this measures the engine:

* ``cpu``: ``time.process_time()`` of this process (one thread: OMP_NUM_THREADS=1 and
  ``torch.set_num_threads(1)``) per speculative step, minus that of the model forwards run
  inside it (the target's forward + logits, every draft forward and feature GEMM) — the
  overhead the step adds around its forwards — and the forwards' own CPU ms beside it;
* ``ops``: aten ops per speculative step outside the forwards (``torch.profiler``, top-level
  aten events, i.e. not nested in another aten op and not inside a forward), and inside them.

Greedy, bs=1 (one prompt at a time) and bs=4 (four at once), each shape in ``--shapes``.
Compare two builds by running this script with each on PYTHONPATH, alternating, e.g.

    for i in 1 2 3; do for t in /work/main /work/wt/i26b; do
      PYTHONPATH=$t OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_step_ops.py --tag $t
    done; done

Each line prints the tag, the load average and, per case, the median over its steps.

``--micro``: instead, the CPU µs of one ``draft_tree`` (build_tree included; S5K4N16, a 300-row
prefix, score temperature 0.4) with the draft forward stubbed out (fixed logits), and of one CPU
``kernels.greedy_accept`` on its tree: the tree's and the accept's own bookkeeping, far less
noisy than a whole step.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch

import workbench as wb

TARGET, DRAFT = "data/models/wb-target", "data/models/wb-eagle3"
SHAPES = {"S5K4N16": wb.SpecConfig(num_steps=5, topk=4, num_draft_tokens=16),
          "chain5": wb.SpecConfig(num_steps=5, topk=1),
          "S6K8N32": wb.SpecConfig(num_steps=6, topk=8, num_draft_tokens=32)}


class Clock:
    """process_time of each engine step and of the forwards inside it; the step's mode."""

    def __init__(self, engine: wb.Engine) -> None:
        self.engine, self.fwd = engine, 0.0
        self.rows: list[dict[str, Any]] = []
        self.undo: list[tuple[Any, str]] = []
        self.depth = 0

    def wrap(self, obj: Any, name: str) -> None:
        fn: Callable[..., Any] = getattr(obj, name)

        def timed(*a: Any, **k: Any) -> Any:
            self.depth += 1
            t0 = time.process_time()
            try:
                with torch.profiler.record_function("FWD") if self.depth == 1 else _Null():
                    return fn(*a, **k)
            finally:
                self.depth -= 1
                if self.depth == 0:
                    self.fwd += time.process_time() - t0

        setattr(obj, name, timed)
        self.undo.append((obj, name))

    def __enter__(self) -> Clock:
        run = self.engine.runner
        self.wrap(run.target, "forward")
        self.wrap(run.target, "logits")
        self.wrap(run.draft, "forward")
        self.wrap(run.draft, "features")
        step = self.engine.step
        worker = self.engine.worker

        def timed_step() -> Any:
            self.fwd = 0.0
            spec0 = worker.stats.steps.get("spec", 0)
            t0 = time.process_time()
            with torch.profiler.record_function("STEP"):
                out = step()
            dt = time.process_time() - t0
            is_spec = worker.stats.steps.get("spec", 0) > spec0
            self.rows.append({"spec": is_spec, "cpu_ms": dt * 1e3, "fwd_ms": self.fwd * 1e3})
            return out

        setattr(self.engine, "step", timed_step)  # noqa: B010
        self.undo.append((self.engine, "step"))
        return self

    def __exit__(self, *exc: object) -> None:
        while self.undo:
            obj, name = self.undo.pop()
            delattr(obj, name)


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def count_ops(prof: Any) -> list[tuple[int, int]]:
    """Per STEP range: (aten ops outside FWD, aten ops inside FWD), top-level aten only."""
    steps: list[tuple[int, int]] = []
    for ev in prof.events():
        if ev.name != "STEP":
            continue
        out = inside = 0
        stack = [(c, False) for c in ev.cpu_children]
        while stack:
            e, in_fwd = stack.pop()
            if e.name.startswith("aten::"):
                if in_fwd:
                    inside += 1
                else:
                    out += 1
                continue  # nested aten ops belong to this one
            f = in_fwd or e.name == "FWD"
            stack.extend((c, f) for c in e.cpu_children)
        steps.append((out, inside))
    return steps


def prompts(engine: wb.Engine, n: int) -> list[list[int]]:
    with open("workbench/engine/worker.py") as f:
        toks = list(engine.tokenizer.encode(f.read()))
    return [toks[200 * i : 200 * i + 120] for i in range(n)]


class _StubDraft:
    """A draft whose forward returns fixed logits and its input rows (no model work)."""

    def __init__(self, vocab: int) -> None:
        self.config = SimpleNamespace(num_attention_heads=4)
        self.d2t = torch.zeros(vocab, dtype=torch.int64)
        self.logits = torch.randn(64, vocab, generator=torch.Generator().manual_seed(0))

    def target_ids(self) -> torch.Tensor:
        return self.d2t + torch.arange(self.d2t.shape[0])

    def __call__(self, tok: torch.Tensor, hidden: torch.Tensor, pos: torch.Tensor,
                 attn: object) -> tuple[torch.Tensor, torch.Tensor]:
        return self.logits[: tok.shape[0]], hidden


@torch.inference_mode()
def micro(tag: str) -> None:
    from workbench import kernels
    from workbench.speculative.drafter import draft_tree

    g = torch.Generator().manual_seed(1)
    vocab, d, draft = 2048, 256, _StubDraft(2048)
    kp, vp = torch.randn(1, 4096, 2, 64, generator=g), torch.randn(1, 4096, 2, 64, generator=g)
    line = [f"{tag} load {_load()} micro"]
    for b in (1, 4):
        args = (draft, torch.randn(b, vocab, generator=g), torch.randn(b, d, generator=g),
                torch.zeros(b, dtype=torch.int64), torch.full((b,), 300),
                [torch.arange(300 + 10 * i) for i in range(b)], kp, vp, 5, 4, 16)
        temp = torch.full((b,), 0.4)
        for _ in range(50):
            tree = draft_tree(*args, score_temperature=temp)  # type: ignore[arg-type]
        t0 = time.process_time()
        for _ in range(400):
            tree = draft_tree(*args, score_temperature=temp)  # type: ignore[arg-type]
        tree_us = (time.process_time() - t0) / 400 * 1e6
        pred = torch.randint(0, 5, (b, 16), generator=g)
        t0 = time.process_time()
        for _ in range(2000):
            kernels.greedy_accept(tree.tokens, tree.parents, pred)
        acc_us = (time.process_time() - t0) / 2000 * 1e6
        line.append(f"bs{b}: draft_tree {tree_us:.0f} us, greedy_accept {acc_us:.1f} us")
    print(" | ".join(line), flush=True)


def _load() -> str:
    with open("/proc/loadavg") as f:
        return f.read().split()[0]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tag", default="")
    ap.add_argument("--micro", action="store_true", help="the stubbed draft_tree / accept only")
    ap.add_argument("--shapes", default="S5K4N16,chain5,S6K8N32")
    ap.add_argument("--tokens", type=int, default=48)
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.micro:
        micro(args.tag)
        return
    e = wb.Engine.from_pretrained(TARGET, draft=DRAFT)
    sp = wb.SamplingParams(max_new_tokens=args.tokens, ignore_eos=True)
    ps = prompts(e, 4)
    e.generate(ps[:1], sp, spec=SHAPES["S5K4N16"])  # warm-up
    line = [f"{args.tag} load {_load()}"]
    for name in args.shapes.split(","):
        spec = SHAPES[name]
        for bs in (1, 4):
            with Clock(e) as clock:
                for i in range(0, 4, bs):
                    e.generate(ps[i : i + bs], sp, spec=spec)
            rows = [r for r in clock.rows if r["spec"]]
            over = statistics.median(r["cpu_ms"] - r["fwd_ms"] for r in rows)
            fwd = statistics.median(r["fwd_ms"] for r in rows)
            with Clock(e) as clock, torch.profiler.profile(
                    activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                e.generate(ps[:bs], sp, spec=spec)
            spec_steps = [c for c, r in zip(count_ops(prof), clock.rows, strict=True) if r["spec"]]
            ops = statistics.median(c[0] for c in spec_steps)
            ops_fwd = statistics.median(c[1] for c in spec_steps)
            line.append(f"{name} bs{bs}: over {over:.2f} ms fwd {fwd:.2f} ms "
                        f"ops {ops:.0f} (fwd {ops_fwd:.0f})")
    print(" | ".join(line), flush=True)


if __name__ == "__main__":
    main()
