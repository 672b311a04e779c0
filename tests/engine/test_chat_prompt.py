"""Chat messages → token ids: the engine renders the tokenizer's chat template and encodes the
text, as the server's chat endpoint does (one prompt, one token sequence, whichever door)."""

from __future__ import annotations

from transformers import AutoTokenizer

from workbench.engine.prompts import tokenize

MESSAGES = [{"role": "user", "content": "Write a function that adds two numbers."},
            {"role": "assistant", "content": "def add(a, b):\n    return a + b"},
            {"role": "user", "content": "Now three."}]


def test_chat_messages_become_the_rendered_templates_ids() -> None:
    tok = AutoTokenizer.from_pretrained("data/models/wb-target")
    assert tok.chat_template, "the shipped target carries a chat template"
    ids = tokenize(tok, tok.vocab_size, MESSAGES)
    text = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert ids == list(tok.encode(text, add_special_tokens=False))
    assert ids and all(isinstance(i, int) and 0 <= i < len(tok) for i in ids)
    assert "Now three." in tok.decode(ids)
