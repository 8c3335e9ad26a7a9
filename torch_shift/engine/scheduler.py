"""Continuous batching under a per-step token budget, in plain Python.

Each step the policy (torch_shift.engine.policies) decides which layouts run: groups of replicas,
each with its own token budget and batch. The scheduler gives every running request of a bound
group the tokens it still lacks (one for a request that is generating, a chunk of its prompt for
one that is not), then admits waiting requests, each into a group the policy routes it to, while
budget, sequence slots and KV blocks last. A running request whose group is not bound this step
is paused: it keeps its blocks and resumes when its group runs again. When a request cannot get a
block, the worst running request holding blocks in the same pools is preempted: its blocks are
freed and it is recomputed later from its prompt and the tokens it already produced (outputs
unchanged). The decision is a `SchedulerOutput`, a plain object: the step plan.

With a host tier of the KV cache (torch_shift.kv.tier), a request's KV may also leave the device for
the tier and come back: a preempted request that is generating is swapped out when the tier has
room (recomputed otherwise), a policy may move requests there (`StepDecision.swap_out`), and in any
step that is not prefill-only the requests in the tier are swapped in, first come first, into a
group the policy routes them to, before waiting requests are admitted. A request's states:
waiting (no KV; `waiting`), in the tier (SWAPPED; `swapped`), on the device (RUNNING; `running`,
paused while no group of its replicas and its KV view runs) and running (scheduled this step).
A request's KV is only read in the view it was written in (`Layout.kv_view`); it changes view
through the tier.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import deque
from dataclasses import dataclass, field, replace

from torch_shift.config import SchedulerConfig
from torch_shift.engine.policies.base import Policy
from torch_shift.engine.request import Request, RequestStatus
from torch_shift.kv.block_manager import BlockManager
from torch_shift.kv.tier import SwapOp, TierAllocator


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_tokens: int  # tokens computed this step
    num_computed_tokens: int  # position of the first of them
    sample: bool  # the chunk reaches the request's last token: sample the next one
    prompt_logprobs: bool  # return logits at every position of the chunk
    block_tables: tuple[list[int], ...]  # the request's blocks in each pool of its group (live lists)
    # proposed tokens checked this step (speculative decoding): they follow the request's last token, which is
    # computed with them; logits at every position of the entry
    spec_token_ids: tuple[int, ...] = ()  # a tuple: the empty one is shared, not allocated per entry per step
    # a redrafting check's slots past its first stage's proposals (Request.spec_redraft): fillers, whose ids the C++
    # decoder writes over with its own drafts; the last spec_fillers of spec_token_ids
    spec_fillers: int = 0

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def token_ids(self) -> list[int]:
        start = self.num_computed_tokens
        num_known = self.num_tokens - len(self.spec_token_ids)
        return self.request.all_token_ids[start:start + num_known] + list(self.spec_token_ids)

    @property
    def block_table(self) -> list[int]:
        return self.block_tables[0]


@dataclass
class ScheduledGroup:
    """One bound group's batch in execution order: one-token decodes first, then prompt chunks (each in
    scheduling order: running requests, then admitted ones). Logits and sampling follow this order."""

    layout: str
    replicas: tuple[int, ...]
    entries: list[ScheduledRequest] = field(default_factory=list)
    num_spec_tokens: int = 0  # proposed tokens checked in this group: with none, nothing reads them per entry

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(e.num_tokens for e in self.entries)


@dataclass
class SchedulerOutput:
    groups: list[ScheduledGroup] = field(default_factory=list)
    preempted_request_ids: list[str] = field(default_factory=list)
    swap_outs: list[SwapOp] = field(default_factory=list)  # device -> tier, before the forward
    swap_ins: list[SwapOp] = field(default_factory=list)  # tier -> device, after the swap-outs
    # requests that left the device since the last output (finished, aborted, preempted, moved, swapped out):
    # their rows of the replicas' persistent batches are free
    removed_request_ids: list[str] = field(default_factory=list)
    # requests whose block tables lost blocks since the last output (rejected proposals' blocks given back):
    # request -> blocks left. Blocks past those may since have been taken again, other ones in their places
    shrunk_block_tables: dict[str, int] = field(default_factory=dict)
    # decode steps the plan runs (multi-step scheduling, SchedulerConfig.num_scheduler_steps): each entry a decode
    # with KV blocks for that many tokens, drawing greedily on the ranks; then it has drawn that many tokens
    num_steps: int = 1

    @property
    def has_swaps(self) -> bool:
        return bool(self.swap_outs or self.swap_ins)

    @property
    def scheduled(self) -> list[ScheduledRequest]:
        return [e for g in self.groups for e in g.entries]

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(g.num_scheduled_tokens for g in self.groups)

    @property
    def is_empty(self) -> bool:
        return not any(g.entries for g in self.groups)

    @property
    def layout(self) -> str:
        """The layouts of this step's groups, '+'-joined ("shift"; "dp@0+dp@1")."""
        return "+".join(g.layout for g in self.groups if g.entries)


class WaitingQueue:
    """FCFS (preempted requests go back to the front) or priority order (lower value first,
    then arrival)."""

    def __init__(self, policy: str):
        self.policy = policy
        self._fifo: deque[Request] = deque()
        self._heap: list[tuple[int, float, int, Request]] = []
        self._counter = itertools.count()

    def __len__(self) -> int:
        return len(self._fifo) + len(self._heap)

    def __iter__(self):
        if self.policy == "priority":
            return iter(r for *_, r in sorted(self._heap))
        return iter(self._fifo)

    def push(self, request: Request, front: bool = False) -> None:
        if self.policy == "priority":
            heapq.heappush(self._heap, (request.priority, request.arrival_time, next(self._counter), request))
        elif front:
            self._fifo.appendleft(request)
        else:
            self._fifo.append(request)

    def peek(self) -> Request:
        return self._heap[0][-1] if self.policy == "priority" else self._fifo[0]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[-1] if self.policy == "priority" else self._fifo.popleft()

    def remove(self, request: Request) -> None:
        if self.policy == "priority":
            self._heap = [e for e in self._heap if e[-1] is not request]
            heapq.heapify(self._heap)
        else:
            self._fifo.remove(request)


@dataclass
class _Group:
    """A bound group while the step is being formed."""

    layout: str
    replicas: tuple[int, ...]
    budget: int
    phase: str | None
    kv_view: str
    pool: BlockManager | None  # the one pool of a one-replica group
    entries: list[ScheduledRequest] = field(default_factory=list)
    num_spec_tokens: int = 0
    out_of_blocks: bool = False


class Scheduler:
    def __init__(self, config: SchedulerConfig, pools: BlockManager | list[BlockManager], policy: Policy,
                 tier: TierAllocator | None = None):
        """`pools`: one block manager per replica (a single one: one replica). `policy`: what runs each
        step (torch_shift.engine.policies). `tier`: the host tier of the KV cache, if any."""
        self.config = config
        self.pools: list[BlockManager] = [pools] if isinstance(pools, BlockManager) else list(pools)
        self.policy = policy
        self.waiting = WaitingQueue(config.policy)
        self.running: list[Request] = []
        self.num_running_changes = 0  # requests that joined or left `running`, counted
        self.requests: dict[str, Request] = {}
        self.num_seqs = [0] * len(self.pools)  # admitted requests holding a place on each replica
        # tokens left per replica while this step admits (remaining_tokens), kept by each placement and release
        self._remaining: list[int] | None = None
        self._admitting = False
        self._removed: list[str] = []  # left the device since the last output
        self._shrunk: dict[str, int] = {}  # block tables that lost blocks since the last output: blocks left
        self.tier = tier
        self.swapped: deque[Request] = deque()  # KV in the tier, in the order they will be swapped in
        self._deferred_frees: list[tuple[int, str]] = []  # (replica, request): device blocks an async copy reads
        # swapped out this step with copies beside the forward: their device blocks are still theirs
        self._swapped_out_now: set[str] = set()
        self.num_host_sampled = 0  # unfinished requests whose sampling reads their tokens on the host
        self.num_preemptions = 0  # requests that lost their device KV for another's blocks or a move
        self.num_swap_outs = 0
        self.num_swap_ins = 0
        self.num_steps = 0
        self.last_decision = None
        self.view = SchedulerView(self)
        # multi-step runs may hold requests that sample (EngineCore sets it where every rank draws them as the
        # sampler would); else only requests that draw their argmax
        self.sampled_runs = False

    @property
    def block_manager(self) -> BlockManager:
        """The pool of the first replica (the only one without data parallelism)."""
        return self.pools[0]

    def add_request(self, request: Request) -> None:
        assert request.request_id not in self.requests, request.request_id
        self.requests[request.request_id] = request
        self.num_host_sampled += not request.samples_on_device
        self.waiting.push(request)
        self.policy.on_add(request, self.view)

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # -- KV blocks over a request's pools ---------------------------------------------------------------
    def _allocate(self, request: Request, replicas: tuple[int, ...], num_tokens: int,
                  cached: list[int] = (), view: str = "heads") -> bool:
        width = len(replicas)
        rid = request.request_id
        if width == 1:
            return self.pools[replicas[0]].allocate(rid, num_tokens, cached, view=view)
        pools = [self.pools[r] for r in replicas]
        if len(pools) > 1 and not all(p.can_allocate(rid, num_tokens, cached, width) for p in pools):
            return False
        for p in pools:
            ok = p.allocate(rid, num_tokens, cached, width, view)
            assert ok or len(pools) == 1
            if not ok:
                return False
        return True

    def remaining_tokens(self) -> list[int]:
        """Tokens the requests placed on each replica have left: their prompts' uncomputed tokens and their outputs
        up to `max_tokens`. One pass over the running requests, once per step while a step admits (routing reads it
        for every request it places)."""
        if self._remaining is not None:
            return self._remaining
        remaining = [0] * len(self.num_seqs)
        for request in self.running:
            left = _tokens_left(request)
            for r in request.replicas:
                remaining[r] += left
        if self._admitting:
            self._remaining = remaining
        return remaining

    def _placed(self, request: Request, sign: int) -> None:
        self.num_running_changes += 1
        if self._remaining is not None:
            left = sign * _tokens_left(request)
            for r in request.replicas:
                self._remaining[r] += left

    def _release(self, request: Request, free_blocks: bool = True) -> None:
        """The request leaves the device (finished, preempted, swapped or moved): its blocks, and its proposals,
        which a step scheduled before its next token reaches the host would take as following that token."""
        self._placed(request, -1)
        if request.spec_token_ids:
            request.spec_token_ids = []
            request.spec_stage = 0
            request.spec_redraft = None
        for r in request.replicas:
            if free_blocks:
                self.pools[r].free(request.request_id)
            self.num_seqs[r] -= 1
        request.replicas = ()
        request.kv_layout = request.kv_view = None
        self._removed.append(request.request_id)

    def _can_swap_out(self, request: Request) -> bool:
        """A request of one replica whose KV covers all but its last sampled token (it is generating):
        swapped in again, it decodes at once in any layout of the pool."""
        return (self.tier is not None and len(request.replicas) == 1 and request.num_computed_tokens > 0
                and request.num_tokens - request.num_computed_tokens == 1)

    def _swap_out(self, request: Request, output: SchedulerOutput, front: bool = False) -> bool:
        """Move a running request's KV to the tier (False: the tier cannot hold it). Its device blocks
        are free at once, or from the next step when copies run beside the forward."""
        rid = request.request_id
        tier_blocks = self.tier.allocate(rid, request.num_computed_tokens)
        if tier_blocks is None:
            return False
        replica = request.replicas[0]
        device_blocks = self.pools[replica].req_blocks[rid][:len(tier_blocks)]
        output.swap_outs.append(SwapOp(replica, request.kv_layout, list(device_blocks), tier_blocks))
        self.running.remove(request)
        if self.tier.async_copies:
            self._deferred_frees.append((replica, rid))
        self._release(request, free_blocks=not self.tier.async_copies)
        request.status = RequestStatus.SWAPPED
        if front:
            self.swapped.appendleft(request)
        else:
            self.swapped.append(request)
        if self.tier.async_copies:
            self._swapped_out_now.add(rid)
        self.num_swap_outs += 1
        return True

    def _evict(self, request: Request, output: SchedulerOutput) -> bool:
        """Preempt a request for another's blocks: to the tier when it is generating and the tier has
        room, else by recompute. True when its device blocks are free at once."""
        if self._can_swap_out(request) and self._swap_out(request, output, front=True):
            request.num_preemptions += 1
            self.num_preemptions += 1
            return not self.tier.async_copies
        self._preempt(request, output)
        return True

    def _preempt(self, request: Request, output: SchedulerOutput) -> None:
        self.running.remove(request)
        self._release(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.push(request, front=True)
        output.preempted_request_ids.append(request.request_id)

    def _victim(self, replicas: tuple[int, ...], after: Request) -> Request:
        """The request to preempt for blocks in `replicas`' pools: the last running one that holds
        blocks there (the latest admitted under FCFS; the worst priority under the priority policy,
        running being sorted), `after` itself at the latest."""
        wanted = set(replicas)
        for request in reversed(self.running):
            if request is after or wanted.intersection(request.replicas):
                return request
        raise AssertionError("the request itself is running")

    def _paused_victim(self, request: Request, replicas: tuple[int, ...],
                       groups: dict[tuple[int, ...], _Group]) -> Request | None:
        """A request of worse priority (a greater value) that holds blocks in `replicas`' pools but does
        not run this step (its group is not bound): the worst such, or None. Only a more urgent
        request may take a paused one's blocks (as vLLM's priority preemption)."""
        wanted = set(replicas)
        candidates = [r for r in self.running if r.priority > request.priority
                      and wanted.intersection(r.replicas) and r.replicas not in groups]
        return max(candidates, key=lambda r: (r.priority, r.arrival_time), default=None)

    # -- one step ---------------------------------------------------------------------------------------
    def schedule(self, max_run_steps: int | None = None) -> SchedulerOutput:
        """The next step's plan. `max_run_steps`: the most decode steps a run of it may take, below
        num_scheduler_steps (with speculative decoding, the steps until a proposal may follow: EngineCore)."""
        output = SchedulerOutput()
        if self.tier is not None:
            self.tier.advance()
            self._swapped_out_now.clear()
            for replica, request_id in self._deferred_frees:  # the copies that read them are done
                self.pools[replica].free(request_id)
            self._deferred_frees.clear()
        decision = self.policy.decide(self.view)
        self.last_decision = decision
        for request_id in decision.recompute:
            request = self.requests.get(request_id)
            if request is not None and request.status == RequestStatus.RUNNING:
                self._preempt(request, output)
        for request_id in decision.swap_out:
            request = self.requests.get(request_id)
            if request is not None and request.status == RequestStatus.RUNNING:
                if not (self._can_swap_out(request) and self._swap_out(request, output)):
                    self._preempt(request, output)  # the tier cannot hold it: recomputed later, outputs unchanged
        deployment = self.policy.deployment
        groups: dict[tuple[int, ...], _Group] = {}
        for name in decision.layouts:
            layout = deployment[name]
            replicas = layout.replicas
            assert not any(set(replicas) & set(g) for g in groups), f"{name}: replicas bound twice"
            groups[replicas] = _Group(name, replicas, self.config.max_num_batched_tokens, decision.phase,
                                      layout.kv_view, self.pools[replicas[0]] if len(replicas) == 1 else None)
        if self.config.policy == "priority":
            # the worst request runs last, so it is the one preempted and nobody better waits behind it
            self.running.sort(key=lambda r: (r.priority, r.arrival_time))  # stable: ties keep admission order

        num_moved = self.num_preemptions
        running = RequestStatus.RUNNING
        step = self.num_steps
        assert max_run_steps is None or max_run_steps >= 1, max_run_steps
        num_steps = 1 if max_run_steps == 1 else self.run_length()
        if max_run_steps is not None:
            num_steps = min(num_steps, max_run_steps)
        for request in list(self.running):
            if request.status is not running:
                continue  # preempted this step for another's blocks
            group = groups.get(request.replicas)
            if (group is None or group.budget == 0 or group.out_of_blocks or group.kv_view != request.kv_view
                    or request.kv_ready_step > step):
                continue  # paused: no group of its replicas and its KV view runs this step
            num_computed = request.num_computed_tokens
            num_left = len(request.all_token_ids) - num_computed
            placeholders = request.num_output_placeholders  # asynchronous scheduling: tokens still on the device
            if placeholders:
                if request.finishes_by_length(placeholders, self.config.max_model_len):
                    continue  # the token on its way is its last
                num_left += placeholders
            if group.phase is not None and (group.phase == "decode") != (num_left == 1):
                continue
            spec = request.spec_token_ids if num_left == 1 else ()  # proposed tokens count in the budget
            num_new = num_left + len(spec) if spec else num_left
            if num_new > group.budget:
                num_new = group.budget
                spec = spec[:num_new - 1]
            assert num_new > 0, request.request_id
            while not self._allocate(request, group.replicas, num_computed + num_new, view=group.kv_view):
                victim = self._victim(group.replicas, request)
                freed = self._evict(victim, output)
                if victim is request or not freed:
                    group.out_of_blocks = True  # no block is left for anyone after it in these pools
                    break
            else:
                if spec:
                    group.entries.append(self._entry(group, request, num_new, tuple(spec)))
                    group.num_spec_tokens += len(spec)
                else:
                    group.entries.append(self._entry(group, request, num_new))
                group.budget -= num_new

        ran_out_of_blocks = self.num_preemptions > num_moved  # swapping in or admitting would only thrash
        if num_steps > 1:
            num_steps = self._run_blocks(groups, num_steps, ran_out_of_blocks)
        self._admitting = True
        try:
            if not ran_out_of_blocks and decision.phase != "prefill" and self.swapped:
                self._swap_in(groups, decision, output)
            if not ran_out_of_blocks and decision.phase != "decode":
                self._admit(groups, decision, output)
        finally:
            self._admitting, self._remaining = False, None
        for group in groups.values():
            if len(group.entries) > 1:
                _without_fillers(group)
            layout = self.policy.finalize(group.layout, sum(e.num_tokens for e in group.entries))
            output.groups.append(ScheduledGroup(layout, group.replicas, _decodes_first(group.entries),
                                                group.num_spec_tokens))
        for group in output.groups:  # as vLLM v1, computed once scheduled: the next step may be scheduled at once
            for entry in group.entries:
                request = entry.request
                request.num_computed_tokens += entry.num_tokens
                if entry.sample:
                    request.num_output_placeholders += 1
        output.removed_request_ids, self._removed = self._removed, []
        output.shrunk_block_tables, self._shrunk = self._shrunk, {}
        output.num_steps = num_steps
        self.num_steps += 1
        return output

    def run_length(self, after_tokens_in_flight: bool = False) -> int:
        """The decode steps this step's plan may run (vLLM v0's multi-step scheduling): 1, or where every running
        request decodes, draws its tokens by argmax (Request.draws_argmax, so every rank of its group draws the
        same) or, with `sampled_runs`, samples with uniforms taken before the run (Request.samples_in_runs), has its
        last token on the host, and nothing waits or sits in the tier, up to num_scheduler_steps, no more than the
        request closest to its length (max_tokens, the context) has left; 1 for a request alone whose stop strings
        may complete at any token (Request.stops_at_any_token). `after_tokens_in_flight`: the run a plan could take
        once the tokens of the step in flight (asynchronous scheduling) reach the host, none of them a stop token."""
        num_steps = self.config.num_scheduler_steps
        if num_steps == 1 or self.waiting or self.swapped or not self.running:
            return 1
        if len(self.running) == 1 and self.running[0].stops_at_any_token:  # Request.lone_stop_token_ids
            return 1
        max_model_len = self.config.max_model_len
        for request in self.running:
            on_their_way = request.num_output_placeholders
            if on_their_way and not after_tokens_in_flight:
                return 1
            num_tokens = len(request.all_token_ids) + on_their_way
            if (not (request.draws_argmax or self.sampled_runs and request.samples_in_runs)
                    or request.spec_token_ids or num_tokens - request.num_computed_tokens != 1):
                return 1
            num_steps = min(num_steps, request.max_tokens - len(request.output_token_ids) - on_their_way,
                            max_model_len - num_tokens)
        return max(num_steps, 1)

    def _run_blocks(self, groups: dict[tuple[int, ...], _Group], num_steps: int, ran_out_of_blocks: bool) -> int:
        """The blocks of a run of `num_steps` decode steps, taken once every running request holds its next
        token's (never another's: a run takes only free blocks, preempting nobody); the steps it runs: 1 where a
        running request was not scheduled (paused, preempted), a group is a pipeline's, or the free blocks fall short.
        Blocks taken before then stay with their requests, for their next tokens. A run whose requests sample has
        one group: groups that end their runs at different steps would leave the sampler's generator where no
        single steps would."""
        entries = [(group, e) for group in groups.values() for e in group.entries]
        deployment = self.policy.deployment
        num_groups = sum(1 for group in groups.values() if group.entries)
        # a pipeline's last stage draws the tokens its first stage embeds next
        if (ran_out_of_blocks or len(entries) != len(self.running)
                or any(deployment[group.layout].pp > 1 for group in groups.values())
                or num_groups > 1 and not all(e.request.draws_argmax for _, e in entries)):
            return 1
        for group, entry in entries:
            if not self._allocate(entry.request, group.replicas, entry.num_computed_tokens + num_steps,
                                  view=group.kv_view):
                return 1
        return num_steps

    def _swap_in(self, groups: dict[tuple[int, ...], _Group], decision, output: SchedulerOutput) -> None:
        """Requests in the tier onto the device, first come first, into groups the policy routes them
        to, while sequence slots and blocks last (with synchronous copies they run this step)."""
        max_seqs = self.config.max_num_seqs
        deployment = self.policy.deployment
        while self.swapped:
            request = self.swapped[0]
            if request.request_id in self._swapped_out_now:
                return
            for name in self.policy.route(request, decision, self.view):
                layout = deployment[name]
                group = groups.get(layout.replicas)
                if (layout.kv_width != 1 or group is None or group.out_of_blocks
                        or (group.budget == 0 and not self.tier.async_copies)
                        or self.num_seqs[layout.replicas[0]] >= max_seqs):
                    continue
                if self._swap_in_into(request, group, output):
                    break
            else:
                return  # first come first: nobody overtakes the head of the tier

    def _swap_in_into(self, request: Request, group: _Group, output: SchedulerOutput) -> bool:
        rid = request.request_id
        if not self._allocate(request, group.replicas, request.num_tokens, view=group.kv_view):
            return False
        self.swapped.popleft()
        replica = group.replicas[0]
        tier_blocks = self.tier.release(rid)
        device_blocks = self.pools[replica].req_blocks[rid][:len(tier_blocks)]
        output.swap_ins.append(SwapOp(replica, group.layout, list(device_blocks), tier_blocks))
        request.status = RequestStatus.RUNNING
        request.replicas = group.replicas
        request.kv_layout, request.kv_view = group.layout, group.kv_view
        self.num_seqs[replica] += 1
        self.running.append(request)
        self._placed(request, 1)
        self.num_swap_ins += 1
        if self.tier.async_copies:
            request.kv_ready_step = self.num_steps + 1  # its copy runs beside this step's forward
        else:
            group.entries.append(self._entry(group, request, 1))
            group.budget -= 1
        return True

    def _admit(self, groups: dict[tuple[int, ...], _Group], decision, output: SchedulerOutput) -> None:
        max_seqs = self.config.max_num_seqs
        while self.waiting:
            request = self.waiting.peek()
            if request.num_output_placeholders:
                return  # preempted with a token on its way: admitted again once it has arrived
            placed = False
            for name in self.policy.route(request, decision, self.view):
                replicas = self.policy.deployment[name].replicas
                group = groups.get(replicas)
                if group is None or group.budget == 0 or group.out_of_blocks:
                    continue
                if any(self.num_seqs[r] >= max_seqs for r in replicas):
                    continue
                if self._admit_into(request, group, groups, output):
                    placed = True
                    break
            if not placed:
                return  # FCFS: nobody overtakes the head of the queue

    def _admit_into(self, request: Request, group: _Group, groups: dict[tuple[int, ...], _Group],
                    output: SchedulerOutput) -> bool:
        cached: list[int] = []
        pools = [self.pools[r] for r in group.replicas]
        if request.num_computed_tokens == 0 and request.prompt_logprobs is None and len(pools) == 1:
            cached = pools[0].find_cached_prefix(request.request_id, request.all_token_ids, view=group.kv_view)
        num_computed = len(cached) * pools[0].block_size
        num_new = min(request.num_tokens - num_computed, group.budget)
        while not self._allocate(request, group.replicas, num_computed + num_new, cached, group.kv_view):
            victim = self._paused_victim(request, group.replicas, groups)
            if victim is None or not self._evict(victim, output):
                return False
        self.waiting.pop()
        if request.status == RequestStatus.WAITING:
            request.num_cached_tokens = num_computed
            request.first_scheduled_time = time.monotonic()
        request.num_computed_tokens = num_computed
        request.status = RequestStatus.RUNNING
        request.replicas = group.replicas
        request.kv_layout, request.kv_view = group.layout, group.kv_view
        for r in group.replicas:
            self.num_seqs[r] += 1
        self.running.append(request)
        self._placed(request, 1)
        group.entries.append(self._entry(group, request, num_new))
        group.budget -= num_new
        return True

    def _entry(self, group: _Group, request: Request, num_new: int,
               spec_token_ids: tuple[int, ...] = ()) -> ScheduledRequest:
        start = request.num_computed_tokens
        rid = request.request_id
        pool = group.pool
        tables = ((pool.req_blocks[rid],) if pool is not None
                  else tuple(self.pools[r].req_blocks[rid] for r in group.replicas))
        num_known = start + num_new - len(spec_token_ids) if spec_token_ids else start + num_new
        num_tokens = len(request.all_token_ids) + request.num_output_placeholders
        fillers = (len(spec_token_ids) - request.spec_stage if request.spec_redraft is not None
                   and request.spec_stage < len(spec_token_ids) else 0)
        return ScheduledRequest(request, num_new, start, num_known == num_tokens,
                                request.prompt_logprobs is not None and request.wants_prompt_logprobs, tables,
                                spec_token_ids, fillers)

    def update_from_output(self, output: SchedulerOutput,
                           sampled_token_ids: dict[str, int | list[int]]) -> list[Request]:
        """The tokens a scheduled step drew have arrived: append them to their requests (one, or with proposed
        tokens the accepted ones and one more, the computed tokens cut back to them); finish those that hit a
        token-level stop; put the blocks the step filled in the prefix cache. A request preempted since it was
        scheduled (asynchronous scheduling) still receives its token. Returns the requests that received tokens."""
        updated = []
        running, pools, max_model_len = RequestStatus.RUNNING, self.pools, self.config.max_model_len
        several = output.num_steps > 1  # every entry drew a token in each of the run's steps
        for group in output.groups:
            pool = pools[group.replicas[0]] if len(group.replicas) == 1 else None
            for entry in group.entries:
                request = entry.request
                status = request.status
                if status._finished:
                    continue  # finished or aborted since it was scheduled
                if entry.spec_token_ids or several:
                    request.num_output_placeholders -= 1
                    self._update_several(entry, pool, sampled_token_ids[request.request_id])
                    updated.append(request)
                    continue
                before = entry.num_computed_tokens
                after = before + entry.num_tokens
                if (status is running and pool is not None
                        and after // pool.block_size > before // pool.block_size):  # a block filled
                    pool.cache_computed_blocks(request.request_id, request.all_token_ids, after)
                if not entry.sample:
                    continue
                request.num_output_placeholders -= 1
                updated.append(request)
                drawn = sampled_token_ids[request.request_id]
                if request.error is not None:  # its grammar failed at this draw: the token drawn is not output
                    self._finish_failed(request)
                elif drawn.__class__ is int:  # the common case, kept cheap: 256 requests per step
                    request.append_output_token(drawn)
                    status = request.check_stop(max_model_len)
                    if status is not None:
                        self.finish_request(request.request_id, status)
                else:
                    self._append_drawn(request, drawn)
        return updated

    def _append_drawn(self, request: Request, drawn: list[int]) -> None:
        # a grammar that failed at the last draw: that token is not output, the accepted ones before it are
        error, request.error = request.error, None
        for token in drawn[:-1] if error is not None else drawn:
            request.append_output_token(token)
            status = request.check_stop(self.config.max_model_len)
            if status is not None:
                self.finish_request(request.request_id, status)
                return
        if error is not None:
            request.error = error
            self._finish_failed(request)

    def _finish_failed(self, request: Request) -> None:
        request.stop_reason = request.error
        self.finish_request(request.request_id, RequestStatus.FINISHED_ERROR)

    def _update_several(self, entry: ScheduledRequest, pool: BlockManager | None, drawn: list[int]) -> None:
        """A request that drew several tokens in the step (the accepted proposals and one more after checking
        proposed tokens, or one in each step of a multi-step run): computed are its last token and every drawn
        token but the last; blocks that held only rejected proposals go back."""
        assert entry.sample, entry  # proposals and runs follow a request's last token: such an entry always samples
        request, rid = entry.request, entry.request.request_id
        before = entry.num_computed_tokens
        request.num_computed_tokens = after = before + len(drawn)
        for r in request.replicas:
            blocks = self.pools[r].req_blocks[rid]
            num_blocks = len(blocks)
            self.pools[r].free_tail(rid, after)
            if len(blocks) < num_blocks:
                self._shrunk[rid] = min(len(blocks), self._shrunk.get(rid, num_blocks))
        if pool is not None and after // pool.block_size > before // pool.block_size:  # a block filled
            pool.cache_computed_blocks(rid, request.all_token_ids + list(drawn[:-1]), after)
        self._append_drawn(request, drawn)

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """Finish or abort a request wherever it is; its blocks go back to the pools."""
        assert status.finished
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        self.num_host_sampled -= not request.samples_on_device
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
            self._release(request)
        elif request.status == RequestStatus.SWAPPED:
            self.swapped.remove(request)
            self.tier.free(request_id)
        elif not request.status.finished:
            self.waiting.remove(request)
        request.status = status
        self.policy.on_finish(request)
        return request


def _without_fillers(group: _Group) -> None:
    """A redrafting check runs only in a plan of its request alone (step_plan): beside another request of its group
    (one admitted this step) its filler slots would be computed as proposals, up to 63 more rows in the forward of a
    prefill. They are dropped: it checks its first stage's proposals, or decodes its token (its blocks stay with it
    for its next tokens, as a run's)."""
    for i, entry in enumerate(group.entries):
        if entry.spec_fillers:
            num_kept = len(entry.spec_token_ids) - entry.spec_fillers
            group.entries[i] = replace(entry, num_tokens=entry.num_tokens - entry.spec_fillers,
                                       spec_token_ids=entry.spec_token_ids[:num_kept], spec_fillers=0)
            group.num_spec_tokens -= entry.spec_fillers
            group.budget += entry.spec_fillers


def _decodes_first(entries: list[ScheduledRequest]) -> list[ScheduledRequest]:
    decodes = [e for e in entries if e.num_tokens == 1]
    if len(decodes) == len(entries):
        return entries
    return decodes + [e for e in entries if e.num_tokens != 1]


def _tokens_left(request: Request) -> int:
    return request.num_prompt_tokens + request.max_tokens - request.num_computed_tokens


class SchedulerView:
    """What a policy may read of the scheduler (torch_shift.engine.policies.base.SchedulerView), read-only."""

    def __init__(self, scheduler: Scheduler):
        self._s = scheduler

    @property
    def num_steps(self) -> int:
        return self._s.num_steps

    @property
    def waiting(self):
        return iter(self._s.waiting)

    @property
    def num_waiting(self) -> int:
        return len(self._s.waiting)

    def peek_waiting(self) -> Request | None:
        return self._s.waiting.peek() if self._s.waiting else None

    @property
    def running(self) -> tuple[Request, ...]:
        return tuple(self._s.running)

    @property
    def num_running(self) -> int:
        return len(self._s.running)

    @property
    def swapped(self):
        """Requests whose KV is in the host tier, in the order they will be swapped in."""
        return iter(self._s.swapped)

    @property
    def num_swapped(self) -> int:
        return len(self._s.swapped)

    @property
    def tier_free_blocks(self) -> int:
        """Free blocks of the host tier (0 without one)."""
        return self._s.tier.num_free_blocks if self._s.tier is not None else 0

    @property
    def tier_num_blocks(self) -> int:
        return self._s.tier.num_blocks if self._s.tier is not None else 0

    @property
    def tier_usage(self) -> float:
        """Fraction of the tier's blocks holding requests' KV."""
        return self._s.tier.usage if self._s.tier is not None else 0.0

    @property
    def num_seqs(self) -> tuple[int, ...]:
        """Requests placed on each replica (running or paused)."""
        return tuple(self._s.num_seqs)

    @property
    def remaining_tokens(self) -> tuple[int, ...]:
        """Tokens the requests placed on each replica still have to compute: their prompts' uncomputed tokens and
        their outputs up to `max_tokens` (a request of several replicas counts on each)."""
        return tuple(self._s.remaining_tokens())

    @property
    def num_free_blocks(self) -> tuple[int, ...]:
        return tuple(p.num_free_blocks for p in self._s.pools)

    @property
    def num_blocks(self) -> tuple[int, ...]:
        return tuple(p.num_blocks for p in self._s.pools)

    @property
    def block_size(self) -> int:
        return self._s.pools[0].block_size

    @property
    def config(self) -> SchedulerConfig:
        return self._s.config

    @property
    def last_decision(self):
        return self._s.last_decision
