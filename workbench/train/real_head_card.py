# ruff: noqa: E501  (markdown table rows are long by nature)
"""The model card of the real model's EAGLE-3 head (``data/models/smollm2-eagle3/README.md``),
rendered from the files the run wrote: ``training_summary.json`` (train-draft), the distilled
corpus' ``corpus.json`` (``workbench.train.distill.pack``), the held-out τ JSON
(``python -m workbench.bench.spec``) and ``run.json`` (commands, machine, load).

    python -m workbench.train.real_head_card --head data/models/smollm2-eagle3 \\
        --ship-from data/work/real-eagle3/out --corpus-json data/work/real-distill/corpus.json --tau data/results/real/tau_heldout.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from workbench.data_io import load_json
from workbench.markdown import interval, num, table


def _f(xs: list[float]) -> str:
    return ", ".join(f"{x:.2f}" for x in xs)


def tau_section(tau: dict[str, Any]) -> str:
    if not tau:
        return "_not measured_\n"
    s = tau["spec"]
    lines = [f"Greedy, S{s['num_steps']} K{s['topk']} N{s['num_draft_tokens']}, up to "
             f"{tau['max_new_tokens']} new tokens per prompt, every held-out prompt "
             f"(`data/prompts/real/heldout.jsonl`); 95 % intervals: percentile bootstrap over "
             "prompts. Acceptance at depth d: share of verify steps that accepted ≥ d drafted "
             "tokens.", "",
             table(["category", "prompts", "τ", "95 % interval",
                    *(f"depth {d + 1}" for d in range(s["num_steps"])), "lossless"],
                   ([name, r["prompts"], num(r["tau"]),
                     f"[{num(r['tau_lo'])}, {num(r['tau_hi'])}]",
                     *(interval(d["accept_rate"], d["lo"], d["hi"], style="bracket")
                       for d in r["per_depth"]), r["lossless"]]
                    for name, r in [*tau["by_kind"].items(), ("**overall**", tau["overall"])]
                    )).rstrip("\n")]
    m = tau.get("machine", {})
    load = m.get("load", {})
    lines += ["", f"Command: `{tau.get('command', '')}` (the commit is in the result JSON); "
              f"machine: {m.get('cpu')}, {m.get('cores')} cores; load average before/after "
              f"{load.get('before')} / {load.get('after')}. τ does not depend on load."]
    return "\n".join(lines) + "\n"


def render(head: Path, corpus: dict[str, Any], tau: dict[str, Any]) -> str:
    s = load_json(head / "training_summary.json")
    run = load_json(head / "run.json")
    cfg = json.loads((head / "config.json").read_text())
    c = s.get("config", {})
    kinds = corpus.get("kinds", {})
    data_rows = "\n".join(f"| {k} | {v['conversations']} | {v['tokens']} | {v['answer_tokens']} |"
                          for k, v in kinds.items())
    held = s.get("heldout", {})
    train = s.get("train", {})
    hist = s.get("history", [])
    est = s.get("est_accept_length_chain", {})
    answers = ""
    if "heldout_answers" in s:  # trained with --answer-loss: the rows drafted at inference
        answers = (f"| top-1 agreement by unrolled step, held-out answers | "
                   f"{_f(s['heldout_answers']['acc'])} |\n"
                   f"| chain estimate of τ (held-out answers) | "
                   f"{est.get('heldout_answers', float('nan')):.2f} |\n")
    loss_on = ("the rows that predict an answer token (`--answer-loss`: windows drawn around "
               "answers)" if c.get("answer_loss") else "every row")
    precision = (" under bfloat16 autocast (`--autocast bfloat16`; the target's features in "
                 "float32)" if c.get("autocast") == "bfloat16" else "")
    on_gpu = str(s.get("device", "cpu")).startswith("cuda")
    where = f"one {s.get('device_name')} GPU" if on_gpu else "CPU"
    workers = (f"on {s.get('device_name')}" if on_gpu else
               f"{s.get('torch_threads')} torch thread(s) (provisional, under load: "
               f"{run.get('load', '')})")
    machine = run.get("training_machine") or run.get("cpu", "")
    picked = ""
    if s.get("selection"):
        picked = (f"| exported | step {s.get('exported_step')} of {s.get('steps')}: the best "
                  f"chain estimate on held-out answers, scored every {c.get('eval_every')} "
                  f"steps (`--eval-every`) |\n")
    if c.get("init_from"):
        picked += (f"| started from | the head in `{c['init_from']}` (`--init-from`; `run.json` "
                   f"says which run made it) |\n")
    hist_rows = "\n".join(f"| {h['step']} | {h['loss']:.3f} | {_f(h['acc'])} | "
                          f"{h['seconds'] / 60:.1f} |" for h in hist)
    return f"""# smollm2-eagle3 — an EAGLE-3 head for SmolLM2-135M-Instruct, trained on {where}

Standard `LlamaForCausalLMEagle3` checkpoint (docs/REFERENCE.md §6) for the real model
`data/models/smollm2-135m-instruct`: one decoder layer over the fused hidden states entering
target layers {cfg.get('eagle_config', {}).get('eagle_aux_hidden_state_layer_ids', s.get('aux_layer_ids'))},
hidden {cfg.get('hidden_size')}, {cfg.get('num_attention_heads')} query / {cfg.get('num_key_value_heads')} KV heads,
draft vocabulary {cfg.get('draft_vocab_size')} (the most frequent tokens of the training
conversations; `d2t` / `t2d`), embedding shared with the target, weights in bfloat16.

| | |
|---|---|
| parameters | {s.get('parameters', 0) / 1e6:.2f} M |
| training | {s.get('steps')} steps × batch {c.get('batch')} × {c.get('seq_len')} tokens = {s.get('tokens')} tokens, training-time test unrolled {c.get('ttt_steps')} steps (weights {c.get('step_decay')}^j), forward KL to the target over the draft vocabulary on {loss_on}{precision}, lr {c.get('lr')} (warmup {c.get('warmup')}, cosine) |
| training time | {s.get('seconds', 0) / 60:.1f} min at {s.get('tokens_per_second', 0):.0f} tokens/s, {workers} |
{picked}| draft-vocab coverage | {s.get('draft_vocab_coverage', 0):.3f} of training tokens |
| top-1 agreement by unrolled step, train windows | {_f(train.get('acc', []))} |
| top-1 agreement by unrolled step, held-out conversations | {_f(held.get('acc', []))} |
| chain estimate of τ (held-out) | {est.get('heldout', float('nan')):.2f} |
{answers}| greedy calibration | T = {s.get('greedy_score_temperature')} ranks greedy requests' tree nodes (ranking only, lossless) |
| machine | {machine}; load {run.get('load', '')} |

## Data: self-distillation on prompts the project writes

`python -m workbench distill prompts` writes `data/prompts/real/train.jsonl` and
`heldout.jsonl` (7 categories like Spec-Bench's: multi-turn chat, translation, summarisation,
question answering, math reasoning, retrieval-style, code; passages from the Python standard
library's docstrings, generated arithmetic problems, templated topics; a held-out prompt never
shares its topic, passage or problem with a train prompt). The target answers each train prompt
greedily with its chat template (`distill`, batched through the engine; chat: the target's
first answer, then the second user turn), and `pack` joins the chat-templated token ids into
`corpus.npz` (every 20th conversation held out for the evaluation above).

| category | conversations | tokens | answer tokens |
|---|---|---|---|
{data_rows}

Commands:

```
{chr(10).join(run.get('commands', []))}
```

## Training curve

| step | loss (sum over steps) | top-1 agreement by step | minutes |
|---|---|---|---|
{hist_rows}

## Held-out τ

{tau_section(tau)}
## Beside published figures

{run.get('published', '')}
"""


def ship(src: Path, head: Path) -> dict[str, int]:
    """Copy a train-draft output folder to ``head`` with its floating-point tensors in
    bfloat16 (``d2t`` / ``t2d`` keep their integer / bool types). Returns bytes before/after."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    state = load_file(str(src / "model.safetensors"))
    small = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in state.items()}
    head.mkdir(parents=True, exist_ok=True)
    save_file(small, str(head / "model.safetensors"), metadata={"format": "pt"})
    for name in ("config.json", "training_summary.json"):
        shutil.copyfile(src / name, head / name)
    return {"bytes_float32": (src / "model.safetensors").stat().st_size,
            "bytes_bfloat16": (head / "model.safetensors").stat().st_size}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m workbench.train.real_head_card")
    ap.add_argument("--head", default="data/models/smollm2-eagle3")
    ap.add_argument("--corpus-json", default="data/work/real-distill/corpus.json")
    ap.add_argument("--tau", default="data/results/real/tau_heldout.json")
    ap.add_argument("--ship-from", default="",
                    help="a train-draft output folder: copy it to --head in bfloat16 first")
    ns = ap.parse_args(argv)
    head = Path(ns.head)
    if ns.ship_from:
        print(json.dumps(ship(Path(ns.ship_from), head)))
    text = render(head, load_json(Path(ns.corpus_json)), load_json(Path(ns.tau)))
    (head / "README.md").write_text(text)
    print(f"card: {head / 'README.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
