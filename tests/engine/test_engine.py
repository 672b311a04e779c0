"""Continuous batching, aborts, preemption, bad input, streaming, staged init."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import id_prompts, make_engine

import workbench as wb
from workbench.core import LogprobParams


@pytest.fixture(scope="module")
def engine(micro_target: Path) -> wb.Engine:
    e = make_engine(micro_target, kv_budget_tokens=4096)
    yield e
    e.close()


def test_text_prompt_roundtrip(engine: wb.Engine) -> None:
    out = engine.generate(["def f(x):"], wb.SamplingParams(max_new_tokens=8))[0]
    assert len(out.token_ids) <= 8 and out.finish_reason in ("length", "stop")
    assert out.text == engine.tokenizer.decode(out.token_ids)


def test_continuous_batching_equals_running_alone(engine: wb.Engine) -> None:
    ps = id_prompts(16)
    sps = [wb.SamplingParams(max_new_tokens=5 + i % 7, ignore_eos=True) for i in range(16)]
    alone = [engine.generate([p], s)[0].token_ids for p, s in zip(ps, sps, strict=True)]
    # Staggered arrivals: half now, the rest while the first half decodes; two aborts.
    rids = [engine.add_request(p, s) for p, s in zip(ps[:8], sps[:8], strict=True)]
    engine.step()
    engine.step()
    rids += [engine.add_request(p, s) for p, s in zip(ps[8:], sps[8:], strict=True)]
    aborted = {rids[3], rids[12]}
    engine.step()
    for r in aborted:
        engine.abort(r)
    while engine.has_unfinished():
        engine.step()
    for i, r in enumerate(rids):
        out = engine.output(r)
        if r in aborted:
            assert out.finish_reason == "abort"
            assert out.token_ids == alone[i][: len(out.token_ids)]
        else:
            assert out.token_ids == alone[i], i
    assert engine.kv_usage()["used_blocks"] == 0


def test_chunked_prefill_and_preemption_never_crash(micro_target: Path) -> None:
    cfg = wb.EngineConfig(kv_budget_tokens=256, page_size=8, max_prefill_tokens=16,
                          self_check=False)
    small = wb.Engine.from_pretrained(micro_target, config=cfg)
    big = make_engine(micro_target, self_check=False)
    ps = id_prompts(12, seed=3)
    sp = wb.SamplingParams(max_new_tokens=24, ignore_eos=True)
    got = small.generate(ps, sp)
    want = big.generate(ps, sp)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert sum(o.metrics.preemptions for o in got) > 0, "pool was meant to be too small"
    assert small.kv_usage()["used_blocks"] == 0


def test_max_new_tokens_zero_is_prefill_only(engine: wb.Engine) -> None:
    """Prefill only: no token, reason "length", the prompt's logprobs, KV freed; batched with
    requests that do generate, which are unaffected."""
    ps = id_prompts(3, seed=7)
    sp = wb.SamplingParams(max_new_tokens=6, ignore_eos=True)
    alone = [engine.generate([p], sp)[0].token_ids for p in ps]
    zero = wb.SamplingParams(max_new_tokens=0)
    rids = [engine.add_request(ps[0], sp), engine.add_request(ps[1], zero,
                                                               logprobs=LogprobParams(start=0)),
            engine.add_request(ps[2], sp)]
    while engine.has_unfinished():
        engine.step()
    outs = [engine.output(r) for r in rids]
    assert outs[0].token_ids == alone[0] and outs[2].token_ids == alone[2]
    z = outs[1]
    assert z.token_ids == [] and z.finish_reason == "length" and z.text == ""
    assert z.input_logprobs is not None and len(z.input_logprobs) == len(ps[1])
    assert z.input_logprobs[0] is None and all(v <= 0 for v in z.input_logprobs[1:])
    assert z.output_logprobs == []
    assert engine.kv_usage()["used_blocks"] == 0


def test_streaming_yields_the_same_text(engine: wb.Engine) -> None:
    sp = wb.SamplingParams(max_new_tokens=12, ignore_eos=True)
    text = "".join(engine.stream("import os\n", sp))
    assert text == engine.generate(["import os\n"], sp)[0].text


def test_sampling_is_seeded(engine: wb.Engine) -> None:
    sp = wb.SamplingParams(max_new_tokens=10, temperature=0.9, top_p=0.9, top_k=50, seed=7)
    a = engine.generate(["def "], sp)[0].token_ids
    b = engine.generate(["def "], sp)[0].token_ids
    assert a == b


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"temperature": -0.1}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"max_new_tokens": -1}, "max_new_tokens"),
    ({"max_new_tokens": -3}, "max_new_tokens"),
    ({"top_k": -1}, "top_k"),
    ({"min_p": 1.0}, "min_p"),
])
def test_bad_sampling_params_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(wb.RequestError, match=field):
        wb.SamplingParams(**kwargs)


def test_bad_prompts_are_refused_and_others_keep_running(engine: wb.Engine) -> None:
    good = engine.add_request([1, 2, 3], wb.SamplingParams(max_new_tokens=4, ignore_eos=True))
    with pytest.raises(wb.RequestError, match="empty prompt"):
        engine.add_request([])
    with pytest.raises(wb.RequestError, match="empty prompt"):
        engine.add_request("")
    with pytest.raises(wb.RequestError, match="outside the vocabulary"):
        engine.add_request([1, 300])
    with pytest.raises(wb.RequestError, match="does not fit the context"):
        engine.add_request([1] * engine.max_model_len)
    while engine.has_unfinished():
        engine.step()
    assert len(engine.output(good).token_ids) == 4


def test_nan_logits_fail_one_request_only(engine: wb.Engine) -> None:
    sp = wb.SamplingParams(max_new_tokens=6, ignore_eos=True)
    a = engine.add_request([5, 6, 7], sp)
    b = engine.add_request([8, 9], sp)
    with wb.faults.inject(f"step:nan_logits@{b}"):
        while engine.has_unfinished():
            engine.step()
    assert engine.output(b).finish_reason == "error" and "non-finite" in engine.output(b).error
    assert len(engine.output(a).token_ids) == 6
    assert engine.kv_usage()["used_blocks"] == 0


def test_unknown_architecture_is_refused(tmp_path: Path, micro_target: Path) -> None:
    import json
    import shutil

    shutil.copytree(micro_target, tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["architectures"], cfg["model_type"] = ["GPT2LMHeadModel"], "gpt2"
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(wb.EngineInitError, match="unknown architecture") as ei:
        wb.Engine.from_pretrained(tmp_path / "m")
    assert ei.value.stage == "load_config"


def test_mis_shaped_tensor_names_tensor_and_shapes(tmp_path: Path, micro_target: Path) -> None:
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(micro_target, tmp_path / "m")
    f = tmp_path / "m" / "model.safetensors"
    state = load_file(str(f))
    state["model.layers.0.mlp.up_proj.weight"] = torch.zeros(3, 3)
    del state["model.norm.weight"]
    save_file(state, str(f))
    with pytest.raises(wb.EngineInitError, match=r"model\.") as ei:
        wb.Engine.from_pretrained(tmp_path / "m")
    assert ei.value.stage == "load_target"
    assert "shape" in str(ei.value)


def test_every_init_stage_failure_names_the_stage(micro_target: Path) -> None:
    for stage in ("load_config", "load_target", "allocate_kv", "attention_backend",
                  "self_check"):
        with wb.faults.inject(f"init:{stage}"), pytest.raises(wb.EngineInitError) as ei:
            wb.Engine.from_pretrained(micro_target)
        assert ei.value.stage == stage
