"""llama.cpp beside the workbench, bs=1 greedy, on the same GGUF file and the same prompt tokens.

``python -m workbench bench peers --peer llamacpp`` runs four arms interleaved per prompt, so
every ratio comes from one stretch of the machine's life:

* ``workbench``: the engine on ``--model`` (the GGUF dequantised by ``workbench.models.gguf``,
  or its Q4_0/Q4_1/Q8_0 codes run packed: ``--engine weights=packed``), plain decoding;
* ``workbench eagle3``: the same with the ``--draft`` EAGLE-3 head at ``--spec`` (when there is
  one);
* ``llama.cpp``: llama-cpp-python (``make llamacpp``: built from source, CPU) on the GGUF file
  as it is — quantised blocks in memory, int8 dot products — ``threads`` = the process's
  cores, in a process of its own (``workbench/bench/llamacpp_runner.py``, the venv's python);
* ``llama.cpp prompt lookup``: llama-cpp-python's one speculative mode,
  ``draft_model=LlamaPromptLookupDecoding`` (n-gram lookup in the context, verified by the
  target). The binding ships no other drafter (no draft model, no EAGLE).

Every arm gets the same token ids: the prompt rendered with the tokenizer's chat template (a
user turn, generation prompt added) and encoded with the workbench tokenizer, as the server's
chat endpoint does; every call prefills in full (llama.cpp's prefix reuse is reset). The
outputs are compared token by token: ``first_divergence`` is the first position where an arm's
greedy tokens leave the ``workbench`` arm's (None: the same for all ``max_new_tokens``).
Quantised arithmetic (llama.cpp: int8 activations) against ours (float32 or bf16 activations)
picks another argmax at near-ties, so llama.cpp diverging is a finding; the speculative arms
must match their own plain arm (``same_as_plain``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import pandas as pd

from workbench.bench import cli_args as args
from workbench.bench.cli_output import (
    finish,
    json_records,
    print_choices,
    run_choices,
    show,
    stamp,
)
from workbench.bench.sanity import LoadSampler, mark, sanity_flags
from workbench.config import SamplingParams
from workbench.engine import affinity
from workbench.errors import ConfigError
from workbench.machine import machine_info
from workbench.models.gguf import find_gguf
from workbench.models.loader import resolve_path
from workbench.stats import mean_ci

if TYPE_CHECKING:
    from workbench.engine.engine import Engine

RUNNER = Path(__file__).with_name("llamacpp_runner.py")
CPUS_ENV = "WORKBENCH_LLAMACPP_CPUS"  # read by the runner (which imports nothing of ours)
VENV_PYTHON = Path.home() / ".cache" / "workbench" / "llamacpp-venv" / "bin" / "python"
PYTHON_ENV = "WORKBENCH_LLAMACPP_PYTHON"
PEERS = ("hf", "llamacpp")
WB, WB_SPEC, LC, LC_LOOKUP = "workbench", "workbench eagle3", "llama.cpp", "llama.cpp prompt lookup"
PLAIN_OF = {WB_SPEC: WB, LC_LOOKUP: LC}


class PeerError(RuntimeError):
    """The llama.cpp runner refused a request or died (the message says which and why)."""


def llamacpp_python(explicit: str | None = None) -> Path:
    """The python of llama-cpp-python's venv: ``explicit``, else ``$WORKBENCH_LLAMACPP_PYTHON``,
    else the ``make llamacpp`` venv; ConfigError naming the fix when it is missing."""
    raw = explicit or os.environ.get(PYTHON_ENV) or str(VENV_PYTHON)
    p = Path(raw).expanduser()
    if not p.is_file():
        raise ConfigError(f"--peer llamacpp: no llama-cpp-python venv python at {p}; "
                          "run `make llamacpp` (or set " + PYTHON_ENV + ")")
    if raw == str(VENV_PYTHON) and not any(VENV_PYTHON.parents[1].glob(".installed-*")):
        raise ConfigError(f"--peer llamacpp: the venv at {VENV_PYTHON.parents[1]} is not built "
                          "to the end (no .installed-* stamp); run `make llamacpp`")
    return p


def gguf_file(model: str | Path, explicit: str | None = None) -> Path:
    """The GGUF file llama.cpp loads: ``--gguf``, else the file ``--model`` names or points to
    (a ``.gguf`` file, a folder holding one, a ``gguf.json`` pointer folder)."""
    if explicit:
        p = Path(explicit).expanduser()
        if not p.is_file() or p.suffix != ".gguf":
            raise ConfigError(f"--gguf: no .gguf file at {p}")
        return p

    p = Path(model)
    # a pointer folder (gguf.json) names the fetched file in the user cache
    found = find_gguf(resolve_path(p) if p.is_dir() and (p / "gguf.json").is_file() else p)
    if found is None:
        raise ConfigError(f"--peer llamacpp: --model {model} is not a GGUF checkpoint (no .gguf "
                          "file there); pass the GGUF file llama.cpp should load with --gguf")
    return Path(found)


def chat_ids(tokenizer: Any, prompt: str) -> list[int]:
    """``prompt`` as a user turn through the tokenizer's chat template (generation prompt
    added), encoded without extra special tokens — as the server's chat endpoint does. Text
    without a template, or already rendered by it (it starts as the template renders a user
    turn: a prompts file of rendered chats), is encoded as it is."""
    if getattr(tokenizer, "chat_template", None):
        mark = "\x00prompt\x00"
        probe = tokenizer.apply_chat_template([{"role": "user", "content": mark}],
                                              add_generation_prompt=True, tokenize=False)
        head = str(probe).split(mark)[0]
        if not (head and prompt.startswith(head)):
            prompt = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                   add_generation_prompt=True, tokenize=False)
    return list(tokenizer.encode(prompt, add_special_tokens=False))


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first position where ``a`` and ``b`` differ (a length difference counts at the
    shorter one's end); None when they are equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


class LlamaCppProcess:
    """The runner (``llamacpp_runner.py``) in its own process, one JSON line per request.

    Use as a context manager; ``request`` returns the reply object or raises PeerError with the
    runner's error (or, when it died, its exit code and the tail of its stderr)."""

    def __init__(self, python: str | Path, runner: str | Path = RUNNER,
                 cpus: Sequence[int] | None = None) -> None:
        env = dict(os.environ)
        if cpus:  # the runner sets its own affinity: this process may be pinned to fewer
            env[CPUS_ENV] = ",".join(str(c) for c in sorted(cpus))
        self._stderr: IO[bytes] = tempfile.TemporaryFile()
        self.proc = subprocess.Popen([str(python), str(runner)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._stderr, text=True,
                                     bufsize=1, env=env)

    def __enter__(self) -> LlamaCppProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _stderr_tail(self, chars: int = 2000) -> str:
        self._stderr.seek(0)
        return self._stderr.read().decode("utf-8", "replace")[-chars:]

    def request(self, obj: dict[str, Any]) -> dict[str, Any]:
        if self.proc.poll() is not None or self.proc.stdin is None or self.proc.stdout is None:
            raise PeerError(f"llama.cpp runner: exited ({self.proc.returncode}) before "
                            f"{obj.get('op')!r}: {self._stderr_tail()}")
        try:
            self.proc.stdin.write(json.dumps(obj) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise PeerError(f"llama.cpp runner: died before {obj.get('op')!r}: "
                            f"{self._stderr_tail()}") from None
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait(timeout=30)
            raise PeerError(f"llama.cpp runner: exited ({code}) during {obj.get('op')!r}: "
                            f"{self._stderr_tail()}")
        reply = json.loads(line)
        if not reply.get("ok"):
            raise PeerError(f"llama.cpp runner: {reply.get('error')}")
        return dict(reply)

    def close(self) -> None:
        """Ask the runner to quit (closing its stdin ends it too), then reap it; killed when it
        has not exited 30 s later."""
        if self.proc.poll() is None and self.proc.stdin is not None:
            try:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.close()
            except BrokenPipeError:
                self.proc.stdin = None  # it died meanwhile: wait() below collects its code
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._stderr.close()


def run_llamacpp_peers(engine: Engine, gguf: str | Path, prompts: list[str], *,
                       python: str | Path, max_new_tokens: int = 128, spec: Any = None,
                       repeats: int = 1, threads: int | None = None,
                       num_pred_tokens: int = 10) -> tuple[pd.DataFrame, pd.DataFrame, dict]:
    """Returns (per-prompt rows, summary, peer facts: llama.cpp's version, build features,
    threads, weights' bytes, tokenizer agreement, first divergences)."""
    if repeats < 1:
        raise ConfigError(f"--repeats: must be >= 1, got {repeats}")
    if not prompts:
        raise ConfigError("--peer llamacpp: no prompts")

    # threads = cores: every core this process started with (the engine may have pinned it to
    # fewer since; the runner sets its own affinity back to all of them)
    cpus = sorted(affinity.HOME) if affinity.HOME else list(range(os.cpu_count() or 1))
    threads = threads or len(cpus)
    tok = engine.tokenizer
    ids = [chat_ids(tok, p) for p in prompts]
    n_ctx = max(len(i) for i in ids) + max_new_tokens + 64
    sp = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    with LlamaCppProcess(python, cpus=cpus) as peer:
        info = peer.request({"op": "load", "model": str(gguf), "threads": threads,
                             "n_ctx": n_ctx, "num_pred_tokens": num_pred_tokens})
        vocab = engine.model_config.vocab_size if engine.model_config is not None else None
        if info["n_vocab"] != vocab:
            raise ConfigError(f"--peer llamacpp: {gguf} has {info['n_vocab']} tokens, the "
                              f"engine's model {vocab}: not the same model (pass its GGUF with "
                              "--gguf)")
        rendered = tok.decode(ids[0])
        tokenizer_agrees = peer.request({"op": "tokenize", "text": rendered})["tokens"] == ids[0]
        steps: dict[str, float] = {}  # the last call's target forwards after the prefill

        def lc(arm: str) -> Any:
            def go(p: int) -> list[int]:
                r = peer.request({"op": "generate", "arm": arm, "tokens": ids[p],
                                  "max_new_tokens": max_new_tokens})
                steps["steps"] = int(r["verify_steps"])
                steps["runner_s"] = float(r["seconds"])
                steps["first_token_s"] = float(r["first_token_s"])
                return list(r["tokens"])
            return go

        def wb_arm(with_spec: Any) -> Any:
            def go(p: int) -> list[int]:
                out = engine.generate([ids[p]], sp, spec=with_spec)[0]
                steps["steps"] = out.metrics.verify_ct + out.metrics.plain_steps
                if out.metrics.ttft is not None:
                    steps["first_token_s"] = out.metrics.ttft
                return list(out.token_ids)
            return go

        arms = {WB: wb_arm(None)}
        if spec is not None and engine.runner.draft is not None:
            arms[WB_SPEC] = wb_arm(spec)
        arms[LC] = lc("plain")
        arms[LC_LOOKUP] = lc("lookup")
        startup: dict[str, float] = {}
        for name, fn in arms.items():  # warm-up: the first call of every arm
            t0 = time.perf_counter()
            fn(0)
            startup[name] = time.perf_counter() - t0
        rows = []
        for r in range(repeats):
            for i in range(len(prompts)):
                outs: dict[str, list[int]] = {}
                for name, fn in arms.items():
                    steps.clear()
                    t0 = time.perf_counter()
                    out = fn(i)
                    dt = time.perf_counter() - t0
                    outs[name] = out
                    plain = outs.get(PLAIN_OF.get(name, name), out)
                    rows.append({"repeat": r, "prompt": i, "arm": name, "prompt_tokens":
                                 len(ids[i]), "tokens": len(out), "seconds": dt,
                                 "tok_s": len(out) / dt,
                                 "runner_s": steps.get("runner_s"),
                                 "first_token_s": steps.get("first_token_s"),
                                 "steps": steps.get("steps"),
                                 "same_as_plain": out == plain,
                                 "first_divergence": first_divergence(out, outs[WB]),
                                 "tokens_ids": out if r == 0 else None})
    df = pd.DataFrame(rows)
    summary = _summary(df, list(arms), startup, repeats)
    facts = {"llama_cpp": info["version"], "system_info": info["system_info"],
             "threads": threads, "gguf": str(gguf), "n_ctx": n_ctx,
             "num_pred_tokens": num_pred_tokens, "tokenizer_agrees": tokenizer_agrees,
             "llamacpp_weight_bytes": info.get("model_size"),
             "workbench_weight_bytes": _weight_bytes(engine),
             "workbench_weights": engine.choices.get("weights", {}).get("choice", "dequant"),
             "chat_template": bool(getattr(tok, "chat_template", None)),
             "divergence": _divergences(df, getattr(tok, "decode", None))}
    return df.drop(columns=["tokens_ids"]), summary, facts


def _weight_bytes(engine: Engine) -> int | None:
    """Bytes of the engine's target weights as its GEMMs read them: the packed codes and scales
    on packed weights (``models/quant.py``), else every parameter once (tied ones once)."""
    model = getattr(engine.runner, "target", None)
    if model is None or not hasattr(model, "parameters"):
        return None
    if getattr(model, "gemm", "") == "packed":
        total = 0
        for w in [x for f in model._fast for x in (f.qkv, f.o, f.gate_up, f.down)] + \
                [model._head]:
            parts = (w.packed, w.scales_zeros) if hasattr(w, "packed") else (w,)
            total += sum(t.numel() * t.element_size() for t in parts)
        return total
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def _divergences(df: pd.DataFrame, decode: Any = None) -> dict[str, Any]:
    """Per arm: the first divergence from ``workbench`` of each prompt (first repeat) and, with
    ``decode`` (ids → text), the two tokens there (``at``: prompt, position, workbench's token,
    the arm's)."""
    first = df[df["repeat"] == 0]
    ref = {int(r.prompt): r.tokens_ids for r in first[first["arm"] == WB].itertuples()}
    out: dict[str, Any] = {}
    for arm, g in first.groupby("arm", sort=False):
        pos = [None if pd.isna(v) else int(v) for v in g["first_divergence"]]
        at = []
        for i, ids, p in zip(g["prompt"], g["tokens_ids"], pos, strict=True):
            w = ref.get(int(i))
            if decode is not None and p is not None and w is not None \
                    and p < min(len(ids), len(w)):
                at.append({"prompt": int(i), "position": p, "workbench": decode(w[p:p + 1]),
                           "arm": decode(ids[p:p + 1])})
        out[str(arm)] = {"per_prompt": pos, "identical_prompts": sum(v is None for v in pos),
                         "prompts": len(pos), "at": at}
    return out


def _summary(df: pd.DataFrame, arms: list[str], startup: dict[str, float],
             repeats: int) -> pd.DataFrame:
    g = df.groupby("arm", sort=False).agg(tokens=("tokens", "sum"), seconds=("seconds", "sum"),
                                          steps=("steps", "sum"),
                                          same_as_plain=("same_as_plain", "all"))
    g = g.loc[arms]
    g["tok_s"] = g["tokens"] / g["seconds"]
    # decode tokens per target forward after the prefill (1.0 for a plain arm)
    n_prompts = df.groupby("arm", sort=False)["prompt"].count()
    g["tokens_per_step"] = [(g.loc[a, "tokens"] - n_prompts[a]) / g.loc[a, "steps"]
                            if g.loc[a, "steps"] else None for a in g.index]
    g = g.drop(columns=["steps"])
    # decode alone: the tokens after the first over the time after it (the prefill, which
    # grows with the prompt, left out)
    dec = df.dropna(subset=["first_token_s"]).groupby("arm", sort=False)
    after = (dec["seconds"].sum() - dec["first_token_s"].sum())
    g["decode_tok_s"] = [(dec["tokens"].sum()[a] - dec["prompt"].count()[a]) / after[a]
                         if a in after.index and after[a] > 0 else None for a in g.index]
    g["prefill_s"] = [dec["first_token_s"].mean()[a] if a in after.index else None
                      for a in g.index]
    for ref, col in ((WB, "vs_workbench"), (LC, "vs_llamacpp")):
        g[col] = g["tok_s"] / g.loc[ref, "tok_s"]
    first = df[df["repeat"] == 0]
    div = first.groupby("arm", sort=False)["first_divergence"]
    g["identical_to_workbench"] = [int(div.get_group(a).isna().sum()) for a in g.index]
    g["first_divergence_min"] = [div.get_group(a).min() for a in g.index]
    g["startup_s"] = [startup[a] for a in g.index]
    if repeats > 1:
        per = df.groupby(["arm", "repeat"], sort=False)[["tokens", "seconds"]].sum()
        per["tok_s"] = per["tokens"] / per["seconds"]
        for arm in g.index:
            _, lo, hi = mean_ci(per.loc[arm, "tok_s"].tolist())
            g.loc[arm, ["tok_s_lo", "tok_s_hi"]] = [lo, hi]
            for ref, col in ((WB, "vs_workbench"), (LC, "vs_llamacpp")):
                ratio = per.loc[arm, "tok_s"] / per.loc[ref, "tok_s"]
                _, lo, hi = mean_ci(ratio.tolist())
                g.loc[arm, [f"{col}_lo", f"{col}_hi"]] = [lo, hi]
    return g.reset_index()


def check_args(ns: argparse.Namespace) -> None:
    """The flags of ``--peer llamacpp`` before anything is loaded (errors name the flag)."""
    peer = getattr(ns, "peer", "hf")
    if peer not in PEERS:
        raise ConfigError(f"--peer: expected one of {list(PEERS)}, got {peer!r}")
    if peer != "llamacpp":
        for flag in ("gguf", "llamacpp_python", "llamacpp_threads"):
            if getattr(ns, flag, None):
                raise ConfigError(f"--{flag.replace('_', '-')}: only with --peer llamacpp")
        return
    if ns.which != "peers":
        raise ConfigError(f"--peer llamacpp: only for `bench peers`, not `bench {ns.which}`")
    if getattr(ns, "url", None):
        raise ConfigError("--peer llamacpp: runs both sides in-process; --url is not supported")
    threads = getattr(ns, "llamacpp_threads", None)
    if threads is not None and (not isinstance(threads, int) or threads < 1):
        raise ConfigError(f"--llamacpp-threads: must be an integer >= 1, got {threads!r}")
    lookup = getattr(ns, "lookup_tokens", 10)
    if not isinstance(lookup, int) or lookup < 1:
        raise ConfigError(f"--lookup-tokens: must be an integer >= 1, got {lookup!r}")


def bench_llamacpp(ns: argparse.Namespace) -> int:
    """``python -m workbench bench peers --peer llamacpp``: run, print, save, stamp."""
    check_args(ns)
    python = llamacpp_python(getattr(ns, "llamacpp_python", None))
    gguf = gguf_file(ns.model, getattr(ns, "gguf", None))
    shape = args.spec(ns)
    repeats = args.repeats(ns)
    prompts = args.prompts(ns)
    engine = args.engine(ns, need_draft=False)
    try:
        spec = shape if engine.runner.draft is not None else None
        print_choices(engine)
        with LoadSampler() as load:
            rows, summary, facts = run_llamacpp_peers(
                engine, gguf, prompts, python=python, max_new_tokens=args.max_new(ns),
                spec=spec, repeats=repeats, num_pred_tokens=getattr(ns, "lookup_tokens", 10),
                threads=getattr(ns, "llamacpp_threads", None))
        choices = run_choices(engine)
    finally:
        engine.close()
    flags = sanity_flags(summary, load=load.as_dict())
    summary = mark(summary, flags)
    show(f"llama.cpp {facts['llama_cpp']} ({facts['threads']} threads) beside the workbench, "
         "bs=1, greedy (ratios measured side by side)", summary)
    print(f"llama.cpp build: {facts['system_info']}")
    mb = {k: (v or 0) / 1e6 for k, v in facts.items() if k.endswith("weight_bytes")}
    read = "as its packed GEMMs read them" if facts.get("workbench_weights") == "packed" \
        else "dequantised"
    print(f"weights: llama.cpp {mb['llamacpp_weight_bytes']:.1f} MB as stored in the GGUF "
          f"(quantised blocks), workbench {mb['workbench_weight_bytes']:.1f} MB {read}")
    for arm, d in facts["divergence"].items():
        if arm != WB:
            print(f"{arm}: {d['identical_prompts']}/{d['prompts']} prompts token-identical to "
                  f"the workbench; first divergence per prompt {d['per_prompt']}")
            for at in d["at"]:
                print(f"  prompt {at['prompt']} at {at['position']}: workbench "
                      f"{at['workbench']!r}, {arm} {at['arm']!r}")
    if not facts["tokenizer_agrees"]:
        print("note: the GGUF's own tokenizer encodes the rendered prompt differently; every arm "
              "gets the workbench tokenizer's ids")
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    rows.to_csv(out / "peers_llamacpp_per_prompt.csv", index=False)
    summary.to_csv(out / "peers_llamacpp.csv", index=False)
    path = out / "peers_llamacpp.json"

    path.write_text(json.dumps({"machine": machine_info(), "peer": facts,
                                "spec": ns.spec if spec is not None else None,
                                "max_new_tokens": args.max_new(ns), "repeats": repeats,
                                "summary": json_records(summary)}, indent=2, default=str) + "\n")
    stamp(path, flags, load.as_dict(), {"engine_choices": choices}, "peers_llamacpp", summary)
    print(f"\nresults: {path}")
    # our EAGLE-3 is lossless by construction: its tokens differ from our plain arm's only by a
    # bug. llama.cpp's prompt lookup verifies a drafted run in one batched evaluation, whose
    # kernels add in another order than one-token decoding: at a near-tie it may pick another
    # token than its own plain arm (a finding, printed, not a failure)
    ok = bool(summary.loc[summary["arm"] == WB_SPEC, "same_as_plain"].all())
    if not ok:
        print("workbench eagle3's tokens differ from the workbench's own plain arm's",
              file=sys.stderr)
    lc_look = summary.loc[summary["arm"] == LC_LOOKUP, "same_as_plain"]
    if not lc_look.empty and not bool(lc_look.all()):
        print("llama.cpp prompt lookup's tokens differ from llama.cpp plain's on some prompt "
              "(its batched verification adds in another order than one-token decoding)")
    return finish(ns, ok, flags)
