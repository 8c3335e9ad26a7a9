"""Parallel layouts: shift-rank groups, plans as DTensor placements, Ulysses attention, ShiftModule."""

from torch_shift.parallel.groups import ShiftGroups, build_shift_groups, shift_rank_order
from torch_shift.parallel.plan import ParallelPlan, base_plan, shift_plan
from torch_shift.parallel.shift import ShiftModule, parallelize

__all__ = ["ParallelPlan", "ShiftGroups", "ShiftModule", "base_plan", "build_shift_groups", "parallelize",
           "shift_plan", "shift_rank_order"]
