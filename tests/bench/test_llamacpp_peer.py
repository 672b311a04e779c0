"""``bench peers --peer llamacpp``: the runner's protocol, the flags, the whole bench on a stand-in
``llama_cpp`` package (fast, always run), and the real llama-cpp-python when ``make llamacpp``
has built its venv."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from workbench.__main__ import main
from workbench.bench import llamacpp_peer as lp
from workbench.bench.llamacpp_runner import ProtocolError, parse_request, serve
from workbench.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
REAL_MODEL = ROOT / "data" / "models" / "smollm2-135m-instruct"

# A stand-in for llama-cpp-python with the surface the runner uses: greedy "generation" that
# continues the prompt's last id + 1, 2, ... (mod the vocabulary), the draft model called once
# per token after the first, as llama-cpp-python's speculative loop does.
FAKE_LLAMA_CPP = '''
__version__ = "0.0-fake"

def llama_print_system_info():
    return b"CPU : FAKE = 1"

def llama_model_size(model):
    return 1234

class _Model:
    def desc(self):
        return "fake"

class Llama:
    def __init__(self, model_path, n_ctx, n_threads, n_threads_batch, n_gpu_layers, seed,
                 verbose, draft_model=None):
        self.model, self._model, self._n_ctx = object(), _Model(), n_ctx
        self.draft_model = draft_model
        self.vocab = int(open(model_path).read().strip() or 300)

    def n_vocab(self):
        return self.vocab

    def n_ctx(self):
        return self._n_ctx

    def reset(self):
        pass

    def tokenize(self, text, add_bos=False, special=True):
        return list(text)

    def generate(self, tokens, **kw):
        assert kw["temp"] == 0.0 and kw["reset"] is True
        t = tokens[-1]
        while True:
            t = (t + 1) % self.vocab
            yield t
            if self.draft_model is not None:
                self.draft_model([t])
'''
FAKE_SPECULATIVE = '''
class LlamaPromptLookupDecoding:
    def __init__(self, max_ngram_size=2, num_pred_tokens=10):
        self.num_pred_tokens = num_pred_tokens

    def __call__(self, input_ids, **kwargs):
        return []
'''


@pytest.fixture()
def fake_llama_cpp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A ``llama_cpp`` stand-in on PYTHONPATH (the runner process inherits it)."""
    pkg = tmp_path / "fake" / "llama_cpp"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(FAKE_LLAMA_CPP)
    (pkg / "llama_speculative.py").write_text(FAKE_SPECULATIVE)
    monkeypatch.setenv("PYTHONPATH", str(pkg.parent))
    return pkg.parent


def _serve(lines: list[Any], backend: Any = None) -> list[dict[str, Any]]:
    text = "\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n"
    out = io.StringIO()
    kw = {"backend": backend} if backend is not None else {}
    assert serve(io.StringIO(text), out, **kw) == 0
    return [json.loads(line) for line in out.getvalue().splitlines()]


@pytest.mark.parametrize(("line", "field"), [
    ("not json", "request: not JSON"),
    ("[1, 2]", "request: expected a JSON object"),
    ('{"op": "fly"}', "op: expected one of"),
    ('{"op": "load"}', "'model'"),
    ('{"op": "load", "model": "m.gguf", "threads": 0}', "'threads'"),
    ('{"op": "load", "model": "m.gguf", "threads": true}', "'threads'"),
    ('{"op": "generate", "arm": "eagle", "tokens": [1], "max_new_tokens": 2}', "'arm'"),
    ('{"op": "generate", "arm": "plain", "tokens": [], "max_new_tokens": 2}', "'tokens'"),
    ('{"op": "generate", "arm": "plain", "tokens": [1, -2], "max_new_tokens": 2}', "'tokens'"),
    ('{"op": "generate", "arm": "plain", "tokens": [1], "max_new_tokens": 0}',
     "'max_new_tokens'"),
    ('{"op": "tokenize", "text": ""}', "'text'"),
])
def test_bad_requests_name_the_field(line: str, field: str) -> None:
    with pytest.raises(ProtocolError, match=field):
        parse_request(line)


def test_load_defaults() -> None:
    req = parse_request('{"op": "load", "model": "m.gguf", "threads": 2}')
    assert req == {"op": "load", "model": "m.gguf", "threads": 2, "n_ctx": 2048,
                   "num_pred_tokens": 10, "max_ngram_size": 2}


class _Backend:
    def __init__(self, req: dict[str, Any]) -> None:
        self.info = {"version": "x", "n_vocab": 10, "loaded": req["model"]}

    def generate(self, arm: str, tokens: list[int], n: int) -> dict[str, Any]:
        return {"tokens": [tokens[-1]] * n, "seconds": 0.5, "first_token_s": 0.1,
                "verify_steps": n - 1, "arm": arm}

    def tokenize(self, text: str) -> list[int]:
        return [len(text)]


def test_serve_answers_every_request_and_goes_on_after_errors() -> None:
    replies = _serve([
        {"op": "generate", "arm": "plain", "tokens": [1], "max_new_tokens": 2},
        {"op": "load", "model": "m.gguf", "threads": 1},
        "oops",
        {"op": "generate", "arm": "lookup", "tokens": [4], "max_new_tokens": 3},
        {"op": "tokenize", "text": "abc"},
        {"op": "quit"},
        {"op": "tokenize", "text": "never answered"},
    ], backend=_Backend)
    assert [r["ok"] for r in replies] == [False, True, False, True, True, True]
    assert "no model loaded" in replies[0]["error"] and "'load'" in replies[0]["error"]
    assert replies[1]["loaded"] == "m.gguf"
    assert replies[3]["tokens"] == [4, 4, 4] and replies[3]["arm"] == "lookup"
    assert replies[4]["tokens"] == [3]


def test_end_of_input_exits_cleanly() -> None:
    assert _serve([{"op": "load", "model": "m", "threads": 1}], backend=_Backend)[0]["ok"]


def test_runner_without_llama_cpp_says_how_to_build_it(tmp_path: Path) -> None:
    """The project's own python has no llama_cpp: the runner answers, names `make llamacpp`."""
    gguf = tmp_path / "m.gguf"
    gguf.write_text("300")
    with lp.LlamaCppProcess(sys.executable) as peer:
        with pytest.raises(lp.PeerError, match="make llamacpp"):
            peer.request({"op": "load", "model": str(gguf), "threads": 1})
        with pytest.raises(lp.PeerError, match="no model loaded"):
            peer.request({"op": "tokenize", "text": "x"})


def test_a_dead_runner_is_named(tmp_path: Path) -> None:
    script = tmp_path / "dies.py"
    script.write_text("import sys\nsys.stderr.write('boom from the runner')\nsys.exit(3)\n")
    with lp.LlamaCppProcess(sys.executable, runner=script) as peer:
        with pytest.raises(lp.PeerError, match=r"exited \(3\).*boom from the runner"):
            peer.request({"op": "load", "model": "m.gguf", "threads": 1})


def test_runner_protocol_over_a_stand_in(fake_llama_cpp: Path, tmp_path: Path) -> None:
    """The runner process on the stand-in: stdout carries only the protocol, even when the
    library prints; generate returns exactly max_new_tokens; lookup counts its forwards."""
    gguf = tmp_path / "m.gguf"
    gguf.write_text("50")
    (fake_llama_cpp / "llama_cpp" / "__init__.py").write_text(
        FAKE_LLAMA_CPP + "\nprint('library noise on stdout')\n")
    with lp.LlamaCppProcess(sys.executable) as peer:
        info = peer.request({"op": "load", "model": str(gguf), "threads": 1, "n_ctx": 64})
        assert info["n_vocab"] == 50 and info["model_size"] == 1234 and "FAKE" in \
            info["system_info"]
        plain = peer.request({"op": "generate", "arm": "plain", "tokens": [7, 48],
                              "max_new_tokens": 4})
        assert plain["tokens"] == [49, 0, 1, 2] and plain["seconds"] > 0
        look = peer.request({"op": "generate", "arm": "lookup", "tokens": [7, 48],
                             "max_new_tokens": 4})
        assert look["tokens"] == plain["tokens"] and look["verify_steps"] == 3
        with pytest.raises(lp.PeerError, match="outside the model's vocabulary"):
            peer.request({"op": "generate", "arm": "plain", "tokens": [50],
                          "max_new_tokens": 1})
        with pytest.raises(lp.PeerError, match="n_ctx=64"):
            peer.request({"op": "generate", "arm": "plain", "tokens": [1] * 50,
                          "max_new_tokens": 20})


def test_first_divergence() -> None:
    assert lp.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert lp.first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert lp.first_divergence([1, 2], [1, 2, 3]) == 2


def test_chat_ids_render_the_template_as_the_server_does() -> None:
    class Tok:
        chat_template = "x"

        def apply_chat_template(self, msgs: list[dict[str, str]], add_generation_prompt: bool,
                                tokenize: bool) -> str:
            assert add_generation_prompt and not tokenize
            return f"<user>{msgs[0]['content']}</user><assistant>"

        def encode(self, text: str, add_special_tokens: bool) -> list[int]:
            assert not add_special_tokens
            return [ord(c) for c in text]

    assert lp.chat_ids(Tok(), "hi") == [ord(c) for c in "<user>hi</user><assistant>"]
    # a prompt the template already rendered is not wrapped twice
    assert lp.chat_ids(Tok(), "<user>hi</user><assistant>") == lp.chat_ids(Tok(), "hi")
    Tok.chat_template = None
    assert lp.chat_ids(Tok(), "hi") == [ord("h"), ord("i")]


@pytest.mark.parametrize(("argv", "message"), [
    (["bench", "spec", "--peer", "llamacpp"], "only for `bench peers`"),
    (["bench", "peers", "--gguf", "x.gguf"], "--gguf: only with --peer llamacpp"),
    (["bench", "peers", "--llamacpp-python", "py"], "--llamacpp-python: only with --peer"),
    (["bench", "peers", "--peer", "llamacpp", "--lookup-tokens", "0"], "--lookup-tokens"),
    (["bench", "peers", "--llamacpp-threads", "2"], "--llamacpp-threads: only with --peer"),
    (["bench", "peers", "--peer", "llamacpp", "--llamacpp-threads", "0"],
     "--llamacpp-threads: must be"),
    (["bench", "peers", "--peer", "llamacpp", "--url", "http://x"], "--url"),
    (["bench", "peers", "--peer", "llamacpp", "--llamacpp-python", "/no/such/python"],
     "make llamacpp"),
])
def test_flag_errors_name_the_flag(argv: list[str], message: str,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 1
    assert message in capsys.readouterr().err


def test_gguf_file_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--gguf: no .gguf file"):
        lp.gguf_file(tmp_path, str(tmp_path / "missing.gguf"))
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError, match="not a GGUF checkpoint"):
        lp.gguf_file(tmp_path)
    one = tmp_path / "m.gguf"
    one.write_bytes(b"GGUF")
    assert lp.gguf_file(tmp_path, str(one)) == one


def test_bench_on_a_stand_in(micro_target: Path, random_head: Path, fake_llama_cpp: Path,
                             tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole bench with the stand-in as llama.cpp: four arms, ratios, divergences, and the
    JSON with machine, load and the peer's facts."""
    monkeypatch.setenv("WORKBENCH_AUTOTUNE_CACHE", str(tmp_path / "at.json"))
    gguf = tmp_path / "m.gguf"
    gguf.write_text(str(json.loads((micro_target / "config.json").read_text())["vocab_size"]))
    out = tmp_path / "res"
    code = main(["bench", "peers", "--peer", "llamacpp", "--model", str(micro_target),
                 "--draft", str(random_head), "--gguf", str(gguf), "--llamacpp-python",
                 sys.executable, "--prompts", "2", "--max-new-tokens", "5", "--repeats", "2",
                 "--out", str(out), "--engine", "gemm=dense"])
    assert code == 0
    doc = json.loads((out / "peers_llamacpp.json").read_text())
    assert {"machine", "load", "flags", "peer", "summary", "engine_choices"} <= set(doc)
    assert doc["machine"]["cpu"] and len(doc["load"]["before"]) == 3
    arms = {r["arm"]: r for r in doc["summary"]}
    assert list(arms) == [lp.WB, lp.WB_SPEC, lp.LC, lp.LC_LOOKUP]
    for r in arms.values():
        assert r["tokens"] == 2 * 2 * 5 and r["tok_s"] > 0 and r["tok_s_lo"] <= r["tok_s_hi"]
        assert r["same_as_plain"]
        assert r["decode_tok_s"] > 0 and r["prefill_s"] >= 0  # decode apart from the prefill
    assert arms[lp.WB]["vs_workbench"] == 1.0 and arms[lp.LC]["vs_llamacpp"] == 1.0
    assert arms[lp.WB_SPEC]["identical_to_workbench"] == 2  # lossless: every prompt
    assert arms[lp.LC_LOOKUP]["tokens_per_step"] == 1.0  # the stand-in drafts nothing
    peer = doc["peer"]
    assert peer["llama_cpp"] == "0.0-fake" and peer["threads"] >= 1
    assert peer["llamacpp_weight_bytes"] == 1234 and peer["workbench_weight_bytes"] > 0
    assert peer["divergence"][lp.LC]["prompts"] == 2
    for at in peer["divergence"][lp.LC]["at"]:  # the two tokens where llama.cpp left ours
        assert at["position"] >= 0 and isinstance(at["workbench"], str)
    kind = doc["machine"]["kind"]
    entry = json.loads((out / f"{kind}.json").read_text())["benchmarks"]["peers_llamacpp"]
    assert "--peer llamacpp" in entry["command"]


def test_vocabulary_mismatch_is_refused(micro_target: Path, fake_llama_cpp: Path,
                                        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("WORKBENCH_AUTOTUNE_CACHE", str(tmp_path / "at.json"))
    gguf = tmp_path / "other.gguf"
    gguf.write_text("49152")
    code = main(["bench", "peers", "--peer", "llamacpp", "--model", str(micro_target),
                 "--draft", str(tmp_path / "none"), "--gguf", str(gguf), "--llamacpp-python",
                 sys.executable, "--prompts", "1", "--max-new-tokens", "2", "--out",
                 str(tmp_path / "res"), "--engine", "gemm=dense"])
    assert code == 1
    assert "not the same model" in capsys.readouterr().err


def _real() -> tuple[Path, Path]:
    """The venv's python and the real GGUF, or skip saying how to get them."""
    try:
        python = lp.llamacpp_python()
    except ConfigError:
        pytest.skip("no llama-cpp-python venv: run `make llamacpp`")
    try:
        gguf = lp.gguf_file(REAL_MODEL)
    except (ConfigError, ImportError, OSError) as e:
        pytest.skip(f"the real model's GGUF is not available ({e}): run `make real-model`")
    return python, gguf


def test_real_llama_cpp_generates_greedy_tokens() -> None:
    """llama-cpp-python itself on the real GGUF: plain and prompt lookup give max_new_tokens
    tokens, its tokenizer reads the chat markers as special tokens, its build is reported."""
    python, gguf = _real()
    out = subprocess.run([str(python), "-c", "import llama_cpp"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    with lp.LlamaCppProcess(python) as peer:
        info = peer.request({"op": "load", "model": str(gguf), "threads": 1, "n_ctx": 256})
        assert info["n_vocab"] == 49152 and info["model_size"] > 0 and info["system_info"]
        ids = peer.request({"op": "tokenize", "text": "<|im_start|>user\nHi<|im_end|>\n"})
        assert ids["tokens"][0] == 1  # <|im_start|> is one special token
        prompt = ids["tokens"] + peer.request(
            {"op": "tokenize", "text": "<|im_start|>assistant\n"})["tokens"]
        for arm in ("plain", "lookup"):
            r = peer.request({"op": "generate", "arm": arm, "tokens": prompt,
                              "max_new_tokens": 6})
            assert len(r["tokens"]) == 6 and r["seconds"] > 0
            assert all(0 <= t < 49152 for t in r["tokens"])
