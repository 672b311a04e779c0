"""No partial initialization, ever (DESIGN.md §5): every init stage, fault-injected, refuses to
start with the stage named, lets no Engine escape and frees every allocation.

The seed story as a regression test: SGLang's EAGLE worker came up half-initialized because the
draft's attention backend failed silently, and crashed with AttributeError on the first decode.
Here that failure either refuses to start or, when asked, starts an explicit baseline.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
from pathlib import Path

import pytest
from reliability import kit

import workbench as wb
from workbench.engine.engine import Engine
from workbench.engine.output import OutputProcessor
from workbench.engine.runner import ModelRunner
from workbench.reliability import snapshot
from workbench.trace.tracer import RecordingTracer

STAGES = wb.faults.INIT_STAGES
DRAFT_STAGES = ("load_draft", "draft_attention_backend")
# Slack for live tensor bytes: the smallest thing a failed init could leak (the micro pool is
# ~9 MB, the target ~1.5 MB) is far above lazily created torch globals (a few bytes).
SLACK = 64 * 1024


def config(**kw: object) -> wb.EngineConfig:
    return dataclasses.replace(kit.CONFIG, self_check=True, **kw)


def chain(e: BaseException) -> list[BaseException]:
    out: list[BaseException] = []
    cur: BaseException | None = e
    while cur is not None and cur not in out:
        out.append(cur)
        cur = cur.__cause__ or cur.__context__
    return out


def test_all_stages_are_covered() -> None:
    assert STAGES == ("load_config", "load_target", "load_draft", "autotune", "allocate_kv",
                      "attention_backend", "draft_attention_backend", "cuda_graphs", "compile",
                      "policy_costmodel", "self_check")


@pytest.mark.parametrize("stage", STAGES)
def test_stage_fault_refuses_to_start_and_frees_everything(stage: str, micro_target: Path,
                                                           head: Path) -> None:
    before = snapshot()
    got = None
    with wb.faults.inject(f"init:{stage}"):
        try:
            wb.Engine.from_pretrained(micro_target, draft=head, config=config())
        except wb.EngineInitError as e:  # anything else (AttributeError…) fails the test
            got = (e.stage, str(e), [type(x).__name__ for x in chain(e)])
    assert got is not None, f"engine started despite a fault at {stage}"
    assert got[0] == stage
    assert f"stage {stage!r}" in got[1] and f"injected fault at init:{stage}" in got[1]
    assert "AttributeError" not in got[2], got[2]
    # Nothing from the failed engine survives: no Engine, pool, backend, model, tensor bytes.
    assert snapshot().grown_since(before, slack_bytes=SLACK) == {}


@pytest.mark.parametrize("stage", STAGES)
def test_failed_engine_is_inert_even_if_a_traceback_keeps_it(stage: str, micro_target: Path,
                                                             head: Path) -> None:
    """A notebook keeps the last traceback (sys.last_traceback), whose frames hold the
    half-built object: it must own nothing and refuse work with a clear error."""
    kept: list[Engine] = []

    class Keep(Engine):
        def _init(self) -> None:
            kept.append(self)
            super()._init()

    with wb.faults.inject(f"init:{stage}"), pytest.raises(wb.EngineInitError):
        Keep(micro_target, head, config())
    (e,) = kept
    r = e.runner
    assert (r.pool, r.target, r.draft, r.attn, r.draft_attn, e.scheduler) == (None,) * 6
    assert e.init_log[-1][:2] == (stage, "failed")
    assert [s for s, st, _ in e.init_log if st == "ok"] == list(STAGES[: STAGES.index(stage)])
    for call in (e.step, lambda: e.add_request([1, 2]), lambda: e.generate([[1, 2]]),
                 lambda: next(iter(e.stream([1, 2]))), e.kv_usage):
        with pytest.raises(RuntimeError, match="engine is closed"):
            call()
    assert not e.has_unfinished() and e.num_running() == e.num_waiting() == 0
    e.abort(0)
    e.close()  # idempotent
    with pytest.raises(wb.ConfigError, match="no draft model"):
        e.set_spec(kit.SPEC)


def test_story_draft_attention_backend_failure_refuses_to_start(micro_target: Path,
                                                                head: Path) -> None:
    with wb.faults.inject("init:draft_attention_backend"), \
            pytest.raises(wb.EngineInitError) as ei:
        wb.Engine.from_pretrained(micro_target, draft=head, config=config())
    assert ei.value.stage == "draft_attention_backend"
    assert isinstance(ei.value.cause, wb.faults.InjectedFault)


@pytest.mark.parametrize("stage", DRAFT_STAGES)
def test_story_with_fallback_starts_an_explicit_baseline(stage: str, micro_target: Path,
                                                         head: Path,
                                                         reference: object) -> None:
    rec = RecordingTracer()
    with wb.faults.inject(f"init:{stage}"):
        e = Engine(micro_target, head, config(allow_baseline_fallback=True), tracer=rec)
    try:
        assert e.baseline_only and e.runner.draft is None and e.runner.draft_attn is None
        assert e.runner.aux_layers == () and e.runner.pool is not None and e.runner.pool.dk is None
        statuses = {s: st for s, st, _ in e.init_log}
        assert statuses == {s: ("fallback" if s == stage else "ok") for s in STAGES}
        assert all(isinstance(sec, float) and sec >= 0 for _, _, sec in e.init_log)
        (fb,) = [x for x in rec.of("InitStage") if x.status == "fallback"]
        assert fb.stage == stage and f"injected fault at init:{stage}" in fb.detail
        with pytest.raises(wb.ConfigError, match="running as an explicit baseline"):
            e.set_spec(wb.SpecConfig())
        with pytest.raises(wb.ConfigError, match="baseline"):
            e.generate([[1, 2, 3]], kit.greedy(2), spec=kit.SPEC)
        assert e.spec is None
        p = [5, 6, 7, 8]
        assert e.generate([p], kit.greedy(6))[0].token_ids == reference(p, 6)  # type: ignore[operator]
        assert kit.kv_used(e) == 0
    finally:
        e.close()


def test_no_fallback_without_a_draft_or_for_target_stages(micro_target: Path,
                                                          head: Path) -> None:
    """allow_baseline_fallback covers the draft only: the target failing still refuses."""
    for stage in ("load_target", "allocate_kv", "attention_backend", "self_check"):
        with wb.faults.inject(f"init:{stage}"), pytest.raises(wb.EngineInitError) as ei:
            wb.Engine.from_pretrained(micro_target, draft=head,
                                      config=config(allow_baseline_fallback=True))
        assert ei.value.stage == stage


def _assigned_attributes(cls: type) -> set[str]:
    """Every ``self.<name> = ...`` (plain, tuple, annotated or augmented) in ``cls``'s body."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    names: set[str] = set()

    def targets(t: ast.expr) -> None:
        if isinstance(t, (ast.Tuple, ast.List)):
            for x in t.elts:
                targets(x)
        elif isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) \
                and t.value.id == "self":
            names.add(t.attr)

    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for t in node.targets:
                targets(t)
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            targets(node.target)
    return names


def test_every_attribute_exists_before_the_first_fallible_stage(micro_target: Path,
                                                                head: Path) -> None:
    seen: dict[str, object] = {}

    class Probe(Engine):
        def _init(self) -> None:
            # the object as the first stage finds it (containers copied: stages fill them),
            # with the parts the stages fill: the model runner and the output processor
            for part in (self.runner, self.out, self):
                seen.update({k: v.copy() if isinstance(v, (list, dict)) else v
                             for k, v in vars(part).items()})
            super()._init()

    with wb.faults.inject("init:load_config"), pytest.raises(wb.EngineInitError):
        Probe(micro_target, head, config())
    assigned = _assigned_attributes(Engine) | _assigned_attributes(ModelRunner) | \
        _assigned_attributes(OutputProcessor)
    assert {"pool", "draft", "draft_attn", "scheduler", "baseline_only"} <= assigned
    missing = sorted(assigned - set(seen))
    assert not missing, f"set only after init started (a half-built engine lacks them): {missing}"
    # what the stages build starts as a safe empty default
    for name in ("model_config", "target", "draft", "tokenizer", "pool", "attn", "draft_attn",
                 "scheduler", "spec"):
        assert seen[name] is None, name
    assert seen["init_log"] == [] and seen["requests"] == {} and seen["baseline_only"] is False
