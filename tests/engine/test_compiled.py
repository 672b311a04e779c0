"""The ``compile`` init stage (engine/compiled.py): a compiled bs=1 decode that is lossless,
a compile that fails or overruns falls back to eager (named in the detail, nothing half-built),
and ``compile="auto"`` follows the verdict measured on this machine kind and model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import workbench as wb
from workbench.engine import autotune, compiled
from workbench.engine.runner import ModelRunner
from workbench.models.synthetic import TargetShape, write_random_head, write_random_target
from workbench.trace.tracer import RecordingTracer

SHAPE = TargetShape(layers=2, hidden=32, intermediate=64, heads=4, kv_heads=2, vocab=300)
SPEC = wb.SpecConfig(num_steps=3, topk=2, num_draft_tokens=6)
PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13]]


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("compiled_pair")
    target = write_random_target(root / "target", SHAPE)
    return target, write_random_head(target, root / "head", draft_vocab=100)


@pytest.fixture()
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "autotune.json"
    monkeypatch.setenv(autotune.ENV_CACHE, str(path))
    return path


def _outputs(e: wb.Engine, spec: wb.SpecConfig | None) -> list[list[int]]:
    sp = wb.SamplingParams(max_new_tokens=12, ignore_eos=True)
    return [e.generate([p], sp, spec=spec)[0].token_ids for p in PROMPTS]


def test_compiled_decode_is_lossless(cache: Path, pair: tuple[Path, Path]) -> None:
    target, head = pair
    with wb.Engine(target, draft=head, config=wb.EngineConfig(compile="off")) as eager:
        reference = _outputs(eager, None)
    rec = RecordingTracer()
    # oneDNN-packed weights cannot be traced: the graph is traced on dense views of them
    cfg = wb.EngineConfig(compile="on", gemm="onednn")
    with wb.Engine(target, draft=head, config=cfg, tracer=rec) as e:
        choice = e.choices["compile"]
        assert choice["choice"] == "on" and choice["source"] == "forced", choice
        assert isinstance(e.runner.graphs, compiled.CompiledSteps)
        plain = _outputs(e, None)
        assert e.runner.graphs.calls > 0  # the bs=1 decode steps ran through the compiled graph
        assert _outputs(e, SPEC) == plain  # speculative == plain on the compiled path
        calls = e.runner.graphs.calls
        assert _outputs(e, wb.SpecConfig(num_steps=3, topk=1)) == plain
        assert e.runner.graphs.calls > calls
        (stage,) = [s for s in rec.of("InitStage") if s.stage == "compile"]
        assert stage.status == "ok" and stage.detail.startswith("compile=on (forced")
    assert plain == reference  # same tokens as the eager engine on this model
    verdict = json.loads(cache.read_text())["entries"]
    (entry,) = verdict.values()
    assert entry["compile"]["source"] == "measured"
    assert entry["compile"]["choice"] in ("on", "off")
    assert set(entry["compile"]["timings_ms"]) == {"eager", "compiled"}


def _eager_fn(runner: ModelRunner, key: int) -> object:
    """Stands in for the compiled function in tests of the stage's logic (no compile)."""
    def fn(tokens: object, positions: object) -> object:
        return runner.target(tokens, positions, runner.attn, runner.aux_layers)

    return fn


def test_auto_follows_the_cached_verdict(cache: Path, pair: tuple[Path, Path],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    target, _ = pair
    monkeypatch.setattr(compiled, "make_fn", _eager_fn)
    with wb.Engine(target) as e:  # no verdict yet: auto does not compile at init
        assert e.choices["compile"]["choice"] == "off"
        assert e.choices["compile"]["source"] == "auto" and e.runner.graphs is None
        key = autotune.cache_key(e)
    for verdict in ("off", "on"):
        autotune.write_cache(cache, key, {"compile": autotune.Choice(
            "compile", verdict, "measured", ("eager", "compiled"),
            {"eager": {"decode M=1": 1.0}, "compiled": {"decode M=1": 0.5}})})
        # build() measures again; make it report "faster" without depending on timing
        monkeypatch.setattr(compiled.CompileReport, "faster", property(lambda self: True))
        with wb.Engine(target) as e:
            c = e.choices["compile"]
            if verdict == "off":
                assert (c["choice"], c["source"], e.runner.graphs) == ("off", "cached", None)
            else:
                assert (c["choice"], c["source"]) == ("on", "measured")
                assert isinstance(e.runner.graphs, compiled.CompiledSteps)


def test_overrun_or_failure_falls_back_to_eager(cache: Path, pair: tuple[Path, Path],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    target, head = pair
    monkeypatch.setattr(compiled, "make_fn", _eager_fn)
    monkeypatch.setattr(compiled, "BUDGET_S", 0.0)
    with wb.Engine(target, draft=head, config=wb.EngineConfig(compile="on")) as e:
        c = e.choices["compile"]
        assert c["choice"] == "off" and "fallback to eager" in c["note"]
        assert "> budget 0 s" in c["note"] and e.runner.graphs is None
        assert _outputs(e, SPEC) == _outputs(e, None)

    def boom(*a: object, **k: object) -> None:
        raise RuntimeError("inductor exploded")

    monkeypatch.setattr(compiled, "make_fn", boom)
    monkeypatch.setattr(compiled, "BUDGET_S", 300.0)
    with wb.Engine(target, config=wb.EngineConfig(compile="on")) as e:
        c = e.choices["compile"]
        assert c["choice"] == "off" and "compile failed: RuntimeError: inductor exploded" in \
            c["note"]
        assert e.runner.graphs is None and not compiled._BACKENDS.get(-1)


def test_compile_field_is_validated() -> None:
    with pytest.raises(wb.ConfigError, match="^EngineConfig.compile"):
        wb.EngineConfig(compile="sometimes")  # type: ignore[arg-type]
