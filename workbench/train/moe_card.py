# ruff: noqa: E501  (markdown table rows are long by nature)
"""Model cards of the shipped MoE pair (``wb-moe``, ``wb-moe-eagle3``), rendered from the files
the upcycler, ``train-draft`` and the benchmarks write — every figure beside the command, the
machine and the load it came from, so a card is regenerated, never edited
(``scripts/write_model_cards.py``).

Inputs: each folder's ``config.json`` and ``training_summary.json``; a results folder (by
default ``data/results/wb-moe``) with ``peers.json`` (``bench peers --model data/models/wb-moe``),
``spec_bs1.json`` (``bench spec`` on the MoE pair), ``dense/spec_bs1.json`` (the dense pair in the
same sitting) and the machine kind's file with ``cost_ratio`` (``scripts/bench_moe_ratio.py``).
A missing input renders as "not measured yet".
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from workbench.data_io import load_json, load_result_files
from workbench.markdown import MISSING, num, table


def provenance(doc: dict[str, Any], command: str) -> str:
    """"Command … · machine … · load a → b on n cores (flags)" for a saved result."""
    m = doc.get("machine") or {}
    load = doc.get("load") or {}
    before, after = (load.get("before") or ["?"])[0], (load.get("after") or ["?"])[0]
    flags = sorted({f.get("code", "?") if isinstance(f, dict) else str(f)
                    for f in doc.get("flags") or []})
    loaded = (f"; flags: {', '.join(flags)} — other work competed for the CPU, the figures "
              "are provisional" if flags else "")
    return (f"Command: `{command}` · {m.get('cpu')} · {m.get('cores')} cores · torch "
            f"{m.get('torch')} · {m.get('torch_threads')} thread(s) · {m.get('time')} · load "
            f"{before} → {after} on {load.get('cores', '?')} cores{loaded}.")


def _table(rows: list[dict[str, Any]], cols: list[tuple[str, str, int]]) -> str:
    """Columns (header, key, decimals; decimals < 0, a bool or a string: as written)."""
    return table([h for h, _, _ in cols], (
        [MISSING if r.get(k) is None else str(r[k]) if nd < 0 or isinstance(r[k], bool | str)
         else num(r[k], f".{nd}f") for _, k, nd in cols] for r in rows))


SPEC_COLS = [("arm", "arm", -1), ("tok/s", "tok_s", 1), ("speedup", "speedup", 2),
             ("τ", "tau", 2), ("verify ÷ plain step", "verify_ratio", 2),
             ("lossless", "lossless", -1)]


def spec_section(results: Path, commands: dict[str, str]) -> str:
    """EAGLE-3 on the MoE pair beside the dense pair, each with its command and load."""
    out = []
    for label, doc, cmd in (
            ("wb-moe + wb-moe-eagle3", load_json(results / "spec_bs1.json"), commands["spec_moe"]),
            ("wb-target + wb-eagle3 (same sitting)", load_json(results / "dense" / "spec_bs1.json"),
             commands["spec_dense"])):
        out.append(f"**{label}**\n")
        if not doc.get("summary"):
            out.append("_not measured yet_\n")
            continue
        out += [_table(doc["summary"], SPEC_COLS), provenance(doc, cmd) + "\n"]
    return "\n".join(out)


def peers_section(results: Path, command: str) -> str:
    doc = load_json(results / "peers.json")
    if not doc.get("summary"):
        return "_not measured yet_\n"
    cols = [("arm", "arm", -1), ("tok/s", "tok_s", 1), ("vs hf generate", "vs_hf_generate", 2),
            ("same as hf", "same_as_hf", -1)]
    return _table(doc["summary"], cols) + "\n" + provenance(doc, command) + "\n"


def ratio_section(results: Path, command: str) -> str:
    """The verify/decode cost ratio vs the cost model, per machine kind that measured it."""
    out = []
    for kind, doc in load_result_files(results).items():
        b = doc.get("benchmarks", {}).get("cost_ratio")
        if not b:
            continue
        cols = [("target", "target", -1), ("B", "batch", 0), ("decode ms", "decode_ms", 2),
                ("verify ms", "verify_ms", 2), ("measured", "ratio", 2),
                ("predicted", "predicted", 2), ("error", "error", 3),
                ("within ±15 %", "within", -1)]
        m = doc["machine"]
        out += [f"`{kind}` ({m.get('cpu')}, {m.get('cores')} cores):\n", _table(b["summary"], cols),
                provenance({**b, "machine": {**m, "time": b.get("time"),
                                             "torch_threads": b.get("torch_threads")}},
                           b.get("command") or command) + "\n"]
    return "\n".join(out) or "_not measured yet_\n"


def moe_target_card(folder: Path, results: Path, commands: dict[str, str]) -> str:
    s = load_json(folder / "training_summary.json")
    cfg = json.loads((folder / "config.json").read_text())
    c = s.get("config", {})
    src = load_json(Path(c.get("source", "")) / "config.json") or load_json(
        folder.parent / Path(c.get("source", "")).name / "config.json")
    e, k, inter = cfg["num_local_experts"], cfg["num_experts_per_tok"], cfg["intermediate_size"]
    dense_inter = src.get("intermediate_size")
    slices = dense_inter // inter if dense_inter else None
    d, n, v = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    active = s.get("parameters", 0) - n * (e - k) * 3 * d * inter
    hist = s.get("history") or [{}]
    first, last = hist[0], hist[-1]
    return f"""# wb-moe — {Path(c.get('source', 'wb-target')).name} sparsely upcycled into {e} experts, top-{k}

A Mixtral-format MoE (`{cfg['architectures'][0]}`, written by transformers' own `save_pretrained`;
config.json, model.safetensors in {cfg.get('dtype', cfg.get('torch_dtype'))} — the engine computes
in float32 — and the source's tokenizer). Its attention, embedding and norms are the source's;
each layer's dense SwiGLU MLP (intermediate {dense_inter}) became {e} experts of {inter} neurons
(expert e = slice e mod {slices} of the dense neurons plus {c.get('noise', 0) * 100:g} % noise,
down projection × {slices}/{k} so {k} uniform experts give the dense output in expectation),
routed top-{k} with renormalised softmax weights, then briefly trained
(`workbench/train/upcycle.py`).

| | |
|---|---|
| parameters | {s.get('parameters', 0) / 1e6:.1f} M ({n} layers × {d}, {e} experts of {inter}, top-{k}; {active / 1e6:.1f} M active per token, the embedding included; vocab {v}) |
| made by | `{commands['train']}` |
| training | {s.get('steps', c.get('steps'))} steps × {c.get('batch')} × {c.get('seq_len')} tokens ({s.get('tokens_seen', 0):,} tokens), AdamW lr {c.get('lr')}: KL to the source's next-token distribution (weight {c.get('distill')}) + the corpus' cross-entropy + {c.get('balance')} × load-balancing loss (E · Σ f_e p_e) |
| data | the standard-library corpus split of the source (the same held-out files) |
| held-out loss (16 windows of {c.get('seq_len')}) | {s.get('heldout_loss', float('nan')):.2f} (the source on the same windows: {s.get('teacher_heldout_loss', float('nan')):.2f}) |
| training time | {s.get('train_seconds', 0):.0f} s on {s.get('torch_threads')} thread(s); {commands.get('train_machine', 'machine and load not recorded')} |

First and last steps: CE {first.get('ce', float('nan')):.2f} → {last.get('ce', float('nan')):.2f}, KL to the source {first.get('kl', float('nan')):.2f} → {last.get('kl', float('nan')):.2f}, balance {first.get('balance', float('nan')):.2f} → {last.get('balance', float('nan')):.2f} (1.0 = perfectly even). `training_summary.json` has every step.

## bs=1 greedy decode vs transformers (`bench peers`)

{peers_section(results, commands['peers'])}
## EAGLE-3 on this pair beside the dense pair (`bench spec`)

{spec_section(results, commands)}
## Verify/decode cost ratio vs the cost model

One forward (+ LM head) over B requests × N new tokens ÷ over B × 1, at context 64, beside
`calibrate`'s fitted model (docs/MOE.md §3).

{ratio_section(results, commands['ratio'])}"""


def moe_draft_card(folder: Path, results: Path, commands: dict[str, str]) -> str:
    s = load_json(folder / "training_summary.json")
    cfg = json.loads((folder / "config.json").read_text())
    c = s.get("config", {})
    acc = ", ".join(f"{a:.2f}" for a in (s.get("heldout_regen") or s.get("heldout") or {}).get(
        "acc", []))
    est = s.get("est_accept_length_chain") or {}
    return f"""# wb-moe-eagle3 — the EAGLE-3 head of wb-moe

Standard `LlamaForCausalLMEagle3` checkpoint (docs/REFERENCE.md §6) trained by `train-draft` on
the MoE target: one decoder layer over the hidden states entering target layers
{s.get('aux_layer_ids')}, `fc` 3·{cfg['target_hidden_size']} → {cfg['hidden_size']}, MLP
{cfg['intermediate_size']}, draft vocabulary {cfg['draft_vocab_size']} (`d2t` / `t2d`),
embedding shared with the target.

| | |
|---|---|
| parameters | {s.get('parameters', 0) / 1e6:.2f} M |
| made by | `{commands['train']}` |
| training | {s.get('steps')} steps × batch {c.get('batch')} × {c.get('seq_len')} tokens, training-time test unrolled {c.get('ttt_steps')} steps (weights {c.get('step_decay')}^i) |
| data | corpus windows mixed with wb-moe's own continuations ({c.get('regen_sequences')} windows, {c.get('regen_greedy_frac')} greedy / rest T={c.get('regen_temperature')}; share per batch {c.get('regen_mix')}) |
| held-out top-1 agreement by unrolled step (regenerated windows) | {acc} |
| estimated chain accept length (train / held-out / held-out regenerated) | {num(est.get('train'))} / {num(est.get('heldout'))} / {num(est.get('heldout_regen'))} |
| training speed | {s.get('tokens_per_second', 0):.0f} tokens/s, {s.get('seconds', 0) / 60:.1f} min on {s.get('torch_threads')} thread(s); {commands.get('train_machine', 'machine and load not recorded')} |

## Measured τ and speedup, beside the dense pair (`bench spec`)

{spec_section(results, commands)}"""


def write_moe_cards(target: Path, draft: Path, results: Path,
                    commands: dict[str, dict[str, str]]) -> None:
    (target / "README.md").write_text(moe_target_card(target, results, commands["moe"]))
    (draft / "README.md").write_text(moe_draft_card(draft, results, commands["moe_draft"]))
