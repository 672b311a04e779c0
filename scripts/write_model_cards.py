"""Render data/models/*/README.md from training summaries and the latest bench results.

Usage: python scripts/write_model_cards.py  (after the bench commands below)

Dense pair (wb-target, wb-eagle3): the main table is the latest ``data/results/spec_bs1.json``;
a "Speed by machine kind" section follows with every ``data/results/<kind>.json`` (one per kind
of machine, each figure with its command, load and flags).

MoE pair (wb-moe, wb-moe-eagle3; ``workbench.train.moe_card``): from ``data/results/wb-moe/``,
written by the ``COMMANDS["moe"]`` commands: ``bench peers`` and ``bench spec`` on the MoE pair,
``bench spec`` on the dense pair in the same sitting (``dense/``), and
``scripts/bench_moe_ratio.py``; then its own "Speed by machine kind" section.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from workbench.train.card import write_cards
from workbench.train.moe_card import write_moe_cards

ROOT = Path(__file__).resolve().parents[1]

COMMANDS = {
    "target": {
        "train": "python -m workbench train-target --layers 18 --hidden 256 --heads 4 "
                 "--kv-heads 2 --intermediate 704 --steps 1000 --ckpt-every 50 --threads 2",
        "bench": "python -m workbench bench spec --prompts 8 --max-new-tokens 64 --repeats 3",
    },
    "draft": {
        "train": "python -m workbench train-draft --threads 2 --steps 600 --batch 8 "
                 "--seq-len 256 --ttt-steps 7 --regen-sequences 768 --regen-mix 0.6 "
                 "--regen-greedy-frac 0.7  && python -m workbench train-draft --threads 2 "
                 "--steps 1100 --batch 8 --seq-len 256 --ttt-steps 7 --regen-sequences 768 "
                 "--regen-mix 0.8 --regen-greedy-frac 0.7  && python -m workbench train-draft "
                 "--threads 2 --steps 1900 --batch 8 --seq-len 256 --ttt-steps 7 "
                 "--regen-sequences 2048 --regen-mix 0.9 --regen-greedy-frac 0.9   (each command "
                 "resumes the previous one's checkpoint in data/work/eagle3 and continues with "
                 "more, and more greedy, regenerated data; the shipped run of the third stage was "
                 "interrupted and resumed twice — at step 1150 under a --steps 2200 schedule, then "
                 "--steps 1600, then 1900 — so its learning-rate curve differs slightly from one "
                 "uninterrupted command. The last stage also fits the greedy calibration "
                 "temperature on held-out regenerated windows)",
        "bench": "python -m workbench bench spec --prompts 8 --max-new-tokens 64 --repeats 3",
    },
}

MOE_RESULTS = "data/results/wb-moe"
MOE_MACHINE = ("trained on a 2-core AMD EPYC (family 26) under load 9.3–11.2 (other agents' jobs "
               "on the 2 cores): the time is provisional")
MOE_SPEC = {
    "spec_moe": "python -m workbench bench spec --prompts 8 --max-new-tokens 64 --model "
                "data/models/wb-moe --draft "
                f"data/models/wb-moe-eagle3 --out {MOE_RESULTS}",
    "spec_dense": "python -m workbench bench spec --prompts 8 --max-new-tokens 64 --model "
                  "data/models/wb-target --draft "
                  f"data/models/wb-eagle3 --out {MOE_RESULTS}/dense",
}
COMMANDS["moe"] = {
    "train": "python -c 'from workbench.train.upcycle import UpcycleConfig, upcycle; "
             "upcycle(UpcycleConfig(source=\"data/models/wb-target\", "
             "out=\"data/models/wb-moe\", steps=100, batch=8, seq_len=64))'",
    "train_machine": MOE_MACHINE,
    "peers": "python -m workbench bench peers --quick --repeats 3 --model data/models/wb-moe "
             f"--draft data/models/wb-moe-eagle3 --out {MOE_RESULTS}",
    "ratio": f"OMP_NUM_THREADS=1 python scripts/bench_moe_ratio.py --out {MOE_RESULTS}",
    **MOE_SPEC,
}
COMMANDS["moe_draft"] = {
    "train": "python -m workbench train-draft --target data/models/wb-moe --out "
             "data/models/wb-moe-eagle3 --work data/work/moe-eagle3 --intermediate 704 "
             "--steps 700 --batch 4 --seq-len 256 --ttt-steps 7 --regen-sequences 384 "
             "--regen-mix 0.85 --regen-greedy-frac 0.9 --regen-batch 32 --threads 1",
    "train_machine": "2-core AMD EPYC (family 26), nice 10, shared with other agents' jobs "
                     "(1-min load sampled at 2.0–5.8): the time is provisional",
    **MOE_SPEC,
}

BY_MACHINE = "## Speed by machine kind"


def _fmt(v: Any, nd: int = 2) -> str:
    if isinstance(v, bool) or v is None:
        return "—" if v is None else str(v)
    if isinstance(v, int) or (isinstance(v, float) and v.is_integer() and abs(v) >= 1):
        return str(int(v))
    return f"{v:.{nd}f}" if isinstance(v, float) else str(v)


def machine_section(folder: Path) -> str:
    """Every machine kind's figures (``data/results/<kind>.json``), each with its machine,
    command, load and flags: a figure is never quoted without the machine it came from."""
    from workbench.data_io import load_result_files

    docs = load_result_files(folder)
    lines = [BY_MACHINE, "",
             "Speed depends on the machine: each kind's figures come from "
             "`data/results/<kind>.json`, written by the `bench` command shown; the file also "
             "holds each run's commit and the engine's measured choices. `loaded` marks a "
             "run whose load average exceeded the cores (other jobs competed): its absolute tok/s "
             "are low and only its side-by-side ratios mean something.", ""]
    if not docs:
        return "\n".join([*lines, "_no per-machine results yet_", ""])
    for kind, doc in docs.items():
        m = doc["machine"]
        l2, l3 = m.get("l2"), m.get("l3")
        caches = (f" · L2 {l2 / 2**20:g} MiB · L3 {l3 / 2**20:g} MiB"
                  if isinstance(l2, int) and isinstance(l3, int) else "")
        lines += [f"### {m.get('cpu')} (`{kind}`)", "",
                  f"{m.get('cores')} cores{caches} · "
                  f"{', '.join(m.get('flags') or []) or 'flags not recorded'} · torch "
                  f"{m.get('torch')} · result file: `{_rel(folder / (kind + '.json'))}`" +
                  (" · transcribed from a report, not measured by the commands shown (the "
                   "file's `source` says from where)" if doc.get("source") else ""), ""]
        for bench, b in doc["benchmarks"].items():
            load = b.get("load") or {}
            before, after = load.get("before") or ["?"], load.get("after") or ["?"]
            ld = (f"load {before[0]} → {after[0]} on {load.get('cores', '?')} cores" if load
                  else "load not recorded")
            flags = ", ".join(sorted(set(b.get("flags") or []))) or "none"
            lines += [f"**{bench}** — `{b.get('command')}` ({b.get('time', 'date not recorded')}"
                      f"; {ld}; flags: {flags})", ""]
            rows = b.get("summary") or []
            if rows:
                cols = [c for c in rows[0] if c not in ("flags",) and not c.endswith(("_lo",
                                                                                       "_hi"))]
                cols = cols[:9]
                lines.append("| " + " | ".join(cols) + " |")
                lines.append("|" + "---|" * len(cols))
                for r in rows:
                    lines.append("| " + " | ".join(_fmt(r.get(c)) for c in cols) + " |")
                lines.append("")
            if b.get("note"):
                lines += ["_A note on this run is in the result file._", ""]
    return "\n".join(lines)


def _rel(path: Path) -> str:
    """``path`` from the repository root (as given when it lies elsewhere)."""
    path = path.resolve()
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.as_posix()


def append_machine_section(card: Path, section: str) -> None:
    text = card.read_text()
    if BY_MACHINE in text:
        text = text[: text.index(BY_MACHINE)].rstrip() + "\n"
    card.write_text(text.rstrip() + "\n\n" + section)


if __name__ == "__main__":
    write_cards(ROOT / "data/models/wb-target", ROOT / "data/models/wb-eagle3",
                ROOT / "data/results/spec_bs1.json", COMMANDS)
    section = machine_section(ROOT / "data/results")
    for name in ("wb-target", "wb-eagle3"):
        append_machine_section(ROOT / "data/models" / name / "README.md", section)
    moe = ROOT / MOE_RESULTS
    write_moe_cards(ROOT / "data/models/wb-moe", ROOT / "data/models/wb-moe-eagle3", moe,
                    COMMANDS)
    section = machine_section(moe)
    for name in ("wb-moe", "wb-moe-eagle3"):
        append_machine_section(ROOT / "data/models" / name / "README.md", section)
    print("wrote the README.md of data/models/wb-target, wb-eagle3, wb-moe, wb-moe-eagle3")
