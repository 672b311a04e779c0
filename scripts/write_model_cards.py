"""Render data/models/*/README.md from training summaries and the latest bench results.

Usage: python scripts/write_model_cards.py  (after `python -m workbench bench spec`)
"""

from __future__ import annotations

from pathlib import Path

from workbench.train.card import write_cards

ROOT = Path(__file__).resolve().parents[1]

COMMANDS = {
    "target": {
        "train": "python -m workbench train-target --layers 18 --hidden 256 --heads 4 "
                 "--kv-heads 2 --intermediate 704 --steps 1000 --ckpt-every 50 --threads 2",
        "bench": "python -m workbench bench spec --prompts 16 --max-new-tokens 128",
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
        "bench": "python -m workbench bench spec --prompts 16 --max-new-tokens 128",
    },
}

if __name__ == "__main__":
    write_cards(ROOT / "data/models/wb-target", ROOT / "data/models/wb-eagle3",
                ROOT / "data/results/spec_bs1.json", COMMANDS)
    print("wrote data/models/wb-target/README.md and data/models/wb-eagle3/README.md")
