# ruff: noqa: E501  (markdown table rows are long by nature)
"""Model cards (README.md) rendered from the files the trainers and benchmarks write.

Every figure in a card comes from ``training_summary.json`` or a ``data/results`` JSON, next to
the command that produced it, so a card can be regenerated and never drifts from the data.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from workbench.data_io import load_json
from workbench.markdown import num, table


def _bench_table(bench: dict[str, Any]) -> str:
    rows = bench.get("summary", [])
    if not rows:
        return "_not measured yet_\n"
    m = bench.get("machine", {})
    return table(["arm", "tok/s", "speedup vs baseline", "τ (accept length)", "lossless"],
                 ([r["arm"], num(r["tok_s"], ".1f"), num(r["speedup"], unit="×"),
                   num(r["tau"]), r["lossless"]] for r in rows)) + (
        f"\nMachine: {m.get('cpu')} · {m.get('cores')} cores · torch "
        f"{m.get('torch')} · {m.get('torch_threads')} threads · {m.get('time')}.\n")


def target_card(folder: Path, bench: dict[str, Any], commands: dict[str, str]) -> str:
    s = load_json(folder / "training_summary.json")
    cfg = json.loads((folder / "config.json").read_text())
    c = s.get("config", {})
    held = s.get("heldout_files", [])
    return f"""# wb-target — a {cfg['num_hidden_layers']}-layer Llama trained on the Python standard library

A Llama-architecture decoder (`LlamaForCausalLM`, HF format: config.json, model.safetensors,
tokenizer.json) trained from scratch on CPU so the workbench has a real target whose drafts can be
accepted. Loads with `workbench` and with `transformers.AutoModelForCausalLM` / `AutoTokenizer`.

| | |
|---|---|
| parameters | {s.get('parameters', 0) / 1e6:.1f} M |
| shape | {cfg['num_hidden_layers']} layers × {cfg['hidden_size']} wide, {cfg['num_attention_heads']} heads / {cfg['num_key_value_heads']} KV heads (GQA), MLP {cfg['intermediate_size']}, tied embeddings, RoPE θ {cfg['rope_theta']} |
| tokenizer | byte-level BPE (HF `tokenizers`), vocab {cfg['vocab_size']}, `<|endoftext|>` = EOS |
| corpus | `Lib/**/*.py` of the training interpreter (Python 3.11), tests, `encodings/`, `pydoc_data/`, `lib2to3/`, data tables and files > 200 kB excluded |
| split | by file, deterministic (sha1 of the relative path mod 20 == 0 → held-out): {s.get('train_tokens', 0):,} train tokens, {s.get('heldout_tokens', 0):,} held-out tokens in {len(held)} files |
| training | {s.get('steps')} steps × batch {c.get('batch')} × {c.get('seq_len')} tokens = {s.get('tokens_seen', 0):,} tokens, AdamW lr {c.get('lr')} warmup {c.get('warmup')} cosine→10 %, fp32, seed {c.get('seed')} |
| train loss / held-out loss | {s.get('train_loss', float('nan')):.3f} / {s.get('heldout_loss', float('nan')):.3f} (nats/token) |
| training speed | {s.get('tokens_per_second', 0):.0f} tokens/s over {s.get('train_seconds', 0) / 60:.1f} min on 2 CPU cores ({s.get('torch_threads')} torch threads; the machine was shared with other jobs for part of the run) |

Reproduce: `{commands.get('train', '')}`

## Speculative decoding with its EAGLE-3 head (`../wb-eagle3`)

Held-out prompts (`data/prompts/heldout.jsonl`), greedy, bs=1, float32; arms interleaved per
prompt in one run. Command: `{commands.get('bench', '')}`

{_bench_table(bench)}
## Chat template

`tokenizer_config.json` carries a chat template, so chat clients (the `openai` SDK's chat, LangChain
`ChatOpenAI`, LiteLLM, SGLang's `bench_serving --backend sglang-oai-chat`) work against
`workbench serve` out of the box. The model only ever saw Python source, so a conversation is
rendered as Python: each system/user message becomes a comment (`# user: ...`, every line of it
commented), each assistant turn is `# assistant:` on its own line followed by its content, and the
generation prompt is that same `# assistant:` line, so a reply is the model continuing with code
(it was not trained to chat: expect Python, not answers). For example
`[{{"role": "user", "content": "sort a list"}}]` renders as `# user: sort a list\\n# assistant:\\n`.
The template is `workbench.train.target.CHAT_TEMPLATE`; `train-target` writes it.

## Held-out files

{', '.join(f'`{h}`' for h in held)}
"""


def draft_card(folder: Path, bench: dict[str, Any], commands: dict[str, str]) -> str:
    s = load_json(folder / "training_summary.json")
    cfg = json.loads((folder / "config.json").read_text())
    c = s.get("config", {})
    per_step = s.get("heldout", {})
    acc = ""
    if isinstance(per_step, dict) and per_step.get("acc"):
        acc = ", ".join(f"{a:.2f}" for a in per_step["acc"])
    elif isinstance(per_step, list):
        acc = ", ".join(f"{r.get('acc', float('nan')):.2f}" for r in per_step)
    return f"""# wb-eagle3 — the EAGLE-3 head of wb-target

Standard `LlamaForCausalLMEagle3` checkpoint (docs/REFERENCE.md §6): one decoder layer over the fused
hidden states entering target layers {s.get('aux_layer_ids')}, `fc` 3·{cfg['target_hidden_size']}
→ {cfg['hidden_size']}, attention input width 2·{cfg['hidden_size']}, draft vocabulary
{cfg['draft_vocab_size']} (the most frequent target tokens; `d2t` / `t2d`), embedding shared
with the target. Loads in SGLang's EAGLE-3 loader layout.

| | |
|---|---|
| parameters | {s.get('parameters', 0) / 1e6:.2f} M |
| training | {s.get('steps')} steps × batch {c.get('batch')} × {c.get('seq_len')} tokens, training-time test unrolled {c.get('ttt_steps')} steps (weights {c.get('step_decay')}^i), forward KL to the target over the draft vocab |
| data | corpus windows mixed with target-regenerated continuations ({c.get('regen_sequences')} windows, {c.get('regen_greedy_frac')} greedy / rest T={c.get('regen_temperature')}; share per batch {c.get('regen_mix')}) |
| draft-vocab coverage | {s.get('draft_vocab_coverage', float('nan')):.3f} of training tokens |
| held-out top-1 agreement by unrolled step | {acc} |
| training speed | {s.get('tokens_per_second', 0):.0f} tokens/s, {s.get('seconds', 0) / 60:.1f} min |
| greedy calibration | {_calibration(s)} |

Reproduce: `{commands.get('train', '')}`

## Measured τ and speedup (held-out prompts, greedy, bs=1)

Command: `{commands.get('bench', '')}`

{_bench_table(bench)}"""


def write_cards(target: Path, draft: Path, bench_json: Path, commands: dict[str, dict[str, str]]
                ) -> None:
    bench = load_json(bench_json)
    (target / "README.md").write_text(target_card(target, bench, commands["target"]))
    if (draft / "config.json").is_file():
        (draft / "README.md").write_text(draft_card(draft, bench, commands["draft"]))


def _calibration(s: dict) -> str:
    """The tree-ranking temperature row (EAGLE-3 card)."""
    t, cal = s.get("greedy_score_temperature"), s.get("calibration")
    if t is None or not cal:
        return "none (draft probabilities rank tree nodes as they are)"
    return (f"T = {t} ranks greedy requests' tree nodes (held-out NLL of the target's argmax "
            f"{cal['nll_T=1']:.2f} at T=1 → {cal['nll_best']:.2f}; ranking only, lossless)")
