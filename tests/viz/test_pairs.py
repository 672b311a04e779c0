"""workbench.viz.pairs: which pair a page runs, and the real pair's chat prompts as text."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from workbench.errors import ConfigError
from workbench.viz import pairs


class Template:
    """A tokenizer stand-in with a chat template of its own."""

    chat_template = "{{ messages }}"

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool,
                            tokenize: bool) -> str:
        assert add_generation_prompt and not tokenize
        return "".join(f"<{m['role']}>{m['content']}\n" for m in messages) + "<assistant>"


def write(path: Path, lines: list[object]) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def test_chat_prompts_rendered_per_category(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    f = write(tmp_path / "heldout.jsonl", [
        {"kind": "code", "prompt": "sort a list"},
        {"kind": "chat", "messages": [{"role": "user", "content": "hi"},
                                      {"role": "assistant", "content": "hello"},
                                      {"role": "user", "content": "more"}]},
        {"kind": "code", "prompt": "reverse a string"},
        {"kind": "code", "prompt": "a third"}])
    monkeypatch.setattr(pairs, "REAL_PROMPTS", f)
    pair = pairs.PagePair(tmp_path, tmp_path, "real", "real pair")
    engine = SimpleNamespace(tokenizer=Template())
    cats = pair.categories(engine, per_category=2)
    assert cats == {"code": ["<user>sort a list\n<assistant>",
                             "<user>reverse a string\n<assistant>"],
                    "chat": ["<user>hi\n<assistant>hello\n<user>more\n<assistant>"]}
    assert pair.held_out_counts() == {"code": 3, "chat": 1}
    assert pair.prompts_for(engine) == [cats["code"][0], cats["chat"][0]]
    assert pair.config.kv_budget_tokens == pairs.REAL_KV_TOKENS


@pytest.mark.parametrize(("line", "field"), [
    ({"prompt": "x"}, "'kind'"),
    ({"kind": "code"}, "'prompt'"),
    ({"kind": "code", "messages": [{"role": "user"}]}, "'messages'"),
    ("{not json", "not JSON"),
])
def test_bad_prompt_lines_name_the_line_and_field(tmp_path: Path, line: object,
                                                  field: str) -> None:
    f = write(tmp_path / "p.jsonl", [{"kind": "code", "prompt": "ok"}, line])
    with pytest.raises(ConfigError, match=rf"p\.jsonl:2: .*{field}"):
        pairs.read_chat_prompts(f)


def test_render_needs_a_chat_template() -> None:
    with pytest.raises(ConfigError, match="chat template"):
        pairs.render(SimpleNamespace(chat_template=None), [{"role": "user", "content": "x"}])


def test_fast_or_missing_real_pair_gives_the_demo_pair(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    demo = SimpleNamespace(target=tmp_path / "t", draft=tmp_path / "d", kind="micro",
                           prompts=("def f():",), describe=lambda: "micro models")
    monkeypatch.setattr(pairs, "demo_models", lambda fast: demo)
    monkeypatch.setattr(pairs, "REAL_DRAFT", tmp_path / "no-head")
    assert "no EAGLE-3 head" in (pairs.real_missing() or "")
    for fast in (True, False):
        pair = pairs.page_models(fast=fast)
        assert (pair.kind, pair.target, pair.describe()) == ("micro", demo.target,
                                                             "micro models")
        assert pair.prompts_for(None) == ["def f():"]
