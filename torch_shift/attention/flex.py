"""Paged attention with FlexAttention: one kernel call per layer for the whole step (backend "flex").

The step's queries stay flattened (`[1, heads, T, head_dim]`); the keys are the context of
every scheduled sequence read from the paged cache by slot, back to back with no padding
(`[1, kv_heads, L, head_dim]`). A block mask built once per step lets each query see only its
own sequence's earlier positions, so FlexAttention skips the blocks of other sequences. This is
the path meant for GPUs; on CPU FlexAttention runs only compiled, with static shapes (inductor
fails on its dynamic-shape CPU kernel in torch 2.13), so there SDPA over gathered blocks
(`PagedAttention`) and the paged CPU kernel are the CPU paths.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, create_block_mask, flex_attention

from torch_shift.attention.backend import AttentionBatch
from torch_shift.kv.cache import KVCache
from torch_shift.memory import to_device

_compiled: dict[str, object] = {}
_FLEX_BLOCK = 128


def compiled_flex_attention(device_type: str):
    if device_type not in _compiled:
        _compiled[device_type] = torch.compile(flex_attention, dynamic=device_type != "cpu")
    return _compiled[device_type]


@dataclass
class FlexMetadata:
    slot_mapping: torch.Tensor  # [T] where the step's own k/v are written
    context_slots: torch.Tensor  # [L] cache slots of every sequence's context, sequence after sequence
    query_seq: torch.Tensor  # [T, padded to 128] index of the query's sequence in the step (padding: -1)
    query_pos: torch.Tensor  # [T]
    context_seq: torch.Tensor  # [L, padded to 128] (padding: -2)
    context_pos: torch.Tensor  # [L]
    sliding_window: int | None  # the step's window; a layer may ask for its own
    block_masks: dict[int | None, BlockMask] = field(default_factory=dict)

    @property
    def num_queries(self) -> int:
        return self.slot_mapping.numel()

    def block_mask(self, window: int | None) -> BlockMask:
        """Each query sees its own sequence's earlier positions (within `window`); built once per window."""
        if window not in self.block_masks:
            query_seq, query_pos, context_seq, context_pos = (self.query_seq, self.query_pos, self.context_seq,
                                                              self.context_pos)

            def mask_mod(b, h, q_idx, kv_idx):
                visible = (query_seq[q_idx] == context_seq[kv_idx]) & (context_pos[kv_idx] <= query_pos[q_idx])
                if window is not None:
                    visible = visible & (context_pos[kv_idx] > query_pos[q_idx] - window)
                return visible

            self.block_masks[window] = create_block_mask(mask_mod, None, None, self.num_queries,
                                                         self.context_slots.numel(), device=query_seq.device)
        return self.block_masks[window]


def _padded(values: torch.Tensor, fill: int) -> torch.Tensor:
    """`values` padded to a multiple of FlexAttention's block (128) with `fill`: its GPU kernel calls mask_mod on
    the indices of whole blocks, and an index past the end is a device-side assert."""
    pad = -values.numel() % _FLEX_BLOCK
    return torch.cat((values, values.new_full((pad,), fill))) if pad else values


def build_flex_metadata(
    slot_mapping: torch.Tensor,
    query_seq: torch.Tensor,
    query_pos: torch.Tensor,
    context_slots: torch.Tensor,
    context_seq: torch.Tensor,
    context_pos: torch.Tensor,
    sliding_window: int | None,
) -> FlexMetadata:
    # padding queries belong to sequence -1, padding keys to -2: neither sees anything
    metadata = FlexMetadata(slot_mapping, context_slots, _padded(query_seq, -1), _padded(query_pos, 0),
                            _padded(context_seq, -2), _padded(context_pos, 0), sliding_window)
    metadata.block_mask(sliding_window)  # the step's own, built with the step's inputs
    return metadata


class FlexBackend:
    name = "flex"

    def build(self, batch: AttentionBatch, kv_cache: KVCache) -> FlexPagedAttention:
        num_scheduled = batch.query_len.astype(np.int64)
        ctx = batch.num_computed.astype(np.int64) + num_scheduled
        runs = np.arange(batch.num_runs)
        request_of_key = np.repeat(runs, ctx)
        key_starts = np.cumsum(ctx) - ctx
        key_pos = np.arange(len(request_of_key)) - key_starts[request_of_key]
        tpb = batch.tokens_per_block
        key_rows = batch.block_table_rows[request_of_key]
        context_slots = batch.block_table[key_rows, key_pos // tpb].astype(np.int64) * tpb + key_pos % tpb

        query_seq, slots, key_seq, key_pos = to_device([np.repeat(runs, num_scheduled), context_slots,
                                                         request_of_key, key_pos], np.int64, batch.device)
        metadata = build_flex_metadata(batch.slot_mapping, query_seq, batch.positions, slots, key_seq, key_pos,
                                       batch.sliding_window)
        return FlexPagedAttention(kv_cache, metadata)


class FlexPagedAttention:
    """The model's `attention(layer_idx, q, k, v, sinks, sliding_window)` for one step, through FlexAttention."""

    def __init__(self, kv_cache: KVCache, metadata: FlexMetadata):
        self.kv_cache = kv_cache
        self.metadata = metadata
        self.flex = compiled_flex_attention(metadata.slot_mapping.device.type)

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 sinks: torch.Tensor | None = None, sliding_window: int | None = None) -> torch.Tensor:
        md = self.metadata
        window = md.sliding_window if sliding_window is None else sliding_window
        self.kv_cache.write(layer_idx, md.slot_mapping, k, v)
        k_ctx, v_ctx = self.kv_cache.read_slots(layer_idx, md.context_slots)
        k_ctx, v_ctx = k_ctx.transpose(0, 1).unsqueeze(0), v_ctx.transpose(0, 1).unsqueeze(0)
        q = q.transpose(0, 1).unsqueeze(0)
        if sinks is None:
            out = self.flex(q, k_ctx, v_ctx, block_mask=md.block_mask(window), enable_gqa=True)
        else:
            if q.device.type == "cpu":
                raise ValueError("attention_backend 'flex' cannot run attention sinks on the CPU (inductor's CPU "
                                 "FlexAttention returns no log-sum-exp); use 'cpu' or 'sdpa'")
            # a sink beside the keys scales each row by exp(lse) / (exp(lse) + exp(sink))
            out, aux = self.flex(q, k_ctx, v_ctx, block_mask=md.block_mask(window), enable_gqa=True,
                                 return_aux=AuxRequest(lse=True))
            out = (out.float() * torch.sigmoid(aux.lse - sinks.float()[None, :, None])[..., None]).to(q.dtype)
        return out[0].transpose(0, 1)
