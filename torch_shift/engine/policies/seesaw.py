"""Seesaw's policy (paper 003): prefill in pipeline parallelism, decode in tensor parallelism over the
same ranks, with the host tier of the KV cache between the two and transitions kept rare.

Prefill and decode want different layouts: prefill is compute-bound and PP communicates least;
decode reads the weights and only TP divides them. Every replica runs its PP layout during a
prefill phase and its TP layout during a decode phase (all replicas switch together; DP stays
fixed, as in the paper). KV written under PP (a stage's layers, every head) is never read under TP
(every layer, a head slice): a request that finished its prefill is swapped out to the tier at the
next step, and swapped in under TP when a decode phase has room for it. The tier re-shards it.

Transition-minimizing scheduling (`scheduling`, paper 003 Sec. 4.2, Fig. 2):
- "tiered" (the paper): prefill until the tier is full or no prompt waits (prompts are admitted only
  while the tier can take their KV once prefilled), then decode with continuous batching, swapping
  requests in from the tier as device blocks free; back to prefill when the tier is empty, or with
  `refill_below` (the artifact's 0.2) when its use falls below that fraction. Requests still decoding
  on the device at that point pause, their KV kept, until the next decode phase.
- "prefill_first": back to prefill as soon as a waiting prompt fits (vLLM's eager prefills): the
  most transitions.
- "decode_first": back to prefill only when nothing is left to decode: the fewest transitions and
  shrinking decode batches.
A transition drains the pipeline (a step plan is the safe point: every micro-batch of a step ends
in it) and swaps the layer weights in use (torch_shift.parallel.pipeline).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch_shift.engine.policies.base import Policy, SchedulerView, StepDecision
from torch_shift.engine.request import Request, RequestStatus
from torch_shift.parallel.layouts import Deployment

SCHEDULES = ("tiered", "prefill_first", "decode_first")


@dataclass(frozen=True)
class SeesawOptions:
    scheduling: str = "tiered"  # one of SCHEDULES (paper 003, Fig. 2)
    refill_below: float = 0.0  # back to prefill when the tier's use falls below this fraction (the artifact: 0.2)

    def __post_init__(self) -> None:
        if self.scheduling not in SCHEDULES:
            raise ValueError(f"scheduling must be one of {', '.join(SCHEDULES)}, got {self.scheduling!r}")
        if isinstance(self.refill_below, bool) or not isinstance(self.refill_below, (int, float)) \
                or not 0.0 <= self.refill_below < 1.0:
            raise ValueError(f"refill_below is a fraction of the tier in [0, 1), got {self.refill_below!r}")


class SeesawPolicy(Policy):
    name = "seesaw"

    def __init__(self, deployment: Deployment, options: SeesawOptions = SeesawOptions()):
        super().__init__(deployment)
        self.prefill_layouts = tuple(layout.name for layout in deployment.layouts if layout.kv_view == "layers")
        self.decode_layouts = tuple(layout.name for layout in deployment.layouts
                                    if layout.kind == "tp" and layout.pp == 1)
        if not self.prefill_layouts or len(self.decode_layouts) != len(self.prefill_layouts):
            raise ValueError("policy 'seesaw' switches each replica between its PP and TP layouts: build it with "
                             f"pp >= 2 and policy='seesaw' (this deployment is {deployment.family!r})")
        self.scheduling = options.scheduling
        self.refill_below = options.refill_below
        self.phase = "prefill"
        self.prefill_to_decode = 0
        self.decode_to_prefill = 0

    @property
    def num_transitions(self) -> int:
        return self.prefill_to_decode + self.decode_to_prefill

    def decide(self, view: SchedulerView) -> StepDecision:
        offload, prefilling, decoding = [], False, False
        for request in view.running:
            if request.kv_view == "layers":
                if request.num_tokens - request.num_computed_tokens == 1:
                    offload.append(request.request_id)  # prefilled: its KV goes to the tier
                else:
                    prefilling = True
            else:
                decoding = True
        if self.phase == "prefill":
            if (not prefilling and (offload or decoding or view.num_swapped)
                    and not self._can_prefill(view, offload)):
                self.phase = "decode"
                self.prefill_to_decode += 1
        elif self._wants_prefill(view, decoding or bool(offload)) and self._can_prefill(view, offload):
            self.phase = "prefill"
            self.decode_to_prefill += 1
        layouts = self.prefill_layouts if self.phase == "prefill" else self.decode_layouts
        return StepDecision(layouts, swap_out=tuple(offload), phase=self.phase)

    def _wants_prefill(self, view: SchedulerView, decoding: bool) -> bool:
        if not view.num_waiting:
            return False
        if self.scheduling == "prefill_first":
            return True
        if self.scheduling == "decode_first":
            return not decoding and not view.num_swapped
        return not view.num_swapped or view.tier_usage < self.refill_below

    # -- admission: a prompt is prefilled only when the tier can take its KV afterwards ------------------
    def _tier_room(self, view: SchedulerView) -> int:
        """Tier blocks left once the prompts being prefilled under PP have gone to the tier."""
        block_size = view.block_size
        reserved = 0
        for request in view.running:
            if request.kv_view == "layers":
                # done: its KV covers num_computed tokens; still prefilling: every token it has
                tokens = (request.num_computed_tokens if request.num_tokens - request.num_computed_tokens == 1
                          else request.num_tokens)
                reserved += -(-tokens // block_size)
        return view.tier_free_blocks - reserved

    def _fits(self, request: Request, view: SchedulerView, tier_room: int) -> bool:
        return -(-request.num_tokens // view.block_size) <= tier_room

    def _can_prefill(self, view: SchedulerView, offload: list[str]) -> bool:
        """The head of the queue could start: the tier would hold it, and a replica has room for all of
        it once the prefilled requests leaving for the tier have freed their blocks (a prompt stays on
        the device until its last chunk is done; room for its first chunk only could leave it preempting
        itself for blocks that requests paused in the decode view hold)."""
        head = view.peek_waiting()
        if head is None or not self._fits(head, view, self._tier_room(view)):
            return False
        config, block_size = view.config, view.block_size
        seqs, free = list(view.num_seqs), list(view.num_free_blocks)
        leaving = set(offload)
        for request in view.running:
            if request.request_id in leaving:
                seqs[request.replicas[0]] -= 1
                free[request.replicas[0]] += -(-request.num_computed_tokens // block_size)
        needed = -(-head.num_tokens // block_size)
        return any(n < config.max_num_seqs and f >= needed for n, f in zip(seqs, free))

    def route(self, request: Request, decision: StepDecision, view: SchedulerView) -> list[str]:
        if request.status != RequestStatus.SWAPPED and not self._fits(request, view, self._tier_room(view)):
            return []  # the tier is full: the prompt waits (paper 003: prefill until the tier is full)
        return super().route(request, decision, view)

    def stats(self) -> dict:
        return {"phase": self.phase, "scheduling": self.scheduling, "num_transitions": self.num_transitions,
                "prefill_to_decode": self.prefill_to_decode, "decode_to_prefill": self.decode_to_prefill}
