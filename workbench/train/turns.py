"""What writes self-distillation's turns: the workbench engine (the default, on the CPU), or
transformers' ``generate`` on a device (``--backend transformers --device cuda``), where one GPU
writes in a minute what two CPU cores write in an hour.

Both answer the same two calls:

- ``sample(ids, limits, seed, stop)``: one user turn per row (temperature ``TEMPERATURE``,
  nucleus ``TOP_P``, no top-k), at most ``limits[i]`` tokens, ending at the first stop (a token
  id, or the first token whose text completes a stop string: ``stop`` is ``{"stop_token_ids":
  ids}`` or ``{"stop": (text,)}``); returns ``(tokens, finished)`` per row, ``finished`` when
  the stop came within the limit.
- ``greedy(ids, max_new_tokens)``: the target's greedy answer per row, ending with its
  end-of-sequence id when it stopped (as the engine's outputs do).

Sampled turns differ between the backends (the engine seeds each row, transformers each batch
through torch's global generator); greedy answers are the target's own on both, up to the
rounding of the device's float32 kernels (TF32 is switched off). Either backend's conversations
train the head alike: the trainer recomputes the target's features from the token ids.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import torch

import workbench as wb
from workbench.config import usable_device
from workbench.errors import ConfigError
from workbench.models.config import ModelConfig
from workbench.models.loader import resolve_path, transformers_source

TEMPERATURE = 0.9
TOP_P = 0.95
BACKENDS = ("engine", "transformers")


class Turns(Protocol):
    def sample(self, ids: list[list[int]], limits: list[int], seed: int,
               stop: dict[str, tuple]) -> list[tuple[list[int], bool]]: ...

    def greedy(self, ids: list[list[int]], max_new_tokens: int) -> list[list[int]]: ...

    def close(self) -> None: ...


class EngineTurns:
    """The workbench engine on ``device`` (each sampled row seeded by ``seed * 1024 + row``)."""

    def __init__(self, model: str, batch: int, threads: int, device: str = "cpu") -> None:
        self._wb = wb
        self.engine = wb.Engine.from_pretrained(model, config=wb.EngineConfig(
            max_batch_size=batch, kv_budget_tokens=batch * 1024, max_prefill_tokens=4096,
            threads=threads, device=device))

    def sample(self, ids: list[list[int]], limits: list[int], seed: int,
               stop: dict[str, tuple]) -> list[tuple[list[int], bool]]:
        outs = self.engine.generate(ids, [self._wb.SamplingParams(
            max_new_tokens=n, temperature=TEMPERATURE, top_p=TOP_P, seed=seed * 1024 + i,
            **stop) for i, n in enumerate(limits)])
        return [(list(o.token_ids), o.finish_reason == "stop") for o in outs]

    def greedy(self, ids: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        outs = self.engine.generate(ids, self._wb.SamplingParams(max_new_tokens=max_new_tokens))
        return [list(o.token_ids) for o in outs]

    def close(self) -> None:
        self.engine.close()


class TransformersTurns:
    """transformers' ``AutoModelForCausalLM`` (its own GGUF load for a GGUF target) in float32 on
    ``device``; rows go through ``generate`` ``batch`` at a time, grouped by length and left
    padded."""

    def __init__(self, model: str, batch: int, device: str, tok: Any) -> None:
        from transformers import AutoModelForCausalLM


        dev = usable_device(device)
        src, kw = transformers_source(model)
        self.model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32,
                                                          **kw).to(dev).eval()
        eos = ModelConfig.from_folder(resolve_path(model)).eos_token_id
        if not eos:
            raise ConfigError(f"model {model!r}: its config names no eos_token_id")
        self.eos = tuple(eos)
        self.tok = tok  # the caller's: text stops are read through it
        self.batch, self.dev = batch, dev
        # last, once nothing can fail: TF32 off while this backend lives (float32 as the
        # target's own; close restores it)
        self._tf32 = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False

    def _generate(self, ids: list[list[int]], max_new: int, stop: tuple[int, ...],
                  sample: bool, seed: int) -> list[list[int]]:
        """Each row's new tokens, cut after its first stop id."""
        from transformers import GenerationConfig

        cfg = GenerationConfig(
            max_new_tokens=max_new, do_sample=sample, eos_token_id=list(stop),
            pad_token_id=stop[0], **(dict(temperature=TEMPERATURE, top_p=TOP_P, top_k=0)
                                     if sample else dict(temperature=None, top_p=None,
                                                         top_k=None)))
        order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
        out: list[list[int]] = [[] for _ in ids]
        for c, start in enumerate(range(0, len(order), self.batch)):
            rows = order[start:start + self.batch]
            width = max(len(ids[i]) for i in rows)
            x = torch.full((len(rows), width), stop[0], dtype=torch.long)
            mask = torch.zeros((len(rows), width), dtype=torch.long)
            for r, i in enumerate(rows):
                x[r, width - len(ids[i]):] = torch.tensor(ids[i])
                mask[r, width - len(ids[i]):] = 1
            if sample:
                torch.manual_seed((seed * 1024 + c) % 2**63)
            with torch.inference_mode():
                y = self.model.generate(input_ids=x.to(self.dev),
                                        attention_mask=mask.to(self.dev),
                                        generation_config=cfg)[:, width:].tolist()
            for r, i in enumerate(rows):
                t = y[r]
                cut = next((j + 1 for j, v in enumerate(t) if v in stop), len(t))
                out[i] = t[:cut]
        return out

    def sample(self, ids: list[list[int]], limits: list[int], seed: int,
               stop: dict[str, tuple]) -> list[tuple[list[int], bool]]:
        # as the engine: the stop ids and the end-of-sequence ids end a turn
        halt = tuple(dict.fromkeys(tuple(stop.get("stop_token_ids", ())) + self.eos))
        texts = tuple(stop.get("stop", ()))
        res: list[tuple[list[int], bool]] = [([], False)] * len(ids)
        for n in sorted(set(limits)):  # one generate per limit: a short row is not run long
            rows = [i for i, m in enumerate(limits) if m == n]
            got = self._generate([ids[i] for i in rows], n, halt, True, seed * 4099 + n)
            for i, t in zip(rows, got, strict=True):
                # a text stop ends at the first token whose text completes it
                cut = next((j + 1 for j in range(len(t))
                            if any(x in self.tok.decode(t[:j + 1]) for x in texts)), None)
                if cut is not None:
                    t = t[:cut]
                res[i] = (t, cut is not None or (bool(t) and t[-1] in halt))
        return res

    def greedy(self, ids: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        return self._generate(ids, max_new_tokens, self.eos, False, 0)

    def close(self) -> None:
        del self.model
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = self._tf32
        if self.dev.type == "cuda":
            torch.cuda.empty_cache()


def open_turns(backend: str, model: str | Path, batch: int, threads: int, device: str,
               tok: Any) -> Turns:
    """``backend`` on ``device``; ``tok`` is the target's tokenizer (the caller's, loaded
    once)."""
    if backend == "engine":
        return EngineTurns(str(model), batch, threads, device)
    if backend == "transformers":
        return TransformersTurns(str(model), batch, device, tok)
    raise ConfigError(f"backend: expected one of {', '.join(BACKENDS)}, got {backend!r}")
