"""``bench threshold --url BASELINE_URL,EAGLE3_URL``: the box's crossover, swept over HTTP.

Both servers are swept level by level (closed loop, the same prompts, the two arms back to back,
``workbench.bench.http``); :func:`workbench.remote.crossover.threshold_rule` names the crossover and
the suggested threshold, and ``OUT/threshold.json`` is what
:func:`workbench.remote.launch.plan_from_threshold` turns into the adaptive launch.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from workbench.bench.http import run_http_bench
from workbench.remote.crossover import split_urls, threshold_rule


def sweep_threshold(url: str, prompts: Sequence[str], levels: Sequence[int],
                    max_new_tokens: int, out: str | Path, progress: bool = True,
                    ) -> dict[str, Any]:
    """Sweep the baseline and EAGLE-3 servers of ``url`` (:func:`split_urls`), print the
    table and the suggested threshold, write ``out/threshold.json``; returns that document."""
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
