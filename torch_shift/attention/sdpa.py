"""Attention by gathering each context through the block table and calling SDPA: the reference backend,
on any device.

Decode tokens attend together: their contexts are gathered padded to the longest one, with a mask. Each
prompt chunk is one SDPA call over its own gathered context (or over its own keys when nothing was
cached before it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

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
    # sliding window -> [1, 1, num_tokens, context] (None: plain causal, is_causal), built when a layer asks
    masks: dict[int | None, torch.Tensor | None] = field(default_factory=dict)


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T]
    num_decode_tokens: int
    decode_block_table: torch.Tensor | None  # [num_decodes, max_blocks]
    prefills: list[PrefillChunk]
    decode_positions: torch.Tensor | None = None  # [num_decodes]: the position of each decode token
    decode_context_len: int = 0  # max_blocks * tokens per block
    sliding_window: int | None = None  # the step's window; a layer may ask for its own
    tokens_per_block: int = 1
    # sliding window -> [num_decodes, 1, 1, decode_context_len], True = attend; built when a layer first asks
    # (it grows with the context: it belongs to the attention, not to the step's inputs)
    decode_masks: dict[int | None, torch.Tensor] = field(default_factory=dict)

    def decode_attention_mask(self, window: int | None) -> torch.Tensor:
        if window not in self.decode_masks:
            self.decode_masks[window] = key_mask(self.decode_positions, self.decode_context_len,
                                                 window)[:, None, None, :]
        return self.decode_masks[window]

    def prefill_mask(self, chunk: PrefillChunk, window: int | None) -> torch.Tensor | None:
        """The chunk's mask over its context (whole blocks of it once something was cached), or None where
        is_causal over its own keys is the same."""
        if window not in chunk.masks:
            n, done = chunk.num_tokens, chunk.num_computed_tokens
            mask = None
            if done > 0 or (window is not None and window < n):
                ctx = done + n
                mask = key_mask(torch.arange(done, ctx), ctx, window)
                if done > 0:
                    mask = F.pad(mask, (0, -ctx % self.tokens_per_block), value=False)
                mask = mask[None, None].to(self.slot_mapping.device)
            chunk.masks[window] = mask
        return chunk.masks[window]


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
    device, tpb = batch.device, batch.tokens_per_block
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
        table = torch.from_numpy(batch.blocks_of(i).astype(np.int64))[None].to(device)
        prefills.append(PrefillChunk(start=int(batch.query_start[i]), num_tokens=int(batch.query_len[i]),
                                     num_computed_tokens=int(batch.num_computed[i]), block_table=table))
    return AttentionMetadata(slot_mapping=batch.slot_mapping, num_decode_tokens=nd,
                             decode_block_table=decode_block_table, prefills=prefills, decode_positions=query_pos,
                             decode_context_len=context_len, sliding_window=batch.sliding_window,
                             tokens_per_block=tpb)


class SdpaBackend:
    name = "sdpa"

    def build(self, batch: AttentionBatch, kv_cache: KVCache) -> PagedAttention:
        return PagedAttention(kv_cache, build_sdpa_metadata(batch))


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
           sinks: torch.Tensor | None) -> torch.Tensor:
    """SDPA of q [B, heads, n, d] over k/v [B, kv_heads, L, d] (GQA), causal where `mask` is None; with
    `sinks`, the same in float32 math with each head's sink logit beside its keys (transformers' eager
    GPT-OSS attention), since SDPA takes no sinks."""
    if sinks is None:
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    group = q.shape[1] // k.shape[1]
    k, v = k.float().repeat_interleave(group, 1), v.float().repeat_interleave(group, 1)
    scores = q.float() @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if mask is None:
        n, context = scores.shape[-2:]
        mask = torch.ones(n, context, dtype=torch.bool, device=q.device).tril(context - n)
    scores = scores.masked_fill(~mask, float("-inf"))
    sink_column = sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    probs = torch.cat((scores, sink_column), dim=-1).softmax(-1)[..., :-1]
    return (probs @ v).to(q.dtype)


class PagedAttention:
    """The model's `attention(layer_idx, q, k, v, sinks, sliding_window)` for one step."""

    def __init__(self, kv_cache: KVCache, metadata: AttentionMetadata):
        self.kv_cache = kv_cache
        self.metadata = metadata

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 sinks: torch.Tensor | None = None, sliding_window: int | None = None) -> torch.Tensor:
        md = self.metadata
        window = md.sliding_window if sliding_window is None else sliding_window
        self.kv_cache.write(layer_idx, md.slot_mapping, k, v)
        out = torch.empty_like(q)
        nd = md.num_decode_tokens
        if nd:
            k_ctx, v_ctx = self.kv_cache.gather(layer_idx, md.decode_block_table)
            o = attend(q[:nd].unsqueeze(2), k_ctx, v_ctx, md.decode_attention_mask(window), sinks)
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
            out[sl] = attend(q_chunk, k_ctx, v_ctx, md.prefill_mask(chunk, window), sinks)[0].transpose(0, 1)
        return out
