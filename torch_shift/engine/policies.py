"""Switching policies: each step, which layouts run, where new requests go, and what moves.

A policy reads the scheduler (a `SchedulerView`, read-only) and returns a `StepDecision`: the
layouts bound this step (disjoint replicas; torch_shift.parallel.layouts), the requests to move to
another group (their KV is dropped and recomputed where they are routed next: outputs unchanged),
the requests whose KV moves to the host tier (swapped in later, in whatever layout then runs: the
tier re-shards it), and an optional phase constraint on the batch. The scheduler forms each bound group's batch under
that decision; `route` tells it which layouts a waiting request may join, best first; `finalize`
may change a formed batch's layout to another over the same replicas (Shift's per-step choice).
Rank 0 broadcasts the outcome in the step plan, so policies run on rank 0 only, in plain Python.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from dataclasses import dataclass

from torch_shift.engine.request import Request
from torch_shift.parallel.layouts import Deployment, Layout


@dataclass(frozen=True)
class StepDecision:
    layouts: tuple[str, ...]  # bound this step; their replicas are disjoint
    recompute: tuple[str, ...] = ()  # running requests whose KV is dropped, to be recomputed where routed
    swap_out: tuple[str, ...] = ()  # running requests whose KV moves to the host tier (recomputed if full)
    phase: str | None = None  # "prefill": prompt chunks only (nothing swapped in); "decode": one-token
    # steps only (nothing admitted); None: both


class Policy(ABC):
    """The interface, with the defaults of a policy that never switches; a policy defines `decide`."""

    name = "static"
    uses_priority = False  # whether request priorities change what the policy decides

    def __init__(self, deployment: Deployment):
        self.deployment = deployment

    @abstractmethod
    def decide(self, view) -> StepDecision:
        """The layouts of the next step (and what moves to the host tier), from the scheduler's view."""

    def route(self, request: Request, decision: StepDecision, view) -> list[str]:
        """Layouts of `decision` a waiting request may be admitted into, best first: the replica with
        the fewest requests, then the most free blocks (least loaded)."""
        seqs, free = view.num_seqs, view.num_free_blocks
        names = [n for n in decision.layouts if self.deployment[n].kv_width == 1]
        return sorted(names, key=lambda n: (seqs[self.deployment[n].replicas[0]],
                                            -free[self.deployment[n].replicas[0]]))

    def finalize(self, layout: str, num_scheduled_tokens: int) -> str:
        return layout

    def on_add(self, request: Request, view) -> None:
        """A request entered the scheduler."""

    def on_finish(self, request: Request) -> None:
        """A request left the scheduler (finished or aborted)."""

    def stats(self) -> dict:
        return {}


class SingleGroupPolicy(Policy):
    """One layout over every replica, always (one rank, static TP)."""

    def __init__(self, layout: str, deployment: Deployment | None = None):
        if deployment is None:
            deployment = Deployment(1, ((0,),), (Layout(layout, "single", (0,), (0,)),), "single")
        super().__init__(deployment)
        self._decision = StepDecision((layout,))

    def decide(self, view) -> StepDecision:
        return self._decision


class StaticPolicy(Policy):
    """Every replica on its own, every step (static DP, DP x TP)."""

    def __init__(self, deployment: Deployment):
        super().__init__(deployment)
        self._decision = StepDecision(tuple(layout.name for layout in deployment.replica_layouts()))

    def decide(self, view) -> StepDecision:
        return self._decision


class ShiftPolicy(SingleGroupPolicy):
    """Paper 000, Alg. 3: a step with more scheduled tokens than the threshold runs the base layout
    (SP x TP), any other the shift layout (full TP); `threshold=None`: the base layout only."""

    name = "shift"

    def __init__(self, deployment: Deployment, threshold: int | None):
        super().__init__("base", deployment)
        self.threshold = threshold

    def finalize(self, layout: str, num_scheduled_tokens: int) -> str:
        if self.threshold is None or num_scheduled_tokens > self.threshold:
            return "base"
        return "shift"


class RandomPolicy(Policy):
    """A random legal binding every step and random moves: a stress test of the switching machinery
    (every layout, every width change), never a serving policy."""

    name = "random"

    def __init__(self, deployment: Deployment, seed: int = 0, move_probability: float = 0.1):
        super().__init__(deployment)
        self.rng = random.Random(seed)
        self.move_probability = move_probability
        self.bindings = _bindings(deployment)

    def decide(self, view) -> StepDecision:
        layouts = self.rng.choice(self.bindings)
        bound = {self.deployment[n].replicas for n in layouts}
        moves = tuple(r.request_id for r in view.running
                      if r.replicas not in bound and self.rng.random() < self.move_probability)
        return StepDecision(layouts, recompute=moves)

    def route(self, request: Request, decision: StepDecision, view) -> list[str]:
        names = list(decision.layouts)
        self.rng.shuffle(names)
        return names

    def finalize(self, layout: str, num_scheduled_tokens: int) -> str:
        options = [n for n in (layout, "shift") if n in self.deployment._by_name
                   and self.deployment[n].replicas == self.deployment[layout].replicas]
        return self.rng.choice(options)


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


def build_policy(name: str | None, deployment: Deployment, shift_threshold: int | None = None, seed: int = 0,
                 **options) -> Policy:
    """The policy `name` for a deployment (None: the deployment's own: Shift for SP x TP, static
    otherwise)."""
    if name is None:
        name = {"shift": "shift", "flying": "flying", "seesaw": "seesaw"}.get(deployment.family, "static")
    if options and name not in ("flying", "seesaw"):
        raise ValueError(f"policy {name!r} takes no options, got {sorted(options)}")
    if name == "shift":
        if deployment.family != "shift":
            raise ValueError("policy 'shift' switches between the SP x TP and full-TP layouts: it needs sp > 1")
        return ShiftPolicy(deployment, shift_threshold)
    if name == "static":
        if deployment.num_replicas == 1:
            return SingleGroupPolicy(deployment.layouts[0].name, deployment)
        return StaticPolicy(deployment)
    if name == "random":
        return RandomPolicy(deployment, seed=seed)
    if name == "flying":
        from torch_shift.engine.flying import FlyingPolicy

        return FlyingPolicy(deployment, **options)
    if name == "seesaw":
        from torch_shift.engine.seesaw import SeesawPolicy

        return SeesawPolicy(deployment, **options)
    raise ValueError(f"unknown policy {name!r}; known: static, shift, flying, seesaw, random")
