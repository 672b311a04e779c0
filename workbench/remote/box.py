"""The seeds' experiment on the box: where does the baseline catch up with EAGLE-3?

``python -m workbench bench threshold --url BASELINE_URL,EAGLE3_URL`` sweeps both servers
(closed loop, the same prompts, level by level, the two arms back to back) and applies the
rule of :func:`workbench.bench.concurrency.find_threshold`: the crossover is the smallest level
where the baseline's output tok/s >= EAGLE-3's, the suggested threshold the largest level below
it (0: never speculate; no crossover: the highest level measured). It writes
``OUT/threshold.json`` (``{"threshold": {"crossover", "suggested_n"}, "rows": [...]}``), which
:func:`workbench.remote.launch.plan_from_threshold` turns into the adaptive launch.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from workbench.errors import ConfigError


def threshold_rule(baseline: dict[int, float], eagle3: dict[int, float]) -> tuple[int | None,
                                                                                   int]:
    """(crossover, suggested_n) from tok/s per concurrency level of the two arms."""
    levels = sorted(set(baseline) & set(eagle3))
    if not levels:
        raise ConfigError("threshold: the two sweeps share no concurrency level")
    cross = next((c for c in levels if baseline[c] >= eagle3[c]), None)
    if cross is None:
        return None, levels[-1]
    below = [c for c in levels if c < cross]
    return cross, below[-1] if below else 0


def split_urls(url: str) -> tuple[str, str]:
    """``"BASE,EAGLE3"`` → the two server URLs."""
    parts = [u.strip() for u in str(url).split(",") if u.strip()]
    if len(parts) != 2:
        raise ConfigError(f"url: bench threshold against servers needs two URLs, "
                          f"'BASELINE_URL,EAGLE3_URL'; got {url!r}")
    return parts[0], parts[1]


def sweep_threshold(url: str, prompts: Sequence[str], levels: Sequence[int],
                    max_new_tokens: int, out: str | Path, progress: bool = True,
                    ) -> dict[str, Any]:
    """Sweep the baseline and EAGLE-3 servers of ``url`` (:func:`split_urls`), print the
    table and the suggested threshold, write ``out/threshold.json``; returns that document."""
    from workbench.bench.http import run_http_bench

    base_url, spec_url = split_urls(url)
    rows: list[dict[str, Any]] = []
    for c in levels:
        plist = [prompts[i % len(prompts)] for i in range(max(2 * c, len(prompts)))]
        for arm, u in (("baseline", base_url), ("eagle3", spec_url)):
            res = run_http_bench(u, plist, concurrency=c, max_new_tokens=max_new_tokens,
                                 progress=progress)
            rows.append({"arm": arm, "url": u, "concurrency": c,
                         "tok_s": res["output_throughput"], "failed": res.get("failed", 0),
                         "itl_p50_ms": res.get("p50_itl_ms"), "tau": res.get("accept_length")})
    tok = {a: {r["concurrency"]: r["tok_s"] for r in rows if r["arm"] == a}
           for a in ("baseline", "eagle3")}
    crossover, n = threshold_rule(tok["baseline"], tok["eagle3"])
    print(f"{'concurrency':>11} {'baseline tok/s':>15} {'eagle3 tok/s':>13} {'speedup':>8}")
    for c in levels:
        b, e = tok["baseline"][c], tok["eagle3"][c]
        print(f"{c:>11} {b:>15.1f} {e:>13.1f} {e / b if b else float('nan'):>8.2f}")
    failed = [(r["arm"], r["concurrency"]) for r in rows if r["failed"]]
    if failed:
        print(f"WARNING: failed requests at (arm, concurrency) {failed}: their tok/s count only "
              "the requests that finished")
    where = "never (eagle3 wins at every level)" if crossover is None else \
        f"at concurrency {crossover}"
    print(f"\nbaseline catches up {where}; suggested BatchThreshold({n})")
    doc = {"urls": {"baseline": base_url, "eagle3": spec_url}, "max_new_tokens": max_new_tokens,
           "prompts": len(prompts), "rows": rows,
           "threshold": {"crossover": crossover, "suggested_n": n}}
    path = Path(out)
    path.mkdir(parents=True, exist_ok=True)
    (path / "threshold.json").write_text(json.dumps(doc, indent=2) + "\n")
    print(f"results: {path / 'threshold.json'} → workbench.remote.launch."
          "plan_from_threshold(...)")
    return doc
