"""An adversarial catalogue of the Python API: every case asserts its exception (type and the
field the message names) or its clean outcome, then that a normal generate still returns the
text it returned before, with nothing left queued and no KV held. One engine per module.

Also: a fuzz over sampling parameters (every combination yields tokens, never an exception or
NaN), and a request whose numbers fail inside a speculative batch (it alone fails)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import make_engine
from serve.serving import ENGINE_CONFIG, SPEC

import workbench as wb
from workbench import sampler

SP = wb.SamplingParams
SC = wb.SpecConfig
EC = wb.EngineConfig
CANARY = "def parse(path):"


@pytest.fixture(scope="module")
def engine(micro_target: Path, random_head: Path) -> Iterator[wb.Engine]:
    with make_engine(micro_target, random_head, ENGINE_CONFIG) as e:
        yield e


@pytest.fixture(scope="module")
def canary(engine: wb.Engine) -> str:
    return run_canary(engine)


def run_canary(e: wb.Engine) -> str:
    return e.generate([CANARY], SP(max_new_tokens=8, ignore_eos=True), spec=SPEC)[0].text


def still_serves(e: wb.Engine, canary: str) -> None:
    assert not e.has_unfinished() and e.kv_usage()["used_blocks"] == 0
    assert e.spec is None
    assert run_canary(e) == canary


Call = Callable[[wb.Engine], Any]
# name → (call, exception type, regex the message starts with)
RAISES: dict[str, tuple[Call, type[Exception], str]] = {
    # SamplingParams
    "stop_token_ids scalar": (lambda e: SP(stop_token_ids=5), wb.RequestError,
                              "^stop_token_ids"),
    "stop_token_ids -1": (lambda e: SP(stop_token_ids=[-1]), wb.RequestError, "^stop_token_ids"),
    "stop_token_ids str": (lambda e: SP(stop_token_ids=["x"]), wb.RequestError,
                           "^stop_token_ids"),
    "stop_token_ids bool": (lambda e: SP(stop_token_ids=[True]), wb.RequestError,
                            "^stop_token_ids"),
    "stop_token_ids string": (lambda e: SP(stop_token_ids="12"), wb.RequestError,
                              "^stop_token_ids"),
    "ignore_eos 'no'": (lambda e: SP(ignore_eos="no"), wb.RequestError, "^ignore_eos"),
    "ignore_eos 1": (lambda e: SP(ignore_eos=1), wb.RequestError, "^ignore_eos"),
    "no_stop_trim 'yes'": (lambda e: SP(no_stop_trim="yes"), wb.RequestError, "^no_stop_trim"),
    "temperature inf": (lambda e: SP(temperature=math.inf), wb.RequestError, "^temperature"),
    "temperature nan": (lambda e: SP(temperature=math.nan), wb.RequestError, "^temperature"),
    "temperature -1": (lambda e: SP(temperature=-1), wb.RequestError, "^temperature"),
    "temperature str": (lambda e: SP(temperature="1"), wb.RequestError, "^temperature"),
    "top_p 0": (lambda e: SP(top_p=0.0), wb.RequestError, "^top_p"),
    "top_p nan": (lambda e: SP(top_p=math.nan), wb.RequestError, "^top_p"),
    "top_p 1.5": (lambda e: SP(top_p=1.5), wb.RequestError, "^top_p"),
    "min_p 1": (lambda e: SP(min_p=1.0), wb.RequestError, "^min_p"),
    "min_p -0.1": (lambda e: SP(min_p=-0.1), wb.RequestError, "^min_p"),
    "top_k -1": (lambda e: SP(top_k=-1), wb.RequestError, "^top_k"),
    "top_k 2.5": (lambda e: SP(top_k=2.5), wb.RequestError, "^top_k"),
    "seed 2**70": (lambda e: SP(seed=2**70), wb.RequestError, "^seed"),
    "seed -2**64": (lambda e: SP(seed=-(2**64)), wb.RequestError, "^seed"),
    "seed float": (lambda e: SP(seed=1.0), wb.RequestError, "^seed"),
    "max_new_tokens -1": (lambda e: SP(max_new_tokens=-1), wb.RequestError, "^max_new_tokens"),
    "max_new_tokens None": (lambda e: SP(max_new_tokens=None), wb.RequestError,
                            "^max_new_tokens"),
    "stop empty string": (lambda e: SP(stop=("",)), wb.RequestError, "^stop"),
    "stop number": (lambda e: SP(stop=5), wb.RequestError, "^stop"),
    "stop list of numbers": (lambda e: SP(stop=[1]), wb.RequestError, "^stop"),
    "stop lone surrogate": (lambda e: SP(stop="\ud800"), wb.RequestError, "^stop"),
    "from_dict unknown": (lambda e: SP.from_dict({"beam": 2}), wb.RequestError,
                          r"^sampling_params: unknown field\(s\) \['beam'\]"),
    # SpecConfig
    "policy 'always'": (lambda e: SC(policy="always"), wb.ConfigError, "^SpecConfig.policy"),
    "policy 5": (lambda e: SC(policy=5), wb.ConfigError, "^SpecConfig.policy"),
    "num_steps 0": (lambda e: SC(num_steps=0), wb.ConfigError, "^SpecConfig.num_steps"),
    "num_steps True": (lambda e: SC(num_steps=True), wb.ConfigError, "^SpecConfig.num_steps"),
    "topk 0": (lambda e: SC(topk=0), wb.ConfigError, "^SpecConfig.topk"),
    "num_draft_tokens 1": (lambda e: SC(num_draft_tokens=1), wb.ConfigError,
                           "^SpecConfig.num_draft_tokens"),
    "draft_state hot": (lambda e: SC(draft_state="hot"), wb.ConfigError,
                        "^SpecConfig.draft_state"),
    "catchup_window 0": (lambda e: SC(catchup_window=0), wb.ConfigError,
                         "^SpecConfig.catchup_window"),
    "simulate_accept_length nan": (lambda e: SC(simulate_accept_length=math.nan),
                                   wb.ConfigError, "^SpecConfig.simulate_accept_length"),
    "extra list": (lambda e: SC(extra=[]), wb.ConfigError, "^SpecConfig.extra"),
    # EngineConfig
    "max_model_len -5": (lambda e: EC(max_model_len=-5, self_check=False), wb.ConfigError,
                         "^EngineConfig.max_model_len"),
    "max_model_len 1": (lambda e: EC(max_model_len=1), wb.ConfigError,
                        "^EngineConfig.max_model_len"),
    "device gpu": (lambda e: EC(device="gpu"), wb.ConfigError, "^EngineConfig.device"),
    "device None": (lambda e: EC(device=None), wb.ConfigError, "^EngineConfig.device"),
    "dtype int8": (lambda e: EC(dtype="int8"), wb.ConfigError, "^EngineConfig.dtype"),
    "threads -1": (lambda e: EC(threads=-1), wb.ConfigError, "^EngineConfig.threads"),
    "self_check 'no'": (lambda e: EC(self_check="no"), wb.ConfigError,
                        "^EngineConfig.self_check"),
    "page_size 0": (lambda e: EC(page_size=0), wb.ConfigError, "^EngineConfig.page_size"),
    "kv_budget below a page": (lambda e: EC(kv_budget_tokens=8), wb.ConfigError,
                               "^EngineConfig.kv_budget_tokens"),
    # Engine calls
    "generate(None)": (lambda e: e.generate(None), wb.RequestError, "^prompts"),
    "generate([None])": (lambda e: e.generate([None]), wb.RequestError, r"^prompts\[0\]"),
    "generate(['a', 5])": (lambda e: e.generate(["a", 5]), wb.RequestError, r"^prompts\[1\]"),
    "generate(5)": (lambda e: e.generate(5), wb.RequestError, "^prompts"),
    "generate(bytes)": (lambda e: e.generate(b"abc"), wb.RequestError, "^prompts"),
    "generate spec='yes'": (lambda e: e.generate(["a"], spec="yes"), wb.ConfigError, "^spec"),
    "generate empty text": (lambda e: e.generate([""]), wb.RequestError, "^prompt: empty"),
    "generate empty ids": (lambda e: e.generate([[]]), wb.RequestError, "^prompt: empty"),
    "generate id outside vocab": (lambda e: e.generate([[1, 10**9]]), wb.RequestError,
                                  "^prompt: token id"),
    "generate float ids": (lambda e: e.generate([[1.5, 2.0]]), wb.RequestError, "^prompt"),
    "generate lone surrogate": (lambda e: e.generate(["a\udc00"]), wb.RequestError,
                                "^prompt: not valid Unicode"),
    "generate prompt over context": (lambda e: e.generate([[5] * 300]), wb.RequestError,
                                     "^prompt: 300 tokens"),
    "generate sampling count": (lambda e: e.generate(["a", "b"], [SP(), SP(), SP()]),
                                wb.RequestError, "^sampling"),
    "add_request sampling dict": (lambda e: e.add_request("a", {"temperature": 1}),
                                  wb.RequestError, "^sampling"),
    "output(999)": (lambda e: e.output(999), wb.RequestError, "^rid: unknown request 999"),
    "output('x')": (lambda e: e.output("x"), wb.RequestError, "^rid: unknown request"),
    "release(999)": (lambda e: e.release(999), wb.RequestError, "^rid: unknown request 999"),
    "stream spec='yes'": (lambda e: list(e.stream("a", spec="yes")), wb.ConfigError, "^spec"),
}


@pytest.mark.parametrize("name", sorted(RAISES))
def test_refused(name: str, engine: wb.Engine, canary: str) -> None:
    call, exc, match = RAISES[name]
    with pytest.raises(exc, match=match):
        call(engine)
    still_serves(engine, canary)


ACCEPTED: dict[str, wb.SamplingParams] = {
    "stop None": SP(stop=None, max_new_tokens=4),
    "stop_token_ids None": SP(stop_token_ids=None, max_new_tokens=4),
    "top_p 1e-300": SP(temperature=1.0, top_p=1e-300, max_new_tokens=4),
    "top_p 5e-324": SP(temperature=1.0, top_p=5e-324, max_new_tokens=4),
    "min_p 0.999999": SP(temperature=1.0, min_p=0.999999, max_new_tokens=4),
    "temperature 1e-300": SP(temperature=1e-300, max_new_tokens=4),
    "temperature 1e300": SP(temperature=1e300, max_new_tokens=4),
    "seed -2**63": SP(temperature=1.0, seed=-(2**63), max_new_tokens=4),
    "seed 2**64-1": SP(temperature=1.0, seed=2**64 - 1, max_new_tokens=4),
    "stop id outside vocab": SP(stop_token_ids=[10**9], max_new_tokens=4),
    "huge max_new_tokens": SP(max_new_tokens=10**12, ignore_eos=True),
}


@pytest.mark.parametrize("name", sorted(ACCEPTED))
@pytest.mark.parametrize("speculate", [False, True], ids=["plain", "spec"])
def test_accepted(name: str, speculate: bool, engine: wb.Engine, canary: str) -> None:
    out = engine.generate(["def f(x):", [3, 4, 5]], ACCEPTED[name],
                          spec=SPEC if speculate else None)
    for o in out:
        assert o.error is None and o.finish_reason in ("length", "stop"), o
        assert o.token_ids
    still_serves(engine, canary)


GRID = list(itertools.product([1e-30, 1e-6, 0.5, 1.0, 100.0, 1e30],  # temperature
                              [1e-300, 1e-46, 1e-8, 0.5, 1.0],  # top_p
                              [0, 1, 3, 1000],  # top_k
                              [0.0, 0.5, 0.999999]))  # min_p


@pytest.mark.parametrize("speculate", [False, True], ids=["plain", "spec"])
def test_sampling_fuzz_never_fails(speculate: bool, engine: wb.Engine, canary: str) -> None:
    """360 combinations in one continuous batch: tokens every time, never an error."""
    sps = [SP(temperature=t, top_p=p, top_k=k, min_p=m, seed=i, max_new_tokens=3,
              ignore_eos=True) for i, (t, p, k, m) in enumerate(GRID)]
    outs = engine.generate(["def f("] * len(sps), sps, spec=SPEC if speculate else None)
    bad = [(sp, o.error) for sp, o in zip(sps, outs, strict=True)
           if o.error or len(o.token_ids) != 3]
    assert not bad, bad[:3]
    still_serves(engine, canary)


@pytest.mark.parametrize("speculate", [False, True], ids=["plain", "spec"])
def test_process_probs_is_a_distribution_for_every_grid_point(speculate: bool) -> None:
    torch.manual_seed(int(speculate))
    logits = torch.randn(3, 300) * (30.0 if speculate else 1.0)
    for t, p, k, m in GRID:
        probs = sampler.process_probs(logits, SP(temperature=t, top_p=p, top_k=k, min_p=m))
        assert torch.isfinite(probs).all() and (probs >= 0).all()
        assert torch.allclose(probs.sum(-1), torch.ones(3), atol=1e-5)
        # the most likely token (or one tied with it) always keeps its probability
        plain = sampler.process_probs(logits, SP(temperature=t))
        for r in range(3):
            assert plain[r][probs[r] > 0].max() == plain[r].max()


@pytest.mark.parametrize("speculate", [False, True], ids=["plain", "spec"])
def test_a_request_whose_numbers_fail_fails_alone(speculate: bool, engine: wb.Engine,
                                                  canary: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Its probabilities turn NaN mid-generation: that request ends with a sampling error; the
    greedy and sampled requests in the same batch are exactly what they are alone."""
    from workbench.speculative import verify  # the acceptance rule filters with it

    ok_sp = SP(max_new_tokens=12, ignore_eos=True)
    seeded = SP(temperature=0.8, seed=5, max_new_tokens=12, ignore_eos=True)
    spec = SPEC if speculate else None
    alone = [engine.generate([p], s, spec=spec)[0].token_ids
             for p, s in ((CANARY, ok_sp), ([7, 8, 9], ok_sp))]
    real = sampler.process_probs
    calls = {"n": 0}

    def poisoned(logits: torch.Tensor, sp: wb.SamplingParams) -> torch.Tensor:
        p = real(logits, sp)
        if sp.temperature == 0.7:
            calls["n"] += 1
            if calls["n"] > 2:
                return torch.full_like(p, float("nan"))
        return p

    monkeypatch.setattr(sampler, "process_probs", poisoned)
    monkeypatch.setattr(verify, "process_probs", poisoned)
    outs = engine.generate([CANARY, [7, 8, 9], "class A:", "x = ["],
                           [ok_sp, ok_sp, SP(temperature=0.7, seed=1, max_new_tokens=12,
                                             ignore_eos=True), seeded], spec=spec)
    monkeypatch.undo()
    assert outs[2].finish_reason == "error" and "sampling: no valid distribution" in outs[2].error
    assert [o.token_ids for o in outs[:2]] == alone
    assert outs[3].error is None and len(outs[3].token_ids) == 12
    still_serves(engine, canary)


def test_nan_logits_fault_fails_one_request(engine: wb.Engine, canary: str) -> None:
    rid_next = engine.add_request(CANARY, SP(max_new_tokens=2))
    engine.abort(rid_next)
    engine.release(rid_next)
    with wb.faults.inject(f"step:nan_logits@{rid_next + 3}"):
        outs = engine.generate([CANARY, "x = [", "def g("], SP(max_new_tokens=6,
                                                              ignore_eos=True))
    assert [o.finish_reason for o in outs] == ["length", "length", "error"]
    assert "non-finite logits" in outs[2].error
    still_serves(engine, canary)
