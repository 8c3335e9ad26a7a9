"""The core step on rank 0, along the data path: the scheduler decides each bound group's tokens and its
layout under the policy; the plan builder turns that into the step plan (deltas of the replicas' batches);
the executor runs the plan on every rank (the Worker; a simulator prices it instead); the output processor
samples from the logits (and checks proposed tokens); the scheduler advances the requests; with speculative
decoding, the speculator proposes the next tokens of the requests that advanced.

With asynchronous scheduling (one rank; vLLM's `async_scheduling`) a step's tokens stay on the device while the
next step is scheduled and launched: the decodes of that step take their input ids from the device
(placeholders in the plan), and the host's work (scheduling, inputs, outputs) runs beside the device's instead
of between its steps. `step` then returns the step before the one it launched. A request that must see its
tokens on the host before it samples (penalties, a minimum length, a grammar, logprobs) makes the steps
synchronous while it is in the engine. On the CPU the C++ decoder's steps run on a thread of its own in the same way
(torch_shift.engine.model_runner): a step's argmax rows stand for its tokens until it ran. With speculative decoding
only the steps after which the speculator proposes nothing run ahead (its quiet steps: every request waits for a
probe or a backoff's end; and the end of such a wait where no check can pay, found without the tokens); a step whose
tokens a proposal follows, and a step that checks proposals, wait for the tokens on the host, as proposals are made
from them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from torch_shift.engine.model_runner import StepResult
from torch_shift.engine.policies import Policy
from torch_shift.engine.request import Request, RequestStatus
from torch_shift.engine.scheduler import ScheduledRequest, Scheduler, SchedulerOutput
from torch_shift.engine.spec_decode import Speculator
from torch_shift.engine.stats import EngineStats
from torch_shift.engine.step_plan import PlanBuilder, StepPlan
from torch_shift.models.fused import ROW_ARGMAX
from torch_shift.models.native_decoder import LaunchedStep, redraft_stages

# (plan), or asynchronously (plan, the last step's tokens on the device, launch=True): a CPU step the C++ decoder runs
# may return before its logits are written (StepResult.launched)
Executor = Callable[..., StepResult]
SampleFn = Callable[[list[list[ScheduledRequest]], list], dict[str, int | list[int]]]
SampleOnDeviceFn = Callable[[list[list[ScheduledRequest]], list, LaunchedStep | None, np.ndarray | None],
                            tuple[list[Request], torch.Tensor | None]]
DrawsFn = Callable[[list[list[ScheduledRequest]]], np.ndarray | None]
RunDrawsFn = Callable[[list[ScheduledRequest], int], tuple[np.ndarray, Callable[[int], None]] | None]


@dataclass
class CoreStep:
    """What one step did on rank 0: the scheduler's output, its groups' entries in plan order, the requests
    that received a token, and where rank 0's time went."""

    output: SchedulerOutput
    entries: list[list[ScheduledRequest]]
    updated: list[Request]
    swap_seconds: float
    reshard_seconds: float


@dataclass
class _InFlight:
    """A step launched whose sampled tokens have not reached the host (asynchronous scheduling)."""

    output: SchedulerOutput
    entries: list[list[ScheduledRequest]]
    requests: list[Request]  # the requests that sampled, in the order of `tokens`
    tokens: torch.Tensor | None  # on the device (None: nobody sampled)
    host_tokens: torch.Tensor | None  # their copy to the host, under way
    copied: torch.cuda.Event | LaunchedStep | None  # after that copy; a CPU step still running; None: they are here
    swap_seconds: float
    reshard_seconds: float

    @property
    def sources(self) -> dict[str, int]:
        return {r.request_id: i for i, r in enumerate(self.requests)}


class EngineCore:
    def __init__(self, scheduler: Scheduler, plan_builder: PlanBuilder, executor: Executor, sample: SampleFn,
                 stats: EngineStats, speculator: Speculator | None = None,
                 sample_on_device: SampleOnDeviceFn | None = None, draws: DrawsFn | None = None,
                 run_draws: RunDrawsFn | None = None):
        """`sample_on_device`: schedule asynchronously (one rank), drawing tokens with it; with a speculator, in
        the steps after which it proposes nothing. `draws`: what a step's sampling requests draw with, fixed before
        it runs (OutputProcessor.draws): a step launched on the C++ decoder's thread draws its tokens with them.
        `run_draws`: the same for a multi-step run's steps (OutputProcessor.run_draws), where its requests may sample
        (Scheduler.sampled_runs); None: runs of requests that draw their argmax only."""
        self.scheduler = scheduler
        self.plan_builder = plan_builder
        self.executor = executor
        self.sample = sample
        self.sample_on_device = sample_on_device
        self.draws = draws
        self.run_draws = run_draws
        scheduler.sampled_runs = run_draws is not None
        self.stats = stats
        self.speculator = speculator
        # the suffix proposer's global tree where other replicas' ranks keep copies of it (its `additions` kept,
        # Worker.build): each plan run carries what it took since the last (StepPlan.global_tree_outputs)
        tree = getattr(speculator.proposer, "global_tree", None) if speculator is not None else None
        self.copied_tree = tree if tree is not None and tree.additions is not None else None
        self.in_flight: _InFlight | None = None
        # the scheduler's count of requests that joined or left `running` when the speculator last proposed: the
        # running requests are the ones it saw while the count stays
        self._proposed_for = -1
        # a step's forward and sampling time from its start on perf_counter's clock (a simulator sets its model's)
        self.step_seconds: Callable[[float], float] = lambda start: time.perf_counter() - start
        # the last call of `step` with a speculator that may run steps ahead (asynchronously, or in multi-step runs):
        # its start, and the plain decode steps it ran (requests, whether launched behind the one in flight or in a
        # run, steps), or None: any other (speculator.sync_penalty)
        self._last_call: tuple[float, tuple[int, bool, int] | None] | None = None
        self._steps_run = 1  # by the last plan (the most of its groups')
        self._speculator_seconds = 0.0  # the speculator's time after the last step run synchronously

    @property
    def policy(self) -> Policy:
        return self.scheduler.policy

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def finish_request(self, request_id: str, status: RequestStatus) -> None:
        request = self.scheduler.finish_request(request_id, status)
        if request is not None and self.speculator is not None:
            self.speculator.on_finish(request)
        if not self.scheduler.requests:
            self.in_flight = None  # its requests all finished: nothing to wait for

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> CoreStep | None:
        """One step on every rank; None when there was nothing to run (asynchronously: the step completed, the
        one before the step launched; None when none was in flight)."""
        if self.sample_on_device is None:
            return self._step() if self.speculator is None else self._step_in_runs()
        speculator = self.speculator
        if speculator is not None:
            self._time_call()
        # a request samples on the host, or proposals follow the step in flight (or the next one), or a request the
        # last propose did not see may hold some: every token must be there first
        if self.scheduler.num_host_sampled or (speculator is not None and not self._quiet_ahead()):
            if self.in_flight is not None:
                return self._complete()
            return self._step() if speculator is None else self._timed_step()
        if speculator is not None and self._runs_quiet_steps():
            # a multi-step run takes the quiet steps, once every token is on the host
            return self._complete() if self.in_flight is not None else self._timed_step()
        in_flight = self.in_flight
        output = self.scheduler.schedule(max_run_steps=1)
        assert speculator is None or not any(group.num_spec_tokens for group in output.groups)
        plan = self.plan_builder.build(output, None if in_flight is None else in_flight.sources)
        if output.is_empty and not output.has_swaps:
            return None if in_flight is None else self._complete()
        assert self.copied_tree is None, "asynchronous scheduling runs one rank"
        self.stats.record_plan(plan)
        entries = [group.entries for group in output.groups if group.entries]
        draws = self.draws(entries) if self.draws is not None else None
        result = self.executor(plan, None if in_flight is None else in_flight.tokens, launch=True, draws=draws)
        requests, tokens = self.sample_on_device(entries, result.logits, result.launched, draws)  # behind the forward
        host_tokens, copied = None, result.launched  # a CPU step still running (waited for even where none sampled)
        if tokens is not None:
            host_tokens = tokens.to("cpu", non_blocking=True)
            if tokens.device.type == "cuda":
                copied = torch.cuda.Event()
                copied.record()
        # while the device runs the step just launched
        done = None if in_flight is None else self._complete(launched_behind=True)
        if speculator is not None and done is not None and _plain_decode(entries):
            self._last_call = (self._last_call[0], (sum(map(len, entries)), True, 1))
        if self.scheduler.requests:  # else its requests all finished (stop tokens, stop strings): it is dropped
            self.in_flight = _InFlight(output, entries, requests, tokens, host_tokens, copied, result.swap_seconds,
                                       result.reshard_seconds)
        return done

    def _step_in_runs(self) -> CoreStep | None:
        """A synchronous step beside the speculator. Where plans run several decode steps, the speculator's quiet
        steps run in runs and the others singly: the intervals between calls after plain decodes in runs (per step)
        and alone are what SyncPenalty prices a check's single step against, as it prices a synchronous step against
        one launched ahead of the host."""
        if self.scheduler.config.num_scheduler_steps == 1:
            return self._step()
        self._time_call()
        return self._timed_step()

    def _timed_step(self) -> CoreStep | None:
        """A step that waits for its tokens, beside the speculator: after a plain decode (alone, or a multi-step
        run's), the call's start for the next `_time_call`, less the speculator's own time (its asks are priced
        apart: Speculator._prices)."""
        self._speculator_seconds = 0.0
        done = self._step()
        if done is not None and _plain_decode(done.entries):
            self._last_call = (self._last_call[0] + self._speculator_seconds,
                               (sum(map(len, done.entries)), self._steps_run > 1, self._steps_run))
        return done

    def _quiet_ahead(self) -> bool:
        """Whether the next step may run ahead of the host beside the speculator: the requests the last propose saw
        are the running ones, and they wait (quiet steps), or the step in flight decodes each of them and the
        speculator finds, without its tokens, that it would propose nothing after it (Speculator.relook_ahead)."""
        speculator, scheduler = self.speculator, self.scheduler
        if not self._running_as_proposed():
            return False
        if speculator.quiet_steps:
            return True
        in_flight, num_running = self.in_flight, len(scheduler.running)
        return (in_flight is not None and in_flight.output.num_scheduled_tokens == num_running
                and _plain_decode(in_flight.entries)
                and speculator.relook_ahead([e.request for group in in_flight.entries for e in group], num_running))

    def _runs_quiet_steps(self) -> bool:
        """Whether the next quiet steps run as a multi-step run rather than singly ahead of the host: where plans
        run several steps and, once the step in flight is done, the next may run two or more (Scheduler.run_length)
        with nothing proposed between (the step in flight, where there is one, is the first of the quiet steps)."""
        in_flight = self.in_flight is not None
        return (self.scheduler.config.num_scheduler_steps > 1 and self.speculator.quiet_steps >= 1 + in_flight
                and self._running_as_proposed() and self.scheduler.run_length(after_tokens_in_flight=in_flight) > 1)

    def _time_call(self) -> None:
        """The interval since the last call of `step`, told to the speculator where that call ran a plain decode step
        (synchronously, or launched behind the one in flight): what a step costs that waits for its tokens beside
        one that runs ahead of the host."""
        now = time.perf_counter()
        if self._last_call is not None and self._last_call[1] is not None:
            num_requests, pipelined, steps = self._last_call[1]
            self.speculator.sync_penalty.observe(num_requests, pipelined, (now - self._last_call[0]) / steps)
        self._last_call = (now, None)

    def _complete(self, launched_behind: bool = False) -> CoreStep:
        """The step in flight, once its tokens are on the host: its requests advanced. `launched_behind`: the next
        step is in flight already."""
        step, self.in_flight = self.in_flight, None
        sampled = {}
        if step.copied is not None:
            step.copied.synchronize()
        if step.requests:
            sampled = dict(zip([r.request_id for r in step.requests], step.host_tokens.tolist()))
        updated = self.scheduler.update_from_output(step.output, sampled)
        if self.speculator is not None:  # a step that ran ahead checked nothing: no observe, nor a fair time
            self._speculate(step.output.num_scheduled_tokens, step.entries, updated, sampled, None, launched_behind)
        _stamp_token_times(updated)
        return CoreStep(step.output, step.entries, updated, step.swap_seconds, step.reshard_seconds)

    def _step(self) -> CoreStep | None:
        output = self.scheduler.schedule(self._max_run_steps())
        plan = self.plan_builder.build(output)  # every output: the rows of the requests it removed come free
        if output.is_empty and not output.has_swaps:
            return None
        if self.copied_tree is not None:
            plan.global_tree_outputs = self.copied_tree.take_additions()
        self.stats.record_plan(plan)
        start = time.perf_counter()
        entries = [group.entries for group in output.groups if group.entries]  # the plan's groups'
        rewind = None
        if output.num_steps > 1 and self.run_draws is not None:
            draws_by_group = [self.run_draws(group, output.num_steps) for group in entries]
            # a run whose requests sample has one group (Scheduler._run_blocks), whose requests all end it at one step
            assert len(entries) == 1 or draws_by_group == [None] * len(entries), "several groups' runs that sample"
            if draws_by_group[0] is not None:
                plan.groups[0].run_draws, rewind = draws_by_group[0]
        if self.draws is not None and output.num_steps == 1:
            # where the runner launches steps on the C++ decoder's thread, a step that waits for its tokens (a check,
            # a step whose tokens the speculator proposes from, a request sampled on the host) is launched there too,
            # with nothing in flight, and waited for: run here, its GEMVs switched from the decoder's thread to the
            # decode pool and back, 1.7-2.2 ms a step on an AMX Xeon (free text with suffix decoding: 0.98x the
            # plain engine's TPOT, now 1.00x; docs/performance.md)
            result = self.executor(plan, None, launch=True)
            if result.launched is not None:
                result.launched.synchronize()
        else:
            result = self.executor(plan)
        if result.redraft_counts is not None:
            self.stats.num_scheduled_tokens -= _take_redrafted(entries, result)
        else:
            self.stats.num_scheduled_tokens -= _unrun_second_stages(plan, result)
        steps_run = [1]
        if output.num_steps > 1:  # the ranks drew every token of the run (ModelRunner._run_steps)
            sampled = {e.request.request_id: drawn for group, tokens in zip(entries, result.logits)
                       for e, drawn in zip(group, tokens.T.tolist())}
            steps_run = [len(tokens) for tokens in result.logits]
            if min(steps_run) < output.num_steps:  # a group drew a stop token, or was interrupted
                self.stats.cut_run(plan, steps_run)
            if rewind is not None:
                rewind(steps_run[0])
        else:
            sampled = self.sample(entries, result.logits)
        self._steps_run = max(steps_run)
        seconds = self.step_seconds(start) if self.speculator is not None else None
        updated = self.scheduler.update_from_output(output, sampled)
        if self.speculator is not None:
            self._speculate(output.num_scheduled_tokens, entries, updated, sampled, seconds, False, steps_run)
        _stamp_token_times(updated)
        return CoreStep(output, entries, updated, result.swap_seconds, result.reshard_seconds)

    def _running_as_proposed(self) -> bool:
        """Whether the running requests are those the speculator's last propose saw: none joined or left since (the
        scheduler counts both, since a finish and an arrival in one step keep their number)."""
        return self.scheduler.num_running_changes == self._proposed_for

    def _max_run_steps(self) -> int | None:
        """The most steps a multi-step run of the next plan may take beside the speculator: its quiet steps (those
        after which every request the last propose saw waits) and the one after which a proposal may follow; 1 where
        the running requests are not the ones it saw. None without a speculator."""
        speculator = self.speculator
        if speculator is None:
            return None
        if speculator.quiet_steps and self._running_as_proposed():
            return speculator.quiet_steps + 1
        return 1

    def _speculate(self, num_tokens: int, entries: list[list[ScheduledRequest]], updated: list[Request],
                   sampled: dict[str, int | list[int]], seconds: float | None, launched_behind: bool,
                   steps_run: Sequence[int] = (1,)) -> None:
        """After a step of `num_tokens` tokens that ran in `seconds` (None: it ran ahead of the host), the
        speculator: nothing where every request the last propose saw waits, else the step's checks observed and
        the next proposals made; none while a step launched behind this one computes the tokens they would
        follow. `steps_run`: a multi-step run's steps, by group (its decodes priced at their mean)."""
        speculator, scheduler = self.speculator, self.scheduler
        num_running = len(scheduler.running)
        num_steps = max(steps_run)
        if seconds is not None:
            seconds /= num_steps
        # the requests the last propose saw, each decoding a token a step, all of them waiting
        if (speculator.quiet_steps and self._running_as_proposed()
                and len(updated) == num_tokens == num_running and min(steps_run) == num_steps):
            skipped = min(num_steps, speculator.quiet_steps)
            speculator.skip_step(updated, skipped)
            num_steps -= skipped
        if not num_steps:
            return
        if launched_behind:  # a request finished, or came in, while a step ran ahead
            speculator.pass_step(updated)
        else:
            start = time.perf_counter()
            if seconds is not None:
                self.stats.record_spec(speculator.observe(entries, sampled, seconds))
            speculator.propose(updated, num_running, num_steps)
            self._proposed_for = scheduler.num_running_changes
            self.stats.num_cut_tokens = speculator.num_cut_tokens
            self._speculator_seconds = time.perf_counter() - start


def _plain_decode(entries: list[list[ScheduledRequest]]) -> bool:
    """Whether a step's entries are decodes of one token each, none checking proposals."""
    return all(e.num_tokens == 1 and not e.spec_token_ids for group in entries for e in group) and any(entries)


def _stamp_token_times(updated: list[Request]) -> None:
    now = time.monotonic()
    for request in updated:
        if request.first_token_time is None:
            request.first_token_time = now
        request.last_token_time = now


def _unrun_second_stages(plan: StepPlan, result: StepResult) -> int:
    """The slots of batch-1 checks in two stages (GroupStep.first_stage, not redrafting) whose second stage the C++
    decoder did not run, their first having rejected a proposal (run_in_stages: those rows' argmax -1)."""
    unrun = 0
    for group, logits in zip(plan.groups, result.logits):
        argmax = getattr(logits, ROW_ARGMAX, None) if group.first_stage and group.redraft is None else None
        if argmax is not None and argmax[group.first_stage] < 0:
            unrun += group.num_tokens - group.first_stage
    return unrun


def _take_redrafted(entries: list[list[ScheduledRequest]], result: StepResult) -> int:
    """A batch-1 check whose stages after the first the C++ decoder drafted (GroupStep.redraft): its rows' argmax are
    the tokens it drew at the step's positions (-1 past them), each but the last a proposal accepted there, so the
    sampler checks it as a one-stage check of those proposals and one that no token equals (-1) where the last was
    drawn; its request keeps the stages the decoder ran, each a check of its own (Speculator.observe). Nothing where
    the decoder declined the step (its forward checked every slot's proposal in one stage). Returns the entry's slots
    that no stage computed (a stage computes its proposals and the token before them)."""
    stages = redraft_stages(result.redraft_counts)
    if not stages:
        return 0
    ((entry,),) = entries
    drawn = getattr(result.logits[0], ROW_ARGMAX).tolist()
    num_drawn = drawn.index(-1) if -1 in drawn else len(drawn)
    entry.spec_token_ids = (*drawn[:num_drawn - 1], -1)
    entry.request.spec_stages = stages
    return entry.num_tokens - sum(stage.proposed + 1 for stage in stages)
