"""Policies that never switch: one layout over every replica, or every replica on its own."""

from __future__ import annotations

from torch_shift.engine.policies.base import Policy, SchedulerView, StepDecision
from torch_shift.parallel.layouts import Deployment, Layout


class SingleGroupPolicy(Policy):
    """One layout over every replica, always (one rank, static TP)."""

    def __init__(self, layout: str, deployment: Deployment | None = None):
        if deployment is None:
            deployment = Deployment(1, ((0,),), (Layout(layout, "single", (0,), (0,)),), "single")
        super().__init__(deployment)
        self._decision = StepDecision((layout,))

    def decide(self, view: SchedulerView) -> StepDecision:
        return self._decision


class StaticPolicy(Policy):
    """Every replica on its own, every step (static DP, DP x TP)."""

    def __init__(self, deployment: Deployment):
        super().__init__(deployment)
        self._decision = StepDecision(tuple(layout.name for layout in deployment.replica_layouts()))

    def decide(self, view: SchedulerView) -> StepDecision:
        return self._decision
