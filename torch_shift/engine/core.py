"""The core step on rank 0, along the data path: the scheduler decides each bound group's tokens and its
layout under the policy; the plan builder turns that into the step plan (deltas of the replicas' batches);
the executor runs the plan on every rank (the Worker; a simulator prices it instead); the output processor
samples from the logits (and checks proposed tokens); the scheduler advances the requests; with speculative
decoding, the speculator proposes the next tokens of the requests that advanced."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from torch_shift.engine.model_runner import StepResult
from torch_shift.engine.policies import Policy
from torch_shift.engine.request import Request, RequestStatus
from torch_shift.engine.scheduler import ScheduledRequest, Scheduler, SchedulerOutput
from torch_shift.engine.spec_decode import Speculator
from torch_shift.engine.stats import EngineStats
from torch_shift.engine.step_plan import PlanBuilder, StepPlan

Executor = Callable[[StepPlan], StepResult]
SampleFn = Callable[[list[list[ScheduledRequest]], list], dict[str, int | list[int]]]


@dataclass
class CoreStep:
    """What one step did on rank 0: the scheduler's output, its groups' entries in plan order, the requests
    that received a token, and where rank 0's time went."""

    output: SchedulerOutput
    entries: list[list[ScheduledRequest]]
    updated: list[Request]
    swap_seconds: float
    reshard_seconds: float


class EngineCore:
    def __init__(self, scheduler: Scheduler, plan_builder: PlanBuilder, executor: Executor, sample: SampleFn,
                 stats: EngineStats, speculator: Speculator | None = None):
        self.scheduler = scheduler
        self.plan_builder = plan_builder
        self.executor = executor
        self.sample = sample
        self.stats = stats
        self.speculator = speculator
        # a step's forward and sampling time from its start on perf_counter's clock (a simulator sets its model's)
        self.step_seconds: Callable[[float], float] = lambda start: time.perf_counter() - start

    @property
    def policy(self) -> Policy:
        return self.scheduler.policy

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def finish_request(self, request_id: str, status: RequestStatus) -> None:
        request = self.scheduler.finish_request(request_id, status)
        if request is not None and self.speculator is not None:
            self.speculator.on_finish(request)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> CoreStep | None:
        """One step on every rank; None when there was nothing to run."""
        output = self.scheduler.schedule()
        plan = self.plan_builder.build(output)  # every output: the rows of the requests it removed come free
        if output.is_empty and not output.has_swaps:
            return None
        self.stats.record_plan(plan)
        start = time.perf_counter()
        result = self.executor(plan)
        entries = [group.entries for group in output.groups if group.entries]
        sampled = self.sample(entries, result.logits)
        if self.speculator is not None:
            self.stats.record_spec(self.speculator.observe(entries, sampled, self.step_seconds(start)))
        updated = self.scheduler.update_from_output(output, sampled)
        if self.speculator is not None:
            self.speculator.propose(updated, len(self.scheduler.running))
            self.stats.num_cut_tokens = self.speculator.num_cut_tokens
        now = time.monotonic()
        for request in updated:
            if request.first_token_time is None:
                request.first_token_time = now
        return CoreStep(output, entries, updated, result.swap_seconds, result.reshard_seconds)
