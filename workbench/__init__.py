"""workbench — a Jupyter-first research workbench for EAGLE-3 speculative decoding.

    import workbench as wb
    engine = wb.Engine.from_pretrained("data/models/wb-target", draft="data/models/wb-eagle3")
    outs = engine.generate(["def parse(path):"], wb.SamplingParams(max_new_tokens=64),
                           spec=wb.SpecConfig(num_steps=5, topk=4, num_draft_tokens=16))
"""

from __future__ import annotations

from workbench import faults
from workbench.config import EngineConfig, SamplingParams, SpecConfig
from workbench.core import DraftTree, Request, RequestOutput, StepOutput, VerifyResult
from workbench.engine.calibrate import calibrate
from workbench.engine.engine import Engine
from workbench.errors import (
    CheckpointError,
    ConfigError,
    EngineInitError,
    RequestError,
    RequestFailed,
    WorkbenchError,
)
from workbench.policy import (
    Always,
    BatchThreshold,
    CostModel,
    Decision,
    Goodput,
    Never,
    Policy,
    PolicyContext,
    RandomFlip,
    StepTable,
)
from workbench.trace.tracer import trace

__all__ = [
    "Always", "BatchThreshold", "CheckpointError", "ConfigError", "CostModel", "Decision",
    "DraftTree", "Goodput", "RandomFlip", "StepTable", "calibrate",
    "Engine", "EngineConfig", "EngineInitError", "Never", "Policy", "PolicyContext",
    "Request", "RequestError", "RequestFailed", "RequestOutput", "SamplingParams", "SpecConfig",
    "StepOutput", "VerifyResult", "WorkbenchError", "faults", "trace",
]
__version__ = "0.1.0"
