"""A random legal binding of layouts every step: a stress test of the switching machinery."""

from __future__ import annotations

import random
from dataclasses import dataclass

from torch_shift.engine.policies.base import Policy, SchedulerView, StepDecision
from torch_shift.engine.request import Request
from torch_shift.parallel.layouts import Deployment, Layout


@dataclass(frozen=True)
class RandomOptions:
    seed: int = 0
    move_probability: float = 0.1  # per paused running request and step: moved (recomputed) elsewhere


class RandomPolicy(Policy):
    """A random legal binding every step and random moves: a stress test of the switching machinery
    (every layout, every width change), never a serving policy."""

    name = "random"

    def __init__(self, deployment: Deployment, options: RandomOptions = RandomOptions()):
        super().__init__(deployment)
        self.rng = random.Random(options.seed)
        self.move_probability = options.move_probability
        self.bindings = _bindings(deployment)

    def decide(self, view: SchedulerView) -> StepDecision:
        layouts = self.rng.choice(self.bindings)
        bound = {self.deployment[n].replicas for n in layouts}
        moves = tuple(r.request_id for r in view.running
                      if r.replicas not in bound and self.rng.random() < self.move_probability)
        return StepDecision(layouts, recompute=moves)

    def route(self, request: Request, decision: StepDecision, view: SchedulerView) -> list[str]:
        names = list(decision.layouts)
        self.rng.shuffle(names)
        return names

    def finalize(self, layout: str, num_scheduled_tokens: int) -> str:
        return self.rng.choice([other.name for other in self.deployment.alternatives(self.deployment[layout])])


def _bindings(deployment: Deployment) -> list[tuple[str, ...]]:
    """Every way to cover the replicas with disjoint layouts of the deployment (layouts that only
    `finalize` picks, such as Shift's "shift", are left to it)."""
    by_first: dict[int, list[Layout]] = {}
    for layout in deployment.layouts:
        if layout.kind != "shift":
            by_first.setdefault(layout.replicas[0], []).append(layout)

    def cover(first: int) -> list[tuple[str, ...]]:
        if first == deployment.num_replicas:
            return [()]
        return [(layout.name,) + rest for layout in by_first.get(first, [])
                for rest in cover(first + layout.kv_width)]

    return cover(0)
