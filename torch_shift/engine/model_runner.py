"""Turns a step plan into tensors, runs the model over the paged KV cache, returns logits."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from torch_shift.compilation import compile_forward
from torch_shift.engine.scheduler import ScheduledRequest, SchedulerOutput
from torch_shift.kv.attention import AttentionMetadata, PagedAttention, PrefillChunk, key_mask
from torch_shift.kv.cache import KVCache
from torch_shift.kv.flex_attention import FlexMetadata, FlexPagedAttention, build_flex_metadata
from torch_shift.parallel.shift import ShiftModule


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    attention: AttentionMetadata | FlexMetadata
    logits_indices: torch.Tensor  # rows of the hidden states that go through the LM head
    # (request_id, first row in the logits, number of rows): rows are the chunk's positions when
    # prompt logprobs are wanted, else only its last position.
    logits_rows: list[tuple[str, int, int]]


@dataclass
class RunnerOutput:
    logits: torch.Tensor  # [rows, vocab]
    logits_rows: list[tuple[str, int, int]]


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_cache: KVCache, sliding_window: int | None = None,
                 attention_backend: str = "sdpa", compile: bool = False):
        if attention_backend not in ("sdpa", "flex"):
            raise ValueError(f"attention_backend must be 'sdpa' or 'flex', got {attention_backend!r}")
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = kv_cache.block_size
        self.sliding_window = sliding_window
        self.attention_backend = attention_backend
        self.device = next(model.parameters()).device
        self.compiled_forward = None
        if compile:
            if isinstance(model, ShiftModule):
                model.compile_layouts()
            else:
                self.compiled_forward = compile_forward(model)

    def prepare(self, plan: SchedulerOutput) -> StepInputs:
        bs = self.block_size
        decodes = [e for e in plan.scheduled if e.num_tokens == 1]
        prefills = [e for e in plan.scheduled if e.num_tokens > 1]
        ordered: list[ScheduledRequest] = decodes + prefills

        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_indices: list[int] = []
        logits_rows: list[tuple[str, int, int]] = []
        for e in decodes:
            pos = e.num_computed_tokens
            input_ids.append(e.token_ids[0])
            positions.append(pos)
            slots.append(e.block_table[pos // bs] * bs + pos % bs)
        prefill_chunks = []
        for e in prefills:
            start = len(input_ids)
            n = e.num_tokens
            pos = np.arange(e.num_computed_tokens, e.num_computed_tokens + n)
            table = np.asarray(e.block_table, dtype=np.int64)
            input_ids.extend(e.token_ids)
            positions.extend(pos.tolist())
            slots.extend((table[pos // bs] * bs + pos % bs).tolist())
            ctx = e.num_computed_tokens + n
            needs_mask = e.num_computed_tokens > 0 or (self.sliding_window is not None and self.sliding_window < n)
            mask = None
            if needs_mask:
                mask = key_mask(torch.from_numpy(pos), ctx, self.sliding_window)
                if e.num_computed_tokens > 0:
                    # the gathered context is padded to whole blocks
                    pad = -ctx % bs
                    mask = torch.nn.functional.pad(mask, (0, pad), value=False)
                mask = mask[None, None].to(self.device)
            num_blocks = -(-ctx // bs)
            prefill_chunks.append(PrefillChunk(
                start=start, num_tokens=n, num_computed_tokens=e.num_computed_tokens,
                block_table=torch.tensor([e.block_table[:num_blocks]], device=self.device), mask=mask,
            ))

        for row_start, e in _row_starts(ordered):
            if e.prompt_logprobs:
                logits_rows.append((e.request_id, len(logits_indices), e.num_tokens))
                logits_indices.extend(range(row_start, row_start + e.num_tokens))
            elif e.sample:
                logits_rows.append((e.request_id, len(logits_indices), 1))
                logits_indices.append(row_start + e.num_tokens - 1)

        decode_block_table = decode_mask = None
        if decodes:
            num_blocks = [positions[i] // bs + 1 for i in range(len(decodes))]
            max_blocks = max(num_blocks)
            table = np.zeros((len(decodes), max_blocks), dtype=np.int64)
            for i, e in enumerate(decodes):
                table[i, : num_blocks[i]] = e.block_table[: num_blocks[i]]
            decode_block_table = torch.from_numpy(table).to(self.device)
            query_pos = torch.tensor(positions[: len(decodes)], device=self.device)
            decode_mask = key_mask(query_pos, max_blocks * bs, self.sliding_window)[:, None, None, :]

        def as_tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=self.device)

        if self.attention_backend == "flex":
            attention = self._flex_metadata(ordered, as_tensor(slots), as_tensor(positions))
        else:
            attention = AttentionMetadata(
                slot_mapping=as_tensor(slots),
                num_decode_tokens=len(decodes),
                decode_block_table=decode_block_table,
                decode_mask=decode_mask,
                prefills=prefill_chunks,
            )
        return StepInputs(
            input_ids=as_tensor(input_ids),
            positions=as_tensor(positions),
            attention=attention,
            logits_indices=as_tensor(logits_indices),
            logits_rows=logits_rows,
        )

    def _flex_metadata(self, ordered: list[ScheduledRequest], slots: torch.Tensor,
                       positions: torch.Tensor) -> FlexMetadata:
        bs = self.block_size
        offsets = np.arange(bs)
        query_seq, context_slots, context_seq, context_pos = [], [], [], []
        for i, e in enumerate(ordered):
            ctx = e.num_computed_tokens + e.num_tokens
            table = np.asarray(e.block_table[: -(-ctx // bs)], dtype=np.int64)
            context_slots.append((table[:, None] * bs + offsets).reshape(-1)[:ctx])
            context_seq.append(np.full(ctx, i))
            context_pos.append(np.arange(ctx))
            query_seq.append(np.full(e.num_tokens, i))

        def as_tensor(parts: list[np.ndarray]) -> torch.Tensor:
            return torch.from_numpy(np.concatenate(parts)).to(self.device)

        return build_flex_metadata(slots, as_tensor(query_seq), positions, as_tensor(context_slots),
                                   as_tensor(context_seq), as_tensor(context_pos), self.sliding_window)

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> RunnerOutput:
        inputs = self.prepare(plan)
        if self.attention_backend == "flex":
            attention = FlexPagedAttention(self.kv_cache, inputs.attention)
        else:
            attention = PagedAttention(self.kv_cache, inputs.attention)
        if isinstance(self.model, ShiftModule):
            logits = self.model.forward_step(inputs.input_ids, inputs.positions, attention, inputs.logits_indices,
                                             plan.layout)
        else:
            forward = self.compiled_forward or self.model
            hidden = forward(inputs.input_ids, inputs.positions, attention)
            logits = self.model.compute_logits(hidden[inputs.logits_indices])
        return RunnerOutput(logits=logits, logits_rows=inputs.logits_rows)


def _row_starts(entries: list[ScheduledRequest]):
    row = 0
    for e in entries:
        yield row, e
        row += e.num_tokens
