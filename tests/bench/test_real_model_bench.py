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
