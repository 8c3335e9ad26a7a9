"""The policy interface: each step, which layouts run, where new requests go, and what moves.

A policy reads the scheduler through a `SchedulerView` (read-only) and returns a `StepDecision`: the
layouts bound this step (disjoint replicas; torch_shift.parallel.layouts), the requests to move to
another group (their KV is dropped and recomputed where they are routed next: outputs unchanged),
the requests whose KV moves to the host tier (swapped in later, in whatever layout then runs: the
tier re-shards it), and an optional phase constraint on the batch. The scheduler forms each bound group's batch under
that decision; `route` tells it which layouts a waiting request may join, best first; `finalize`
may change a formed batch's layout to another over the same replicas (Shift's per-step choice).
Rank 0 broadcasts the outcome in the step plan, so policies run on rank 0 only, in plain Python.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

from torch_shift.config import SchedulerConfig
from torch_shift.engine.request import Request
from torch_shift.parallel.layouts import Deployment


@dataclass(frozen=True)
class StepDecision:
    layouts: tuple[str, ...]  # bound this step; their replicas are disjoint
    recompute: tuple[str, ...] = ()  # running requests whose KV is dropped, to be recomputed where routed
    swap_out: tuple[str, ...] = ()  # running requests whose KV moves to the host tier (recomputed if full)
    phase: str | None = None  # "prefill": prompt chunks only (nothing swapped in); "decode": one-token
    # steps only (nothing admitted); None: both


class SchedulerView(Protocol):
    """What a policy may read of the scheduler: requests, pools, the host tier and the step count."""

    @property
    def num_steps(self) -> int: ...
    @property
    def waiting(self) -> Iterator[Request]: ...
    @property
    def num_waiting(self) -> int: ...
    def peek_waiting(self) -> Request | None: ...
    @property
    def running(self) -> tuple[Request, ...]: ...  # on the device: scheduled, or paused
    @property
    def num_running(self) -> int: ...
    @property
    def swapped(self) -> Iterator[Request]: ...  # KV in the host tier, in swap-in order
    @property
    def num_swapped(self) -> int: ...
    @property
    def tier_free_blocks(self) -> int: ...  # 0 without a tier
    @property
    def tier_num_blocks(self) -> int: ...
    @property
    def tier_usage(self) -> float: ...  # fraction of the tier's blocks in use
    @property
    def num_seqs(self) -> tuple[int, ...]: ...  # requests placed on each replica (running or paused)
    @property
    def remaining_tokens(self) -> tuple[int, ...]: ...  # tokens they have left: prompt and output up to max_tokens
    @property
    def num_free_blocks(self) -> tuple[int, ...]: ...  # per replica
    @property
    def num_blocks(self) -> tuple[int, ...]: ...  # per replica
    @property
    def block_size(self) -> int: ...
    @property
    def config(self) -> SchedulerConfig: ...
    @property
    def last_decision(self) -> StepDecision | None: ...


class Policy(ABC):
    """The interface, with the defaults of a policy that never switches; a policy defines `decide`."""

    name = "static"
    uses_priority = False  # whether request priorities change what the policy decides

    def __init__(self, deployment: Deployment):
        self.deployment = deployment

    @abstractmethod
    def decide(self, view: SchedulerView) -> StepDecision:
        """The layouts of the next step (and what moves to the host tier), from the scheduler's view."""

    def route(self, request: Request, decision: StepDecision, view: SchedulerView) -> list[str]:
        """Layouts of `decision` a waiting request may be admitted into, best first: the replica with the fewest
        tokens left to compute (as SGLang's minimum-tokens balancing of DP replicas), then the fewest requests, then
        the most free blocks. By request counts alone, bench_peers.py's 64 requests of 64-512 prompt tokens gave one
        DP-2 replica 10% more prompt tokens than the other: a whole run priced by the simulator took 30.5 s, 28.0 s by
        tokens left (docs/performance.md)."""
        names = [n for n in decision.layouts if self.deployment[n].kv_width == 1]
        if len(names) < 2:
            return names
        remaining, seqs, free = view.remaining_tokens, view.num_seqs, view.num_free_blocks
        return sorted(names, key=lambda n: (remaining[self.deployment[n].replicas[0]],
                                            seqs[self.deployment[n].replicas[0]],
                                            -free[self.deployment[n].replicas[0]]))

    def finalize(self, layout: str, num_scheduled_tokens: int) -> str:
        """The layout a formed batch of `num_scheduled_tokens` runs in: `layout` or another over the same
        replicas and KV view."""
        return layout

    def on_add(self, request: Request, view: SchedulerView) -> None:
        """A request entered the scheduler."""

    def on_finish(self, request: Request) -> None:
        """A request left the scheduler (finished or aborted)."""

    def stats(self) -> dict:
        return {}
