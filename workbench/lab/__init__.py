"""Policy lab: record one run, replay any speculation policy on it, score it against the
hindsight oracle, validate against real runs, fit it to the box (docs/LAB.md).

record.py (the recording) · trees.py (sub-shape trees, accepted lengths) · sim.py (the
continuous-batching replay and the oracle) · arms.py (policy names → Policy objects, SGLang's
and vLLM's controllers) · replay.py (every policy × level, regret) · validate.py (replayed vs
measured ratios) · boxreplay.py (fit from box sweeps and request records; tier files) · cli.py
(``python -m workbench lab record|replay``).
"""
