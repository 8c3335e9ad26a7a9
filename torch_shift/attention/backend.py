"""The attention-backend interface: a step's runs of queries in, the model's `attention(layer, q, k, v)` out.

A step's tokens are flattened runs: first the decode tokens (one per sequence), then the prompt chunks,
each a run of consecutive tokens of one sequence. Every run attends causally (within the sliding window,
if any) to its own sequence's keys in the paged KV cache, through its block table, after its own keys
and values were written into their slots. `AttentionBatch` describes that once per step, as host arrays;
each backend's `build` (its metadata builder) turns it into what its kernel needs, once per step, and
returns the callable every layer calls. Backends: "cpu" (torch_shift's paged CPU kernel), "sdpa" (gather
each context and call SDPA: the reference, any device), "flex" (FlexAttention with a block mask).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from torch_shift.kv.cache import KVCache
from torch_shift.models.decoder import AttentionFn


@dataclass
class AttentionBatch:
    """One bound group's step as this rank's attention sees it."""

    num_decodes: int  # runs [0, num_decodes) are one query each
    query_start: np.ndarray  # int32 [R]: the run's first row in the step's tokens
    query_len: np.ndarray  # int32 [R]
    num_computed: np.ndarray  # int32 [R]: tokens of the run's sequence already in the cache = its first position
    block_table: np.ndarray  # int32 [rows, max_blocks]: the replica's persistent block table (not copied)
    block_table_rows: np.ndarray  # int32 [R]: each run's row of `block_table`
    tokens_per_block: int  # block_size * KV width
    slot_mapping: torch.Tensor  # [T] int64 on the device: where each token's K/V is written
    positions: torch.Tensor  # [T] int64 on the device
    sliding_window: int | None

    @property
    def num_runs(self) -> int:
        return len(self.query_len)

    @property
    def device(self) -> torch.device:
        return self.slot_mapping.device

    def blocks_of(self, run: int) -> np.ndarray:
        """The blocks holding run `run`'s context (its cached tokens and its own)."""
        context = int(self.num_computed[run]) + int(self.query_len[run])
        return self.block_table[self.block_table_rows[run], : -(-context // self.tokens_per_block)]


class AttentionBackend(Protocol):
    name: str

    def build(self, batch: AttentionBatch, kv_cache: KVCache) -> AttentionFn:
        """The step's attention over `kv_cache` (this rank's pool as the layout views it)."""
        ...
