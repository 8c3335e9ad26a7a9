"""A request's state. Its progress is `num_computed_tokens` catching up with `num_tokens`; there
is no prefill or decode phase (a preempted request simply drops back to zero)."""

from __future__ import annotations

import enum
import time
from typing import NamedTuple

import numpy as np
import torch

from torch_shift.engine.outputs import PositionLogprobs
from torch_shift.engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # no KV anywhere yet
    RUNNING = "running"  # KV on the device: scheduled, or paused while its group does not run
    PREEMPTED = "preempted"  # KV dropped: waiting to be recomputed
    SWAPPED = "swapped"  # KV in the host tier only (torch_shift.kv.tier), waiting for device blocks
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # the request could not go on (its grammar failed): `stop_reason` says why

    @property
    def finished(self) -> bool:
        return self._finished


for _status in RequestStatus:  # a plain attribute: this is read for every request at every step
    _status._finished = _status.value in ("stop", "length", "abort", "error")


class Redrafting(NamedTuple):
    """A batch-1 check's stages after its first, drafted by the C++ decoder with suffix decoding's rule over the
    request's own tokens and those each stage drew (Speculator._second_stage; kernels/cpu_decoder.cpp's
    run_redrafting): the most proposals a stage checks after one that rejected a proposal and after one that accepted
    all, the most stages, the suffix tree's depth, speculation factor and least token probability, and whether the
    drafts look in the global tree of earlier outputs too (rank 0's, or its copy on another replica's ranks:
    ModelRunner.suffix_global_tree). A stage that finds no draft decodes its token alone."""

    fresh_tokens: int
    more_tokens: int
    max_stages: int
    max_depth: int
    max_spec_factor: float
    min_token_prob: float
    global_tree: bool


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        max_tokens: int,
        eos_token_ids: frozenset[int] = frozenset(),
        arrival_time: float | None = None,
        priority: int = 0,
        primary_eos_token_id: int | None = None,
    ):
        """`primary_eos_token_id`: the tokenizer's eos, which ends a request with no stop_reason; the model's other
        end ids (generation_config.json's) end it with their id as stop_reason, as vLLM makes them stop_token_ids.
        None: none of them gives a stop_reason."""
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.num_prompt_tokens = len(prompt_token_ids)
        self.sampling_params = sampling_params
        self.max_tokens = max_tokens  # max_tokens clipped to the model's context
        self.eos_token_ids = frozenset() if sampling_params.ignore_eos else eos_token_ids
        self.primary_eos_token_id = primary_eos_token_id
        self.stop_token_ids = frozenset(sampling_params.stop_token_ids)
        # the tokens that may complete one of its stop strings (Tokenizer.stop_string_token_ids; found by the input
        # processor where the engine runs multi-step runs or speculates), and whether its detokenizer holds back text
        # for an unfinished character (set by the output processor): what ends its runs and redrafting checks early
        # while it runs alone (lone_stop_token_ids)
        self.stop_string_token_ids: frozenset[int] | None = frozenset()  # None: any token
        self.holds_text = False
        self._lone_stop_token_ids: np.ndarray | None = None
        # what min_tokens keeps from being drawn: the model's end ids with ignore_eos too (vLLM's rule)
        self.min_tokens_banned = eos_token_ids | self.stop_token_ids
        # vLLM's: the wall-clock (unix) time it arrived, which orders requests; the engine's own timestamps below are
        # monotonic
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.queued_time = time.monotonic()
        self.priority = priority
        self.status = RequestStatus.WAITING
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        # tokens sampled on the device whose values have not reached the host yet (asynchronous scheduling:
        # the next step is scheduled, and its input ids taken from the device, before they arrive)
        self.num_output_placeholders = 0
        self.replicas: tuple[int, ...] = ()  # replicas whose KV pools hold its blocks (set while running)
        self.kv_layout: str | None = None  # the layout whose KV view its device KV is in (set while running)
        self.kv_view: str | None = None  # that layout's view: it runs only in layouts of the same view
        self.kv_ready_step = 0  # first step it may run at (a swap-in copied beside a step is ready after it)
        self.num_cached_tokens = 0  # prompt tokens served by the prefix cache at first admission
        self.num_preemptions = 0
        self.stop_reason: int | str | None = None
        p = sampling_params
        # what it draws depends on its earlier outputs, read on the host: penalties, a minimum length, a grammar
        reads_outputs = (p.repetition_penalty != 1.0 or bool(p.presence_penalty) or bool(p.frequency_penalty)
                         or p.min_tokens != 0 or p.structured_outputs is not None)
        # its token is the argmax of its logits row: greedy, nothing that changes logits (bias, or the above) and no
        # logprobs; the sampler draws a batch of such requests with one argmax
        self.greedy = p.greedy  # a plain attribute, as draws_argmax: the speculator reads it at every step
        self.draws_argmax = self.greedy and not p.logit_bias and not reads_outputs and p.logprobs is None
        # nothing it draws reads its outputs on the host and it returns no logprobs: it may be scheduled again
        # before its last token arrives
        self.samples_on_device = not reads_outputs and p.logprobs is None and p.prompt_logprobs is None
        # every rank of a multi-step run draws its tokens as the sampler would (Scheduler.sampled_runs): its argmax,
        # or the CPU kernel's draw with the uniforms taken before the run
        self.samples_in_runs = self.draws_argmax or (self.samples_on_device and not p.logit_bias)
        self.generator: torch.Generator | None = None
        if sampling_params.seed is not None:
            self.generator = torch.Generator().manual_seed(sampling_params.seed)
        self.logprobs: list[PositionLogprobs] | None = [] if sampling_params.logprobs is not None else None
        self.cumulative_logprob = 0.0
        self.prompt_logprobs: list[PositionLogprobs | None] | None = (
            [None] if sampling_params.prompt_logprobs is not None else None
        )
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.grammar = None  # an llguidance matcher when the output is constrained (structured_output.py)
        self.waiting_grammar = None  # a WaitingGrammar: the matcher that becomes `grammar` after its marker
        self.error: str | None = None  # why the request cannot go on (set by the sampler); it finishes with "error"
        # speculative decoding: tokens proposed to follow its last one, checked at its next step; of those, the ones a
        # batch-1 check runs first, the rest only where all of them are accepted (0: one stage; Speculator.propose)
        self.spec_token_ids: list[int] = []
        self.spec_stage = 0
        # its stages after the first drafted by the C++ decoder (the proposals past the first stage only hold the
        # check's slots), and once the step ran each stage's proposed and accepted tokens and seconds
        self.spec_redraft: Redrafting | None = None
        self.spec_stages: list[tuple[int, int, float]] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def wants_prompt_logprobs(self) -> bool:
        """True while prompt positions still lack their logprobs."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    def finishes_by_length(self, num_more: int, max_model_len: int) -> bool:
        """Whether `num_more` tokens beyond those it has end it by its length (max_tokens or the context)."""
        return (len(self.output_token_ids) + num_more >= self.max_tokens
                or len(self.all_token_ids) + num_more >= max_model_len)

    def lone_stop_token_ids(self) -> np.ndarray:
        """What ends a multi-step run or a redrafting check of this request alone after the step (stage) that drew
        one (int64, sorted): its end and stop tokens (check_stop's) and the tokens that may complete one of its stop
        strings, so that its steps do not run on past a stop string the host then finds (a run's up to
        num_scheduler_steps, a check's up to spec_decode.REDRAFT_STAGES). Where any token may (stops_at_any_token), a
        run or check runs one step."""
        if self._lone_stop_token_ids is None:
            self._lone_stop_token_ids = np.array(
                sorted(self.eos_token_ids | self.stop_token_ids | (self.stop_string_token_ids or frozenset())),
                dtype=np.int64)
        return self._lone_stop_token_ids

    @property
    def stops_at_any_token(self) -> bool:
        """Whether any token it draws next may complete one of its stop strings: its detokenizer holds text back, or
        its stop strings may end at any token (Tokenizer.stop_string_token_ids' None). A run or a redrafting check of
        it alone then runs one step (Scheduler.run_length, step_plan)."""
        return self.holds_text or self.stop_string_token_ids is None

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def check_stop(self, max_model_len: int) -> RequestStatus | None:
        """Token-level stop conditions after a token was appended (stop strings are the detokenizer's)."""
        if self.error is not None:
            self.stop_reason = self.error
            return RequestStatus.FINISHED_ERROR
        outputs = self.output_token_ids
        num_outputs = len(outputs)
        if num_outputs >= self.sampling_params.min_tokens:
            last = outputs[-1]
            if last in self.eos_token_ids:
                if self.primary_eos_token_id is not None and last != self.primary_eos_token_id:
                    self.stop_reason = last
                return RequestStatus.FINISHED_STOPPED
            if last in self.stop_token_ids:
                self.stop_reason = last
                return RequestStatus.FINISHED_STOPPED
        if num_outputs >= self.max_tokens or len(self.all_token_ids) >= max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
