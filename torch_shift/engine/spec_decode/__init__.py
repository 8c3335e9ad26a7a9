"""Speculative decoding on rank 0: after each step a proposer guesses the next tokens of every request that got a
token; the scheduler schedules them with the request's last token (KV slots for all), the step computes logits at
every position, and the output processor keeps the proposals that match what the request draws
(torch_shift.engine.output_processor), the scheduler giving back the blocks of the rejected ones.

Methods (vLLM's `speculative_config`, see config.py): "ngram" (prompt lookup) and "suffix" (SuffixDecoding, as
ArcticInference) propose from tokens already seen and cost no forward; "draft_model" runs a smaller checkpoint on
rank 0 with its own KV cache (draft.py).
"""

from __future__ import annotations

from typing import Protocol

from torch_shift.engine.request import Request, RequestStatus
from torch_shift.engine.spec_decode.config import SpeculativeConfig
from torch_shift.engine.spec_decode.ngram import NgramProposer
from torch_shift.engine.spec_decode.suffix import SuffixProposer

__all__ = ["Proposer", "SpeculativeConfig", "Speculator", "build_proposer"]


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


class Speculator:
    """When and how much each request proposes: after a step, for the running requests that got a token."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int, proposer: Proposer | None = None):
        self.config = config
        self.max_model_len = max_model_len
        self.proposer = proposer if proposer is not None else build_proposer(config)

    @property
    def method(self) -> str:
        return self.config.method

    def propose(self, updated: list[Request], num_running: int) -> None:
        """Proposals for the requests that received tokens this step (the others keep theirs); none in a step of
        `disable_by_batch_size` running requests or more."""
        limit = self.config.disable_by_batch_size
        disabled = limit is not None and num_running >= limit
        k = self.config.num_speculative_tokens
        proposing, rooms = [], []
        for request in updated:
            if request.status.finished:
                self.proposer.on_finish(request, cache=request.status is not RequestStatus.FINISHED_ABORTED)
                continue
            # at most one token past max_tokens and the context: the step adds the accepted ones and one more
            room = min(k, request.max_tokens - request.num_output_tokens - 1,
                       self.max_model_len - request.num_tokens - 1)
            request.spec_token_ids = []
            if not disabled and room > 0:
                proposing.append(request)
                rooms.append(room)
        if proposing:
            for request, proposal in zip(proposing, self.proposer.propose(proposing, rooms)):
                request.spec_token_ids = proposal

    def on_finish(self, request: Request) -> None:
        self.proposer.on_finish(request, cache=request.status is not RequestStatus.FINISHED_ABORTED)
