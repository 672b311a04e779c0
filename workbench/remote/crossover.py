"""The seeds' experiment on the box: where does the baseline catch up with EAGLE-3?

``python -m workbench bench threshold --url BASELINE_URL,EAGLE3_URL``
(:func:`workbench.bench.threshold.sweep_threshold`) sweeps both servers (closed loop, the same
prompts, level by level, the two arms back to back) and applies :func:`threshold_rule`, the
rule of :func:`workbench.bench.concurrency.find_threshold`: the crossover is the smallest level
where the baseline's output tok/s >= EAGLE-3's, the suggested threshold the largest level below
it (0: never speculate; no crossover: the highest level measured). It writes
``OUT/threshold.json`` (``{"threshold": {"crossover", "suggested_n"}, "rows": [...]}``), which
:func:`workbench.remote.launch.plan_from_threshold` turns into the adaptive launch.
"""

from __future__ import annotations

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
