"""Issue 50's small page defects: a one-sample interval, an unrunnable "saved by" command,
a run-wide flag repeated over every bar."""
from __future__ import annotations

import pandas as pd

from workbench.viz import figures as F
from workbench.viz import prose as P
from workbench.viz.report import rerun_command, runnable_command


def test_zero_width_interval_is_not_printed() -> None:
    assert P.interval(1.81, 1.81, 1.81, "×") == "1.81×"
    assert P.interval(1.8, 1.7, 1.9, "×") == "1.80× [1.70–1.90]"
    assert "[" not in P.ratio("the tree", 1.81, 1.81, 1.81, n=1).text


def test_spliced_command_is_not_runnable_and_is_rebuilt() -> None:
    bad = ("python -m workbench bench concurrency --out data/results/ (from /tmp/s/)conc "
           "--levels 1,4")
    assert not runnable_command(bad)
    assert runnable_command("python -m workbench bench concurrency --levels 1,4 (one repeat)")
    assert not runnable_command("bench concurrency --levels 1")
    cmd = rerun_command("concurrency", {"levels": [1, 4], "max_new_tokens": 64, "repeats": 1})
    assert cmd == ("python -m workbench bench concurrency --levels 1,4 --max-new-tokens 64 "
                   "--repeats 1")
    assert runnable_command(cmd)


def test_run_wide_flag_said_once_labels_above_whiskers() -> None:
    s = pd.DataFrame({"arm": ["baseline", "a", "b"], "speedup": [1.0, 0.6, 0.7],
                      "speedup_lo": [None, 0.5, 0.55], "speedup_hi": [None, 0.75, 0.9],
                      "tau": [1.0, 1.7, 2.4], "n": [4, 4, 4], "flags": ["loaded"] * 3})
    fig = F.speedup_bars(s)
    labels = [a for a in fig.layout.annotations if a.yref == "y"]
    assert all("⚠" not in a.text for a in labels)
    assert "every row: loaded" in fig.layout.title.text
    assert [a.y for a in labels] == [1.0, 0.75, 0.9]  # above each error bar, not on the bar
