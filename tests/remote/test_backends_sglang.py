"""SGLang backend: launch command golden tests against the flag table (every plan built here is
also parsed by SGLang's own code in test_sglang_upstream); the HTTP client against the native
(SGLang-compatible) server and against SGLang-shaped answers (adaptive, histograms)."""

from __future__ import annotations

import json

import httpx
import pytest
from helpers import id_prompts
from plans import make_plan
from serve.serving import SPEC, TEXT_PROMPTS, greedy

import workbench as wb
from workbench.core import RequestMetrics
from workbench.remote.sglang import (
    DEFAULT_SPEC,
    SGLangClient,
    accept_lengths_from_histogram,
    approx_accept_lengths,
    launch_command,
    launch_plan,
    round_accept_lengths,
    sglang_accept_lengths,
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

WARM = {"draft_state": "warm"}  # SGLang's own draft state: no note


def test_launch_command_eagle3_flag_table() -> None:
    plan = make_plan("/m/target", "/m/draft", tp=8,
                     spec=wb.SpecConfig(num_steps=5, topk=4, num_draft_tokens=16, **WARM))
    assert plan.command == HEAD + spec_flags(5, 4, 16) + TAIL
    assert plan.notes == [] and plan.files == {} and plan.max_running_requests == 48


def test_launch_command_defaults_and_chain() -> None:
    assert make_plan("/m/target", "/m/draft").command == \
        HEAD + spec_flags(DEFAULT_SPEC.num_steps, DEFAULT_SPEC.topk,
                          DEFAULT_SPEC.num_draft_tokens) + TAIL
    chain = make_plan("/m/target", "/m/draft", tp=1, spec=wb.SpecConfig(num_steps=3, topk=1),
                      host="127.0.0.1", port=31000).command
    assert chain == HEAD + spec_flags(3, 1, 4) + ["--tp", "1", "--host", "127.0.0.1",
                                                  "--port", "31000"]


def test_launch_command_baseline() -> None:
    assert launch_command("/m/target") == HEAD + TAIL
    assert make_plan("/m/target").routing_table(8)["sglang_steps"].eq(0).all()


def test_extra_kwargs_become_kebab_flags_with_current_names() -> None:
    plan = make_plan("/m/target", "/m/draft", spec=wb.SpecConfig(5, 4, 16, **WARM),
                     mem_fraction_static=0.8, cuda_graph_max_bs=64, enable_torch_compile=True,
                     disable_radix_cache=False, chunked_prefill_size=None,
                     cuda_graph_bs=[1, 2, 4])
    assert plan.command == HEAD + spec_flags(5, 4, 16) + TAIL + [
        "--mem-fraction-static", "0.8", "--cuda-graph-max-bs-decode", "64",
        "--enable-torch-compile", "--cuda-graph-bs-decode", "1", "2", "4"]
    assert [n.split(":")[0] for n in plan.notes] == ["cuda_graph_max_bs=", "cuda_graph_bs="]
    assert all("ambiguous" in n for n in plan.notes)
    # 0.5.9 had the short names: left alone there
    old = launch_plan("/m/target", "/m/draft", spec=wb.SpecConfig(5, 4, 16, **WARM),
                      sglang_version="0.5.9", cuda_graph_max_bs=64)
    assert old.command[-2:] == ["--cuda-graph-max-bs", "64"]
    with pytest.raises(wb.ConfigError, match="cuda_graph_bs"):
        launch_plan("/m/target", "/m/draft", cuda_graph_bs=[1], cuda_graph_bs_decode=[1])


def adaptive_flags(s: int, path: str = "sglang-adaptive.json") -> list[str]:
    return spec_flags(s, 1, s + 1) + ["--speculative-adaptive", "--speculative-adaptive-config",
                                      path]


def test_batch_threshold_is_an_adaptive_launch(tmp_path) -> None:
    spec = wb.SpecConfig(5, 1, policy=wb.BatchThreshold(8), **WARM)
    plan = make_plan("/m/target", "/m/draft", spec=spec, adaptive_config="cfg/tiers.json")
    assert plan.command == HEAD + adaptive_flags(5, "cfg/tiers.json") + TAIL
    assert plan.notes == [] and plan.differ == ()
    assert json.loads(plan.files["cfg/tiers.json"]) == {"1": {"candidate_steps": [5]},
                                                        "9": {"candidate_steps": [0]}}
    assert plan.adaptive_config == json.loads(plan.files["cfg/tiers.json"])
    (written,) = plan.write_files(tmp_path)
    assert written == tmp_path / "cfg" / "tiers.json"
    assert json.loads(written.read_text()) == plan.adaptive_config
    script = plan.script()
    assert script.startswith("cat > cfg/tiers.json <<'EOF'\n{") and \
        script.endswith(plan.shell())
    table = plan.routing_table()
    assert len(table) == 48  # EAGLE-3's default cap on running requests
    assert table.agree.all() and list(table.sglang_steps[:9]) == [5] * 8 + [0]


def test_batch_threshold_refuses_trees() -> None:
    with pytest.raises(wb.ConfigError, match="spec.topk: 4.*topk 1.*SpecConfig\\(num_steps=5, "
                                             "topk=1\\)"):
        launch_plan("/m/target", "/m/draft",
                    spec=wb.SpecConfig(5, 4, 16, policy=wb.BatchThreshold(8)))
    with pytest.raises(wb.ConfigError, match="StepTable tier starting at 1: topk 4"):
        launch_plan("/m/target", "/m/draft", spec=wb.SpecConfig(5, 1, policy=wb.StepTable(
            {(1, 4): (5, 4, 16), (5, None): None})))


def test_threshold_padding_and_the_nearest_exact_threshold() -> None:
    from workbench.remote.adaptive import spec_decode_capture_sizes

    spec = wb.SpecConfig(5, 1, policy=wb.BatchThreshold(9), **WARM)
    exact = make_plan("/m/target", "/m/draft", spec=spec)
    assert exact.differ == () and exact.capture_bs is None  # no list: raw batch sizes
    padded = make_plan("/m/target", "/m/draft", spec=spec,
                       cuda_graph_bs_decode=spec_decode_capture_sizes(48))
    assert padded.differ == (9,) and padded.proposed_thresholds == (8, 10)
    assert "batch sizes 9: SGLang pads them" in padded.notes[0]
    assert "BatchThreshold(8) or BatchThreshold(10)" in padded.notes[1]
    row = padded.routing_table().iloc[8]
    assert (row.padded, row.tier, row.sglang_steps, row.policy_steps, row.agree) == \
        (10, 10, 0, 5, False)


def test_thresholds_above_eagle3s_running_cap() -> None:
    spec = wb.SpecConfig(5, 1, policy=wb.BatchThreshold(60), **WARM)
    auto = make_plan("/m/target", "/m/draft", spec=spec)
    assert auto.command[-8:-6] == ["--max-running-requests", "120"]
    assert auto.max_running_requests == 120 and "never run" in auto.notes[0]
    assert len(auto.routing_table()) == 120
    mine = make_plan("/m/target", "/m/draft", spec=spec, max_running_requests=200)
    assert mine.max_running_requests == 200 and mine.notes == []
    low = make_plan("/m/target", "/m/draft", spec=spec, max_running_requests=32)
    assert "never reached" in low.notes[0]


def test_step_table_and_zero_thresholds() -> None:
    table = wb.StepTable({(1, 4): (5, 1, 6), (5, 16): (3, 1, 4), (17, 32): (3, 1, 4),
                          (33, None): None})
    plan = make_plan("/m/target", "/m/draft", spec=wb.SpecConfig(3, 1, policy=table, **WARM))
    assert plan.adaptive_config == {"1": {"candidate_steps": [5]},
                                    "5": {"candidate_steps": [3]},
                                    "33": {"candidate_steps": [0]}}  # equal tiers merged
    assert plan.command == HEAD + adaptive_flags(3) + TAIL and plan.routing_table().agree.all()
    odd = make_plan("/m/target", "/m/draft", spec=wb.SpecConfig(2, 1, policy=table, **WARM))
    assert odd.num_steps == 5 and "in no tier" in odd.notes[0]
    for policy in (wb.BatchThreshold(0), wb.StepTable({(1, None): None}), wb.Never()):
        off = make_plan("/m/target", "/m/draft", spec=wb.SpecConfig(5, 1, policy=policy,
                                                                    **WARM))
        assert off.command == HEAD + TAIL and "never speculates" in off.notes[0]


def test_old_sglang_needs_an_upgrade() -> None:
    spec = wb.SpecConfig(5, 1, policy=wb.BatchThreshold(8), **WARM)
    plan = launch_plan("/m/target", "/m/draft", spec=spec, sglang_version="0.5.9")
    assert plan.command == HEAD + spec_flags(5, 1, 6) + TAIL and plan.tiers is None
    assert "verified against SGLang 0.5.23" in plan.notes[0]
    assert "0.5.9 is older than 0.5.23" in plan.notes[1] and "upgrade to >= 0.5.23" in \
        plan.notes[1]
    assert plan.differ[0] == 9  # static speculation drafts above the threshold
    with pytest.raises(wb.ConfigError, match="sglang_version"):
        launch_plan("/m/target", "/m/draft", sglang_version="latest")


def test_export_metrics_and_runtime_policies() -> None:
    plan = make_plan("/m/target", "/m/draft", spec=wb.SpecConfig(5, 1, **WARM),
                     export_metrics_dir="/data/records")
    assert plan.command[-9:-6] == ["--export-metrics-to-file", "--export-metrics-to-file-dir",
                                   "/data/records"]
    assert plan.export_dir == "/data/records"
    flip = make_plan("/m/target", "/m/draft", spec=wb.SpecConfig(5, 1, policy=wb.RandomFlip(),
                                                                 **WARM))
    assert "decides at run time" in flip.notes[0]
    assert flip.routing_table(4).policy_steps.isna().all()


def test_plan_from_threshold(tmp_path) -> None:
    from workbench.remote.launch import plan_from_threshold, threshold_from

    (tmp_path / "threshold.json").write_text(json.dumps(
        {"threshold": {"crossover": 16, "suggested_n": 8}, "rows": []}))
    plan = plan_from_threshold(tmp_path, "/m/target", "/m/draft",
                               spec=wb.SpecConfig(5, 1, **WARM))
    assert plan.spec.policy == wb.BatchThreshold(8)
    assert plan.notes[0] == ("BatchThreshold(8) from bench threshold (baseline caught up at "
                             "concurrency 16)")
    assert threshold_from(4) == (4, None)
    with pytest.raises(wb.ConfigError, match="threshold: .*not found"):
        threshold_from(tmp_path / "missing.json")


def test_always_never_and_simulated_acceptance() -> None:
    always = make_plan("/m/target", "/m/draft", spec=wb.SpecConfig(5, 4, 16, policy=wb.Always(),
                                                                    **WARM))
    assert always.command == HEAD + spec_flags(5, 4, 16) + TAIL and always.notes == []
    never = make_plan("/m/target", "/m/draft", spec=wb.SpecConfig(5, 4, 16, policy=wb.Never()))
    assert never.command == HEAD + TAIL and "Never" in never.notes[0]
    sim = make_plan("/m/target", "/m/draft",
                    spec=wb.SpecConfig(5, 4, 16, simulate_accept_length=2.5, **WARM))
    assert sim.env == {"SGLANG_SIMULATE_ACC_LEN": "2.5"}
    assert sim.shell().startswith("SGLANG_SIMULATE_ACC_LEN=2.5 python -m sglang.launch_server ")
    cold = make_plan("/m/target", "/m/draft", spec=wb.SpecConfig(5, 4, 16, draft_state="cold"))
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


def test_accept_lengths_counted_as_sglang_counts() -> None:
    # 3 rounds with 0 correct drafts (plain steps-0 rounds included), 1 with 2, 2 with 5
    assert accept_lengths_from_histogram([3, 0, 1, 0, 0, 2]) == [1, 1, 1, 3, 6, 6]
    meta = {"completion_tokens": 20, "spec_verify_ct": 6,
            "spec_correct_drafts_histogram": [3, 0, 1, 0, 0, 2]}
    assert round_accept_lengths(meta) == [1, 1, 1, 3, 6, 6]
    assert round_accept_lengths({"completion_tokens": 10, "spec_verify_ct": 4}) == [3, 3, 2, 2]
    with pytest.raises(wb.RequestFailed, match="6 rounds but spec_verify_ct=5"):
        round_accept_lengths({**meta, "spec_verify_ct": 5})
    with pytest.raises(wb.RequestFailed, match=r"histogram\[1\]"):
        accept_lengths_from_histogram([1, -2])
    # a speculating engine's plain steps are SGLang's steps-0 rounds: accept length 1 each
    m = RequestMetrics(verify_ct=2, accept_lengths=[4, 2], correct_drafts=[3, 1],
                       plain_steps=3, spec_plain_steps=3)
    assert sglang_accept_lengths(m) == [4, 2, 1, 1, 1]
    # a baseline engine's are no rounds (SGLang without speculation counts none)
    assert sglang_accept_lengths(RequestMetrics(plain_steps=3)) == []


# ---- client against the native server --------------------------------------------------------

N = 8


@pytest.mark.parametrize("stream", [True, False])
def test_client_generate_equals_engine(server, solo, stream: bool) -> None:
    prompts: list = TEXT_PROMPTS[:4] + id_prompts(3, seed=4, lo=2, hi=24)
    with SGLangClient(server.url, stream=stream, max_concurrency=4) as client:
        outs = client.generate(prompts, greedy(N), spec=SPEC)
    assert len(outs) == len(prompts)
    for p, o in zip(prompts, outs, strict=True):
        ref = solo(p, N)
        assert isinstance(o, wb.RequestOutput)
        assert o.token_ids == ref.token_ids and o.text == ref.text
        assert o.finish_reason == "length"
        # the server counts SGLang's rounds (verify steps and the speculating engine's plain
        # steps) and sends their histogram: the client reads them back exactly (order lost)
        assert o.metrics.verify_ct == len(sglang_accept_lengths(ref.metrics))
        assert ref.metrics.verify_ct > 0
        assert sorted(o.metrics.accept_lengths) == sorted(sglang_accept_lengths(ref.metrics))
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
        assert e.verify_ct == o.metrics.verify_ct and e.accept_lengths == o.metrics.accept_lengths
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


# ---- client against SGLang-shaped answers (no server: httpx.MockTransport) -------------------

def fake_sglang(info: dict, meta: dict | None = None) -> SGLangClient:
    """A client whose transport answers like SGLang 0.5.23 (non-streamed /generate)."""
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/server_info":
            return httpx.Response(200, json=info)
        if request.url.path == "/generate":
            return httpx.Response(200, json={"text": "x", "output_ids": [7] * 20,
                                             "meta_info": meta or {}})
        return httpx.Response(404)

    client = SGLangClient("http://box:30000", stream=False)
    client._http = httpx.Client(base_url="http://box:30000",
                                transport=httpx.MockTransport(handler))
    return client


ADAPTIVE_INFO = {"speculative_algorithm": "EAGLE3", "speculative_adaptive": True,
                 "speculative_num_steps": 5, "speculative_eagle_topk": 1,
                 "speculative_num_draft_tokens": 6}


def test_client_refuses_a_threshold_experiment_on_static_fallback() -> None:
    spec = wb.SpecConfig(5, 1, policy=wb.BatchThreshold(8))
    fell_back = fake_sglang({**ADAPTIVE_INFO, "speculative_adaptive": False})
    assert fell_back.speculation_mode() == "static"
    with pytest.raises(wb.ConfigError, match="fell back to static speculation"):
        fell_back.generate(["a"], greedy(2), spec=spec)
    fell_back.generate(["a"], greedy(2), spec=wb.SpecConfig(5, 1))  # Always: static is right
    meta = {"id": "r1", "prompt_tokens": 3, "completion_tokens": 20, "spec_verify_ct": 6,
            "spec_accept_length": 20 / 6, "finish_reason": {"type": "length", "length": 20},
            "spec_correct_drafts_histogram": [3, 0, 1, 0, 0, 2]}
    adaptive = fake_sglang(ADAPTIVE_INFO, meta)
    assert adaptive.speculation_mode() == "adaptive"
    (out,) = adaptive.generate(["a"], greedy(20), spec=spec)
    assert out.metrics.verify_ct == 6 and out.metrics.accept_lengths == [1, 1, 1, 3, 6, 6]
    assert out.finish_reason == "length"
    with pytest.raises(wb.ConfigError, match="spec.topk: server runs speculative_eagle_topk=4"):
        fake_sglang({**ADAPTIVE_INFO, "speculative_eagle_topk": 4}).generate(
            ["a"], greedy(2), spec=spec)
    assert fake_sglang({"speculative_algorithm": None}).speculation_mode() == "none"
    with pytest.raises(wb.ConfigError, match="no speculative_adaptive: this server cannot"):
        fake_sglang({"speculative_algorithm": "EAGLE3", "speculative_eagle_topk": 1}).generate(
            ["a"], greedy(2), spec=spec)
