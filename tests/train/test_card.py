"""The dense model cards: what the chat-template section shows is the template's literal output."""

from __future__ import annotations

from pathlib import Path

from workbench.train.card import target_card

ROOT = Path(__file__).resolve().parents[2]


def test_the_chat_template_example_shows_its_newlines_as_escapes() -> None:
    text = target_card(ROOT / "data/models/wb-target", {}, {})
    line = next(ln for ln in text.splitlines() if "renders as" in ln)
    assert line.endswith("renders as `# user: sort a list\\n# assistant:\\n`.")
