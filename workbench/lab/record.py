"""A recorded run: greedy outputs plus, at every output position, every draft tree the head
proposes there — enough to replay any policy of smaller shapes without a target forward.

Why one run answers every policy: greedy outputs do not depend on the policy, so at output
position j (root = output token j) a tree accepts the longest path whose tokens match the
recorded continuation, whatever decided to draft it. The recorder decodes each prompt plainly
(bs=1) with a *warm* draft (``SpecConfig(policy=Never(), draft_state="warm")``): after every
token the engine's own draft extend feeds the head (target features of that token, computed by
the target on the real context) and leaves it exactly where a speculating step starts its tree.
There the recorder asks the engine's own drafter (``EagleWorker._draft`` → ``draft_tree``) for
one tree per top-k K' = 1..K with every candidate kept (N = candidates + 1). A draft node's
output depends only on its path (tree attention sees the prefix and its ancestors), so:

* the first ``K' + (S'−1)·K'²`` candidates of the K' record are exactly the candidates a
  (S', K', N') tree expands (the frontier process of the first S' steps is the same), and
  ``build_tree`` over them with N' is the engine's tree for that shape (:mod:`.trees`);
* chains (K'=1) are recorded to ``chain_steps`` (default max(S, 7): SGLang's default tiers run
  7-step chains), trees to S.

What differs from a speculating engine is float rounding only: there the features come from
verify forwards (T = N rows), here from T=1 decode rows (the lossless suites assert the same
argmax; a draft top-k tie may break otherwise). ``RecordedRun`` is saved as ``run.json`` (meta,
prompts, outputs, the cost model, machine and load) plus ``trees.npz`` (candidates per K').
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from workbench.errors import ConfigError
from workbench.lab.trees import accepted, check_recorded, num_candidates

if TYPE_CHECKING:
    from workbench.engine.engine import Engine

FORMAT = 1
SGLANG_DEFAULT_MAX_STEPS = 7  # the deepest chain of SGLang 0.5.23's default adaptive tiers


@dataclass
class RecordedRun:
    """One recorded run (see the module doc). ``trees[k]`` = dict of arrays for top-k ``k``:
    ``tokens``/``parents`` (int64, parents are candidate indices, −1 = the root) and
    ``scores``/``probs`` (float32), each (P, C_k); row p is output position ``pos[p]`` of
    request ``req[p]``. ``outputs[r]`` is request r's greedy output (ids), ``prompt_lens[r]``
    its prompt length, ``prompt_index[r]`` the prompt it ran."""

    shape: tuple[int, int, int]
    chain_steps: int
    max_new_tokens: int
    prompts: list[str]
    prompt_lens: list[int]
    outputs: list[list[int]]
    req: np.ndarray
    pos: np.ndarray
    trees: dict[int, dict[str, np.ndarray]]
    cost_model: dict[str, Any] | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    path: Path | None = None

    @property
    def output_lens(self) -> list[int]:
        return [len(o) for o in self.outputs]

    def accept_table(self, shape: Sequence[int]) -> np.ndarray:
        """(P,) greedy accepted draft tokens of ``shape`` at every tree row (exact)."""
        return accepted(self, shape)

    def check(self, shape: Sequence[int], where: str) -> tuple[int, int, int]:
        """``shape`` if the run recorded it (errors name ``where``)."""
        return check_recorded(self, shape, where)

    @property
    def steps_for(self) -> dict[int, int]:
        """Recorded depth per top-k."""
        return {k: (self.chain_steps if k == 1 else self.shape[0]) for k in self.trees}

    def row_offsets(self) -> list[int]:
        """First tree row of each request (rows of request r: r's offset + output position)."""
        out, n = [], 0
        for o in self.outputs:
            out.append(n)
            n += max(len(o) - 1, 0)
        return out

    # -- persistence -----------------------------------------------------------------------
    def save(self, folder: str | Path) -> Path:
        out = Path(folder)
        out.mkdir(parents=True, exist_ok=True)
        arrays: dict[str, Any] = {"req": self.req, "pos": self.pos}
        for k, t in self.trees.items():
            arrays.update({f"{name}_k{k}": a for name, a in t.items()})
        np.savez_compressed(out / "trees.npz", **arrays)  # type: ignore[arg-type]
        doc = {"format": FORMAT, "shape": list(self.shape), "chain_steps": self.chain_steps,
               "max_new_tokens": self.max_new_tokens, "topks": sorted(self.trees),
               "prompts": self.prompts, "prompt_lens": self.prompt_lens,
               "outputs": self.outputs, "cost_model": self.cost_model, "meta": self.meta}
        (out / "run.json").write_text(json.dumps(doc) + "\n")
        self.path = out
        return out

    @classmethod
    def load(cls, folder: str | Path) -> RecordedRun:
        """Errors name the run and what is missing or malformed."""
        p = Path(folder)
        meta_path, tree_path = p / "run.json", p / "trees.npz"
        if not meta_path.is_file():
            raise ConfigError(f"RUN {p}: no recorded run there (run.json missing); record one "
                              "with `python -m workbench lab record ... --out RUN`")
        if not tree_path.is_file():
            raise ConfigError(f"RUN {p}: trees.npz missing (an interrupted record?)")
        try:
            doc = json.loads(meta_path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"RUN {p}: run.json is not JSON ({e})") from None
        fmt = doc.get("format") if isinstance(doc, dict) else None
        if fmt != FORMAT:
            raise ConfigError(f"RUN {p}: run.json format {fmt!r} is not {FORMAT}")
        try:
            with np.load(tree_path) as z:
                arrays = {name: z[name] for name in z.files}
            trees = {int(k): {name: arrays[f"{name}_k{k}"]
                              for name in ("tokens", "parents", "scores", "probs")}
                     for k in doc["topks"]}
            run = cls(shape=tuple(doc["shape"]), chain_steps=int(doc["chain_steps"]),  # type: ignore[arg-type]
                      max_new_tokens=int(doc["max_new_tokens"]), prompts=list(doc["prompts"]),
                      prompt_lens=[int(x) for x in doc["prompt_lens"]],
                      outputs=[[int(t) for t in o] for o in doc["outputs"]],
                      req=arrays["req"], pos=arrays["pos"], trees=trees,
                      cost_model=doc.get("cost_model"), meta=doc.get("meta", {}), path=p)
        except (KeyError, ValueError, TypeError) as e:
            raise ConfigError(f"RUN {p}: malformed recording ({type(e).__name__}: {e})") from None
        if len(run.req) != sum(max(len(o) - 1, 0) for o in run.outputs):
            raise ConfigError(f"RUN {p}: trees.npz rows do not match run.json's outputs")
        return run


# -- recording -------------------------------------------------------------------------------
def record(engine: Engine, prompts: Sequence[str | Sequence[int]], shape: Sequence[int],
           max_new_tokens: int, chain_steps: int | None = None,
           cost_model: Any = None, progress: bool = False) -> RecordedRun:
    """Record ``prompts`` on ``engine`` (see the module doc): greedy, ``ignore_eos`` (every
    request runs ``max_new_tokens``, as ``bench concurrency`` runs them), one prompt at a time.
    ``cost_model`` (a fitted ``CostModel``) is stored with the run for replay's step times."""
    from tqdm.auto import tqdm

    from workbench.config import SamplingParams, SpecConfig
    from workbench.policy.policies import Decision, Never, check_shape

    s, k, n = check_shape(tuple(shape), "lab record --shape")
    if engine.runner.draft is None:
        raise ConfigError("lab record: the engine has no draft model (--draft)")
    draft = engine.runner.draft
    if draft.compute_dtype not in (None, draft.fc.weight.dtype):
        # replay re-ranks the recorded candidates for other shapes: it needs the draft's scores
        # as its parameters' dtype computes them at any row count (a bf16 draft's scores move by
        # ~1e-2 between a T=1 and a T=N step, so sub-shape trees would differ from real ones)
        raise ConfigError(f"lab record: the draft computes in {draft.compute_dtype} "
                          f"(EngineConfig.draft_dtype={engine.config.draft_dtype!r}); record "
                          "with EngineConfig(draft_dtype='same')")
    if not prompts:
        raise ConfigError("lab record: no prompts (the prompts file is empty)")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 2:
        raise ConfigError(f"lab record --max-new-tokens: need an integer >= 2, got "
                          f"{max_new_tokens!r}")
    chain = max(s, SGLANG_DEFAULT_MAX_STEPS) if chain_steps is None else int(chain_steps)
    if chain < s:
        raise ConfigError(f"lab record --chain-steps: {chain} < the shape's {s} draft steps")
    steps = {kk: (chain if kk == 1 else s) for kk in range(1, k + 1)}
    cols: dict[int, dict[str, list[np.ndarray]]] = {
        kk: {"tokens": [], "parents": [], "scores": [], "probs": []} for kk in steps}
    req_rows: list[int] = []
    pos_rows: list[int] = []
    outputs: list[list[int]] = []
    plens: list[int] = []
    sp = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
    previous = engine.spec
    engine.set_spec(SpecConfig(num_steps=s, topk=k, num_draft_tokens=n, policy=Never(),
                               draft_state="warm"))
    t0 = time.perf_counter()
    try:
        for i, prompt in enumerate(tqdm(prompts, desc="lab record", unit="prompt",
                                        disable=not progress)):
            rid = engine.add_request(prompt, sp)
            r = engine.requests[rid]
            plens.append(len(r.prompt_ids))
            while True:
                outs = engine.step()
                done = any(o.rid == rid and o.finished for o in outs)
                if done:
                    break
                if r.kv_len == 0 or r.draft.len != r.kv_len or r.draft.logits is None:
                    continue  # still prefilling
                j = len(r.tokens) - len(r.prompt_ids) - 1  # root = output token j
                for kk, st in steps.items():
                    c = num_candidates(st, kk)
                    tree = engine.worker._draft([r], Decision(True, st, kk, c + 1))
                    t = cols[kk]
                    t["tokens"].append(tree.tokens[0, 1:].cpu().numpy())
                    t["parents"].append(tree.parents[0, 1:].cpu().numpy() - 1)
                    t["scores"].append(tree.scores[0, 1:].cpu().numpy())
                    t["probs"].append(tree.draft_probs[0, 1:].cpu().numpy())
                req_rows.append(i)
                pos_rows.append(j)
            out = engine.output(rid, text=False).token_ids
            if len(out) - 1 != sum(1 for q in req_rows if q == i):
                raise AssertionError(f"lab record: request {i}: {len(out)} tokens but "
                                     f"{sum(1 for q in req_rows if q == i)} trees recorded")
            outputs.append(list(out))
            engine.release(rid)
    finally:
        engine.set_spec(previous)
    trees: dict[int, dict[str, np.ndarray]] = {
        kk: {"tokens": np.stack(v["tokens"]).astype(np.int64),
             "parents": np.stack(v["parents"]).astype(np.int64),
             "scores": np.stack(v["scores"]).astype(np.float32),
             "probs": np.stack(v["probs"]).astype(np.float32)} for kk, v in cols.items()}
    meta = {"record_s": time.perf_counter() - t0,
            "score_temperature": engine.runner.draft.config.greedy_score_temperature}
    return RecordedRun(shape=(s, k, n), chain_steps=chain, max_new_tokens=max_new_tokens,
                       prompts=[p if isinstance(p, str) else json.dumps(list(p)) for p in prompts],
                       prompt_lens=plens, outputs=outputs,
                       req=np.asarray(req_rows, dtype=np.int64),
                       pos=np.asarray(pos_rows, dtype=np.int64), trees=trees,
                       cost_model=None if cost_model is None else cost_model.to_dict(), meta=meta)
