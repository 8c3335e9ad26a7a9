"""Continuous batching under a per-step token budget, in plain Python.

Each step the scheduler gives every running request the tokens it still lacks (one for a
request that is generating, a chunk of its prompt for one that is not), then admits waiting
requests while budget, sequence slots and KV blocks last. When a running request cannot get
a block, the lowest-ranked running request is preempted: its blocks are freed and it is
recomputed later from its prompt and the tokens it already produced (outputs unchanged).
The decision is a `SchedulerOutput`, a plain object: the step plan.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from torch_shift.config import SchedulerConfig
from torch_shift.engine.request import Request, RequestStatus
from torch_shift.kv.block_manager import BlockManager


@dataclass
class ScheduledRequest:
    request_id: str
    token_ids: list[int]  # the tokens computed this step
    num_computed_tokens: int  # position of the first of them
    block_table: list[int]
    sample: bool  # the chunk reaches the request's last token: sample the next one
    prompt_logprobs: bool  # return logits at every position of the chunk

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted_request_ids: list[str] = field(default_factory=list)
    layout: str = "base"  # the parallel layout of this step ("base" or "shift")

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


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


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager,
                 choose_layout: Callable[[int], str] | None = None):
        self.config = config
        self.block_manager = block_manager
        self.choose_layout = choose_layout  # scheduled token count -> layout
        self.waiting = WaitingQueue(config.policy)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    def add_request(self, request: Request) -> None:
        assert request.request_id not in self.requests, request.request_id
        self.requests[request.request_id] = request
        self.waiting.push(request)

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def _preempt(self, index: int, output: SchedulerOutput) -> None:
        request = self.running.pop(index)
        self.block_manager.free(request.request_id)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.push(request, front=True)
        output.preempted_request_ids.append(request.request_id)

    def _entry(self, request: Request, num_new: int) -> ScheduledRequest:
        start = request.num_computed_tokens
        return ScheduledRequest(
            request_id=request.request_id,
            token_ids=request.all_token_ids[start:start + num_new],
            num_computed_tokens=start,
            block_table=self.block_manager.block_table(request.request_id),
            sample=start + num_new == request.num_tokens,
            prompt_logprobs=request.wants_prompt_logprobs,
        )

    def schedule(self) -> SchedulerOutput:
        output = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        bm = self.block_manager
        if self.config.policy == "priority":
            # the worst request runs last, so it is the one preempted and nobody better waits behind it
            self.running.sort(key=lambda r: (r.priority, r.arrival_time))  # stable: ties keep admission order

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            assert num_new > 0, request.request_id
            while not bm.allocate(request.request_id, request.num_computed_tokens + num_new):
                # the last running request: the latest admitted (FCFS) or, running being sorted, the
                # worst priority, ties to the latest arrival
                victim = len(self.running) - 1
                self._preempt(victim, output)
                if victim == i:
                    break
            else:
                output.scheduled.append(self._entry(request, num_new))
                budget -= num_new
                i += 1
                continue
            break  # the request itself was preempted: no block is left for anyone after it

        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            if output.preempted_request_ids:
                break  # blocks ran out this step: admitting more would only thrash
            request = self.waiting.peek()
            cached: list[int] = []
            if request.num_computed_tokens == 0 and request.prompt_logprobs is None:
                cached = bm.find_cached_prefix(request.request_id, request.all_token_ids)
            num_computed = len(cached) * bm.block_size
            num_new = min(request.num_tokens - num_computed, budget)
            if not bm.allocate(request.request_id, num_computed + num_new, cached):
                break  # FCFS: nobody overtakes the head of the queue
            self.waiting.pop()
            if request.status == RequestStatus.WAITING:
                request.num_cached_tokens = num_computed
                request.first_scheduled_time = time.monotonic()
            request.num_computed_tokens = num_computed
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            output.scheduled.append(self._entry(request, num_new))
            budget -= num_new
        if self.choose_layout is not None and output.scheduled:
            output.layout = self.choose_layout(output.num_scheduled_tokens)
        return output

    def update_from_output(self, output: SchedulerOutput, sampled_token_ids: dict[str, int]) -> list[Request]:
        """Advance every scheduled request; append its sampled token; finish those that hit a
        token-level stop. Returns the requests that received a token."""
        bm = self.block_manager
        updated = []
        for entry in output.scheduled:
            request = self.requests.get(entry.request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran
            request.num_computed_tokens += entry.num_tokens
            bm.cache_computed_blocks(request.request_id, request.all_token_ids, request.num_computed_tokens)
            if not entry.sample:
                continue
            request.append_output_token(sampled_token_ids[entry.request_id])
            updated.append(request)
            status = request.check_stop(self.config.max_model_len)
            if status is not None:
                self.finish_request(request.request_id, status)
        return updated

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """Finish or abort a request wherever it is; its blocks go back to the pool."""
        assert status.finished
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif not request.status.finished:
            self.waiting.remove(request)
        request.status = status
        self.block_manager.free(request_id)
        return request
