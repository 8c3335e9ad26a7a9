"""The simulator: torch_shift's own engine with modelled steps.

A discrete-event loop drives rank 0's half of a real `LLMEngine` (`LLMEngine.driver_only`: the request
queue, `Scheduler`, block managers, host tier, policy and `PlanBuilder`, all the project's own code)
over a request stream. Only the forward is replaced: `SimulatedEngine._modelled_forward` prices the step plan
with a `StepTimer` (the cost model, or fixed times in tests) instead of computing it, and the sampler
returns a filler token (outputs end by their length: `ignore_eos`). The clock is virtual: a step takes
its modelled time, a request arrives at its time in the stream, and each token is stamped with the end
of the step that produced it. So any change to scheduling, block accounting or a policy changes the
simulation the same way it changes the engine.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from torch_shift.bench.traffic import RequestSpec
from torch_shift.config import ModelConfig
from torch_shift.engine.llm_engine import EngineArgs, LLMEngine
from torch_shift.engine.model_runner import StepResult
from torch_shift.engine.sampling_params import SamplingParams
from torch_shift.engine.step_plan import GroupStep, StepPlan, split_micro_batches
from torch_shift.kv.tier import SwapOp
from torch_shift.parallel.layouts import Deployment
from torch_shift.parallel.layouts import Layout as EngineLayout
from torch_shift.planner.cost import Layout, lone_multiple, memory_per_rank, step_cost
from torch_shift.planner.hardware import HardwareProfile
from torch_shift.planner.shape import ModelShape, Seq

StepTimer = Callable[[StepPlan, Deployment], float]


# -- step times ---------------------------------------------------------------------------------------------
def _standing_clock() -> float:
    """A simulated engine's clock for the host's own work (SimulatedEngine.simulated): it never advances."""
    return 0.0


def cost_layout(layout: EngineLayout, num_micro_batches: int | None = None, expert_parallel: bool = False) -> Layout:
    """The cost model's description of an engine layout (Shift's shift layout is plain TP over its ranks; with
    `expert_parallel` both hold whole experts, as `enable_expert_parallel` places them)."""
    if layout.kind == "sp_tp":
        return Layout("sp_tp", sp=layout.sp, tp=layout.tp, expert_parallel=expert_parallel)
    if layout.kind == "pp":
        return Layout("pp", pp=layout.pp, num_microbatches=num_micro_batches)
    return Layout("tp", tp=len(layout.ranks), expert_parallel=expert_parallel and len(layout.ranks) > 1)


def group_seqs(group: GroupStep) -> list[Seq]:
    return [Seq(int(n), int(c), int(r))
            for n, c, r in zip(group.num_scheduled, group.num_computed, group.logits_counts)]


class CostModelTimer:
    """A step plan's time by the cost model (torch_shift.planner.cost): the groups of a step run side by
    side on disjoint ranks (the step lasts as long as the slowest), plus the host tier's copies: each
    rank moves its share of the blocks over its host link (`hw.host_bandwidth`), before the forward, or
    beside it when the tier's copies are asynchronous. `expert_parallel`: the experts placed as
    `enable_expert_parallel` places them."""

    def __init__(self, shape: ModelShape, hw: HardwareProfile, block_size: int, async_swaps: bool = False,
                 expert_parallel: bool = False):
        self.shape, self.hw, self.block_size, self.async_swaps = shape, hw, block_size, async_swaps
        self.expert_parallel = expert_parallel
        self.last_forward_s = 0.0
        self.last_swap_s = 0.0

    def __call__(self, plan: StepPlan, deployment: Deployment) -> float:
        forward = 0.0
        if plan.groups:
            layouts = [deployment[g.layout] for g in plan.groups]
            if all(layout.pp == 1 for layout in layouts) and len(plan.groups) > 1:
                widths = tuple(len(layout.ranks) for layout in layouts)
                seqs, groups = [], []
                for i, g in enumerate(plan.groups):
                    group = group_seqs(g)
                    seqs += group
                    groups += [i] * len(group)
                forward = step_cost(self.shape, self.hw, Layout.dp_groups(*widths), seqs, groups).total_s
            elif len(plan.groups) == 1:  # alone with work: its ranks run on the idle ranks' cores too
                hw = self.hw.borrowing(lone_multiple(deployment.world_size, len(layouts[0].ranks)))
                forward = self.group_seconds(layouts[0], plan.groups[0], hw)
            else:  # pipelines side by side (each priced alone: the shared host memory is not)
                forward = max(self.group_seconds(layout, g) for layout, g in zip(layouts, plan.groups))
        swaps = self.swap_seconds(plan.swap_outs, deployment) + self.swap_seconds(plan.swap_ins, deployment)
        self.last_forward_s, self.last_swap_s = forward, swaps
        return max(forward, swaps) if self.async_swaps else forward + swaps

    def group_seconds(self, layout: EngineLayout, group: GroupStep, hw: HardwareProfile | None = None) -> float:
        hw = hw or self.hw
        if layout.pp == 1:
            return step_cost(self.shape, hw, cost_layout(layout, expert_parallel=self.expert_parallel),
                             group_seqs(group)).total_s
        pieces = [group_seqs(piece) for piece in split_micro_batches(group)]  # as the engine cuts the step
        return step_cost(self.shape, hw, cost_layout(layout, len(pieces)), group_seqs(group),
                         micro_batches=pieces).total_s

    def swap_seconds(self, ops: Sequence[SwapOp], deployment: Deployment) -> float:
        """Every rank of a replica copies its part of each block (a stage's layers or a TP rank's heads):
        the replicas' copies run side by side."""
        shape = self.shape
        block_bytes = 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * shape.kv_bytes * self.block_size
        per_replica: dict[int, float] = {}
        for op in ops:
            ranks = len(deployment[op.layout].ranks)
            nbytes = len(op.tier_blocks) * block_bytes / ranks
            per_replica[op.replica] = per_replica.get(op.replica, 0.0) + nbytes / self.hw.host_bandwidth
        return max(per_replica.values(), default=0.0)


class FixedStepTimer:
    """A step's time from a table by the layouts it binds (tests: the same schedule without any cost model)."""

    def __init__(self, seconds: float | dict[str, float] = 0.01):
        self.seconds = seconds

    def __call__(self, plan: StepPlan, deployment: Deployment) -> float:
        if not isinstance(self.seconds, dict):
            return float(self.seconds)
        return max((self.seconds[g.layout] for g in plan.groups), default=0.0)


def pool_layout(deployment: Deployment) -> Layout:
    """The cost model's layout of a replica's ranks as its KV pool lays out the cache (every view of a pool
    has the same bytes per block: a stage's layers with every head, or every layer with a head slice)."""
    return cost_layout(deployment.layouts[0])


def blocks_for_budget(shape: ModelShape, budget_bytes: int, block_size: int) -> Callable[[Deployment], int]:
    """KV blocks of a pool whose ranks each have `budget_bytes` for KV (the engine's kv_cache_memory_bytes)."""
    def blocks(deployment: Deployment) -> int:
        per_token = memory_per_rank(shape, pool_layout(deployment)).kv_bytes_per_token
        return int(budget_bytes // (per_token * block_size))
    return blocks


# -- the engine with modelled steps -----------------------------------------------------------------------
class ClockedEngine(LLMEngine):
    """An engine whose steps also get a modelled time from `step_timer` (what `simulate` advances its clock
    by); the forward still runs. `plan_log`, when a list, receives every step plan."""

    step_timer: StepTimer = staticmethod(lambda plan, deployment: 0.0)
    plan_log: list | None = None
    last_step_modelled_s: float = 0.0

    def __init__(self, args: EngineArgs, *rest, **kwargs):
        # steps one after the other, each priced as it runs (asynchronous scheduling would overlap them), single ones
        # (a multi-step run's tokens are drawn on the ranks, which a simulator has not)
        super().__init__(replace(args, async_scheduling=False, num_scheduler_steps=None), *rest, **kwargs)
        forward = self.core.executor

        def timed_forward(plan: StepPlan) -> StepResult:
            self._time_plan(plan)
            return forward(plan)

        self.core.executor = timed_forward

    @property
    def last_step_entries(self) -> list:
        """The last step's scheduled requests per group ([] when it ran nothing)."""
        return [] if self.last_core_step is None else self.last_core_step.entries

    def _time_plan(self, plan: StepPlan) -> None:
        self.last_step_modelled_s = self.step_timer(plan, self.deployment)
        if self.plan_log is not None:
            self.plan_log.append(plan)


class SimulatedEngine(ClockedEngine):
    """Rank 0's engine (no model, no ranks) whose forward is only its `step_timer`: the sampler returns a
    filler token that is not an end-of-sequence token. With speculative decoding (the engine arguments'
    `speculative_config`), the proposer runs on the filler outputs and each proposed token is accepted with
    probability `spec_acceptance` (until the first rejection, as a real check): a step is priced with every
    proposed token, and adds the accepted ones and one more."""

    filler_token: int
    spec_acceptance: float = 0.0
    _spec_rng: random.Random

    @classmethod
    def simulated(cls, args: EngineArgs, config: ModelConfig, num_kv_blocks: int | Callable[[Deployment], int],
                  step_timer: StepTimer,
                  filler_token: int | None = None, spec_acceptance: float = 0.0, seed: int = 0) -> SimulatedEngine:
        if not 0.0 <= spec_acceptance <= 1.0:
            raise ValueError(f"spec_acceptance must be in [0, 1], got {spec_acceptance!r}")
        engine = cls.driver_only(args, config, num_kv_blocks)
        engine.step_timer = step_timer
        if filler_token is None:
            filler_token = next(t for t in range(config.vocab_size) if t not in engine.eos_token_ids)
        engine.filler_token = filler_token
        engine.spec_acceptance = spec_acceptance
        engine._spec_rng = random.Random(seed)
        engine.core.sample = engine._filler_sample
        engine.core.executor = engine._modelled_forward
        engine.core.step_seconds = lambda start: engine.last_step_modelled_s  # what the speculator's budget reads
        speculator = engine.core.speculator
        if speculator is not None:
            # the host's own time proposing and fitting is not modelled: on the virtual clock it takes none, so that
            # a plan does not depend on the speed or the load of the machine that makes it
            speculator.clock = speculator.step_cost.clock = _standing_clock
        return engine

    def _modelled_forward(self, plan: StepPlan) -> StepResult:
        self._time_plan(plan)
        return StepResult([None] * len(plan.groups))

    def _filler_sample(self, entries_by_group, logits_by_group) -> dict[str, list[int]]:
        sampled = {}
        for entries in entries_by_group:
            for e in entries:
                if not e.sample:
                    continue
                proposed = e.spec_token_ids
                accepted = 0
                while accepted < len(proposed) and self._spec_rng.random() < self.spec_acceptance:
                    accepted += 1
                after = self.filler_token
                if accepted < len(proposed) and proposed[accepted] == after:  # a rejection draws another token
                    after = next(t for t in range(self.config.model.vocab_size)
                                 if t != after and t not in self.eos_token_ids)
                sampled[e.request.request_id] = [*proposed[:accepted], after]
        return sampled


# -- the event loop ---------------------------------------------------------------------------------------
@dataclass
class RequestRecord:
    request_id: str
    arrival_s: float
    num_prompt_tokens: int
    max_tokens: int
    first_token_s: float | None = None
    finish_s: float | None = None
    num_output_tokens: int = 0
    first_scheduled_s: float | None = None  # the start of its first step: its queue time ends there

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.arrival_s

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first (None with one token)."""
        if self.num_output_tokens < 2:
            return None
        return (self.finish_s - self.first_token_s) / (self.num_output_tokens - 1)


@dataclass
class StepRecord:
    start_s: float
    seconds: float
    layouts: str  # the step's layout names, '+'-joined ("" for a step of tier copies only)
    num_tokens: int
    num_seqs: int


@dataclass
class SimulationResult:
    requests: list[RequestRecord]
    steps: list[StepRecord]
    engine_stats: dict
    end_s: float

    @property
    def num_switches(self) -> int:
        return self.engine_stats["num_switches"]

    def metrics(self) -> dict:
        """Medians and 90th percentiles of TTFT, TPOT and E2E (ms), queue time, throughput (output tokens,
        and all tokens, per second of the whole run), steps and switches."""
        done = [r for r in self.requests if r.finish_s is not None]
        ttft = np.array([r.ttft_s for r in done]) * 1e3
        tpot = np.array([t for r in done if (t := r.tpot_s) is not None]) * 1e3
        e2e = np.array([r.finish_s - r.arrival_s for r in done]) * 1e3
        queue = np.array([r.first_scheduled_s - r.arrival_s for r in done]) * 1e3
        span = self.end_s - min((r.arrival_s for r in self.requests), default=0.0)
        out_tokens = sum(r.num_output_tokens for r in done)

        def pct(a, q):
            return float(np.percentile(a, q)) if len(a) else None

        return {
            "num_requests": len(self.requests), "num_finished": len(done),
            "ttft_p50_ms": pct(ttft, 50), "ttft_p90_ms": pct(ttft, 90),
            "tpot_p50_ms": pct(tpot, 50), "tpot_p90_ms": pct(tpot, 90),
            "e2e_p50_ms": pct(e2e, 50), "queue_p50_ms": pct(queue, 50), "queue_p90_ms": pct(queue, 90),
            "throughput_tok_s": out_tokens / span if span > 0 else None,
            "total_throughput_tok_s": (out_tokens + sum(r.num_prompt_tokens for r in done)) / span if span > 0 else None,
            "duration_s": span, "num_steps": len(self.steps), "num_switches": self.num_switches,
            "steps_by_layout": self.engine_stats["steps_by_layout"],
            "num_preemptions": self.engine_stats["num_preemptions"],
        }


def simulate(engine: ClockedEngine, requests: Sequence[RequestSpec], concurrency: int | None = None,
             max_steps: int | None = None) -> SimulationResult:
    """Run `requests` through `engine` on a virtual clock. Open loop (each request at its `arrival_s`), or
    closed loop with `concurrency` clients: each sends its next request when its last one finished (the
    stream's arrival times are then ignored). The same loop drives a real engine (a `ClockedEngine`)."""
    if concurrency is not None and concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    specs = list(requests) if concurrency else sorted(requests, key=lambda s: s.arrival_s)
    records: dict[str, RequestRecord] = {}
    steps: list[StepRecord] = []
    clock = 0.0
    next_index = 0

    def add(spec: RequestSpec, at: float) -> None:
        params = SamplingParams(max_tokens=spec.max_tokens, ignore_eos=True, temperature=0.0)
        engine.add_request(spec.id, spec.prompt, params, priority=spec.priority)
        records[spec.id] = RequestRecord(spec.id, at, len(spec.prompt), spec.max_tokens)

    if concurrency:
        while next_index < min(concurrency, len(specs)):
            add(specs[next_index], 0.0)
            next_index += 1
    while next_index < len(specs) or engine.has_unfinished_requests():
        if not concurrency:
            if not engine.has_unfinished_requests() and specs[next_index].arrival_s > clock:
                clock = specs[next_index].arrival_s  # idle until the next arrival
            while next_index < len(specs) and specs[next_index].arrival_s <= clock:
                add(specs[next_index], specs[next_index].arrival_s)
                next_index += 1
        engine.last_step_modelled_s = 0.0
        before = engine.num_steps
        outputs = engine.step(final_only=False)
        seconds = engine.last_step_modelled_s
        if engine.num_steps == before and seconds == 0.0:
            stuck = [r for r in records.values() if r.finish_s is None]
            raise RuntimeError(f"the engine cannot schedule any of {len(stuck)} unfinished requests (the KV cache "
                               f"or the host tier is too small for them?), e.g. {stuck[0].request_id}")
        start, clock = clock, clock + seconds
        scheduled = [e for entries in engine.last_step_entries for e in entries]
        steps.append(StepRecord(start, seconds, engine.last_step_layout if engine.num_steps > before else "",
                                sum(e.num_tokens for e in scheduled), len(scheduled)))
        for e in scheduled:
            record = records[e.request.request_id]
            if record.first_scheduled_s is None:
                record.first_scheduled_s = start
        if max_steps is not None and len(steps) > max_steps:
            raise RuntimeError(f"the simulation passed {max_steps} steps")
        for output in outputs:
            record = records[output.request_id]
            n = len(output.outputs[0].token_ids)
            if n and record.first_token_s is None:
                record.first_token_s = clock
            record.num_output_tokens = n
            if output.finished:
                record.finish_s = clock
                if concurrency and next_index < len(specs):
                    add(specs[next_index], clock)
                    next_index += 1
    return SimulationResult(list(records.values()), steps, engine.stats(), clock)


def predict(engine_args: dict, config: ModelConfig, hw: HardwareProfile, requests: Sequence[RequestSpec], *,
            dtype: str = "auto", concurrency: int | None = None, spec_acceptance: float = 0.0) -> SimulationResult:
    """What `LLMEngine(**engine_args)` would do with `requests` on `hw`, by the cost model: a benchmark's
    configuration simulated (its KV pool from `num_kv_blocks` or `kv_cache_memory_bytes`, as the engine's;
    with a `speculative_config`, proposed tokens accepted with probability `spec_acceptance`)."""
    args = EngineArgs("config-only", **engine_args)
    shape = ModelShape.from_config(config, dtype=dtype)
    if args.num_kv_blocks is not None:
        blocks = args.num_kv_blocks
    elif args.kv_cache_memory_bytes is not None:
        blocks = blocks_for_budget(shape, args.kv_cache_memory_bytes, args.block_size)
    else:
        raise ValueError("predict needs the KV pool's size: num_kv_blocks or kv_cache_memory_bytes")
    timer = CostModelTimer(shape, hw, args.block_size, async_swaps=args.kv_swap == "async",
                           expert_parallel=args.enable_expert_parallel)
    engine = SimulatedEngine.simulated(args, config, blocks, timer, spec_acceptance=spec_acceptance)
    return simulate(engine, requests, concurrency=concurrency)
