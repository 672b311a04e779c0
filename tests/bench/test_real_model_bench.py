"""The benches on a pretrained chat target: held-out requests rendered with the target's chat
template into the ``--prompts-file`` every ``bench`` reads; ``bench shapes`` runs a pretrained
target beside its random twin on the prompts' token ids; the assisted peer needs an assistant
with the target's vocabulary. Small synthetic models (the micro target, vocab 300, carries a
chat template); no timing is asserted."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest

from workbench.__main__ import main
from workbench.bench.real_model import interleave, render_chat_prompts
from workbench.errors import ConfigError

REQUESTS = [
    {"id": "c1", "category": "code", "prompt": "def add(a, b):"},
    {"id": "c2", "category": "code", "prompt": "def sub(a, b):"},
    {"id": "q1", "category": "qa", "messages": [
        {"role": "user", "content": "the cat"}, {"role": "assistant", "content": "sat"},
        {"role": "user", "content": "and then"}]},
]


def write_src(folder: Path, items: list[dict] = REQUESTS) -> Path:
    src = folder / "heldout.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in items))
    return src


def test_requests_rendered_with_the_chat_template_categories_interleaved(
        micro_target: Path, tmp_path: Path) -> None:
    from workbench.models.loader import load_tokenizer

    tok = load_tokenizer(micro_target)
    out = render_chat_prompts(write_src(tmp_path), micro_target, tmp_path / "p.jsonl")
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == ["c1", "q1", "c2"]  # round-robin over categories
    assert [r["category"] for r in rows] == ["code", "qa", "code"]
    want = tok.apply_chat_template([{"role": "user", "content": "def add(a, b):"}],
                                   add_generation_prompt=True, tokenize=False)
    assert rows[0]["prompt"] == want
    assert rows[1]["prompt"] == tok.apply_chat_template(REQUESTS[2]["messages"],
                                                        add_generation_prompt=True,
                                                        tokenize=False)
    two = render_chat_prompts(write_src(tmp_path), micro_target, tmp_path / "two.jsonl",
                              limit=2)
    assert [json.loads(x)["id"] for x in two.read_text().splitlines()] == ["c1", "q1"]


def test_bad_inputs_are_refused_naming_the_field(micro_target: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--src: no file"):
        render_chat_prompts(tmp_path / "none.jsonl", micro_target, tmp_path / "o.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "ok"}) + "\n" + json.dumps({"messages": []}) + "\n")
    with pytest.raises(ConfigError, match=r"bad.jsonl:2: 'messages'"):
        render_chat_prompts(bad, micro_target, tmp_path / "o.jsonl")
    no_template = SimpleNamespace(chat_template=None)
    with pytest.raises(ConfigError, match="no chat template"):
        render_chat_prompts(write_src(tmp_path), micro_target, tmp_path / "o.jsonl",
                            tokenizer=no_template)
    with pytest.raises(ConfigError, match="--limit"):
        render_chat_prompts(write_src(tmp_path), micro_target, tmp_path / "o.jsonl", limit=0)
    assert interleave([]) == []


def test_bench_spec_on_rendered_chat_prompts(micro_target: Path, random_head: Path,
                                             tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The rendered file through ``bench spec --prompts-file``: every arm lossless, the
    per-step ceiling and the overhead recorded beside the speedup."""
    monkeypatch.setenv("WORKBENCH_AUTOTUNE_CACHE", str(tmp_path / "at.json"))
    prompts = render_chat_prompts(write_src(tmp_path), micro_target, tmp_path / "p.jsonl")
    out = tmp_path / "res"
    code = main(["bench", "spec", "--model", str(micro_target), "--draft", str(random_head),
                 "--prompts-file", str(prompts), "--max-new-tokens", "4", "--out", str(out),
                 "--engine", "gemm=dense,threads=1"])
    assert code == 0
    doc = json.loads((out / "spec_bs1.json").read_text())
    s = pd.DataFrame(doc["summary"]).set_index("arm")
    assert bool(s["lossless"].all())
    tree = s.loc["tree S5 K4 N16"]
    assert tree["ceiling"] > 0 and tree["of_ceiling_step"] > 0
    assert {"machine", "load"} <= set(doc) and len(doc["load"]["before"]) == 3


def test_shapes_runs_a_pretrained_target_beside_its_random_twin(
        micro_target: Path, random_head: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A target whose vocabulary is not the toy shapes' (the micro target's 300, SmolLM2's
    49152) runs with its head and a random pair of its own shape, on token ids."""
    from workbench.bench.shapes import shape_of

    monkeypatch.setenv("WORKBENCH_AUTOTUNE_CACHE", str(tmp_path / "at.json"))
    monkeypatch.chdir(tmp_path)  # random pairs are written under ./data/work/shapes
    prompts = render_chat_prompts(write_src(tmp_path), micro_target, tmp_path / "p.jsonl",
                                  limit=2)
    out = tmp_path / "res"
    code = main(["bench", "shapes", "--model", str(micro_target), "--draft", str(random_head),
                 "--prompts-file", str(prompts), "--max-new-tokens", "4", "--tau", "2",
                 "--spec", "2,1,3", "--out", str(out), "--engine", "gemm=dense,threads=1"])
    assert code == 0
    rows = json.loads((out / "shapes.json").read_text())["rows"]
    assert [r["shape"] for r in rows] == ["trained pair", "trained pair random twin"]
    shape, draft_vocab = shape_of(micro_target, random_head)
    twin = rows[1]
    assert twin["random"] and not rows[0]["random"]
    assert (twin["layers"], twin["hidden"]) == (shape.layers, shape.hidden)
    head = json.loads((random_head / "config.json").read_text())
    assert draft_vocab == head["draft_vocab_size"]
    from workbench.bench.cli_bs1 import bench_shapes

    with pytest.raises(ConfigError, match="--draft"):
        bench_shapes(SimpleNamespace(tau=2.0, spec="2,1,3", prompts_file=str(prompts),
                                     quick=False, draft=str(tmp_path / "none"),
                                     model=str(micro_target), max_new_tokens=4, repeats=1,
                                     engine="", out=str(out)))


def test_assisted_peer_needs_the_targets_vocabulary(micro_target: Path, tmp_path: Path) -> None:
    from workbench.bench.cli_bs1 import same_tokenizer

    assert same_tokenizer(micro_target, micro_target)
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text((micro_target / "config.json").read_text())
    assert not same_tokenizer(micro_target, bare)  # no tokenizer at all


def test_report_reads_the_results_back_with_machine_load_and_command(tmp_path: Path) -> None:
    """``--report``: the bs=1 and policy tables from saved results, each with its stamp; a
    missing result is said so."""
    from workbench.bench.real_model import report

    machine = {"cpu": "AMD EPYC", "kind": "amd-epyc-family-25", "cores": 2}
    load = {"before": [3.5, 3.0, 2.0], "after": [4.0, 3.1, 2.1], "cores": 2}
    (tmp_path / "peers.json").write_text(json.dumps({
        "machine": machine, "load": load, "flags": [{"code": "loaded"}], "summary": [
            {"arm": "hf generate", "tok_s": 4.0, "vs_hf_generate": 1.0, "same_as_hf": True},
            {"arm": "workbench", "tok_s": 9.0, "tok_s_lo": 8.0, "tok_s_hi": 10.0,
             "vs_hf_generate": 2.25, "vs_hf_paired": 2.2, "vs_hf_paired_lo": 2.1,
             "vs_hf_paired_hi": 2.3, "pairs": 14, "same_as_hf": True}]}))
    (tmp_path / "spec_bs1.json").write_text(json.dumps({
        "machine": machine, "load": load, "flags": [], "summary": [
            {"arm": "baseline", "tau": 1.0, "tok_s": 9.0, "speedup": 1.0, "ceiling": None,
             "lossless": True},
            {"arm": "tree S5 K4 N16", "tau": 3.0, "tok_s": 18.0, "speedup": 2.0,
             "verify_ratio": 1.3, "draft_ratio": 0.2, "ceiling": 2.0, "of_ceiling_step": 0.95,
             "overhead": 0.05, "of_ceiling": 1.0, "lossless": True}]}))
    (tmp_path / "amd-epyc-family-25.json").write_text(json.dumps({"machine": machine,
        "benchmarks": {"peers": {"command": "python -m workbench bench peers --quick",
                                 "commit": "abc1234", "torch_threads": 1}}}))
    text = report(tmp_path)
    assert "| workbench | 9.00 (8.00–10.00) | 2.25× | 2.20× (2.10–2.30), n = 14 | yes |" in text
    assert "| hf generate | 4.00 | 1.00× | — | yes |" in text  # a result without the pairs
    assert "| tree S5 K4 N16 | 3.00 | 18.00 | 2.00× | 1.30 + 0.20 | 2.00× | 0.95 | 5 % |" in text
    assert "| baseline | 1.00 | 9.00 | 1.00× | — | — |" in text
    assert "load 3.5 before, 4.0 after; flags: loaded; commit `abc1234`; " \
           "`python -m workbench bench peers --quick`" in text
    assert f"no `bench concurrency --policy` result in {tmp_path}" in text
    rows = [{"arm": arm, "concurrency": c, "repeat": r, "tok_s": t * (1 + r / 10),
             "vs_baseline": t / 4.0, "tau": tau, "spec_share": share, "lossless": True}
            for arm, t, tau, share in (("baseline", 4.0, 1.0, 0.0), ("never", 3.9, 1.0, 0.0),
                                       ("always", 7.0, 3.0, 1.0))
            for c in (1, 2) for r in (0, 1)]
    (tmp_path / "concurrency_policies.json").write_text(json.dumps({
        "machine": machine, "load": load, "flags": [], "rows": rows,
        "config": {"interleaved": False, "max_new_tokens": 16}}))
    text = report(tmp_path)
    assert "sequential, 16 new tokens" in text
    line = next(x for x in text.splitlines() if x.startswith("| always | 1 |"))
    assert "1.75× (" in line and "| 1.79× | 3.00 | 1.00 | yes |" in line
