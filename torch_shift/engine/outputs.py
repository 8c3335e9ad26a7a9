"""Result objects, shaped as vLLM's: `RequestOutput.outputs[i]` is a `CompletionOutput`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None  # 1 = most likely token
    decoded_token: str | None = None


# One dict per position: token id -> Logprob (the chosen token and the top-k).
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None = None  # "stop", "length", "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    lora_request: None = None  # vLLM's (no LoRA adapters here)

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestStateStats:
    """`RequestOutput.metrics`, with vLLM 0.32's names: `arrival_time` is wall-clock (unix) seconds, the `_ts` times
    are the engine's monotonic clock (`time.monotonic()`), 0.0 where not reached yet."""

    num_generation_tokens: int = 0
    num_preemptions: int = 0
    arrival_time: float = 0.0
    queued_ts: float = 0.0
    scheduled_ts: float = 0.0
    first_token_ts: float = 0.0
    last_token_ts: float = 0.0
    first_token_latency: float = 0.0  # first_token_ts - queued_ts
    is_corrupted: bool = False


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestStateStats = field(default_factory=RequestStateStats)
    # vLLM's, for what this engine does not have: LoRA adapters, encoder-decoder models, remote KV transfer
    lora_request: None = None
    encoder_prompt: None = None
    encoder_prompt_token_ids: None = None
    kv_transfer_params: dict[str, Any] | None = None

    def add(self, next_output: RequestOutput, aggregate: bool) -> None:
        """vLLM's: merge a later output of the same request into this one. Each of its samples replaces this one's
        of the same index (appended where new), or with `aggregate` extends it (outputs of new tokens only, vLLM's
        DELTA kind, whose pieces this joins)."""
        self.finished |= next_output.finished
        self.kv_transfer_params = next_output.kv_transfer_params
        for completion in next_output.outputs:
            mine = next((i for i, c in enumerate(self.outputs) if c.index == completion.index), None)
            if mine is None:
                self.outputs.append(completion)
            elif not aggregate:
                self.outputs[mine] = completion
            else:
                c = self.outputs[mine]
                c.text += completion.text
                c.token_ids = [*c.token_ids, *completion.token_ids]
                if completion.logprobs:
                    c.logprobs = [*(c.logprobs or []), *completion.logprobs]
                c.cumulative_logprob = completion.cumulative_logprob
                c.finish_reason, c.stop_reason = completion.finish_reason, completion.stop_reason
