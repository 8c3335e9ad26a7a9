"""The host tier of the KV cache (paper 003's CPU KV buffer), as rank 0 sees it: plain Python.

The tier is one host tensor shared by the local ranks (torch_shift.kv.host_tier) holding whole
requests' KV, every layer and every head, in blocks of `block_size` tokens. `TierAllocator` hands
its blocks out; `SwapOp`s travel in the step plan and every rank of the op's replica copies its part:
under a pipeline layout a stage writes (reads) its layers with every head, under a TP layout a rank
its heads of every layer. The tier re-shards: KV swapped out from one layout is swapped in to
another, and a KV written in one view never needs to be read in another.

When a copy may still run: a swap-in reads its tier blocks during the step it was planned in, so
they return to the free list only at the next step (`advance`). With asynchronous copies (a
prefetch thread beside the forward) the same holds for the device blocks a swap-out reads; the
scheduler defers those itself.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SwapOp:
    """Copy a request's KV between its device blocks in one replica's pools and tier blocks."""

    replica: int
    layout: str  # the layout whose KV view the device blocks are in
    device_blocks: list[int]
    tier_blocks: list[int]


class TierAllocator:
    def __init__(self, num_blocks: int, block_size: int, async_copies: bool = False):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"the host KV tier needs num_blocks and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.async_copies = async_copies  # copies run beside the step's forward, done by the next step
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._releasing: list[int] = []  # read by this step's swap-ins: free from the next step
        self.req_blocks: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free) - len(self._releasing)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(self, request_id: str, num_tokens: int) -> list[int] | None:
        """Blocks for `num_tokens` tokens of a request (all or nothing: None when the tier is full)."""
        assert request_id not in self.req_blocks, request_id
        n = self.blocks_needed(num_tokens)
        if n > len(self._free):
            return None
        blocks = [self._free.pop() for _ in range(n)]
        self.req_blocks[request_id] = blocks
        return blocks

    def release(self, request_id: str) -> list[int]:
        """The request's blocks, read by a swap-in planned this step: free from the next step."""
        blocks = self.req_blocks.pop(request_id)
        self._releasing.extend(blocks)
        return blocks

    def free(self, request_id: str) -> None:
        """A request that leaves while in the tier (finished or aborted): its blocks are free at once."""
        self._free.extend(reversed(self.req_blocks.pop(request_id, [])))

    def advance(self) -> None:
        """A new step: blocks released by the last step's swap-ins are free again."""
        if self._releasing:
            self._free.extend(reversed(self._releasing))
            self._releasing = []
