"""`lab fit-box` on a box whose truth is known: prefill priced once, acceptance without a
histogram carried as a band, the oracle a bound of every arm, the server's running-request cap
carried and honoured, levels above it said."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

from workbench.lab.boxreplay import fit_box
from workbench.lab.replay import replay
from workbench.remote.records import read_request_metrics

REMOTE = Path(__file__).resolve().parents[1] / "remote"
sys.path.insert(0, str(REMOTE))
from sglang_records import load_writer, meta_info, request_params  # noqa: E402

SHAPE = (3, 1, 4)
LEVELS = (1, 4, 16, 32)
PROMPT, OUT = 1000, 48
TARGET = (20.0, 0.5)  # the box's true target forward: a + b * tokens (ms)
DRAFT = (1.0, 0.2)


def _t(x: float) -> float:
    return TARGET[0] + TARGET[1] * x


def _d(x: float) -> float:
    return DRAFT[0] + DRAFT[1] * x


def _records(folder: Path, histogram: bool, n: int = 24) -> None:
    writer, rng, lines = load_writer(), random.Random(0), []
    for i in range(n):
        rounds, emitted = [], 1
        while emitted < OUT:
            k = 0
            while k < 3 and rng.random() < (0.8, 0.6, 0.5)[k]:
                k += 1
            k = min(k, OUT - emitted - 1)
            rounds.append(k)
            emitted += k + 1
        meta = meta_info(f"r{i}", PROMPT, rounds, completion=emitted,
                         finish={"type": "length", "length": emitted}, num_draft_tokens=4,
                         e2e=1.0, sent_ts=1000.0 + i)
        if not histogram:  # SGLang 0.5.9 sends no per-round histogram
            meta.pop("spec_correct_drafts_histogram")
        lines.append(writer.line(request_params(f"r{i}", f"p{i}", OUT), meta))
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sglang-request-metrics-20261201_08.log").write_text("".join(lines))


def _sweep(tau: float) -> dict:
    """tok/s of closed loops on the true box, each request's prefill paid once."""
    rows = []
    for c in LEVELS:
        plain = OUT * _t(c) + c * _t(PROMPT)
        spec = OUT / tau * (_t(4 * c) + 2 * _d(c) + _d(c * tau)) + c * (_t(PROMPT) + _d(PROMPT))
        rows.append({"arm": "baseline", "concurrency": c, "tok_s": 1e3 * c * OUT / plain})
        rows.append({"arm": "eagle3", "concurrency": c, "tok_s": 1e3 * c * OUT / spec,
                     "tau": tau})
    return {"rows": rows, "threshold": {}}


@pytest.fixture(scope="module")
def fitted(tmp_path_factory: pytest.TempPathFactory) -> tuple:
    folder = tmp_path_factory.mktemp("rec")
    _records(folder, histogram=True)
    df = read_request_metrics(folder)
    tau = float(df["tau"].mean())
    run = fit_box(_sweep(tau), df, SHAPE)
    res, _ = replay(run, "always", list(LEVELS))
    return run, res, _sweep(tau)


def test_prefill_priced_once(fitted: tuple) -> None:
    """The replay of its own inputs gives back the sweep's tok/s (each prompt's prefill is in
    the sweep's tok/s: the fit takes it out of the decode line before the replay adds it)."""
    _, res, sweep = fitted
    want = {(r["arm"], r["concurrency"]): r["tok_s"] for r in sweep["rows"]}
    for _, r in res.iterrows():
        arm = {"never": "baseline", "always": "eagle3"}.get(r["policy"])
        if arm is None:
            continue
        assert r["tok_s"] == pytest.approx(want[(arm, r["concurrency"])], rel=0.10), \
            (r["policy"], r["concurrency"])


def test_no_histogram_is_a_flagged_band(tmp_path: Path) -> None:
    _records(tmp_path, histogram=False)
    df = read_request_metrics(tmp_path)
    run = fit_box(_sweep(2.0), df, SHAPE)
    assert run.meta["histogram"] is False
    assert run.rates != pytest.approx((1.0, 0.5, 0.0))  # no profile made up from τ
    assert any("no per-round histogram" in n for n in run.notes)
    band = run.meta["tau_band"]  # τ of every chain length over the profiles τ allows
    lo, hi = band["5"]
    assert lo < hi and band["3"][0] == pytest.approx(band["3"][1])


def test_oracle_bounds_every_arm(fitted: tuple) -> None:
    _, res, _ = fitted
    assert (res["regret"] >= -1e-12).all()
    assert {"bound", "bound_note"} <= set(res.columns)
    beaten = res[res["bound"] != "oracle"]
    assert all("per-step" in n for n in beaten["bound_note"])


def test_running_request_cap_carried_and_honoured(fitted: tuple, tmp_path: Path) -> None:
    run = fitted[0]
    assert run.meta["max_running_requests"] == 48  # SGLang's EAGLE default
    _records(tmp_path, histogram=True)
    small = fit_box(fitted[2], read_request_metrics(tmp_path), SHAPE, max_running_requests=8)
    small.save(tmp_path / "box")
    from workbench.lab.replay import load_run

    back = load_run(str(tmp_path / "box"))
    assert back.meta["max_running_requests"] == 8
    res, results = replay(back, "always", [4, 16])
    row = res[(res["policy"] == "always") & (res["concurrency"] == 16)].iloc[0]
    assert row["batch_cap"] == 8 and bool(row["capped"])
    assert max(b for b, *_ in results[("always", 16)].steps) <= 8
    assert not res[res["concurrency"] == 4]["capped"].any()


def test_fit_box_cli_carries_cap_and_histogram(tmp_path: Path) -> None:
    import json
    import subprocess

    _records(tmp_path / "rec", histogram=False)
    (tmp_path / "threshold.json").write_text(json.dumps(_sweep(2.0)))
    r = subprocess.run([sys.executable, "-m", "workbench", "lab", "fit-box", "--threshold-json",
                        str(tmp_path / "threshold.json"), "--records", str(tmp_path / "rec"),
                        "--shape", "3,1,4", "--out", str(tmp_path / "box"),
                        "--max-running-requests", "16"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    meta = json.loads((tmp_path / "box" / "box.json").read_text())["meta"]
    assert meta["max_running_requests"] == 16 and meta["histogram"] is False
    assert "no per-round histogram" in r.stdout
    r = subprocess.run([sys.executable, "-m", "workbench", "lab", "replay", str(tmp_path / "box"),
                        "--policy", "always", "--levels", "4,32"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "c=32: above the server's running-request cap 16" in r.stdout
