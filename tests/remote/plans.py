"""Every launch plan the backend tests build goes through :func:`make_plan`, which records it in
:data:`PRODUCED`; ``test_sglang_upstream`` parses the :data:`CATALOGUE` and everything recorded
with SGLang 0.5.23's own code."""

from __future__ import annotations

from typing import Any

import workbench as wb
from workbench.remote.adaptive import spec_decode_capture_sizes
from workbench.remote.launch import LaunchPlan, launch_plan

PRODUCED: list[LaunchPlan] = []

T, D = "/m/target", "/m/draft"
CHAIN5 = wb.SpecConfig(num_steps=5, topk=1)
TABLE = wb.StepTable({(1, 4): (5, 1, 6), (5, 16): (3, 1, 4), (17, None): None})


def make_plan(*args: Any, **kwargs: Any) -> LaunchPlan:
    plan = launch_plan(*args, **kwargs)
    PRODUCED.append(plan)
    return plan


def _chain(n: int | None = None, s: int = 5, **kw: Any) -> wb.SpecConfig:
    policy = wb.Always() if n is None else wb.BatchThreshold(n)
    return wb.SpecConfig(num_steps=s, topk=1, policy=policy, **kw)


# (name, args, kwargs): the shapes of launch the box runs
CATALOGUE: list[tuple[str, tuple, dict[str, Any]]] = [
    ("baseline", (T,), {}),
    ("static-tree", (T, D), {"spec": wb.SpecConfig(5, 4, 16)}),
    ("static-chain", (T, D), {"spec": CHAIN5, "mem_fraction_static": 0.8}),
    ("threshold-8", (T, D), {"spec": _chain(8)}),
    ("threshold-1-s3", (T, D), {"spec": _chain(1, s=3)}),
    ("threshold-9-no-list", (T, D), {"spec": _chain(9)}),
    ("threshold-9-spec-list", (T, D), {"spec": _chain(9),
                                       "cuda_graph_bs_decode": spec_decode_capture_sizes(48)}),
    ("threshold-20-short-names", (T, D), {"spec": _chain(20), "cuda_graph_max_bs": 48,
                                          "cuda_graph_bs": spec_decode_capture_sizes(48)}),
    ("threshold-60-auto-running", (T, D), {"spec": _chain(60)}),
    ("threshold-100-running-256", (T, D), {"spec": _chain(100), "max_running_requests": 256,
                                           "cuda_graph_bs_decode":
                                               spec_decode_capture_sizes(256)}),
    ("threshold-list-graph-off", (T, D), {"spec": _chain(9), "disable_decode_cuda_graph": True,
                                          "cuda_graph_bs_decode": [1, 2, 4, 8, 16]}),
    ("step-table", (T, D), {"spec": wb.SpecConfig(3, 1, policy=TABLE)}),
    ("never", (T, D), {"spec": wb.SpecConfig(5, 1, policy=wb.Never())}),
    ("export", (T, D), {"spec": _chain(8), "export_metrics_dir": "/tmp/sglang-records",
                        "enable_metrics": True}),
]
