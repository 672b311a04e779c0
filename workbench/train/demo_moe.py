"""The MoE pair notebook 09 uses: the shipped ``data/models/wb-moe`` + ``wb-moe-eagle3`` (wb-target
sparsely upcycled into 8 experts, top-2; its model card says how), or — under
``WORKBENCH_FAST=1`` or when they are missing — a micro random Mixtral written by transformers
with a random head (seconds to build, cached in ``data/work/demo-moe``)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from workbench.data_io import DATA_DIR
from workbench.models.synthetic import write_random_head
from workbench.models.synthetic_moe import write_random_moe

SHIPPED_MOE = DATA_DIR / "models" / "wb-moe"
SHIPPED_MOE_DRAFT = DATA_DIR / "models" / "wb-moe-eagle3"
MICRO_MOE = dict(vocab_size=300, hidden_size=64, intermediate_size=64, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, num_local_experts=8,
                 num_experts_per_tok=2)


@dataclass(frozen=True)
class MoePair:
    target: Path
    draft: Path
    kind: str  # "shipped" | "micro"

    def describe(self) -> str:
        cfg = json.loads((self.target / "config.json").read_text())
        e = cfg.get("num_local_experts") or cfg.get("num_experts")
        return (f"{self.kind} MoE pair: {self.target.name} ({cfg['num_hidden_layers']} layers × "
                f"{cfg['hidden_size']}, {e} experts, top-{cfg['num_experts_per_tok']}) + "
                f"{self.draft.name}")


def demo_moe(fast: bool = False) -> MoePair:
    if not fast and (SHIPPED_MOE / "config.json").is_file() and \
            (SHIPPED_MOE_DRAFT / "config.json").is_file():
        return MoePair(SHIPPED_MOE, SHIPPED_MOE_DRAFT, "shipped")

    root = Path(os.environ.get("WORKBENCH_DEMO_DIR", DATA_DIR / "work")) / "demo-moe"
    target, draft = root / "target", root / "draft"
    stamp = root / "shape.json"
    if not (stamp.is_file() and json.loads(stamp.read_text()) == MICRO_MOE
            and (draft / "config.json").is_file()):
        root.mkdir(parents=True, exist_ok=True)
        write_random_moe(target, "mixtral", std=0.1, **MICRO_MOE)
        write_random_head(target, draft, draft_vocab=128)
        stamp.write_text(json.dumps(MICRO_MOE) + "\n")
    return MoePair(target, draft, "micro")
