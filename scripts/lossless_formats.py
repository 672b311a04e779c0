"""Greedy speculative == greedy plain on the real pair's 112 held-out chat prompts, in every
number format the engine offers (issue 49's "lossless in every format", measured, not assumed).

For each format — float32; bfloat16 with row-invariant numerics; packed 4-/8-bit weights with
them — one engine decodes every prompt plainly in batches of ``--batch``, then speculatively
(chain S5 and S5K4N16) in the same batches, and the outputs are compared token for token.
Without the switch a bf16 engine with a draft refuses at init when its rows differ: that
refusal is recorded as the format's result (``--with-default`` runs those too). Writes
``<out>/lossless_formats.json`` (machine, load, commit, command, per-format counts and the
first divergence of every differing prompt).

    python scripts/lossless_formats.py --out data/results/smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from tqdm import tqdm

import workbench as wb
from workbench.data_io import REPO_ROOT
from workbench.errors import EngineInitError
from workbench.machine import git_commit, loadavg, machine_info

MODEL = "data/models/smollm2-135m-instruct"
DRAFT = "data/models/smollm2-eagle3"
FORMATS = {
    "float32": dict(dtype="float32"),
    "bfloat16 batch_invariant": dict(dtype="bfloat16", batch_invariant=True),
    "packed batch_invariant": dict(weights="packed", batch_invariant=True),
}
DEFAULTS = {  # what a user gets without the switch: refused at init where rows differ
    "bfloat16": dict(dtype="bfloat16"),
    "packed": dict(weights="packed"),
}
SHAPES = {"chain S5": wb.SpecConfig(num_steps=5, topk=1),
          "S5K4N16": wb.SpecConfig(num_steps=5, topk=4, num_draft_tokens=16)}


def prompts(path: Path, n: int | None) -> list[list[dict[str, str]]]:
    recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [[{"role": "user", "content": r["prompt"]}] for r in recs][:n]


def first_divergence(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def run_format(name: str, kw: dict, ps: list, args: argparse.Namespace) -> dict:
    t0 = time.perf_counter()
    try:
        e = wb.Engine.from_pretrained(MODEL, draft=DRAFT, config=wb.EngineConfig(
            threads=args.threads, **kw))
    except EngineInitError as err:
        return {"config": kw, "refused": f"{err.stage}: {err.cause}"}
    try:
        sp = wb.SamplingParams(max_new_tokens=args.max_new_tokens)
        batches = [ps[i : i + args.batch] for i in range(0, len(ps), args.batch)]
        base: list[list[int]] = []
        for b in tqdm(batches, desc=f"{name}: plain", file=sys.stderr):
            base += [o.token_ids for o in e.generate(b, sp)]
        shapes = {}
        for sname, spec in SHAPES.items():
            out: list[list[int]] = []
            tau: list[float] = []
            for b in tqdm(batches, desc=f"{name}: {sname}", file=sys.stderr):
                for o in e.generate(b, sp, spec=spec):
                    out.append(o.token_ids)
                    tau.append(o.metrics.accept_length)
            diff = [i for i, (a, b) in enumerate(zip(out, base, strict=True)) if a != b]
            shapes[sname] = {"identical": len(ps) - len(diff), "of": len(ps),
                             "differing": {str(i): first_divergence(out[i], base[i])
                                           for i in diff},
                             "mean_tau": sum(tau) / len(tau)}
        return {"config": kw, "choices": {k: v.get("choice") for k, v in e.choices.items()},
                "self_check": e.init_details.get("self_check", ""), "shapes": shapes,
                "tokens": sum(map(len, base)), "seconds": time.perf_counter() - t0}
    finally:
        e.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts-file", default=str(REPO_ROOT / "data/prompts/real/heldout.jsonl"))
    ap.add_argument("--prompts", type=int, default=None, help="the first N (default: all)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--with-default", action="store_true",
                    help="also bfloat16 and packed without the switch")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    table = {**FORMATS, **(DEFAULTS if args.with_default else {})}
    names = [n.strip() for n in args.formats.split(",")] + \
        (list(DEFAULTS) if args.with_default else [])
    for n in names:
        if n not in table:
            raise SystemExit(f"--formats: {n!r} not in {', '.join(table)}")
    ps = prompts(Path(args.prompts_file), args.prompts)
    load0 = loadavg()
    results = {n: run_format(n, table[n], ps, args) for n in names}
    doc = {"machine": machine_info(), "load_before": load0, "load_after": loadavg(),
           "commit": git_commit(), "command": " ".join(["python", *sys.argv]),
           "prompts": len(ps), "max_new_tokens": args.max_new_tokens, "batch": args.batch,
           "formats": results}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "lossless_formats.json").write_text(json.dumps(doc, indent=2) + "\n")
    for n, r in results.items():
        if "refused" in r:
            print(f"{n}: refused at init ({r['refused'][:160]})")
            continue
        print(f"{n}: " + "; ".join(f"{s} {v['identical']}/{v['of']} identical (tau "
                                   f"{v['mean_tau']:.2f})" for s, v in r["shapes"].items()))
    print(f"results: {out / 'lossless_formats.json'}")


if __name__ == "__main__":
    main()
