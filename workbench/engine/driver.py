"""The loops that drive an engine for a caller: ``Engine.generate`` and ``Engine.stream``.

Both set the engine's spec for their run and put the previous one back, and leave no request
behind: a bad prompt, a step fault or Ctrl-C aborts every request they queued.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from workbench.config import SamplingParams, SpecConfig
from workbench.core import LogprobParams, RequestOutput
from workbench.engine.prompts import Prompt, prompt_batch
from workbench.engine.stops import hold_back, text_stops
from workbench.errors import RequestError

if TYPE_CHECKING:
    from workbench.engine.engine import Engine


def generate(engine: Engine, prompts: Prompt | Sequence[Prompt],
             sampling: SamplingParams | Sequence[SamplingParams] | None,
             spec: SpecConfig | None, progress: bool,
             logprobs: LogprobParams | None = None) -> list[RequestOutput]:
    engine.check_open()
    plist, sps = prompt_batch(prompts, sampling)  # all checked before anything is queued
    previous = engine.spec
    engine.set_spec(spec)
    rids: list[int] = []
    try:
        for p, s in zip(plist, sps, strict=True):
            rids.append(engine.add_request(p, s, logprobs=logprobs))
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(rids), desc="generate", unit="req")
        pending = set(rids)
        while pending:
            engine.step()
            # by state, not by step outputs: a request aborted outside a step has none
            done = {r for r in pending if engine.requests[r].finished}
            pending -= done
            if bar is not None:
                bar.update(len(done))
        if bar is not None:
            bar.close()
        return [engine.output(r) for r in rids]
    finally:
        for r in rids:  # a bad prompt, a step fault or Ctrl-C leaves no request behind
            engine.abort(r)
        engine.spec = previous


def stream(engine: Engine, prompt: Prompt, sampling: SamplingParams | None,
           spec: SpecConfig | None) -> Iterator[str]:
    previous = engine.spec
    engine.set_spec(spec)
    try:
        rid = engine.add_request(prompt, sampling)
    except BaseException:
        engine.spec = previous  # a refused prompt leaves the engine's spec as it was
        raise
    text = ""
    try:
        while True:
            engine.step()
            req = engine.requests[rid]
            if engine.tokenizer is not None:
                full = engine.text_of(req)
                if not req.finished:  # a partial stop string may still complete
                    full = hold_back(full, text_stops(req.sampling))
                if not full.endswith("\ufffd") and len(full) > len(text):
                    yield full[len(text):]
                    text = full
            if req.finished:
                if req.error:
                    raise RequestError(req.error)
                return
    finally:
        engine.abort(rid)
        engine.spec = previous
