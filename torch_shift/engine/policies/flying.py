"""Flying Serving's policy (paper 004): data-parallel replicas bound into aligned TP groups on demand.

Three reasons to bind a group, each decided at the step plan (the safe point):
- load (paper 004 Use Case 1): under light load the replicas run as TP groups of `tp_width` (low
  latency); when the requests in the system reach `dp_above` per replica they run as DP replicas
  (no queue), and go back to TP when the load falls to `tp_below` per replica (hysteresis); proposed
  tokens (speculative decoding) count in the load as tokens of the steps, averaged over the last steps (a
  request's proposals come and go from one step to the next, and a switch recomputes every running request), and
  raise it to DP only where there is a request for every replica (a lone request's proposals cannot be spread
  over replicas). With
  `dp_above=None` load never splits them, for machines where a TP group out-serves its replicas at every
  load (`torch-shift plan` sweeps `dp_above` on a machine's profile and a workload). At a
  switch the requests running in the other width move: their KV is dropped and recomputed in the
  new width (outputs unchanged);
- priority (Use Case 2): a request with `priority < priority_below` (lower is more urgent, as in
  vLLM) gets a group of `priority_width` replicas. With `preemption="hard"` the group binds at once
  and the DP requests on its replicas pause, keeping their KV, until it is released or for at most
  `max_pause_steps` steps, after which they move into a bound group (recomputed there), so that a
  stream of priority requests never starves them; with "soft" the request starts at once in DP on
  one of the group's replicas, those replicas take no new DP work, and the group binds when they
  have drained, the request then recomputed in TP. Other new requests go to replicas outside the
  priority groups, or share a priority group when every replica is in one;
- long context (Use Case 3): a request whose tokens cannot fit one replica's KV pool goes to the
  smallest aligned group whose pools together hold it, and keeps it until it finishes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch_shift.engine.policies.base import Policy, SchedulerView, StepDecision
from torch_shift.engine.request import Request
from torch_shift.parallel.layouts import Deployment, check_width

# the load's proposed tokens, an exponential average over steps: alone, a request proposing k tokens every other
# step swung the load between 1 and 1 + k, across both thresholds, and switched (recomputing it) every few steps
PROPOSED_AVERAGING = 1 / 8


@dataclass(frozen=True)
class FlyingOptions:
    tp_width: int | None = None  # width of the TP groups under light load (default: the widest the model allows)
    dp_above: float | None = 4.0  # requests per replica at which the replicas run as DP (None: never on load)
    tp_below: float = 1.0  # ... and back to TP at this load
    priority_below: int = 0  # a request with a priority below this gets a TP group at once
    priority_width: int | None = None  # that group's width (default: the widest)
    preemption: str = "hard"  # "hard": pause the DP requests of the group at once; "soft": wait for them
    max_pause_steps: int = 16  # a request paused by priority groups moves after this many steps

    def __post_init__(self) -> None:
        for name in ("dp_above", "tp_below"):
            value = getattr(self, name)
            if name == "dp_above" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"{name} must be a number" + (" or None" if name == "dp_above" else "")
                                + f", got {type(value).__name__}")
        if not 0 <= self.tp_below <= (math.inf if self.dp_above is None else self.dp_above):
            raise ValueError(f"need 0 <= tp_below <= dp_above, got tp_below={self.tp_below}, "
                             f"dp_above={self.dp_above}")
        if self.preemption not in ("hard", "soft"):
            raise ValueError(f"preemption must be 'hard' or 'soft', got {self.preemption!r}")
        for name in ("max_pause_steps", "priority_below"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        if self.max_pause_steps < 0:
            raise ValueError(f"max_pause_steps must be >= 0, got {self.max_pause_steps!r}")
        for name in ("tp_width", "priority_width"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be an int >= 1 or None, got {value!r}")


class FlyingPolicy(Policy):
    name = "flying"
    uses_priority = True

    def __init__(self, deployment: Deployment, options: FlyingOptions = FlyingOptions()):
        super().__init__(deployment)
        if deployment.num_replicas < 2 or any(layout.kv_width != 1 for layout in deployment.replica_layouts()) \
                or any(len(ranks) != 1 for ranks in deployment.replicas):
            raise ValueError("policy 'flying' binds data-parallel replicas of one rank each into TP groups: it "
                             "needs dp >= 2 (and sp = tp = 1)")
        tp_width, priority_width = options.tp_width, options.priority_width
        self.groups: dict[int, list[str]] = {}  # width -> its aligned layouts
        for layout in deployment.layouts:
            if layout.kv_width > 1:
                self.groups.setdefault(layout.kv_width, []).append(layout.name)
        widest = max(self.groups, default=1)
        self.tp_width = self._check_width("tp_width", widest if tp_width is None else tp_width)
        self.priority_width = self._check_width("priority_width", widest if priority_width is None else priority_width)
        self.max_pause_steps = options.max_pause_steps
        self.dp_above, self.tp_below = options.dp_above, options.tp_below
        self.priority_below = options.priority_below
        self.preemption = options.preemption
        self.mode = "tp" if self.tp_width > 1 else "dp"
        self.dp_layouts = [layout.name for layout in deployment.replica_layouts()]
        self.needs: dict[str, int] = {}  # request -> the group width it needs (priority, long context)
        self.pinned: dict[str, str] = {}  # request -> the group chosen for it
        self.paused_since: dict[str, int] = {}  # request -> the step at which a priority group paused it
        self.num_mode_switches = 0
        self.num_binds = 0
        self.proposed_load = 0.0  # proposed tokens a step, averaged over steps

    def _check_width(self, name: str, width: int) -> int:
        if width == 1 or width in self.groups:
            return width
        n = self.deployment.num_replicas
        if width > n or width & (width - 1):
            raise ValueError(f"{name}={width}: aligned groups have a power-of-two width up to the {n} replicas")
        check_width(self.deployment.config, width, name)  # the model's numbers
        raise AssertionError(f"{name}={width} passed check_width but is not offered")

    # -- request hooks ----------------------------------------------------------------------------------
    def on_add(self, request: Request, view: SchedulerView) -> None:
        need = request.num_prompt_tokens + request.max_tokens
        capacity = view.num_blocks[0] * view.block_size
        if need > capacity and self.groups:
            width = next((w for w in sorted(self.groups) if w * capacity >= need), max(self.groups))
        elif request.priority < self.priority_below and self.priority_width > 1:
            width = self.priority_width
        else:
            return
        self.needs[request.request_id] = width

    def on_finish(self, request: Request) -> None:
        rid = request.request_id
        self.needs.pop(rid, None)
        self.pinned.pop(rid, None)
        self.paused_since.pop(rid, None)

    # -- the decision -----------------------------------------------------------------------------------
    def decide(self, view: SchedulerView) -> StepDecision:
        running = view.running
        proposed = sum(len(r.spec_token_ids) for r in running)
        self.proposed_load += PROPOSED_AVERAGING * (proposed - self.proposed_load)
        self._update_mode(view.num_waiting + len(running))
        for rid, width in self.needs.items():
            if rid not in self.pinned:
                self.pinned[rid] = self._least_busy(self.groups[width], view)
                self.num_binds += 1
        bound: list[str] = []
        taken: set[int] = set()
        draining = self._draining(running) if self.preemption == "soft" else set()
        for name in dict.fromkeys(self.pinned.values()):
            replicas = set(self.deployment[name].replicas)
            if not replicas & taken and name not in draining:
                bound.append(name)
                taken |= replicas
        mode_layouts = self.groups[self.tp_width] if self.mode == "tp" else self.dp_layouts
        for name in mode_layouts + self.dp_layouts:  # what the mode wants, then every replica left alone
            replicas = set(self.deployment[name].replicas)
            if not replicas & taken:
                bound.append(name)
                taken |= replicas

        bound_replicas = {self.deployment[n].replicas for n in bound}
        pausing = set()  # replicas of bound pinned groups: other requests there pause (hard preemption)
        for name in set(self.pinned.values()) & set(bound):
            pausing |= set(self.deployment[name].replicas)
        moves = []
        for r in running:
            pinned = self.pinned.get(r.request_id)
            if pinned is not None:
                if pinned in bound and r.replicas != self.deployment[pinned].replicas:
                    moves.append(r.request_id)  # soft preemption: started in DP, recomputed in TP at bind
            elif r.replicas in bound_replicas:
                self.paused_since.pop(r.request_id, None)  # it runs
            elif not set(r.replicas) & pausing:
                moves.append(r.request_id)  # the load mode changed: recomputed in the new width
            elif view.num_steps - self.paused_since.setdefault(r.request_id, view.num_steps) >= self.max_pause_steps:
                moves.append(r.request_id)  # paused too long by priority groups: recomputed where routed
                del self.paused_since[r.request_id]
            # else: paused by a priority group (hard preemption): its KV stays
        return StepDecision(tuple(bound), recompute=tuple(moves))

    def _update_mode(self, num_requests: int) -> None:
        if self.tp_width == 1:
            return
        num_replicas = self.deployment.num_replicas
        load_per_replica = (num_requests + self.proposed_load) / num_replicas
        mode = self.mode
        if (mode == "tp" and self.dp_above is not None and load_per_replica >= self.dp_above
                and (num_requests >= num_replicas or num_requests >= self.dp_above * num_replicas)):
            mode = "dp"
        elif mode == "dp" and load_per_replica <= self.tp_below:
            mode = "tp"
        if mode != self.mode:
            self.mode = mode
            self.num_mode_switches += 1

    def reserved_replicas(self) -> set[int]:
        """Replicas of the groups chosen for priority and long requests: no other new work there."""
        reserved: set[int] = set()
        for name in set(self.pinned.values()):
            reserved |= set(self.deployment[name].replicas)
        return reserved

    def _draining(self, running) -> set[str]:
        """Soft preemption: groups whose replicas still run other requests in another layout (the
        group binds once they are done; requests of the group's own layout run with it)."""
        draining = set()
        for name in set(self.pinned.values()):
            replicas = self.deployment[name].replicas
            if any(r.replicas != replicas and set(r.replicas) & set(replicas)
                   for r in running if r.request_id not in self.pinned):
                draining.add(name)
        return draining

    def _least_busy(self, names: list[str], view: SchedulerView) -> str:
        seqs = view.num_seqs
        return min(names, key=lambda n: sum(seqs[r] for r in self.deployment[n].replicas))

    def route(self, request: Request, decision: StepDecision, view: SchedulerView) -> list[str]:
        pinned = self.pinned.get(request.request_id)
        if pinned is not None:
            if pinned in decision.layouts:
                return [pinned]
            if self.preemption != "soft":
                return []
            # soft preemption: start at once in DP on the group's least loaded replica
            replicas = self.deployment[pinned].replicas
            remaining, seqs = view.remaining_tokens, view.num_seqs
            return sorted((n for n in decision.layouts
                           if self.deployment[n].kv_width == 1 and self.deployment[n].replicas[0] in replicas),
                          key=lambda n: (remaining[self.deployment[n].replicas[0]],
                                         seqs[self.deployment[n].replicas[0]]))
        reserved = self.reserved_replicas()
        names = [n for n in decision.layouts if not set(self.deployment[n].replicas) & reserved]
        if not names:  # every replica is in a priority group: share the bound ones
            names = [n for n in decision.layouts if n in set(self.pinned.values())]
        if len(names) < 2:
            return names
        # as Policy.route: the fewest tokens left on the layout's busiest replica, then requests, then free blocks
        remaining, seqs, free = view.remaining_tokens, view.num_seqs, view.num_free_blocks
        return sorted(names, key=lambda n: (max(remaining[r] for r in self.deployment[n].replicas),
                                            sum(seqs[r] for r in self.deployment[n].replicas),
                                            -min(free[r] for r in self.deployment[n].replicas)))

    def stats(self) -> dict:
        return {"mode": self.mode, "num_mode_switches": self.num_mode_switches, "num_binds": self.num_binds}
