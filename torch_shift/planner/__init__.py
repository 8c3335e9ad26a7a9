"""The planner's cost model: the time of one engine step under a parallel layout on some hardware.

    shape = ModelShape.from_pretrained("path/to/config.json", dtype="fp8")
    hw = get_profile("h200x8")                       # or a JSON profile from `torch-shift calibrate`
    cost = step_cost(shape, hw, Layout("tp", tp=8), [Seq(1, 4096)] * 64)
    cost.total_s, cost.breakdown()

The cost model is plain arithmetic (no tensors); only `torch_shift.planner.calibrate` runs torch.
"""

from torch_shift.planner.collectives import AlphaBeta, CollectiveModel, fit_alpha_beta, wire_bytes
from torch_shift.planner.cost import (
    CollectiveCost,
    Layout,
    OpCost,
    RankMemory,
    StepCost,
    kv_capacity_tokens,
    memory_per_rank,
    step_cost,
    validate_layout,
)
from torch_shift.planner.hardware import (
    ACHIEVABLE_FRACTION,
    DATASHEETS,
    EngineOverhead,
    HardwareProfile,
    datasheet_profile,
    get_profile,
)
from torch_shift.planner.shape import ModelShape, Seq

__all__ = [
    "ACHIEVABLE_FRACTION", "DATASHEETS", "AlphaBeta", "CollectiveCost", "CollectiveModel", "EngineOverhead",
    "HardwareProfile", "Layout", "ModelShape", "OpCost", "RankMemory", "Seq", "StepCost", "datasheet_profile",
    "fit_alpha_beta", "get_profile", "kv_capacity_tokens", "memory_per_rank", "step_cost", "validate_layout",
    "wire_bytes",
]
