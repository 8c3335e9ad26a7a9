"""Attention by gathering each context through the block table and calling SDPA: the reference backend,
on any device.

Decode tokens attend together: their contexts are gathered padded to the longest one, with a mask. Each
prompt chunk is one SDPA call over its own gathered context (or over its own keys when nothing was
cached before it).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from torch_shift.attention.backend import AttentionBatch
from torch_shift.kv.cache import KVCache


@dataclass
class PrefillChunk:
    start: int  # first token of the chunk in the flattened step
    num_tokens: int
    num_computed_tokens: int  # tokens of the sequence already in the cache before this chunk
    block_table: torch.Tensor  # [1, num_blocks]
    mask: torch.Tensor | None  # [1, 1, num_tokens, context] when the chunk cannot use is_causal


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T]
    num_decode_tokens: int
    decode_block_table: torch.Tensor | None  # [num_decodes, max_blocks]
    # [num_decodes, 1, 1, decode_context_len], True = attend; when None, the first layer's attention builds it
    # from decode_positions (it grows with the context: it belongs to the attention, not to the step's inputs)
    decode_mask: torch.Tensor | None
    prefills: list[PrefillChunk]
    decode_positions: torch.Tensor | None = None  # [num_decodes]: the position of each decode token
    decode_context_len: int = 0  # max_blocks * tokens per block
    sliding_window: int | None = None

    def decode_attention_mask(self) -> torch.Tensor:
        if self.decode_mask is None:
            self.decode_mask = key_mask(self.decode_positions, self.decode_context_len,
                                        self.sliding_window)[:, None, None, :]
        return self.decode_mask


def key_mask(
    query_positions: torch.Tensor, context_len: int, sliding_window: int | None
) -> torch.Tensor:
    """[num_queries, context_len] bool: key j is visible to a query at position p when j <= p
    (and p - j < sliding_window)."""
    key_positions = torch.arange(context_len, device=query_positions.device)
    mask = key_positions[None, :] <= query_positions[:, None]
    if sliding_window is not None:
        mask &= key_positions[None, :] > query_positions[:, None] - sliding_window
    return mask


def build_sdpa_metadata(batch: AttentionBatch) -> AttentionMetadata:
    device, tpb, window = batch.device, batch.tokens_per_block, batch.sliding_window
    nd = batch.num_decodes
    decode_block_table = query_pos = None
    context_len = 0
    if nd:
        decode_positions = batch.num_computed[:nd].astype(np.int64)
        max_blocks = int(decode_positions.max()) // tpb + 1
        table = batch.block_table[batch.block_table_rows[:nd], :max_blocks].astype(np.int64)
        decode_block_table = torch.from_numpy(table).to(device)
        query_pos = torch.from_numpy(decode_positions).to(device)
        context_len = max_blocks * tpb
    prefills = []
    for i in range(nd, batch.num_runs):
        n, done = int(batch.query_len[i]), int(batch.num_computed[i])
        ctx = done + n
        mask = None
        if done > 0 or (window is not None and window < n):
            mask = key_mask(torch.arange(done, ctx), ctx, window)
            if done > 0:
                mask = F.pad(mask, (0, -ctx % tpb), value=False)  # the context is whole blocks
            mask = mask[None, None].to(device)
        table = torch.from_numpy(batch.blocks_of(i).astype(np.int64))[None].to(device)
        prefills.append(PrefillChunk(start=int(batch.query_start[i]), num_tokens=n, num_computed_tokens=done,
                                     block_table=table, mask=mask))
    return AttentionMetadata(slot_mapping=batch.slot_mapping, num_decode_tokens=nd,
                             decode_block_table=decode_block_table, decode_mask=None, prefills=prefills,
                             decode_positions=query_pos, decode_context_len=context_len, sliding_window=window)


class SdpaBackend:
    name = "sdpa"

    def build(self, batch: AttentionBatch, kv_cache: KVCache) -> PagedAttention:
        return PagedAttention(kv_cache, build_sdpa_metadata(batch))


class PagedAttention:
    """The model's `attention(layer_idx, q, k, v)` for one step."""

    def __init__(self, kv_cache: KVCache, metadata: AttentionMetadata):
        self.kv_cache = kv_cache
        self.metadata = metadata

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        md = self.metadata
        self.kv_cache.write(layer_idx, md.slot_mapping, k, v)
        out = torch.empty_like(q)
        nd = md.num_decode_tokens
        if nd:
            k_ctx, v_ctx = self.kv_cache.gather(layer_idx, md.decode_block_table)
            o = F.scaled_dot_product_attention(
                q[:nd].unsqueeze(2), k_ctx, v_ctx, attn_mask=md.decode_attention_mask(), enable_gqa=True
            )
            out[:nd] = o.squeeze(2)
        for chunk in md.prefills:
            sl = slice(chunk.start, chunk.start + chunk.num_tokens)
            q_chunk = q[sl].transpose(0, 1).unsqueeze(0)  # [1, heads, n, head_dim]
            if chunk.num_computed_tokens == 0:
                # the chunk is the whole context so far: attend to its own k/v, no gather
                k_ctx = k[sl].transpose(0, 1).unsqueeze(0)
                v_ctx = v[sl].transpose(0, 1).unsqueeze(0)
            else:
                k_ctx, v_ctx = self.kv_cache.gather(layer_idx, chunk.block_table)
            if chunk.mask is None:
                o = F.scaled_dot_product_attention(q_chunk, k_ctx, v_ctx, is_causal=True, enable_gqa=True)
            else:
                o = F.scaled_dot_product_attention(q_chunk, k_ctx, v_ctx, attn_mask=chunk.mask, enable_gqa=True)
            out[sl] = o[0].transpose(0, 1)
        return out
