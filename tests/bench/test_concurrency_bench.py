"""The concurrency bench: arms side by side, the measured threshold, the bench CLI's bs=1 runs
(micro target + random head)."""

from __future__ import annotations

import json
import math
import random
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
from helpers import small_engine

import workbench as wb
from workbench.bench.concurrency import (
    default_arms,
    find_threshold,
    policy_bases,
    run_concurrency,
    summarize,
    switch_costs,
)
from workbench.policy.costmodel import CostModel, LinearCost
from workbench.policy.policies import (
    BatchThreshold,
    Never,
    RandomFlip,
)


@pytest.fixture(scope="module")
def engine(micro_target: Path, random_head: Path) -> Iterator[wb.Engine]:
    yield from small_engine(micro_target, random_head)


def test_concurrency_bench_smoke(engine: wb.Engine, tmp_path: Path) -> None:
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 299) for _ in range(rng.randrange(3, 20))] for _ in range(5)]
    spec = wb.SpecConfig(num_steps=2, topk=2, num_draft_tokens=4)
    arms = {"baseline": None, "eagle3": spec,
            "never": wb.SpecConfig(num_steps=2, topk=2, num_draft_tokens=4, policy=Never()),
            "flip_warm": wb.SpecConfig(num_steps=2, topk=2, num_draft_tokens=4,
                                       policy=RandomFlip(0.5, seed=0)),
            "flip_cold": wb.SpecConfig(num_steps=2, topk=2, num_draft_tokens=4,
                                       policy=RandomFlip(0.5, seed=0), draft_state="cold")}
    df = run_concurrency(engine, prompts, levels=(1, 3), arms=arms, max_new_tokens=6,
                         out=tmp_path, progress=False)
    assert len(df) == 10 and set(df["arm"]) == set(arms)
    assert df["lossless"].all()
    for col in ("tok_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms",
                "itl_p50_ms", "itl_p99_ms", "tau", "spec_share", "k0_tax", "vs_baseline"):
        assert col in df
    s = summarize(df).set_index(["arm", "concurrency"])
    # at concurrency 1 every decode step speculates except each request's last token, which a
    # draft cannot speed up (it decodes plainly)
    e1 = df[(df["arm"] == "eagle3") & (df["concurrency"] == 1)].iloc[0]
    plain_steps = round(e1["decode_steps"] * (1 - e1["spec_share"]))
    assert 0 < plain_steps <= e1["requests"]
    assert s.loc[("never", 3), "spec_share"] == 0.0
    assert 0.0 < s.loc[("flip_cold", 3), "spec_share"] < 1.0
    assert not math.isnan(s.loc[("never", 1), "k0_tax"])
    # per-step K=0 tax: steady-state steps exist at both levels (full batch, no prefill)
    assert (s["steady_step_ms"] > 0).all()
    assert not math.isnan(s.loc[("never", 3), "k0_tax_step"])
    assert math.isnan(s.loc[("eagle3", 3), "k0_tax_step"])
    assert list(switch_costs(df)["concurrency"]) == [1, 3]
    saved = json.loads((tmp_path / "concurrency.json").read_text())
    assert "machine" in saved and "threshold" in saved and len(saved["rows"]) == 10
    assert (tmp_path / "concurrency.csv").is_file()
    assert engine.kv_usage()["used_blocks"] == 0


def _sweep(base: list[float], eagle: list[float]) -> pd.DataFrame:
    levels = [1, 2, 4, 8]
    return pd.DataFrame([{"arm": a, "concurrency": c, "repeat": 0, "tok_s": v, "lossless": True}
                         for a, vals in (("baseline", base), ("eagle3", eagle))
                         for c, v in zip(levels, vals, strict=True)])


@pytest.mark.parametrize(("base", "eagle", "crossover", "n"), [
    ([10, 20, 40, 80], [20, 30, 35, 60], 4, 2),
    ([10, 20, 40, 80], [20, 30, 45, 90], None, 8),
    ([10, 20, 40, 80], [10, 15, 30, 60], 1, 0),
])
def test_find_threshold(base: list[float], eagle: list[float], crossover: int | None,
                        n: int) -> None:
    th = find_threshold(_sweep(base, eagle))
    assert (th.crossover, th.suggested_n) == (crossover, n)
    assert list(th.table["concurrency"]) == [1, 2, 4, 8]


def test_cli_threshold_quick(micro_target: Path, random_head: Path, tmp_path: Path,
                             monkeypatch: pytest.MonkeyPatch,
                             capsys: pytest.CaptureFixture[str]) -> None:
    from workbench import __main__ as cli
    from workbench import data_io

    monkeypatch.setattr(data_io, "PROMPTS_DIR", tmp_path / "prompts")
    argv = ["bench", "threshold", "--model", str(micro_target), "--draft", str(random_head),
            "--out", str(tmp_path / "res"), "--quick", "--max-new-tokens", "4", "--prompts", "2"]
    assert cli.main(argv) == 1  # no prompts yet: one error line says how to make them
    assert re.search("error: ConfigError: .*make-prompts", capsys.readouterr().err)
    data_io.save_prompts([data_io.Prompt("a", "code", "def f(x):\n", "t"),
                            data_io.Prompt("b", "code", "import os\n", "t")],
                           tmp_path / "prompts" / "heldout.jsonl")
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "suggested BatchThreshold(" in out
    assert (tmp_path / "res" / "threshold.json").is_file()


def _write_prompts(folder: Path) -> None:
    from workbench import data_io

    data_io.save_prompts([data_io.Prompt("a", "code", "def f(x):\n", "t"),
                            data_io.Prompt("b", "code", "import os\n", "t")],
                           folder / "heldout.jsonl")


@pytest.mark.parametrize("which", ["spec", "peers"])
def test_cli_bs1_benches(which: str, micro_target: Path, random_head: Path, tmp_path: Path,
                         monkeypatch: pytest.MonkeyPatch,
                         capsys: pytest.CaptureFixture[str]) -> None:
    from workbench import __main__ as cli
    from workbench import data_io

    monkeypatch.setattr(data_io, "PROMPTS_DIR", tmp_path / "prompts")
    _write_prompts(tmp_path / "prompts")
    argv = ["bench", which, "--model", str(micro_target), "--draft", str(random_head),
            "--out", str(tmp_path / "res"), "--max-new-tokens", "4", "--prompts", "2"]
    assert cli.main(argv) == 0
    assert "results:" in capsys.readouterr().out
    assert any((tmp_path / "res").glob("*.json"))


def test_cli_concurrency_url(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                             capsys: pytest.CaptureFixture[str]) -> None:
    """--url sweeps a running server level by level through workbench.bench.http."""
    from workbench import __main__ as cli
    from workbench import data_io
    from workbench.bench import http

    monkeypatch.setattr(data_io, "PROMPTS_DIR", tmp_path / "prompts")
    _write_prompts(tmp_path / "prompts")
    calls: list[tuple[int, int]] = []

    def fake(url: str, prompts: list[str], concurrency: int = 8, max_new_tokens: int = 128,
             **kw: Any) -> dict[str, Any]:
        calls.append((concurrency, len(prompts)))
        return {"url": url, "concurrency": concurrency, "completed": len(prompts), "failed": 0,
                "output_throughput": 10.0 * concurrency, "p50_ttft_ms": 1.0, "errors": [],
                "requests": []}

    monkeypatch.setattr(http, "run_http_bench", fake)
    monkeypatch.setattr(http, "format_table", lambda res: f"table c={res['concurrency']}")
    argv = ["bench", "concurrency", "--url", "http://127.0.0.1:1", "--quick",
            "--out", str(tmp_path / "res")]
    assert cli.main(argv) == 0
    assert calls == [(1, 2), (4, 8), (16, 32)]  # ≥ 2·c requests per level
    assert "table c=16" in capsys.readouterr().out
    saved = json.loads((tmp_path / "res" / "concurrency_http.json").read_text())
    assert [r["concurrency"] for r in saved["rows"]] == [1, 4, 16] and "machine" in saved


def test_concurrency_bench_interleaved(engine: wb.Engine, micro_target: Path,
                                       random_head: Path) -> None:
    """engines=: the arms of a cell advance one step each in turn, each on its own engine and
    timed on its own clock (its share of the wall time), outputs still compared token for
    token; latencies are measured on the same own clock."""
    import time

    rng = random.Random(1)
    prompts = [[rng.randrange(1, 299) for _ in range(rng.randrange(3, 20))] for _ in range(5)]
    spec = wb.SpecConfig(num_steps=2, topk=2, num_draft_tokens=4)
    arms = {"baseline": None, "eagle3": spec,
            "never": wb.SpecConfig(num_steps=2, topk=2, num_draft_tokens=4, policy=Never())}
    with pytest.raises(ValueError, match=r"no engine for arms \['never'\]"):
        run_concurrency(engine, prompts, levels=(2,), arms=arms, max_new_tokens=4,
                        progress=False, engines={"baseline": engine, "eagle3": engine})
    engines = {a: wb.Engine.from_pretrained(micro_target, draft=random_head,
                                            config=wb.EngineConfig(kv_budget_tokens=4096))
               for a in arms}
    try:
        t0 = time.perf_counter()
        df = run_concurrency(engine, prompts, levels=(1, 3), arms=arms, max_new_tokens=6,
                             progress=False, engines=engines, warmup=False)
        wall = time.perf_counter() - t0
    finally:
        for e in engines.values():
            e.close()
    assert df.attrs["config"]["interleaved"] is True
    assert len(df) == 6 and df["lossless"].all()
    # every arm ran (its tokens, its engine) and own clocks add up to less than the wall time
    assert (df["tokens"] == df["requests"] * 6).all()
    assert df.groupby("concurrency")["seconds"].sum().sum() < wall
    for col in ("ttft_p50_ms", "tpot_p50_ms", "itl_p50_ms"):
        assert (df[col] > 0).all()
    # a request's TTFT on its arm's own clock fits in that arm's own time
    assert (df["ttft_p99_ms"] < 1e3 * df["seconds"]).all()
    assert engine.kv_usage()["used_blocks"] == 0


def hand_model() -> CostModel:
    """target 1 + 0.1·T ms, draft 0.25 + 0.01·T ms, no overheads. At decode batch B, chain
    S3 (N=4), τ=3:  plain cold = 1 + 0.1B, plain warm = 1.25 + 0.11B,
    spec = (1 + 0.4B) + 2·(0.25 + 0.01B) + (0.25 + 0.03B) = 1.75 + 0.45B ms.
    Plain tok/s ≥ spec tok/s ⇔ 3·plain_ms ≤ spec_ms:
    cold 3 + 0.3B ≤ 1.75 + 0.45B ⇔ B ≥ 8.33 → crossover 9, n = 8;
    warm 3.75 + 0.33B ≤ 1.75 + 0.45B ⇔ B ≥ 16.67 → crossover 17, n = 16."""
    return CostModel(target=LinearCost(a=1.0, b=0.1), draft=LinearCost(a=0.25, b=0.01))


def test_default_arms_threshold_auto_and_forced(engine: wb.Engine) -> None:
    spec = wb.SpecConfig(num_steps=3, topk=1, num_draft_tokens=4)
    arms = default_arms(engine, spec=spec, cost_model=hand_model(), tau=3.0, flips=False)
    th = arms["threshold"]
    assert th is not None and th.policy == BatchThreshold(8) and th.draft_state == "auto"
    basis = policy_bases(arms)
    assert list(basis) == ["threshold"] and basis["threshold"]["n"] == 8
    assert basis["threshold"]["policy"] == "BatchThreshold(n=8)"
    forced = default_arms(engine, spec=spec, cost_model=hand_model(), threshold=4, flips=False)
    assert forced["threshold"] is not None and forced["threshold"].policy == BatchThreshold(4)
    assert policy_bases(forced) == {}
    with pytest.raises(wb.ConfigError, match="prompts= .* or tau="):
        default_arms(engine, spec=spec, cost_model=hand_model(), flips=False)
    with pytest.raises(wb.ConfigError, match="default_arms.threshold"):
        default_arms(engine, spec=spec, cost_model=hand_model(), threshold="8", flips=False)


def test_peers_load_transformers_in_the_engines_dtype(micro_target: Path) -> None:
    """A bf16 engine is compared with transformers in bf16 (a ratio of implementations, not of
    precisions): the greedy tokens agree and the run records the dtype."""
    import workbench as wb
    from workbench.bench.peers import run_peers

    engine = wb.Engine.from_pretrained(micro_target, config=wb.EngineConfig(
        dtype="bfloat16", compile="off", gemm="dense"))
    try:
        df, summary, machine = run_peers(engine, ["def f(x):\n"], max_new_tokens=6,
                                         compiled=False)
    finally:
        engine.close()
    assert machine["dtype"] == "bfloat16"
    assert set(summary["arm"]) == {"hf generate", "hf prompt lookup", "workbench"}
    assert (df["tokens"] == 6).all()


def test_peers_paired_ratio_is_the_geometric_mean_of_each_prompts_ratio(
        micro_target: Path) -> None:
    """``vs_hf_paired``: per (repeat, prompt) the arm's tok/s over hf generate's on the same
    prompt, geometric mean with a log-scale interval over prompts × repeats, recomputed here
    from the per-prompt rows."""
    import math

    import workbench as wb
    from workbench.bench.peers import run_peers

    engine = wb.Engine.from_pretrained(micro_target, config=wb.EngineConfig(
        compile="off", gemm="dense"))
    try:
        df, summary, _ = run_peers(engine, ["def f(x):\n", "class A:\n"], max_new_tokens=5,
                                   compiled=False, repeats=2)
    finally:
        engine.close()
    s = summary.set_index("arm")
    hf = df[df.arm == "hf generate"].set_index(["repeat", "prompt"]).tok_s
    ours = df[df.arm == "workbench"].set_index(["repeat", "prompt"]).tok_s
    logs = [math.log(v) for v in ours / hf]
    assert s.loc["workbench", "pairs"] == 4
    assert s.loc["workbench", "vs_hf_paired"] == pytest.approx(math.exp(sum(logs) / 4))
    assert s.loc["workbench", "vs_hf_paired_lo"] < s.loc["workbench", "vs_hf_paired"] \
        < s.loc["workbench", "vs_hf_paired_hi"]
    assert s.loc["hf generate", "vs_hf_paired"] == pytest.approx(1.0)


def test_peers_run_a_second_engine_side_by_side(micro_target: Path, random_head: Path) -> None:
    """``variant`` (the CLI's ``--engine-b``): the same engine arms on a second engine, in the
    same turns, its outputs the same tokens (a row floor never changes them)."""
    import workbench as wb
    from workbench.bench.peers import run_peers

    cfg = wb.EngineConfig(compile="off", gemm="onednn", row_floor=1)
    engine = wb.Engine.from_pretrained(micro_target, draft=random_head, config=cfg)
    variant = wb.Engine.from_pretrained(micro_target, draft=random_head,
                                        config=wb.EngineConfig(compile="off", gemm="onednn",
                                                               row_floor=6))
    try:
        df, summary, _ = run_peers(engine, ["def f(x):\n"], max_new_tokens=5, compiled=False,
                                   spec=wb.SpecConfig(3, 2, 6), variant=variant)
    finally:
        engine.close()
        variant.close()
    arms = list(summary["arm"])
    assert arms[-4:] == ["workbench", "workbench [B]", "workbench eagle3", "workbench eagle3 [B]"]
    toks = df.set_index("arm")["tokens"]
    assert (toks == 5).all()
    assert bool(summary.set_index("arm").loc["workbench [B]", "same_as_hf"]) == \
        bool(summary.set_index("arm").loc["workbench", "same_as_hf"])


@pytest.mark.parametrize(("argv", "match"), [
    (["bench", "spec", "--engine-b", "row_floor=1"], "only for `bench peers`"),
    (["bench", "peers", "--engine-b", "row_floor=1", "--url", "http://127.0.0.1:9"],
     "--url"),
    (["bench", "peers", "--engine-b", "rowfloor=1"], "--engine-b: 'rowfloor=1'"),
    (["bench", "peers", "--engine-b", "row_floor=x"], "--engine-b row_floor: expected an"),
])
def test_engine_b_is_refused_where_it_cannot_run(argv: list[str], match: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    from workbench import __main__ as cli

    assert cli.main(argv) != 0
    assert match in capsys.readouterr().err
