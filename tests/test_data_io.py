"""The one reader of JSONL prompt files (``workbench.data_io.read_jsonl_records``) on
hostile inputs, and each of its callers going through its checks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from workbench.bench.real_model import render_chat_prompts
from workbench.data_io import load_prompt_records, read_jsonl_records, read_prompts_file
from workbench.errors import ConfigError
from workbench.train.distill import read_prompts
from workbench.viz.pairs import read_chat_prompts

OK = json.dumps({"id": "a", "kind": "qa", "prompt": "hello"})


def write(folder: Path, text: str | bytes, name: str = "p.jsonl") -> Path:
    f = folder / name
    if isinstance(text, bytes):
        f.write_bytes(text)
    else:
        f.write_text(text, encoding="utf-8")
    return f


def test_good_file_gives_records_with_their_line_numbers(tmp_path: Path) -> None:
    f = write(tmp_path, f"\n{OK}\n   \n\r\n{OK}\r\n")
    recs = read_jsonl_records(f)
    assert [r.line for r in recs] == [2, 5]
    assert recs[0].data == json.loads(OK)
    assert recs[1].where == f"prompts file: {f}:5"


def test_missing_file_or_folder_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"--x: no file at .*none\.jsonl"):
        read_jsonl_records(tmp_path / "none.jsonl", what="--x")
    with pytest.raises(ConfigError, match="no file at"):
        read_jsonl_records(tmp_path)


@pytest.mark.parametrize("text", ["", "\n", "  \n\n\t\n", "\r\n\r\n"])
def test_empty_or_blank_file_has_no_records(tmp_path: Path, text: str) -> None:
    with pytest.raises(ConfigError, match=r"p\.jsonl has no records \(empty prompts file\)"):
        read_jsonl_records(write(tmp_path, text))


@pytest.mark.parametrize(("line", "message"), [
    ("{not json", r"p\.jsonl:2: not JSON \(Expecting property name"),
    ('{"prompt": "x"} trailing', r"p\.jsonl:2: not JSON \(Extra data"),
    ("[" * 200_000, r"p\.jsonl:2: not JSON"),
    ('["a", "b"]', r"p\.jsonl:2: expected a JSON object, got an array"),
    ('"just a string"', r"p\.jsonl:2: expected a JSON object, got a string"),
    ("42", r"p\.jsonl:2: expected a JSON object, got a number"),
    ("null", r"p\.jsonl:2: expected a JSON object, got null"),
    ('{"id": "b", "kind": "qa"}', r"p\.jsonl:2: no field 'prompt'"),
    ('{"id": "b", "prompt": "x"}', r"p\.jsonl:2: no field 'kind'"),
    ('{"id": "b", "kind": "qa", "prompt": ""}',
     r"p\.jsonl:2: 'prompt' must be a non-empty string, got an empty string"),
    ('{"id": "b", "kind": "qa", "prompt": 7}', r"'prompt' must be .*got a number"),
    ('{"id": "b", "kind": "qa", "prompt": null}', r"'prompt' must be .*got null"),
    ('{"id": "b", "kind": "qa", "prompt": {"text": "x"}}', r"'prompt' must be .*got an object"),
    ('{"id": "b", "kind": "qa", "prompt": [{"role": "user", "content": "x"}]}',
     r"'prompt' must be a non-empty string, got an array"),
])
def test_bad_line_is_refused_naming_file_and_line(tmp_path: Path, line: str,
                                                  message: str) -> None:
    f = write(tmp_path, f"{OK}\n{line}\n{OK}\n")
    with pytest.raises(ConfigError, match=message):
        read_jsonl_records(f, ("id", "kind", "prompt"))


def test_messages_prompt_only_where_allowed(tmp_path: Path) -> None:
    msgs = [{"role": "user", "content": "x"}]
    f = write(tmp_path, json.dumps({"prompt": msgs}) + "\n")
    assert read_jsonl_records(f, allow_messages=True)[0].data["prompt"] == msgs
    for bad in ([], [{"role": "user"}], ["x"], [{"role": 1, "content": "x"}]):
        write(tmp_path, json.dumps({"prompt": bad}) + "\n")
        with pytest.raises(ConfigError, match=r"p\.jsonl:1: 'prompt' must be .*chat messages"):
            read_jsonl_records(f, allow_messages=True)


def test_non_utf8_bytes_name_the_line(tmp_path: Path) -> None:
    f = write(tmp_path, OK.encode() + b"\n\n" + b'{"prompt": "caf\xe9"}\n')
    with pytest.raises(ConfigError, match=r"p\.jsonl:3: not UTF-8"):
        read_jsonl_records(f)


def test_utf8_text_is_read_whole(tmp_path: Path) -> None:
    """A byte-order mark, non-ASCII text and U+2028 (a line break to ``str.splitlines``, not
    to JSONL) inside a prompt are all one record."""
    text = "naïve — 日本語\u2028second half\u0085"
    f = write(tmp_path, "\ufeff" + json.dumps({"prompt": text}, ensure_ascii=False) + "\n")
    assert [r.data["prompt"] for r in read_jsonl_records(f)] == [text]


def test_huge_line_is_fine(tmp_path: Path) -> None:
    big = "word " * 400_000  # 2 MB on one line
    f = write(tmp_path, json.dumps({"prompt": big}) + "\n" + OK + "\n")
    recs = read_jsonl_records(f)
    assert len(recs) == 2 and recs[0].data["prompt"] == big


# each caller goes through the shared reader's checks

def test_distill_read_prompts_refuses_a_bad_line_naming_it(tmp_path: Path) -> None:
    f = write(tmp_path, f"{OK}\n\n{{oops\n")
    with pytest.raises(ConfigError, match=r"p\.jsonl:3: not JSON"):
        read_prompts(f)
    write(tmp_path, f"\n{OK}\n" + json.dumps({"id": "b", "prompt": "x"}) + "\n")
    with pytest.raises(ConfigError, match=r"\.jsonl:3: no field 'kind'"):  # file lines
        read_prompts(f)
    with pytest.raises(ConfigError, match="no file at"):
        read_prompts(tmp_path / "none.jsonl")
    write(tmp_path, f"{OK}\n")
    assert read_prompts(f) == [json.loads(OK)]


def test_load_prompt_records_refuses_bad_lines_and_messages(tmp_path: Path) -> None:
    f = write(tmp_path, f"{OK}\n{{oops\n")
    with pytest.raises(ConfigError, match=r"p\.jsonl:2: not JSON"):
        load_prompt_records(f)
    write(tmp_path, "\n \n")
    with pytest.raises(ConfigError, match="no records"):
        load_prompt_records(f)
    for bad in ("not a list", [], [{"role": "user", "content": "x"}, {"role": "assistant",
                                                                      "content": "y"}]):
        write(tmp_path, json.dumps({**json.loads(OK), "messages": bad}) + "\n")
        with pytest.raises(ConfigError, match=r"p\.jsonl:1: messages must .*user turn"):
            load_prompt_records(f, chat=True)
    msgs = [{"role": "user", "content": "x"}]
    write(tmp_path, json.dumps({"id": "a", "kind": "qa", "prompt": msgs}) + "\n")
    assert load_prompt_records(f, chat=True)[0]["prompt"] == msgs  # sent as is, not wrapped


def test_read_prompts_file_names_the_flag(tmp_path: Path) -> None:
    f = write(tmp_path, f"{OK}\n[1, 2]\n")
    with pytest.raises(ConfigError, match=r"--prompts-file: .*p\.jsonl:2: expected a JSON obj"):
        read_prompts_file(f)
    write(tmp_path, '{"prompt": ""}\n')
    with pytest.raises(ConfigError, match=r"--shapes-from: .*p\.jsonl:1: 'prompt' must be"):
        read_prompts_file(f, "--shapes-from")
    write(tmp_path, f"{OK}\n")
    assert read_prompts_file(f) == ["hello"]


class Template:
    """A tokenizer stand-in with a chat template of its own."""

    chat_template = "{{ messages }}"

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool,
                            tokenize: bool) -> str:
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"


def test_render_chat_prompts_refuses_bad_bytes_and_arrays(tmp_path: Path) -> None:
    src = write(tmp_path, b'{"prompt": "ok"}\n{"prompt": "\xff"}\n')
    with pytest.raises(ConfigError, match=r"--src: .*p\.jsonl:2: not UTF-8"):
        render_chat_prompts(src, "unused", tmp_path / "o.jsonl", tokenizer=Template())
    write(tmp_path, '{"prompt": "ok"}\n["x"]\n')
    with pytest.raises(ConfigError, match=r"--src: .*p\.jsonl:2: expected a JSON object"):
        render_chat_prompts(src, "unused", tmp_path / "o.jsonl", tokenizer=Template())
    write(tmp_path, '{"prompt": "ok", "id": "a"}\n')
    out = render_chat_prompts(src, "unused", tmp_path / "o.jsonl", tokenizer=Template())
    assert json.loads(out.read_text())["prompt"] == "<user>ok<assistant>"


def test_read_chat_prompts_refuses_empty_and_non_objects(tmp_path: Path) -> None:
    f = write(tmp_path, "\n\n")
    with pytest.raises(ConfigError, match="empty prompts file"):
        read_chat_prompts(f)
    write(tmp_path, json.dumps({"kind": "code", "prompt": "x"}) + "\n" + "7\n")
    with pytest.raises(ConfigError, match=r"p\.jsonl:2: expected a JSON object"):
        read_chat_prompts(f)
    with pytest.raises(ConfigError, match="no file at"):
        read_chat_prompts(tmp_path / "none.jsonl")
