"""Speculation policies: per step, speculate (and how much) or decode plainly.

A policy never changes outputs (verification keeps them the target's); it only decides how
much drafting a step buys. Three modules, lowest first:

* :mod:`~workbench.policy.costmodel`: the step-time model (``LinearCost``, ``CostModel``,
  ``Crossover``, ``Acceptance``): pure arithmetic over measurements. Measuring it needs a live
  engine and lives in :mod:`workbench.engine.calibrate`.
* :mod:`~workbench.policy.policies`: the ``Policy`` protocol, ``PolicyContext``/``Decision``,
  the rule-based policies (``Always``, ``Never``, ``BatchThreshold``, ``StepTable``,
  ``RandomFlip``), ``RecordingPolicy`` and the tree-shape rule SpecConfig shares.
* :mod:`~workbench.policy.goodput`: ``Goodput``, the cost-model-driven policy.

Nothing here imports the engine, the models or torch: a policy can be replayed, fitted and
tested on recorded steps alone (``workbench.speculative`` is the drafting algorithm only).
"""

from __future__ import annotations

from workbench.policy.costmodel import Acceptance, CostModel, CostSample, Crossover, LinearCost
from workbench.policy.goodput import Goodput
from workbench.policy.policies import (
    Always,
    BatchThreshold,
    Decision,
    Never,
    Policy,
    PolicyContext,
    RandomFlip,
    RecordingPolicy,
    StepRecord,
    StepTable,
)

__all__ = [
    "Acceptance", "Always", "BatchThreshold", "CostModel", "CostSample", "Crossover", "Decision",
    "Goodput", "LinearCost", "Never", "Policy", "PolicyContext", "RandomFlip", "RecordingPolicy",
    "StepRecord", "StepTable",
]
