"""Shift parallelism's policy (paper 000, Alg. 3): the step's token count picks the layout."""

from __future__ import annotations

from dataclasses import dataclass

from torch_shift.engine.policies.static import SingleGroupPolicy
from torch_shift.parallel.layouts import Deployment


@dataclass(frozen=True)
class ShiftOptions:
    threshold: int | None = 256  # steps with more scheduled tokens run the base layout; None: the base layout only


class ShiftPolicy(SingleGroupPolicy):
    """Paper 000, Alg. 3: a step with more scheduled tokens than the threshold runs the base layout
    (SP x TP), any other the shift layout (full TP); `threshold=None`: the base layout only."""

    name = "shift"

    def __init__(self, deployment: Deployment, options: ShiftOptions = ShiftOptions()):
        if not any(layout.kind == "sp_tp" for layout in deployment.layouts):
            raise ValueError("policy 'shift' switches between the SP x TP and full-TP layouts: it needs sp > 1")
        super().__init__(next(layout.name for layout in deployment.layouts if layout.kind == "sp_tp"), deployment)
        self.base = self._decision.layouts[0]
        shift = [layout.name for layout in deployment.layouts if layout.kind == "shift"]
        self.shift = shift[0] if shift else None
        self.threshold = options.threshold

    def finalize(self, layout: str, num_scheduled_tokens: int) -> str:
        if self.shift is None or self.threshold is None or num_scheduled_tokens > self.threshold:
            return self.base
        return self.shift
