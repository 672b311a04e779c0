"""The real pair on a GPU (issue 51 step 2): SmolLM2-135M-Instruct + its EAGLE-3 head.

Parts, in order, each under one wall-clock budget (``--budget-s``, default 360 s = 6 minutes on
the device); a part that would not fit in what is left is skipped with the reason recorded:

1. ``lossless`` (per dtype: bfloat16 then float32, CUDA graphs on, ``self_check`` on): the engine
   with the head is built; a refusal at init (``engine/stages.self_check``: a bf16 engine whose
   rows are not bit-invariant) is recorded as a finding with its text, never raised. Where it
   builds: greedy plain vs greedy chain S5 and tree S5K4N16 on the held-out prompts, token for
   token; then ``verify_cost``: one target forward of 16/32/64 rows vs one plain decode step
   (1 row), at bs=1, in plain steps (``engine.calibrate.time_forward``, least of repeats).
2. ``spec`` (per dtype that built): ``python -m workbench bench spec`` — bs=1 tok/s plain vs
   EAGLE-3 chain S5 / S5K4N16 / S6K8N32 interleaved per prompt, repeats → intervals, lossless
   column, and the decode-step breakdown (draft, verify, host: step_cost).
3. ``sweep`` (first dtype that built): ``bench concurrency`` c=1..64 with
   never/always/threshold:auto/goodput (+ the baseline arm).
4. ``peers`` (first dtype that built): ``bench peers`` — transformers ``generate`` (eager and
   with a static cache + ``torch.compile``) and ``generate(prompt_lookup_num_tokens=10)`` vs the
   engine's plain and EAGLE-3, per prompt. The second dtype's ``spec`` runs after it: the
   order is the priority when the budget runs short.

Every file lands in ``data/results/gpu/<device>/real_pair/`` (device: ``scripts/gpu_device.py``'s
slug, ``cpu-smoke`` for ``--smoke``), and with ``$OUT`` set (the device machine, which returns
only 8 files at most 2 folders down) also as one archive ``$OUT/gpu_real_pair_<device>.tgz``;
``gpu_real_pair.json`` carries the device and software versions, the commands and each part's
result or skip reason, and is rewritten after every part (a run killed by its timeout keeps what
it had). ``--smoke``: device cpu, float32 only, 2 prompts, 4 tokens, c=1,2, budget 240 s, for
checking the script on a CPU (it measures nothing).

What the device machine must be given (its image has torch, Triton and transformers, not gguf or
FlashInfer): the ``gguf`` wheel (pure Python; the GGUF target does not load without it) and the
GGUF file with its tokenizer, which the pointer ``data/models/smollm2-135m-instruct/gguf.json``
looks for in ``~/.cache/workbench/smollm2-135m-instruct``. ``scripts/gpu_payload.sh pack`` puts
them in the ignored folder ``.gpu_payload/`` (the GGUF in two 48 MiB pieces: a call carries 64 MiB)
and ``scripts/gpu_payload.sh unpack`` installs them there; the head
``data/models/smollm2-eagle3`` is tracked and travels with the tree.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))
from gpu_device import device_slug, software  # noqa: E402

PART_ERRORS: tuple[type[BaseException], ...] = (RuntimeError, ValueError, TypeError, OSError,
                                                 KeyError, IndexError, AssertionError,
                                                 ImportError, NotImplementedError)
VERIFY_ROWS = (16, 32, 64)


class Budget:
    """One deadline for all parts; ``fits(need)`` says whether a part needing ``need`` s may
    start, ``reason`` says why not."""

    def __init__(self, seconds: float, clock: Any = time.monotonic) -> None:
        if seconds <= 0:
            raise ValueError(f"--budget-s: must be > 0, got {seconds}")
        self.clock = clock
        self.deadline = clock() + seconds

    def left(self) -> float:
        return self.deadline - self.clock()

    def fits(self, need: float) -> bool:
        return self.left() >= need

    def reason(self, need: float) -> str:
        return f"time budget: {self.left():.0f} s left, the part needs at least {need:.0f} s"


def settings(smoke: bool, device: str | None) -> dict[str, Any]:
    """Sizes and engine overrides of a run (``--smoke``: toy sizes on the CPU)."""
    if smoke:
        dev = device or "cpu"
        return {"device": dev, "dtypes": ["float32"], "prompts": 2, "new": 4, "repeats": 1,
                "levels": "1,2", "sweep_prompts": 2, "sweep_new": 4, "verify_rows": (16,),
                # forced choices (no measuring at each start); the lossless part on the CPU
                # needs its row-invariant kernels (CUDA refuses batch_invariant), the benches
                # there run without the self-check (the lossless part did it)
                "extra": ("threads=1,gemm=onednn,weights=packed,draft_dtype=same"
                          if dev == "cpu" else "cuda_graphs=true"),
                "check_extra": ",batch_invariant=true" if dev == "cpu" else "",
                "bench_check": dev != "cpu",
                "need": {"lossless": 20, "spec": 20, "peers": 20, "sweep": 20}}
    return {"device": device or "cuda", "dtypes": ["bfloat16", "float32"], "prompts": 8,
            "new": 64, "repeats": 3, "levels": "1,2,4,8,16,32,64", "sweep_prompts": 64,
            "sweep_new": 32, "verify_rows": VERIFY_ROWS, "extra": "cuda_graphs=true",
            "check_extra": "", "bench_check": True,
            "need": {"lossless": 30, "spec": 40, "peers": 40, "sweep": 60}}


def engine_string(cfg: dict[str, Any], dtype: str, self_check: bool) -> str:
    check = "true" if self_check else "false"
    return f"device={cfg['device']},dtype={dtype},self_check={check},{cfg['extra']}"


def lossless_and_cost(model: str, draft: str, prompts: list[str], cfg: dict[str, Any],
                      dtype: str, budget: Budget) -> dict[str, Any]:
    """Build the engine (a refusal is the result), compare greedy plain vs speculative, then
    the verify cost in plain steps (module doc, part 1)."""
    import workbench as wb
    from workbench.config import EngineConfig, SamplingParams, SpecConfig, parse_overrides
    from workbench.engine.calibrate import time_forward
    from workbench.errors import ConfigError, EngineInitError

    spec_str = engine_string(cfg, dtype, True) + cfg["check_extra"]
    out: dict[str, Any] = {"dtype": dtype, "engine": spec_str}
    t0 = time.monotonic()
    try:
        engine = wb.Engine.from_pretrained(model, draft, EngineConfig(
            **parse_overrides(spec_str, "--engine")))
    except (ConfigError, EngineInitError) as exc:  # the self-check's refusal: a finding
        out.update(built=False, refusal=f"{type(exc).__name__}: {exc}")
        return out
    out.update(built=True, init_s=round(time.monotonic() - t0, 1))
    sp = SamplingParams(max_new_tokens=cfg["new"], ignore_eos=True)
    arms = {"chain S5": SpecConfig(num_steps=5, topk=1),
            "tree S5K4N16": SpecConfig(num_steps=5, topk=4, num_draft_tokens=16)}
    with engine:
        rows = []
        for i, prompt in enumerate(prompts):
            if not budget.fits(10):
                rows.append({"prompt": i, "skipped": budget.reason(10)})
                break
            plain = engine.generate([prompt], sp)[0].token_ids
            row: dict[str, Any] = {"prompt": i, "tokens": len(plain)}
            for name, spec in arms.items():
                got = engine.generate([prompt], sp, spec=spec)[0].token_ids
                row[name] = got == plain
                if got != plain:
                    row[f"{name} first_diff"] = next(
                        (j for j, (a, b) in enumerate(zip(got, plain, strict=False)) if a != b),
                        min(len(got), len(plain)))
            rows.append(row)
        out["prompts"] = rows
        out["lossless"] = all(r.get(a, False) for r in rows if "skipped" not in r for a in arms)
        cost: dict[str, Any] = {"context": 256, "repeats": 5}
        plain_ms = min(time_forward(engine.runner, 1, 1, 256, 1, False) for _ in range(5))
        cost["plain_step_ms"] = plain_ms
        for n in cfg["verify_rows"]:
            if not budget.fits(5):
                cost[f"rows{n}"] = {"skipped": budget.reason(5)}
                continue
            ms = min(time_forward(engine.runner, 1, n, 256, 1, False) for _ in range(5))
            cost[f"rows{n}"] = {"verify_ms": ms, "plain_steps": ms / plain_ms}
        out["verify_cost"] = cost
    return out


def bench(args: list[str], budget: Budget, reserve: float, log: Path) -> dict[str, Any]:
    """``python -m workbench bench ARGS`` with the budget left (less ``reserve``) as its
    timeout; its console output goes to ``log``."""
    cmd = [sys.executable, "-m", "workbench", "bench", *args]
    limit = max(1.0, budget.left() - reserve)
    t0 = time.monotonic()
    with log.open("w") as fh:
        try:
            rc = subprocess.run(cmd, cwd=REPO, stdout=fh, stderr=subprocess.STDOUT,
                                timeout=limit).returncode
        except subprocess.TimeoutExpired:
            rc = None
    out = {"command": " ".join(cmd[1:]), "exit": rc, "seconds": round(time.monotonic() - t0, 1),
           "log": str(log)}
    if rc is None:
        out["timed_out"] = f"killed after {limit:.0f} s (the budget)"
    elif rc != 0:
        out["tail"] = log.read_text(errors="replace")[-2000:]
    return out


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="data/models/smollm2-135m-instruct")
    ap.add_argument("--draft", default="data/models/smollm2-eagle3")
    ap.add_argument("--src", default="data/prompts/real/heldout.jsonl")
    ap.add_argument("--device", default=None, help="cuda (default), or cpu with --smoke")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="wall-clock budget of all parts (default 360; --smoke 240)")
    ap.add_argument("--out", type=Path, default=None, help="results folder (default: module doc)")
    ap.add_argument("--only", default="lossless,spec,peers,sweep",
                    help="comma-separated parts to run")
    ap.add_argument("--smoke", action="store_true", help="toy sizes on the CPU")
    ns = ap.parse_args(argv)
    parts = [p for p in ns.only.split(",") if p]
    unknown = sorted(set(parts) - {"lossless", "spec", "peers", "sweep"})
    if unknown:
        ap.error(f"--only: unknown part(s) {unknown} (lossless, spec, peers, sweep)")
    ns.parts = parts
    if ns.budget_s is None:
        ns.budget_s = 240.0 if ns.smoke else 360.0
    if ns.budget_s <= 0:
        ap.error(f"--budget-s: must be > 0, got {ns.budget_s}")
    return ns


def main(argv: list[str] | None = None) -> int:
    ns = parse(argv)
    cfg = settings(ns.smoke, ns.device)
    if cfg["device"].startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            print("gpu_real_pair: torch sees no CUDA device; --smoke runs on the CPU",
                  file=sys.stderr)
            return 2
    budget = Budget(ns.budget_s)
    slug = device_slug(cfg["device"]) + ("-smoke" if ns.smoke else "")
    out = ns.out or REPO / "data" / "results" / "gpu" / slug / "real_pair"
    out.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {"software": software(cfg["device"]), "smoke": ns.smoke,
                               "settings": {k: v for k, v in cfg.items() if k != "need"},
                               "budget_s": ns.budget_s, "argv": sys.argv, "parts": {}}
    from workbench.bench.real_model import render_chat_prompts
    from workbench.machine import git_commit

    summary["commit"] = git_commit()
    bs1 = render_chat_prompts(ns.src, ns.model, out / "prompts_bs1.jsonl", cfg["prompts"])
    sweep = render_chat_prompts(ns.src, ns.model, out / "prompts_sweep.jsonl",
                                cfg["sweep_prompts"])
    prompts = [json.loads(line)["prompt"] for line in bs1.read_text().splitlines() if line]
    need, parts = cfg["need"], summary["parts"]
    built: list[str] = []  # dtypes whose engine with the head built (self_check passed)
    t_start = time.monotonic()

    def save() -> None:
        summary["elapsed_s"] = round(time.monotonic() - t_start, 1)
        (out / "gpu_real_pair.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")

    for dtype in cfg["dtypes"]:
        key = f"lossless {dtype}"
        if "lossless" not in ns.parts:
            built.append(dtype)  # not checked here: the bench's own init decides
            continue
        if not budget.fits(need["lossless"]):
            parts[key] = {"skipped": budget.reason(need["lossless"])}
            continue
        try:
            parts[key] = lossless_and_cost(ns.model, ns.draft, prompts, cfg, dtype, budget)
        except PART_ERRORS as exc:
            parts[key] = {"error": f"{type(exc).__name__}: {exc}",
                          "traceback": traceback.format_exc(limit=8)}
        if parts[key].get("built"):
            built.append(dtype)
        save()
    check = cfg["bench_check"]
    if not built and "lossless" in ns.parts:  # every dtype refused: speeds without the check
        check, built = False, cfg["dtypes"][-1:]
        summary["note"] = (f"every dtype's engine refused at init (see the lossless parts); "
                           f"spec/peers/sweep ran on {built[0]} with self_check=false: their "
                           f"lossless columns say whether the outputs matched")
    common = ["--model", ns.model, "--draft", ns.draft]
    jobs: list[tuple[str, str, list[str]]] = []  # order = priority: the budget cuts the last
    spec_jobs = [(f"spec {dtype}", "spec", [
        "spec", *common, "--prompts-file", str(bs1), "--max-new-tokens", str(cfg["new"]),
        "--repeats", str(cfg["repeats"])]) for dtype in (built if "spec" in ns.parts else [])]
    jobs += spec_jobs[:1]
    if built and "sweep" in ns.parts:
        jobs.append((f"sweep {built[0]}", "sweep", [
            "concurrency", *common, "--prompts-file", str(sweep), "--max-new-tokens",
            str(cfg["sweep_new"]), "--levels", cfg["levels"], "--sequential",
            "--policy", "always,threshold:auto,goodput"]))
    if built and "peers" in ns.parts:
        jobs.append((f"peers {built[0]}", "peers", [
            "peers", *common, "--prompts-file", str(bs1), "--max-new-tokens", str(cfg["new"]),
            "--repeats", str(cfg["repeats"]), *(["--quick"] if ns.smoke else [])]))
    jobs += spec_jobs[1:]
    for key, part, args in jobs:
        dtype = key.split()[-1]
        sub = out / dtype
        sub.mkdir(exist_ok=True)
        if not budget.fits(need[part]):
            parts[key] = {"skipped": budget.reason(need[part])}
            continue
        parts[key] = bench([*args, "--engine", engine_string(cfg, dtype, check),
                            "--out", str(sub)],
                           budget, reserve=5.0, log=out / f"{key.replace(' ', '_')}.log")
        save()
    save()
    if os.environ.get("OUT"):  # the device machine returns only $OUT's top 2 levels, 8 files
        archive = Path(os.environ["OUT"]) / f"gpu_real_pair_{slug}.tgz"
        subprocess.run(["tar", "czf", str(archive), "-C", str(out.parent), out.name],
                       check=True)
        print(f"gpu_real_pair: archived to {archive}")
    bad = {k: v for k, v in parts.items() if v.get("error") or v.get("exit") not in (0, None)
           or v.get("lossless") is False}
    print(json.dumps({k: {f: v.get(f) for f in ("built", "refusal", "lossless", "exit",
                                                  "skipped", "error", "seconds") if f in v}
                      for k, v in parts.items()}, indent=2))
    print(f"gpu_real_pair: {out / 'gpu_real_pair.json'} ({summary['elapsed_s']} s)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
