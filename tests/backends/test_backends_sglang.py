"""SGLang backend: launch command golden tests against the flag table; the HTTP client against
the native (SGLang-compatible) server, with the engine's output shapes and trace events."""

from __future__ import annotations

import pytest
from serve.serving import SPEC, TEXT_PROMPTS, greedy, id_prompts

import workbench as wb
from workbench.backends import sglang
from workbench.backends.sglang import (
    DEFAULT_SPEC,
    SGLangClient,
    approx_accept_lengths,
    launch_command,
    launch_plan,
    sglang_sampling_params,
    wait_healthy,
)
from workbench.trace import events as ev
from workbench.trace.tracer import NullTracer

HEAD = ["python", "-m", "sglang.launch_server", "--model-path", "/m/target"]
TAIL = ["--tp", "8", "--host", "0.0.0.0", "--port", "30000"]


def spec_flags(s: int, k: int, n: int, draft: str = "/m/draft") -> list[str]:
    return ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", draft,
            "--speculative-num-steps", str(s), "--speculative-eagle-topk", str(k),
            "--speculative-num-draft-tokens", str(n)]


# ---- launch command: golden ------------------------------------------------------------------

def test_launch_command_eagle3_flag_table() -> None:
    cmd = launch_command("/m/target", "/m/draft", tp=8,
                         spec=wb.SpecConfig(num_steps=5, topk=4, num_draft_tokens=16))
    assert cmd == HEAD + spec_flags(5, 4, 16) + TAIL


def test_launch_command_defaults_and_chain() -> None:
    assert launch_command("/m/target", "/m/draft") == \
        HEAD + spec_flags(DEFAULT_SPEC.num_steps, DEFAULT_SPEC.topk,
                          DEFAULT_SPEC.num_draft_tokens) + TAIL
    chain = launch_command("/m/target", "/m/draft", tp=1, spec=wb.SpecConfig(num_steps=3, topk=1),
                           host="127.0.0.1", port=31000)
    assert chain == HEAD + spec_flags(3, 1, 4) + ["--tp", "1", "--host", "127.0.0.1",
                                                  "--port", "31000"]


def test_launch_command_baseline() -> None:
    assert launch_command("/m/target") == HEAD + TAIL


def test_extra_kwargs_become_kebab_flags() -> None:
    cmd = launch_command("/m/target", "/m/draft", spec=wb.SpecConfig(5, 4, 16),
                         mem_fraction_static=0.8, cuda_graph_max_bs=64, enable_torch_compile=True,
                         disable_radix_cache=False, chunked_prefill_size=None,
                         cuda_graph_bs=[1, 2, 4])
    assert cmd == HEAD + spec_flags(5, 4, 16) + TAIL + [
        "--mem-fraction-static", "0.8", "--cuda-graph-max-bs", "64", "--enable-torch-compile",
        "--cuda-graph-bs", "1", "2", "4"]


def test_batch_threshold_is_not_an_upstream_flag() -> None:
    spec = wb.SpecConfig(5, 4, 16, policy=wb.BatchThreshold(8))
    plan = launch_plan("/m/target", "/m/draft", spec=spec)
    assert plan.command == HEAD + spec_flags(5, 4, 16) + TAIL  # nothing invented
    assert len(plan.notes) == 1
    assert "BatchThreshold(8)" in plan.notes[0] and "NOT applied" in plan.notes[0]
    patched = launch_plan("/m/target", "/m/draft", spec=spec,
                          threshold_flag="--speculative-disable-batch-threshold")
    assert patched.command == HEAD + spec_flags(5, 4, 16) + [
        "--speculative-disable-batch-threshold", "8"] + TAIL
    assert "patched" in patched.notes[0]
    assert "no upstream SGLang flag" in " ".join((sglang.__doc__ or "").split())


def test_always_never_and_simulated_acceptance() -> None:
    always = launch_plan("/m/target", "/m/draft", spec=wb.SpecConfig(5, 4, 16,
                                                                      policy=wb.Always()))
    assert always.command == HEAD + spec_flags(5, 4, 16) + TAIL and always.notes == []
    never = launch_plan("/m/target", "/m/draft", spec=wb.SpecConfig(5, 4, 16, policy=wb.Never()))
    assert never.command == HEAD + TAIL and "Never" in never.notes[0]
    sim = launch_plan("/m/target", "/m/draft",
                      spec=wb.SpecConfig(5, 4, 16, simulate_accept_length=2.5))
    assert sim.env == {"SGLANG_SIMULATE_ACC_LEN": "2.5"}
    assert sim.shell().startswith("SGLANG_SIMULATE_ACC_LEN=2.5 python -m sglang.launch_server ")
    cold = launch_plan("/m/target", "/m/draft", spec=wb.SpecConfig(5, 4, 16, draft_state="cold"))
    assert cold.command == HEAD + spec_flags(5, 4, 16) + TAIL and "cold" in cold.notes[0]


@pytest.mark.parametrize("kwargs,field", [
    ({"spec": wb.SpecConfig(5, 4, 16)}, "spec"),          # spec without a draft
    ({"draft": "/m/d", "tp": 0}, "tp"),
    ({"draft": "/m/d", "port": 0}, "port"),
    ({"draft": "/m/d", "tp_size": 4}, None),               # distinct flag: allowed
    ({"draft": "/m/d", "model_path": "/x"}, "model_path"),  # collides with a generated flag
])
def test_launch_plan_errors(kwargs: dict, field: str | None) -> None:
    if field is None:
        assert "--tp-size" in launch_command("/m/target", **kwargs)
        return
    with pytest.raises(wb.ConfigError, match=field):
        launch_command("/m/target", **kwargs)


def test_sampling_params_mapping() -> None:
    assert sglang_sampling_params(wb.SamplingParams(max_new_tokens=7)) == {
        "max_new_tokens": 7, "temperature": 0.0}
    sp = wb.SamplingParams(max_new_tokens=3, temperature=0.7, top_p=0.9, top_k=20, min_p=0.1,
                           stop=["\n\n"], stop_token_ids=(0,), ignore_eos=True, seed=5)
    assert sglang_sampling_params(sp) == {
        "max_new_tokens": 3, "temperature": 0.7, "top_p": 0.9, "top_k": 20, "min_p": 0.1,
        "stop": ["\n\n"], "stop_token_ids": [0], "ignore_eos": True, "sampling_seed": 5}


def test_approx_accept_lengths() -> None:
    assert approx_accept_lengths(10, 4) == [3, 3, 2, 2]
    assert approx_accept_lengths(5, 0) == []
    got = approx_accept_lengths(37, 11)
    assert sum(got) == 37 and len(got) == 11 and max(got) - min(got) <= 1


# ---- client against the native server --------------------------------------------------------

N = 8


@pytest.mark.parametrize("stream", [True, False])
def test_client_generate_equals_engine(server, solo, stream: bool) -> None:
    prompts: list = TEXT_PROMPTS[:4] + id_prompts(3, seed=4)
    with SGLangClient(server.url, stream=stream, max_concurrency=4) as client:
        outs = client.generate(prompts, greedy(N), spec=SPEC)
    assert len(outs) == len(prompts)
    for p, o in zip(prompts, outs, strict=True):
        ref = solo(p, N)
        assert isinstance(o, wb.RequestOutput)
        assert o.token_ids == ref.token_ids and o.text == ref.text
        assert o.finish_reason == "length"
        assert o.metrics.verify_ct == ref.metrics.verify_ct > 0
        assert sum(o.metrics.accept_lengths) == N
        assert o.metrics.accept_length == pytest.approx(N / ref.metrics.verify_ct)
        assert o.metrics.e2e is not None and o.metrics.e2e > 0
        if stream:
            assert 0 < o.metrics.ttft <= o.metrics.e2e
            assert len(o.metrics.token_times) == N


def test_client_trace_events(server) -> None:
    client = SGLangClient(server.url)
    prompts = TEXT_PROMPTS[4:7]
    with wb.trace(client) as tr:
        outs = client.generate(prompts, greedy(5))
    assert isinstance(client.tracer, NullTracer)  # restored after the block
    admitted = tr.of(ev.RequestAdmitted)
    finished = tr.of(ev.RequestFinished)
    assert sorted(e.rid for e in admitted) == sorted(o.rid for o in outs)
    assert sorted(e.rid for e in finished) == sorted(o.rid for o in outs)
    by_rid = {o.rid: o for o in outs}
    for e in finished:
        o = by_rid[e.rid]
        assert e.reason == "length" and e.output_len == 5
        assert e.verify_ct == o.metrics.verify_ct and sum(e.accept_lengths) == 5
        assert 0 < e.ttft_s <= e.e2e_s
    for e in admitted:
        assert e.max_new_tokens == 5 and e.temperature == 0.0 and e.prompt_len > 0
    frame = tr.frame("requests")
    assert len(frame) == len(prompts)
    client.close()


def test_client_errors(server) -> None:
    with SGLangClient(server.url) as client:
        with pytest.raises(wb.RequestError, match="input_ids"):
            client.generate([[1, 10**6]], greedy(2))
        with pytest.raises(wb.ConfigError, match="spec.num_steps"):
            client.generate(["a"], greedy(2), spec=wb.SpecConfig(num_steps=5, topk=2,
                                                                  num_draft_tokens=6))
        with pytest.raises(wb.RequestError, match="sampling"):
            client.generate(["a", "b"], [greedy(2)])
        assert client.generate([], greedy(2)) == []
        assert client.health()
        assert client.server_info()["speculative_algorithm"] == "EAGLE3"


def test_wait_healthy(server) -> None:
    assert wait_healthy(server.url, timeout=10, interval=0.05) < 10
    with pytest.raises(TimeoutError, match="not healthy"):
        wait_healthy("http://127.0.0.1:9", timeout=0.3, interval=0.1)

    class Dead:
        returncode = 3

        def poll(self) -> int:
            return 3

    with pytest.raises(RuntimeError, match="code 3"):
        wait_healthy("http://127.0.0.1:9", timeout=5, proc=Dead())
