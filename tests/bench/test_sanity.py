"""workbench.bench.sanity: every check fires on the numbers that should raise it, and only on
those; confidence intervals match Student's t; machine facts are present."""

from __future__ import annotations

import pandas as pd

from workbench.bench import sanity
from workbench.bench.sanity import Flag, LoadSampler, mark, sanity_flags
from workbench.machine import format_machine, machine_info, machine_kind


def _codes(flags: list[Flag]) -> list[str]:
    return [f.code for f in flags]


def test_clean_run_has_no_flags() -> None:
    rows = [
        {"arm": "baseline", "concurrency": 1, "tok_s": 100.0, "itl_p50_ms": 10.0, "tau": 1.0,
         "spec_share": 0.0, "vs_baseline": 1.0},
        {"arm": "never", "concurrency": 1, "tok_s": 99.0, "itl_p50_ms": 10.1, "tau": 1.0,
         "spec_share": 0.0, "vs_baseline": 0.99},
        {"arm": "eagle3", "concurrency": 1, "tok_s": 200.0, "itl_p50_ms": 15.0, "tau": 3.0,
         "spec_share": 1.0, "vs_baseline": 2.0},
    ]
    assert sanity_flags(rows, load={"before": [0.5, 0, 0], "after": [1.0, 0, 0]}, cores=2) == []


def test_load_above_cores_before_or_after() -> None:
    flags = sanity_flags([], load={"before": [0.5, 0, 0], "after": [3.1, 0, 0]}, cores=2)
    assert _codes(flags) == ["loaded"] and "after" in flags[0].message and flags[0].row is None
    row = {"arm": "a", "concurrency": 4, "load_before": 2.5, "load_after": 1.0}
    flags = sanity_flags([row], cores=2)
    assert _codes(flags) == ["loaded"] and flags[0].row == row
    assert sanity_flags([row], cores=4) == []


def test_tok_s_vs_itl_at_c1_only() -> None:
    bad = {"arm": "baseline", "concurrency": 1, "tok_s": 70.0, "itl_p50_ms": 10.0, "tau": 1.0,
           "spec_share": 0.0}
    assert _codes(sanity_flags([bad])) == ["tok_s_vs_itl"]
    # a speculative arm emits tau tokens per step: 3 × 1000 / 15 = 200
    ok = {"arm": "eagle3", "concurrency": 1, "tok_s": 190.0, "itl_p50_ms": 15.0, "tau": 3.0,
          "spec_share": 1.0}
    assert sanity_flags([ok]) == []
    assert sanity_flags([dict(bad, concurrency=4)]) == []  # only checked at c=1
    assert sanity_flags([dict(bad, spec_share=0.5)]) == []  # mixed steps: no single ITL
    # with TTFT and tokens per request: 64 / (60 + 63 × 23.18 / 4.56) ms = 168 tok/s
    spec = {"arm": "eagle3", "concurrency": 1, "tok_s": 152.4, "itl_p50_ms": 23.18, "tau": 4.56,
            "spec_share": 0.99, "ttft_p50_ms": 60.0, "tokens": 512, "requests": 8}
    assert sanity_flags([spec]) == []
    assert _codes(sanity_flags([dict(spec, tok_s=120.0)])) == ["tok_s_vs_itl"]


def test_never_vs_baseline_uses_mean_over_repeats() -> None:
    rows = [{"arm": "baseline", "concurrency": 8, "repeat": r, "tok_s": 100.0} for r in (0, 1)]
    rows += [{"arm": "never", "concurrency": 8, "repeat": 0, "tok_s": 90.0},
             {"arm": "never", "concurrency": 8, "repeat": 1, "tok_s": 96.0}]
    flags = sanity_flags(rows)
    assert _codes(flags) == ["never_vs_baseline"] and "0.930" in flags[0].message
    rows[2]["tok_s"] = 98.0  # mean 97 → 3 % off: within 5 %
    assert sanity_flags(rows) == []


def test_speedup_above_tau() -> None:
    rows = [{"arm": "eagle3", "speedup": 3.2, "tau": 3.0},
            {"arm": "chain", "speedup": 2.0, "tau": 3.0},
            {"arm": "never", "vs_baseline": 1.03, "tau": 1.0, "spec_share": 0.0}]
    flags = sanity_flags(rows)
    assert _codes(flags) == ["speedup_above_tau"] and flags[0].row["arm"] == "eagle3"


def test_mark_puts_codes_on_the_matching_rows() -> None:
    df = pd.DataFrame([{"arm": "baseline", "concurrency": c, "tok_s": 100.0} for c in (1, 2)]
                      + [{"arm": "never", "concurrency": 1, "tok_s": 80.0},
                         {"arm": "never", "concurrency": 2, "tok_s": 100.0}])
    flags = sanity_flags(df)
    marked = mark(df, flags)
    assert marked["flags"].tolist() == ["", "", "never_vs_baseline", ""]
    assert "flags" not in df  # a copy
    run_wide = mark(df, [Flag("loaded", "load 3 > 2 cores")])
    assert set(run_wide["flags"]) == {"loaded"}


def test_load_sampler_and_report() -> None:
    with LoadSampler(cores=2) as load:
        pass
    d = load.as_dict()
    assert d["cores"] == 2 and len(d["before"]) == 3 and len(d["after"]) == 3
    rep = sanity.report([Flag("loaded", "x")], d, {"cpu": "test"})
    assert rep["flagged"] and rep["machine"] == {"cpu": "test"}
    assert rep["flags"] == [{"code": "loaded", "message": "x", "row": None}]


def test_exit_codes() -> None:
    f = [Flag("loaded", "x")]
    assert sanity.exit_code(True, f, strict=False) == 0
    assert sanity.exit_code(True, f, strict=True) == 2
    assert sanity.exit_code(True, [], strict=True) == 0
    assert sanity.exit_code(False, [], strict=True) == 1


def test_machine_info_fields() -> None:
    info = machine_info()
    for key in ("cpu", "kind", "flags", "l2", "l3", "cores", "torch", "commit", "loadavg"):
        assert key in info
    assert isinstance(info["flags"], list)
    assert machine_kind("Intel(R) Xeon(R) Platinum 8581C CPU @ 2.10GHz") == \
        "intel-xeon-platinum-8581c"
    assert machine_kind("AMD EPYC 9B14 96-Core Processor") == "amd-epyc-9b14"
    assert machine_kind("AMD EPYC") == "amd-epyc"
    # a generic name (a hypervisor's) names several CPUs: the family tells them apart
    assert machine_kind("AMD EPYC", 25) == "amd-epyc-family-25"
    assert machine_kind("AMD EPYC", 26) == "amd-epyc-family-26"
    assert machine_kind("AMD EPYC 9B14 96-Core Processor", 25) == "amd-epyc-9b14"
    assert info["cpu"] in format_machine(info)
