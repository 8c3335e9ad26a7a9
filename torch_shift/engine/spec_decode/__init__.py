"""Speculative decoding on rank 0: after each step a proposer guesses the next tokens of every request that got a
token; the scheduler schedules them with the request's last token (KV slots for all), the step computes logits at
every position, and the output processor keeps the proposals that match what the request draws
(torch_shift.engine.output_processor), the scheduler giving back the blocks of the rejected ones.

Methods (vLLM's `speculative_config`, see config.py): "ngram" (prompt lookup) and "suffix" (SuffixDecoding, as
ArcticInference) propose from tokens already seen and cost no forward; "draft_model" runs a smaller checkpoint on
rank 0 with its own KV cache (draft.py).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Protocol

from torch_shift.engine.request import Request, RequestStatus
from torch_shift.engine.spec_decode.budget import AcceptanceRates, StepCostFit, lowest_paying_rate, tokens_that_pay
from torch_shift.engine.spec_decode.config import SpeculativeConfig
from torch_shift.engine.spec_decode.ngram import NgramProposer
from torch_shift.engine.spec_decode.suffix import SuffixProposer

if TYPE_CHECKING:
    from torch_shift.engine.scheduler import ScheduledRequest

__all__ = ["Proposer", "SpeculativeConfig", "Speculator", "build_proposer", "num_accepted"]


class Proposer(Protocol):
    name: str

    def propose(self, requests: list[Request], max_tokens: list[int]) -> list[list[int]]:
        """For each request, up to its `max_tokens` tokens that may follow its tokens (all at once: a draft
        model batches them)."""

    def on_finish(self, request: Request, cache: bool) -> None:
        """The request left (finished, with `cache`: normally, or aborted): forget its state."""


def build_proposer(config: SpeculativeConfig) -> Proposer:
    """The proposer of a method that needs no model (a draft model is loaded by the engine: draft.py)."""
    if config.method == "ngram":
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    assert config.method == "suffix", config.method
    return SuffixProposer(config.suffix_decoding_max_tree_depth, config.suffix_decoding_max_cached_requests,
                          config.suffix_decoding_max_spec_factor, config.suffix_decoding_min_token_prob)


PROBE_EVERY = 16


def num_accepted(proposed, drawn) -> int:
    """The proposed tokens a check accepted: those the request drew in their places, up to the first it did not."""
    accepted = 0
    while accepted < min(len(proposed), len(drawn)) and drawn[accepted] == proposed[accepted]:
        accepted += 1
    return accepted


class Speculator:
    """When and how much each request proposes: after a step, for the running requests that got a token, as much
    of each proposal as pays for its share of the next step's time (budget.py)."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int, proposer: Proposer | None = None):
        self.config = config
        self.max_model_len = max_model_len
        self.proposer = proposer if proposer is not None else build_proposer(config)
        self.step_cost = StepCostFit()
        self.acceptance = AcceptanceRates()
        self.num_cut_tokens = 0  # proposed tokens left unchecked because they would not pay
        self._propose_seconds = 0.0  # the last propose call's time: part of the cost of the step that checks them

    def observe(self, entries: list[list[ScheduledRequest]], sampled: dict[str, int | list[int]],
                seconds: float) -> list[tuple[int, int]]:
        """A step ran in `seconds` (its forward and sampling): each check's outcome, and the step's cost when it
        only decoded, with the time spent proposing the tokens it checked. Returns the checks as (proposed,
        accepted) tokens. A proposal is accepted up to the first token the request drew otherwise (all tokens but
        the last one drawn are accepted proposals, unless a stop came first)."""
        seconds += self._propose_seconds
        self._propose_seconds = 0.0
        num_requests = num_proposed = 0
        decode_only = True
        checks = []
        for group in entries:
            for e in group:
                proposed = e.spec_token_ids
                num_requests += 1
                num_proposed += len(proposed)
                if e.num_tokens != 1 + len(proposed):
                    decode_only = False  # a prompt chunk: its cost is not a decode's
                if proposed:
                    accepted = num_accepted(proposed, sampled.get(e.request.request_id, ()))
                    self.acceptance.observe(e.request.request_id, len(proposed), accepted)
                    checks.append((len(proposed), accepted))
        if decode_only and num_requests:
            self.step_cost.observe(num_requests, num_proposed, len(checks), seconds)
        return checks

    @property
    def method(self) -> str:
        return self.config.method

    def propose(self, updated: list[Request], num_running: int) -> None:
        """Proposals for the requests that received tokens this step (the others keep theirs); none in a step of
        `disable_by_batch_size` running requests or more. Under the goodput budget, a request whose check could not
        pay is not asked for a proposal (the proposer's time saved), except one token every PROBE_EVERY tokens it
        generates, which keeps its acceptance rate current."""
        limit = self.config.disable_by_batch_size
        disabled = limit is not None and num_running >= limit
        k = self.config.num_speculative_tokens
        cost = self.step_cost.at(num_running) if self.config.goodput_budget else None
        # the lowest rate at which a request can pay for a check (above 1: none can)
        bar = lowest_paying_rate(k, num_running, cost) if cost is not None else 0.0
        proposing, rooms, rates = [], [], []
        for request in updated:
            if request.status.finished:
                self.on_finish(request)
                continue
            # at most one token past max_tokens and the context: the step adds the accepted ones and one more
            room = min(k, request.max_tokens - request.num_output_tokens - 1,
                       self.max_model_len - request.num_tokens - 1)
            request.spec_token_ids = []
            if disabled or room <= 0:
                continue
            rate = self.acceptance.rate(request.request_id) if cost is not None else 1.0
            if rate < bar:
                # no probe where no check can pay (bar > 1); the prompt's length staggers requests in step
                if bar > 1.0 or request.num_tokens % PROBE_EVERY:
                    continue
                room, rate = 1, 1.0  # a probe: checked whatever it costs
            proposing.append(request)
            rooms.append(room)
            rates.append(rate)
        if not proposing:
            return
        start = time.perf_counter()
        proposals = self.proposer.propose(proposing, rooms)
        self._propose_seconds = time.perf_counter() - start
        if cost is not None:
            lengths = [len(p) for p in proposals]
            keep = tokens_that_pay(rates, lengths, num_running, cost)
            self.num_cut_tokens += sum(lengths) - sum(keep)
            proposals = [p[:n] for p, n in zip(proposals, keep)]
        for request, proposal in zip(proposing, proposals):
            request.spec_token_ids = proposal

    def on_finish(self, request: Request) -> None:
        self.proposer.on_finish(request, cache=request.status is not RequestStatus.FINISHED_ABORTED)
        self.acceptance.forget(request.request_id)
