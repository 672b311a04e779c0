"""The distill verbs on the main CLI (``python -m workbench distill ...``) and the module's own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from workbench.__main__ import build_parser
from workbench.__main__ import main as workbench_main
from workbench.errors import ConfigError
from workbench.train import real_prompts


@pytest.mark.parametrize("verb", ["self", "self-distill"])
def test_self_distill_parses_under_the_main_cli(verb: str) -> None:
    ns = build_parser().parse_args(["distill", verb, "--model", "M", "--conversations", "3",
                                    "--backend", "transformers", "--time-limit", "5"])
    assert ns.fn is real_prompts.run
    assert (ns.model, ns.conversations, ns.backend, ns.time_limit) == ("M", 3, "transformers", 5.0)


def test_a_verb_is_required(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["distill"])
    assert e.value.code == 2 and "verb" in capsys.readouterr().err


def test_prompts_written_by_both_entry_points_agree(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    assert workbench_main(["distill", "prompts", "--out", str(tmp_path / "a")]) == 0
    counts = json.loads(capsys.readouterr().out)
    assert real_prompts.main(["prompts", "--out", str(tmp_path / "b")]) == 0
    assert json.loads(capsys.readouterr().out) == counts
    for name in ("train.jsonl", "heldout.jsonl"):
        assert (tmp_path / "a" / name).read_text() == (tmp_path / "b" / name).read_text()
    assert set(counts["heldout"]) == set(real_prompts.KINDS)


def test_templates_are_data_and_a_bad_file_is_refused_naming_the_list(tmp_path: Path) -> None:
    assert real_prompts.TEMPLATES_FILE.is_file()
    assert real_prompts.TOPICS == real_prompts._templates()["topics"]
    doc = json.loads(real_prompts.TEMPLATES_FILE.read_text())
    doc["langs"] = ["French", 3]
    bad = tmp_path / "templates.json"
    bad.write_text(json.dumps(doc))
    with pytest.raises(ConfigError, match="'langs' must be a non-empty list of strings"):
        real_prompts._templates(bad)
    with pytest.raises(ConfigError, match="no prompt templates"):
        real_prompts._templates(tmp_path / "missing.json")
