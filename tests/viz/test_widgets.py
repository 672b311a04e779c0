"""Widgets driven headlessly: set ``.value`` on controls, ``click()`` buttons, read the data."""

from __future__ import annotations

from pathlib import Path

import pytest

import workbench as wb
from workbench.viz.widgets import Explorer, SweepProgress

PROMPT = "def fnmatch(name, pat):"


@pytest.fixture
def explorer(engine: wb.Engine) -> Explorer:
    x = Explorer(engine, prompt=PROMPT, num_steps=4, topk=3, num_draft_tokens=10,
                 max_new_tokens=24)
    yield x
    x.reset()


def names(x: Explorer) -> list[str]:
    return [t.name for t in x.tree.data]


def test_step_button_draws_one_verified_tree(explorer: Explorer) -> None:
    assert "press step" in explorer.placeholder.value and explorer.tree is None
    assert explorer.tree_box.children == (explorer.placeholder,)
    explorer.step_button.click()
    # the placeholder leaves the box (the browser swaps the child): no stale message on a tree
    assert explorer.tree_box.children == (explorer.tree,)
    assert [t["name"] for t in explorer.tree._widget_data if t.get("name")][-1] == \
        "bonus (target)"  # the saved state (what an exported page shows) is this tree
    (rep,) = explorer.reports
    # the first step also prefills, which samples the first token
    assert rep.verify_step is not None and rep.new_tokens == rep.accept_length + 1
    assert "bonus (target)" in names(explorer)
    nodes = sum(len(t.x) for t in explorer.tree.data
                if t.name in ("drafted, not accepted", "accepted", "root (last verified token)"))
    assert nodes == 10
    accepted = list(next(t for t in explorer.tree.data if t.name == "accepted").customdata)
    tree = explorer.tree_frame()
    last = tree[tree.step == rep.verify_step]
    assert [0] + accepted == last[last.accepted].node.tolist()
    assert f"τ = {rep.accept_length}" in explorer.status.value
    first_widget = explorer.tree
    explorer.step_button.click()
    second = explorer.reports[1]
    assert second.verify_step > rep.verify_step and second.new_tokens == second.accept_length
    assert explorer.tree is not first_widget and explorer.tree_box.children == (explorer.tree,)
    assert f"step {second.verify_step}," in explorer.tree.layout.title.text


def test_run_is_lossless_and_finishes(explorer: Explorer, engine: wb.Engine) -> None:
    explorer.run_button.click()
    assert explorer.finished and "finished (length)" in explorer.status.value
    out = engine.output(explorer.rid)
    base = engine.generate([PROMPT], wb.SamplingParams(max_new_tokens=24))[0]
    assert out.token_ids == base.token_ids
    assert explorer.text.value.count("border-bottom") == sum(out.from_draft)


def test_chain_forces_n_and_tree_bounds_it(explorer: Explorer) -> None:
    explorer.topk.value = 1
    assert explorer.num_draft_tokens.disabled and explorer.num_draft_tokens.value == 5
    explorer.num_steps.value = 6
    assert explorer.num_draft_tokens.value == 7
    explorer.topk.value = 2
    assert not explorer.num_draft_tokens.disabled and explorer.num_draft_tokens.max == 13
    explorer.num_draft_tokens.value = 64  # clamped by the slider
    assert explorer.spec_config().num_draft_tokens == 13


def test_settings_apply_from_the_next_step(explorer: Explorer) -> None:
    explorer.step_button.click()
    explorer.topk.value = 1
    explorer.num_steps.value = 3
    explorer.step_button.click()
    tree = explorer.tree_frame()
    last = tree[tree.step == explorer.reports[-1].verify_step]
    assert len(last) == 4 and last.depth.max() == 3  # a chain of 3 + root


def test_policy_off_then_on_mid_request(explorer: Explorer, engine: wb.Engine) -> None:
    explorer.policy.value = "off"
    assert explorer.threshold.disabled
    explorer.step_button.click()
    assert explorer.reports[-1].verify_step is None
    assert "plain decoding" in explorer.placeholder.value
    assert explorer.tree_box.children == (explorer.placeholder,)
    explorer.policy.value = "BatchThreshold"
    assert not explorer.threshold.disabled
    explorer.threshold.value = 0  # decode batch 1 > 0: still plain
    explorer.step_button.click()
    assert explorer.reports[-1].verify_step is None
    explorer.threshold.value = 1
    explorer.run_button.click()  # the warm draft picks up where it left off
    assert any(r.verify_step is not None for r in explorer.reports)
    base = engine.generate([PROMPT], wb.SamplingParams(max_new_tokens=24))[0]
    assert engine.output(explorer.rid).token_ids == base.token_ids


def test_reset_aborts_and_restarts(explorer: Explorer, engine: wb.Engine) -> None:
    explorer.step_button.click()
    first = explorer.rid
    explorer.reset_button.click()
    assert engine.requests[first].finish_reason == "abort" and explorer.rid is None
    explorer.prompt.value = "import os\n"
    explorer.step_button.click()
    assert explorer.rid != first
    assert engine.requests[explorer.rid].prompt_ids == engine.tokenize("import os\n")


def test_errors_become_the_status_line(explorer: Explorer) -> None:
    explorer.prompt.value = ""
    explorer.step_button.click()  # RequestError: empty prompt
    assert "error" in explorer.status.value and "empty prompt" in explorer.status.value


def test_engine_without_draft(micro_target: Path) -> None:
    base = wb.Engine.from_pretrained(micro_target, config=wb.EngineConfig(self_check=False))
    x = Explorer(base, prompt=PROMPT, max_new_tokens=4)
    assert x.policy.disabled and x.spec_config() is None
    x.run_button.click()
    assert x.finished and all(r.verify_step is None for r in x.reports)
    assert "no draft tree" in x.placeholder.value and x.tree is None
    base.close()


def test_sweep_progress_live_plot() -> None:
    sp = SweepProgress(4, "grid", x="n", y="tau", color="k")
    for n in sp.iter([2, 4, 6, 8]):
        sp.update(n=n, tau=1.0 + n / 4, k=n % 4)
        assert sp.bar.value == len(sp.rows)
    assert sp.bar.bar_style == "success"
    assert sp.widget.children[-1] is sp.figure  # frozen: the final figure is its initial state
    assert [t["name"] for t in sp.figure._widget_data] == ["2", "0"]  # the saved state
    assert [t.name for t in sp.figure.data] == ["2", "0"]  # legend titled "k", not "k=2"
    assert sp.figure.layout.legend.title.text == "k"
    assert list(sp.figure.data[1].x) == [4, 8] and list(sp.figure.data[1].y) == [2.0, 3.0]
    assert "4/4" in sp.label.value and "tau=3" in sp.label.value
    assert sp.frame().shape == (4, 3)
    plain = SweepProgress(2)
    plain.update(a=1)
    assert plain.figure is None and plain.bar.value == 1
