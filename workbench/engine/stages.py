"""The init stages the engine runs in order (load_config ... self_check), one function each.

:class:`~workbench.engine.engine.Engine` owns the staged all-or-nothing loop (timing, events,
fallbacks, freeing everything on a failure); the work of each stage lives here, each a function
of the engine it builds. Every stage either returns a detail string (or None) or raises.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from workbench.config import SamplingParams, SpecConfig
from workbench.engine.contention import Adaptation, ContentionMonitor
from workbench.engine.scheduler import Scheduler
from workbench.models.config import ModelConfig

if TYPE_CHECKING:
    from workbench.engine.engine import Engine


def load_config(eng: Engine) -> None:
    """The model's config, the length limits, the EOS ids and (when present) the tokenizer."""
    from workbench.models.loader import load_tokenizer, resolve_path

    folder = resolve_path(eng.model_path)
    eng.model_path = folder
    eng.model_config = ModelConfig.from_folder(folder)
    if eng.config.threads:
        torch.set_num_threads(eng.config.threads)
    cfg_len = eng.model_config.max_position_embeddings
    eng.max_model_len = eng.out.max_model_len = min(cfg_len, eng.config.max_model_len or cfg_len)
    eng.eos_ids = eng.out.eos_ids = set(eng.model_config.eos_token_id)
    tok = load_tokenizer(folder)
    if tok is not None:
        eng.tokenizer = eng.out.tokenizer = tok


def autotune(eng: Engine) -> str:
    """Measure every machine-dependent "auto" (GEMM path...) on the real weights, or read the
    per-machine cache (engine/autotune.py); the choices and timings are the detail. A measured
    thread count on a CPU engine with ``contention="adapt"`` gets a contention monitor."""
    from workbench.engine import autotune as tune
    from workbench.engine.invariance import decide_invariance
    from workbench.engine.shape_choices import decide_draft_dtype, decide_rows
    from workbench.engine.weights_choice import decide_weights

    found = tune.autotune(eng, more=(decide_weights, decide_rows, decide_invariance,
                                     decide_draft_dtype))
    eng.choices = {name: c.to_dict() for name, c in found.items()}
    threads = found["threads"]
    if threads.source in ("measured", "only") and eng.config.contention == "adapt" and \
            eng.runner.device.type == "cpu":
        eng.contention = ContentionMonitor(int(threads.candidates[0]),
                                           lambda: gemm_passes(eng),
                                           on_change=lambda a: threads_adapted(eng, a))
    return tune.describe(found)


def gemm_passes(eng: Engine) -> dict[str, Callable[[], None]]:
    """The two GEMM shapes the contention monitor times: one decode row and one verify tree."""
    from workbench.engine.contention import gemm_pass

    target = eng.runner.target
    assert target is not None  # the autotune stage runs after load_target
    return {"decode M=1": gemm_pass(target, 1), "verify M=16": gemm_pass(target, 16)}


def threads_adapted(eng: Engine, a: Adaptation) -> None:
    """The contention monitor re-measured the thread count: the choice says so. It is
    provisional only when measured under contention (a drift-triggered re-measurement on a
    quiet machine is a quiet measurement, and --strict must not refuse a quiet run for it)."""
    from workbench.engine import autotune as tune

    eng.choices["threads"] = tune.Choice(
        "threads", str(a.after), "measured" if a.timings_ms else "only",
        tuple(str(n) for n in a.timings_ms) or (str(a.after),),
        {str(n): t for n, t in a.timings_ms.items()},
        note=f"re-measured: {a.reason}" + (f"; pinned to CPU(s) {a.cpus}, the least busy"
                                           if a.cpus else ""),
        provisional=bool(a.conditions["contended"]),
        conditions={**a.conditions, "cpu": tune.cpu_model(), "cpus": a.cpus}).to_dict()


def allocate_kv(eng: Engine) -> None:
    """The KV pool and the scheduler over it; a request's context is capped at the pool."""
    assert eng.model_config is not None
    pool = eng.runner.allocate_kv(eng.model_config)
    cfg = eng.config
    eng.scheduler = eng.out.scheduler = Scheduler(pool, cfg.max_batch_size,
                                                  cfg.max_prefill_tokens)
    # A request alone must always fit the pool, or preemption could never make room for it
    # (it would wait forever): cap its context at the pool's capacity ("length" finish).
    eng.max_model_len = eng.out.max_model_len = min(eng.max_model_len,
                                                    pool.num_blocks * pool.page_size)


def attention_backend(eng: Engine) -> str:
    assert eng.model_config is not None  # load_config ran
    return eng.runner.attention_backend(eng.model_config)


def compile_forward(eng: Engine) -> str:
    """CPU: the Inductor-compiled bs=1 decode forward per ``EngineConfig.compile``
    (engine/compiled.py). A compile that fails or overruns its budget leaves the runner eager,
    named in the detail; the self-check then runs through whichever path won."""
    from workbench.engine import autotune as tune
    from workbench.engine import compiled

    choice = compiled.compile_stage(eng.runner, tune.cache_key(eng))
    eng.choices["compile"] = choice.to_dict()
    return choice.detail()


# The self-check's row-invariance probe: three prompts of different lengths, decoded plainly
# one at a time and together, then speculatively under each shape (a chain of S+1 rows, the
# default 16-node tree, a 32-node tree), every emitted token's logprob compared bit for bit.
CHECK_SHAPES = {"chain S5": SpecConfig(num_steps=5, topk=1),
                "S5K4N16": SpecConfig(num_steps=5, topk=4, num_draft_tokens=16),
                "S6K8N32": SpecConfig(num_steps=6, topk=8, num_draft_tokens=32)}
CHECK_TOKENS = 8
REDUCED = ("bfloat16", "float16")


def self_check(eng: Engine) -> str | None:
    """Four greedy tokens must come out; with a draft, greedy speculative output must equal
    greedy plain output at the row counts trees verify (:data:`CHECK_SHAPES`, bs 1 and 3),
    and their logprobs must be bit-identical where rows must be invariant:
    ``EngineConfig.batch_invariant`` on, or a reduced-precision dtype (a last-bit difference
    there flips near-ties: the refusal names the switch). A float32 engine without the switch
    passes with equal tokens and says how far its logprobs differ. Then the stats and the
    step counter start from zero."""
    if not eng.config.self_check:
        return None
    assert eng.model_config is not None
    vocab = eng.model_config.vocab_size
    prompt = list(range(1, min(9, vocab)))
    plain = eng.generate([prompt], SamplingParams(max_new_tokens=4))[0].token_ids
    if len(plain) != 4:
        raise RuntimeError(f"self-check produced {len(plain)} tokens, expected 4")
    detail = None
    if eng.runner.draft is not None:
        detail = _rows_check(eng, [prompt] + [[(7 * i + 3 * j) % (vocab - 1) + 1
                                               for j in range(n)]
                                              for i, n in ((1, 13), (2, 21))])
    eng.stats.reset()
    eng.step_id = 0
    eng.worker.plain_streak = 0
    return detail


def _rows_check(eng: Engine, prompts: list[list[int]]) -> str:
    """The self-check's speculative half (see :func:`self_check`); the detail line."""
    from workbench.core import LogprobParams, RequestOutput

    sp = SamplingParams(max_new_tokens=CHECK_TOKENS, ignore_eos=True)
    lp = LogprobParams(top_k=2)
    # packed weights (engine/weights_choice.py) run bf16 activations: reduced precision too
    packed = getattr(eng.runner.target, "gemm", "") == "packed"
    strict = eng.config.batch_invariant or eng.config.dtype in REDUCED or packed

    def run(ps: list[list[int]], spec: SpecConfig | None) -> list[RequestOutput]:
        return eng.generate(ps, sp, spec=spec, logprobs=lp)

    ref = run(prompts, None)
    runs = {"plain bs=1": [run([p], None)[0] for p in prompts]}
    assert eng.runner.draft is not None
    vd = eng.runner.draft.config.draft_vocab_size
    shapes = {n: s for n, s in CHECK_SHAPES.items() if s.topk <= vd}  # a K the head can expand
    for name, spec in shapes.items():
        runs[name] = run(prompts, spec)
    worst = 0.0
    for name, outs in runs.items():
        for i, (o, r) in enumerate(zip(outs, ref, strict=True)):
            if o.token_ids != r.token_ids:
                raise RuntimeError(
                    f"self-check: {name} output {o.token_ids} != plain bs=3 {r.token_ids} "
                    f"(prompt {i}, dtype {eng.config.dtype}, batch_invariant="
                    f"{eng.config.batch_invariant})" + _hint(eng))
            a = torch.tensor(o.output_logprobs, dtype=torch.float64, device="cpu")  # host lists
            b = torch.tensor(r.output_logprobs, dtype=torch.float64, device="cpu")
            d = float((a - b).abs().max()) if a.numel() else 0.0
            if d and strict:
                raise RuntimeError(
                    f"self-check: {name} rows are not bit-identical to plain decoding "
                    f"(prompt {i}: logprobs differ by up to {d:.3g} in {eng.config.dtype}"
                    f"{', packed weights' if packed else ''})"
                    + _hint(eng))
            worst = max(worst, d)
    shapes_s = ", ".join(shapes) + ("" if len(shapes) == len(CHECK_SHAPES) else
                                     f" (a draft vocabulary of {vd} allows no wider top-K)")
    if worst == 0.0:
        return (f"rows invariant: plain bs=1 and {shapes_s} give plain bs=3's tokens and "
                f"logprobs bit for bit")
    return (f"tokens equal under {shapes_s}; logprobs differ by up to {worst:.3g} "
            f"({eng.config.dtype} rows are not bit-invariant here; "
            f"EngineConfig(batch_invariant=True) makes them)")


def _hint(eng: Engine) -> str:
    if eng.config.batch_invariant:
        return " — a row-invariance bug: please report it with this message"
    fix = ("set EngineConfig(batch_invariant=True) (--engine batch_invariant=true)"
           if eng.runner.device.type == "cpu" else
           "EngineConfig(batch_invariant=True) runs on the CPU engine only; use dtype='float32'")
    return ("; rows of a forward are not invariant in this format on this machine, so near-ties "
            f"flip: {fix} for lossless speculation")
