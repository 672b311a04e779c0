"""llama.cpp's side of ``python -m workbench bench peers --peer llamacpp``: a child process.

Runs in llama-cpp-python's own venv (``make llamacpp``), started as
``<that venv>/bin/python workbench/bench/llamacpp_runner.py``; it imports only the standard
library and ``llama_cpp`` (that venv has neither torch nor the workbench). One JSON object per
line on stdin, one reply per line on stdout; whatever the library prints goes to stderr (the
process's stdout file descriptor is pointed at stderr, the protocol keeps a copy of it).

* ``{"op": "load", "model": "X.gguf", "threads": 2, "n_ctx": 2048, "num_pred_tokens": 10,
  "max_ngram_size": 2}`` → ``{"ok": true, "version", "n_vocab", "model_size" (bytes of the
  weights as llama.cpp holds them), "model_desc", "system_info" (the CPU features it was built
  with), "threads", "n_ctx", "load_s"}``: two contexts on the one mmap'd file, ``plain`` and
  ``lookup`` (``draft_model=LlamaPromptLookupDecoding``: llama-cpp-python's one speculative
  mode; it has no draft-model or EAGLE drafter);
* ``{"op": "generate", "arm": "plain" | "lookup", "tokens": [...], "max_new_tokens": n}`` →
  ``{"ok": true, "tokens", "seconds", "first_token_s", "verify_steps"}``: greedy
  (temperature 0, no penalties), exactly ``n`` new tokens (EOS does not stop it: the workbench
  arms run with ``ignore_eos``), from a full prefill (the KV of the previous call is dropped,
  no prefix reuse); ``seconds`` is the call's own time, prefill included; ``verify_steps`` the
  target evaluations after the prefill (with lookup, each checks a drafted run);
* ``{"op": "tokenize", "text": "..."}`` → ``{"ok": true, "tokens"}``: the GGUF's own tokenizer
  (special tokens parsed, no BOS added);
* ``{"op": "quit"}`` → ``{"ok": true}``, and the process exits (so does end of input).

A bad request is answered ``{"ok": false, "error": "..."}`` naming the field, and the runner
keeps serving. ``$WORKBENCH_LLAMACPP_CPUS`` (``0,1,...``) sets the process's CPU affinity
first: the parent may have been pinned to fewer cores than the machine gives the benchmark.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from typing import IO, Any

ARMS = ("plain", "lookup")
OPS = ("load", "generate", "tokenize", "quit")
LOAD_DEFAULTS = {"n_ctx": 2048, "num_pred_tokens": 10, "max_ngram_size": 2}
CPUS_ENV = "WORKBENCH_LLAMACPP_CPUS"


class ProtocolError(ValueError):
    """A request the runner refuses; the message names the field."""


def _int(req: dict[str, Any], key: str, lo: int) -> int:
    v = req.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v < lo:
        raise ProtocolError(f"{key!r}: expected an integer >= {lo}, got {v!r}")
    return v


def parse_request(line: str) -> dict[str, Any]:
    """One request line → the checked request (load's defaults filled in); ProtocolError
    naming the field otherwise."""
    try:
        req = json.loads(line)
    except json.JSONDecodeError as e:
        raise ProtocolError(f"request: not JSON ({e})") from None
    if not isinstance(req, dict):
        raise ProtocolError(f"request: expected a JSON object, got {type(req).__name__}")
    op = req.get("op")
    if op not in OPS:
        raise ProtocolError(f"op: expected one of {list(OPS)}, got {op!r}")
    if op == "load":
        req = {**req, **{k: req.get(k, v) for k, v in LOAD_DEFAULTS.items()}}
        if not isinstance(req.get("model"), str) or not req["model"]:
            raise ProtocolError(f"'model': expected a GGUF file path, got {req.get('model')!r}")
        for key in ("threads", "n_ctx", "num_pred_tokens", "max_ngram_size"):
            _int(req, key, 1)
    elif op == "generate":
        if req.get("arm") not in ARMS:
            raise ProtocolError(f"'arm': expected one of {list(ARMS)}, got {req.get('arm')!r}")
        tokens = req.get("tokens")
        if not isinstance(tokens, list) or not tokens:
            raise ProtocolError("'tokens': expected a non-empty list of token ids")
        for t in tokens:
            if not isinstance(t, int) or isinstance(t, bool) or t < 0:
                raise ProtocolError(f"'tokens': token ids are integers >= 0, got {t!r}")
        _int(req, "max_new_tokens", 1)
    elif op == "tokenize":
        if not isinstance(req.get("text"), str) or not req["text"]:
            raise ProtocolError(f"'text': expected a non-empty string, got {req.get('text')!r}")
    return dict(req)


class LlamaBackend:
    """The GGUF loaded by llama-cpp-python: a ``plain`` and a ``lookup`` context."""

    def __init__(self, req: dict[str, Any]) -> None:
        model = req["model"]
        if not os.path.isfile(model):
            raise ProtocolError(f"'model': no file at {model}")
        try:
            import llama_cpp
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
        except ImportError as e:
            raise ProtocolError(f"llama_cpp: cannot import it with {sys.executable} ({e}); "
                                "run `make llamacpp` and use its venv's python") from None
        self.n_ctx = req["n_ctx"]
        t0 = time.perf_counter()
        common = dict(model_path=model, n_ctx=self.n_ctx, n_threads=req["threads"],
                      n_threads_batch=req["threads"], n_gpu_layers=0, seed=0, verbose=False)
        self.drafts = 0
        lookup = LlamaPromptLookupDecoding(max_ngram_size=req["max_ngram_size"],
                                           num_pred_tokens=req["num_pred_tokens"])
        self.llms = {"plain": llama_cpp.Llama(**common),
                     "lookup": llama_cpp.Llama(**common, draft_model=self._counted(lookup))}
        load_s = time.perf_counter() - t0
        plain = self.llms["plain"]
        self.n_vocab = int(plain.n_vocab())
        info = llama_cpp.llama_print_system_info()
        self.info = {"version": getattr(llama_cpp, "__version__", "unknown"),
                     "n_vocab": self.n_vocab,
                     "model_size": int(llama_cpp.llama_model_size(plain.model)),
                     "model_desc": str(plain._model.desc()),
                     "system_info": info.decode() if isinstance(info, bytes) else str(info),
                     "threads": req["threads"], "n_ctx": self.n_ctx, "load_s": load_s,
                     "num_pred_tokens": req["num_pred_tokens"],
                     "max_ngram_size": req["max_ngram_size"],
                     "cpus": sorted(os.sched_getaffinity(0))
                     if hasattr(os, "sched_getaffinity") else None}

    def _counted(self, draft: Callable[..., Any]) -> Callable[..., Any]:
        """The draft model, counting its calls: llama-cpp-python drafts once before every
        target evaluation after the prefill."""
        def call(input_ids: Any, /, **kw: Any) -> Any:
            self.drafts += 1
            return draft(input_ids, **kw)
        return call

    def generate(self, arm: str, tokens: list[int], n: int) -> dict[str, Any]:
        if max(tokens) >= self.n_vocab:
            raise ProtocolError(f"'tokens': id {max(tokens)} outside the model's vocabulary "
                                f"[0, {self.n_vocab})")
        if len(tokens) + n > self.n_ctx:
            raise ProtocolError(f"'max_new_tokens': {len(tokens)} prompt + {n} new tokens do not "
                                f"fit n_ctx={self.n_ctx} (load with a larger n_ctx)")
        llm = self.llms[arm]
        llm.reset()  # n_tokens = 0: generate prefills the whole prompt
        self.drafts = 0
        out: list[int] = []
        t0 = time.perf_counter()
        first = 0.0
        gen = llm.generate(tokens, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, typical_p=1.0,
                           repeat_penalty=1.0, reset=True)
        for tok in gen:
            if not out:
                first = time.perf_counter() - t0
            out.append(int(tok))
            if len(out) == n:
                break
        gen.close()
        dt = time.perf_counter() - t0
        steps = self.drafts if arm == "lookup" else len(out) - 1
        return {"tokens": out, "seconds": dt, "first_token_s": first, "verify_steps": steps}

    def tokenize(self, text: str) -> list[int]:
        toks = self.llms["plain"].tokenize(text.encode("utf-8"), add_bos=False, special=True)
        return [int(t) for t in toks]


def serve(inp: IO[str], out: IO[str], backend: Callable[[dict[str, Any]], Any] = LlamaBackend
          ) -> int:
    """Answer every request line on ``inp`` on ``out`` until ``quit`` or end of input."""
    model: Any = None
    for line in inp:
        if not line.strip():
            continue
        op = None
        try:
            req = parse_request(line)
            op = req["op"]
            if op == "load":
                if model is not None:
                    raise ProtocolError("op: a model is already loaded")
                model = backend(req)
                reply = {"ok": True, **model.info}
            elif op == "quit":
                reply = {"ok": True}
            elif model is None:
                raise ProtocolError(f"op: no model loaded; send {{'op': 'load'}} before {op!r}")
            elif op == "generate":
                reply = {"ok": True, **model.generate(req["arm"], req["tokens"],
                                                      req["max_new_tokens"])}
            else:
                reply = {"ok": True, "tokens": model.tokenize(req["text"])}
        except ProtocolError as e:
            reply = {"ok": False, "error": str(e)}
        out.write(json.dumps(reply) + "\n")
        out.flush()
        if op == "quit":
            break
    return 0


def main() -> int:
    cpus = os.environ.get(CPUS_ENV)
    if cpus:
        os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})
    # the protocol keeps the real stdout; the library's prints (Python's and C's) go to stderr
    proto = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    sys.stdout = sys.stderr
    return serve(sys.stdin, proto)


if __name__ == "__main__":
    sys.exit(main())
