"""A replica's persistent batch on one rank, and the step inputs built from it with array ops.

Per row (a request placed on the replica; rows are assigned by rank 0's PlanBuilder): the token ids
known so far, the block table in this replica's pool and the KV width. Deltas from the step plan
update it in place; `prepare` turns one bound group's rows into the step's tensors with numpy
index arithmetic, with no Python loop over a request's context.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from torch_shift.attention.backend import AttentionBatch
from torch_shift.engine.step_plan import GroupStep, ReplicaDelta
from torch_shift.memory import to_device

_FEW_TOKENS = 8  # a delta's tokens up to which `apply` writes them one at a time
_ZERO_START = np.zeros(1, dtype=np.int32)  # a one-request step's query start (never written)


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    attention: AttentionBatch  # what the attention backend builds its metadata from
    logits_indices: torch.Tensor  # rows of the hidden states that go through the LM head


@dataclass
class HostInputs:
    """A group's step inputs in host arrays, before they go to the device (a CUDA graph's step stages them in its
    own buffers instead)."""

    input_ids: np.ndarray  # int32 [T]
    positions: np.ndarray  # int64 [T]
    slot_mapping: np.ndarray  # int64 [T]
    logits_indices: np.ndarray  # int64: rows of the hidden states that go through the LM head
    num_decodes: int  # runs [0, num_decodes) are one query each
    query_start: np.ndarray  # int32 [R]
    query_len: np.ndarray  # int32 [R]
    num_computed: np.ndarray  # int32 [R]
    block_table: np.ndarray  # the replica's persistent block table (not copied)
    block_table_rows: np.ndarray  # int32 [R]
    tokens_per_block: int
    # asynchronous scheduling: tokens whose ids the previous step sampled on the device, and their indices there
    placeholders: np.ndarray | None = None
    placeholder_sources: np.ndarray | None = None

    @property
    def num_runs(self) -> int:
        return len(self.query_len)


class InputBatch:
    def __init__(self, max_rows: int, max_model_len: int, block_size: int, device: torch.device,
                 sliding_window: int | None = None):
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.device = device
        self.sliding_window = sliding_window
        # token columns grow on demand (doubling) up to max_model_len; block columns cover it at width 1
        self.token_ids = np.zeros((max_rows, min(max_model_len, 1024)), dtype=np.int32)
        self.num_tokens = np.zeros(max_rows, dtype=np.int64)
        self.block_table = np.zeros((max_rows, -(-max_model_len // block_size)), dtype=np.int32)
        self.num_blocks = np.zeros(max_rows, dtype=np.int64)

    # -- deltas -----------------------------------------------------------------------------------------
    def _ensure_token_columns(self, n: int) -> None:
        cols = self.token_ids.shape[1]
        if n > cols:
            grown = np.zeros((self.token_ids.shape[0], min(self.max_model_len, max(n, 2 * cols))), dtype=np.int32)
            grown[:, :cols] = self.token_ids
            self.token_ids = grown

    def apply(self, delta: ReplicaDelta) -> None:
        for new in delta.new_rows:  # a row that was left is only ever reused through a new row
            n, nb = len(new.token_ids), len(new.block_ids)
            self._ensure_token_columns(n)
            self.token_ids[new.row, :n] = new.token_ids
            self.num_tokens[new.row] = n
            self.block_table[new.row, :nb] = new.block_ids
            self.num_blocks[new.row] = nb
        if 0 < len(delta.token_rows) <= _FEW_TOKENS:  # one at a time: numpy's calls cost more than they save
            num_tokens, columns = self.num_tokens, self.token_ids.shape[1]
            for row, token in zip(delta.token_rows, delta.tokens):
                end = int(num_tokens[row])
                if end >= columns:
                    self._ensure_token_columns(end + 1)
                    columns = self.token_ids.shape[1]
                self.token_ids[row, end] = token
                num_tokens[row] = end + 1
        elif delta.token_rows:  # a row's tokens are consecutive (several after accepted proposals)
            rows = np.asarray(delta.token_rows, dtype=np.int64)
            tokens = np.asarray(delta.tokens, dtype=np.int32)
            new_run = np.concatenate(([True], rows[1:] != rows[:-1]))
            run_start = np.flatnonzero(new_run)
            ends = self.num_tokens[rows] + (np.arange(len(rows)) - run_start[np.cumsum(new_run) - 1])
            self._ensure_token_columns(int(ends.max()) + 1)
            self.token_ids[rows, ends] = tokens
            run_end = np.concatenate((run_start[1:], [len(rows)])) - 1
            self.num_tokens[rows[run_end]] = ends[run_end] + 1
        for row, start, blocks in zip(delta.block_rows, delta.block_starts, delta.block_ids):
            self.block_table[row, start:start + len(blocks)] = blocks
            self.num_blocks[row] = start + len(blocks)

    def write_spec_tokens(self, group: GroupStep, member: int) -> None:
        """Put the group's proposed tokens after each of its rows' known tokens, where `prepare` reads a step's
        input ids; not counted as known (the tokens accepted arrive later as ordinary token deltas, over them)."""
        if group.num_spec is None:
            return
        if len(group.num_spec) == 1:  # a batch-1 check: one slice (the general path's ten numpy calls: 70-85 us cold)
            row = int(group.rows[member][0])
            start, num_spec = int(self.num_tokens[row]), int(group.num_spec[0])
            self._ensure_token_columns(start + num_spec)
            self.token_ids[row, start:start + num_spec] = group.spec_token_ids
            return
        rows = group.rows[member].astype(np.int64)
        num_spec = group.num_spec.astype(np.int64)
        has = num_spec > 0
        rows, num_spec = rows[has], num_spec[has]
        starts = self.num_tokens[rows]
        self._ensure_token_columns(int((starts + num_spec).max()))
        request_of_token = np.repeat(np.arange(len(rows)), num_spec)
        offsets = np.arange(len(request_of_token)) - np.repeat(np.cumsum(num_spec) - num_spec, num_spec)
        self.token_ids[rows[request_of_token], starts[request_of_token] + offsets] = group.spec_token_ids

    def write_drawn(self, rows: np.ndarray, positions: np.ndarray, tokens: np.ndarray) -> None:
        """Tokens a multi-step run drew, where the next of its steps reads its input ids; not counted as known (they
        arrive later as ordinary token deltas, over them)."""
        self._ensure_token_columns(int(positions.max()) + 1)
        self.token_ids[rows, positions] = tokens

    # -- one group's step -------------------------------------------------------------------------------
    def prepare(self, group: GroupStep, member: int, kv_width: int) -> HostInputs:
        """The inputs of `group` as this replica (`member`-th of the layout's replicas) sees them;
        its blocks hold kv_width * block_size tokens each."""
        tpb = self.block_size * kv_width
        if len(group.num_scheduled) == 1:
            return self._prepare_one(group, member, tpb)
        if group.num_decodes == len(group.num_scheduled):
            return self._prepare_decodes(group, member, tpb)
        return self._prepare_runs(group, member, tpb)

    def _prepare_one(self, group: GroupStep, member: int, tpb: int) -> HostInputs:
        """`prepare` for a group of one request (a batch-1 decode or check of proposed tokens, a prompt's chunk): the
        same inputs from slices of its row, in a third of the numpy calls of `_prepare_runs` (a batch-1 check's
        inputs 60-65 -> 16 us after the step before it went through the caches). Slots in one block are a range."""
        rows = np.asarray(group.rows[member], dtype=np.int32)
        row, start, num_tokens = int(rows[0]), int(group.num_computed[0]), int(group.num_scheduled[0])
        positions = np.arange(start, start + num_tokens)
        self._ensure_token_columns(start + num_tokens)
        input_ids = self.token_ids[row, start:start + num_tokens]
        offset = start % tpb
        if offset + num_tokens <= tpb:  # in one block (a check, mostly)
            first = int(self.block_table[row, start // tpb]) * tpb + offset
            slots = np.arange(first, first + num_tokens)
        else:
            slots = self.block_table[row, positions // tpb].astype(np.int64) * tpb + positions % tpb
        logits_indices = np.arange(num_tokens - int(group.logits_counts[0]), num_tokens)
        return HostInputs(input_ids, positions, slots, logits_indices, group.num_decodes, _ZERO_START,
                          np.asarray(group.num_scheduled, dtype=np.int32),
                          np.asarray(group.num_computed, dtype=np.int32), self.block_table, rows, tpb,
                          group.placeholders, group.placeholder_sources)

    def _prepare_runs(self, group: GroupStep, member: int, tpb: int) -> HostInputs:
        """`prepare` for any group: runs of tokens (decodes, prompt chunks, checks of proposed tokens)."""
        rows = group.rows[member].astype(np.int64)
        num_scheduled = group.num_scheduled.astype(np.int64)
        num_computed = group.num_computed.astype(np.int64)
        starts = np.cumsum(num_scheduled) - num_scheduled  # first row of each request in the step
        request_of_token = np.repeat(np.arange(len(rows)), num_scheduled)
        positions = num_computed[request_of_token] + (np.arange(len(request_of_token)) - starts[request_of_token])
        token_rows = rows[request_of_token]
        if group.placeholders is not None:  # read as they are, then replaced on the device
            self._ensure_token_columns(int(positions.max()) + 1)
        input_ids = self.token_ids[token_rows, positions]
        slots = self.block_table[token_rows, positions // tpb].astype(np.int64) * tpb + positions % tpb

        counts = group.logits_counts.astype(np.int64)
        ends = starts + num_scheduled
        if np.all(counts <= 1):
            logits_indices = (ends - 1)[counts == 1]
        else:  # prompt logprobs: every position of those chunks
            logits_indices = np.concatenate([np.arange(e - c, e) for e, c in zip(ends.tolist(), counts.tolist())
                                             if c > 0])
        return HostInputs(input_ids, positions, slots, logits_indices, group.num_decodes, starts.astype(np.int32),
                          num_scheduled.astype(np.int32), num_computed.astype(np.int32), self.block_table,
                          rows.astype(np.int32), tpb, group.placeholders, group.placeholder_sources)

    def _prepare_decodes(self, group: GroupStep, member: int, tpb: int) -> HostInputs:
        """`prepare` for a group of decodes only (one token per request, each its request's next): the same
        inputs in half the numpy calls, which cost several microseconds each after a step's weights went through
        the caches (the plan's int32 arrays are passed as they are: nothing writes them)."""
        rows = np.asarray(group.rows[member], dtype=np.int32)
        positions = group.num_computed.astype(np.int64)
        if group.placeholders is not None:  # read as they are, then replaced on the device
            self._ensure_token_columns(int(positions.max()) + 1)
        input_ids = self.token_ids[rows, positions]
        slots = self.block_table[rows, positions // tpb].astype(np.int64) * tpb + positions % tpb
        query_start = np.arange(len(rows), dtype=np.int32)
        # a decode's count: 1, or 0 mid-prompt
        logits_indices = (np.arange(len(rows)) if group.num_logits == len(rows)
                          else np.flatnonzero(group.logits_counts))
        return HostInputs(input_ids, positions, slots, logits_indices, group.num_decodes, query_start,
                          np.asarray(group.num_scheduled, dtype=np.int32),
                          np.asarray(group.num_computed, dtype=np.int32), self.block_table, rows, tpb,
                          group.placeholders, group.placeholder_sources)

    def to_device(self, host: HostInputs, previous_tokens: torch.Tensor | None = None) -> StepInputs:
        """The step's tensors on the device; `previous_tokens`: the last step's sampled tokens (on the device),
        where the ids of its placeholders come from (None: they stay as they are, for the C++ decoder's thread to
        replace: torch_shift.engine.model_runner)."""
        arrays = [host.input_ids, host.positions, host.slot_mapping, host.logits_indices]
        if host.placeholders is not None and previous_tokens is not None:
            arrays += [host.placeholders, host.placeholder_sources]
        input_ids, positions, slots, logits_indices, *placeholders = to_device(arrays, np.int64, self.device)
        if placeholders:
            index, sources = placeholders
            input_ids[index] = previous_tokens[sources]
        attention = AttentionBatch(
            num_decodes=host.num_decodes, query_start=host.query_start, query_len=host.query_len,
            num_computed=host.num_computed, block_table=host.block_table, block_table_rows=host.block_table_rows,
            tokens_per_block=host.tokens_per_block, slot_mapping=slots, positions=positions,
            sliding_window=self.sliding_window)
        return StepInputs(input_ids, positions, attention, logits_indices)
