"""Device-correct by construction: step-path modules create every tensor with an explicit device.

The CUDA path has never run on a GPU here, so a tensor built with a factory call and no
``device=`` (lands on the host) would meet the first GPU run as a device mismatch or a hidden
host→device copy. This test walks the step-path modules' syntax trees and fails on any
``torch.<factory>(...)`` call without a ``device=`` keyword. ``device="cpu"`` is allowed: it
states that a tensor is host metadata on purpose (e.g. ``KVPool.slots``, which every attention
backend plans from on the host).

``*_like`` and ``Tensor.new_*`` inherit their source's device and are not factories here.

Every module of the step-path packages is either ``CHECKED`` or named in ``OFF_STEP_PATH`` with
the reason, so a new module cannot slip past the rule unlisted (the refactor of issue #19
converted the last pending ones).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "workbench"

FACTORIES = frozenset({
    "tensor", "as_tensor", "arange", "range", "linspace", "logspace", "zeros", "ones", "full",
    "empty", "empty_strided", "eye", "rand", "randn", "randint", "randperm", "tril_indices",
    "triu_indices", "scalar_tensor",
})

CHECKED = (
    "core.py",
    "engine/engine.py",
    "engine/stages.py",
    "engine/runner.py",
    "engine/worker.py",
    "engine/output.py",
    "engine/stops.py",
    "engine/stats.py",
    "engine/prompts.py",
    "engine/driver.py",
    "engine/kv_cache.py",
    "engine/scheduler.py",
    "sampler.py",
    "engine/cuda_graphs.py",
    "engine/overlap.py",
    "engine/compiled.py",
    "models/llama.py",
    "models/eagle3.py",
    "models/gemm.py",
    "models/quant.py",
    "models/rope.py",
    "models/mla.py",
    "models/moe.py",
    "models/moe_model.py",
    "attention/__init__.py",
    "attention/paged.py",
    "attention/tree_draft.py",
    "attention/triton_backend.py",
    "attention/flashinfer_backend.py",
    "attention/invariant.py",
    "speculative/tree.py",
    "speculative/verify.py",
    "speculative/drafter.py",
    "speculative/host_tree.py",
    "policy/policies.py",
    "policy/goodput.py",
    "policy/costmodel.py",
    "policy/moe_cost.py",
    "kernels/__init__.py",
    "kernels/checks.py",
    "kernels/reference.py",
    "kernels/triton_compact_kv.py",
    "kernels/triton_greedy_accept.py",
    "kernels/triton_tree_attention.py",
    "kernels/triton_tree_sample.py",
    "kernels/cpu_row_attention.py",
)

# Modules of the step-path packages that run only outside a step, each with why
OFF_STEP_PATH: dict[str, str] = {
    "engine/__init__.py": "re-exports",
    "engine/affinity.py": "host scheduling only (CPU affinity, /proc/stat): no tensors",
    "engine/autotune.py": "init stage: times host GEMMs on CPU weights",
    "engine/weights_choice.py": "init stage: times host GEMMs on CPU weights (packed or not)",
    "engine/invariance.py": "init stage (autotune, batch_invariant): probes the CPU GEMMs' rows",
    "kernels/cpu_build.py": "builds and loads the C kernels: no tensors",
    "engine/shape_choices.py": "init stage (autotune): times host GEMMs on CPU weights",
    "engine/contention.py": "CPU engines only (the monitor is never built on another device): "
                            "times host GEMMs on CPU weights between steps",
    "engine/policy_init.py": "init stage / set_spec: calibrates through the engine's own steps",
    "engine/thread_timing.py": "CPU engines only (the monitor and the init stage): times host "
                               "GEMMs on CPU weights between steps",
    "models/__init__.py": "re-exports",
    "models/config.py": "config parsing",
    "models/loader.py": "init: builds modules on the meta device, then loads weights",
    "models/ct_loader.py": "init: unpacks a compressed-tensors checkpoint's tensors on the host",
    "models/gguf.py": "init: reads a GGUF file and dequantises its tensors on the host; the "
                      "loader moves them",
    "models/fetch.py": "setup: downloads and unpacks the real model's files; no tensors",
    "models/synthetic.py": "writes random checkpoints for tests",
    "models/synthetic_moe.py": "writes random MoE checkpoints for tests (through transformers)",
    "models/moe_config.py": "config parsing: the MoE/MLA fields and their refusals",
    "speculative/__init__.py": "re-exports",
    "policy/__init__.py": "re-exports",
    "engine/calibrate.py": "calibration: scratch batches built on the host, moved to the "
                           "runner's device, and the engine's own steps",
}
STEP_PATH_PACKAGES = ("engine", "models", "attention", "speculative", "policy", "kernels")


def offending_calls(source: str) -> list[tuple[int, str]]:
    """(line, ``torch.<name>``) of every factory call in ``source`` without ``device=``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        f = node.func
        if not (isinstance(f.value, ast.Name) and f.value.id == "torch" and f.attr in FACTORIES):
            continue
        # a **kwargs splat may carry the device: trust it
        if not any(k.arg in ("device", None) for k in node.keywords):
            found.append((node.lineno, f"torch.{f.attr}"))
    return sorted(found)


def test_the_walker_sees_what_it_should() -> None:
    src = ("import torch\n"
           "a = torch.zeros(3)\n"
           "b = torch.zeros(3, device=x.device)\n"
           "c = torch.tensor([1], dtype=torch.int64)\n"
           "d = torch.zeros_like(a)\n"
           "e = a.new_zeros(3)\n"
           "f = torch.arange(4, **kw)\n"
           "g = torch.cat([a, b])\n"
           "h = torch.full((2,), -1, device='cpu')\n")
    assert offending_calls(src) == [(2, "torch.zeros"), (4, "torch.tensor")]


def test_module_lists_are_real_files() -> None:
    for rel in (*CHECKED, *OFF_STEP_PATH):
        assert (ROOT / rel).is_file(), rel
    assert not set(CHECKED) & set(OFF_STEP_PATH)


def test_every_step_path_package_module_is_listed() -> None:
    modules = {str(p.relative_to(ROOT)) for pkg in STEP_PATH_PACKAGES
               for p in (ROOT / pkg).glob("*.py")}
    unlisted = sorted(modules - set(CHECKED) - set(OFF_STEP_PATH))
    assert not unlisted, (f"{unlisted}: add each to CHECKED (step path: every tensor factory "
                          "names its device) or to OFF_STEP_PATH with the reason")


@pytest.mark.parametrize("rel", CHECKED)
def test_step_path_factories_name_a_device(rel: str) -> None:
    bad = offending_calls((ROOT / rel).read_text())
    assert not bad, f"workbench/{rel}: tensor factory calls without device=: {bad}"
