"""A padded batch [batch, seq] run as the decoder's flattened tokens, without a KV cache.

The real tokens of row 0, then those of row 1, ... (padding dropped); each at the position
transformers' `generate` gives it (its count of real tokens before it in the row), so a padded
row computes what the row alone would. Attention is causal within each row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from torch_shift.attention.sdpa import attend, key_mask
from torch_shift.config import ModelConfig


@dataclass
class PackedBatch:
    input_ids: torch.Tensor  # [T] the real tokens, row after row
    positions: torch.Tensor  # [T]
    seq_lens: list[int]  # real tokens per row
    mask: torch.Tensor  # [batch, seq] bool, True = a real token

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @classmethod
    def from_padded(cls, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, config: ModelConfig,
                    device: torch.device) -> PackedBatch:
        """`attention_mask`: 1 for a token, 0 for padding (left, right or anywhere); None: no padding."""
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype.is_floating_point:
            raise ValueError("input_ids must be an integer tensor of shape [batch, seq]")
        input_ids = input_ids.to(device)
        if attention_mask is None:
            mask = torch.ones_like(input_ids, dtype=torch.bool)
        else:
            if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != input_ids.shape:
                raise ValueError(f"attention_mask must be a tensor of input_ids' shape {tuple(input_ids.shape)}")
            mask = attention_mask.to(device).bool()
        tokens = input_ids[mask]
        if tokens.numel() and (tokens.min() < 0 or tokens.max() >= config.vocab_size):
            raise ValueError(f"input_ids holds token ids outside the vocabulary [0, {config.vocab_size})")
        positions = (mask.cumsum(dim=1) - 1)[mask]
        seq_lens = mask.sum(dim=1).tolist()
        if max(seq_lens, default=0) > config.max_position_embeddings:
            raise ValueError(f"a row has {max(seq_lens)} tokens; the model's context is "
                             f"{config.max_position_embeddings} tokens")
        return cls(tokens, positions, seq_lens, mask)

    def unpack(self, rows: torch.Tensor) -> torch.Tensor:
        """[T, ...] (one row per real token) -> [batch, seq, ...], zeros at the padding."""
        out = rows.new_zeros(*self.mask.shape, *rows.shape[1:])
        out[self.mask] = rows
        return out


class CausalAttention:
    """The model's `attention(layer_idx, q, k, v, sinks, sliding_window)` over packed sequences without a KV
    cache: each sequence attends causally to itself (within the sliding window, if any)."""

    def __init__(self, seq_lens: list[int], sliding_window: int | None = None):
        self.seq_lens = seq_lens
        self.sliding_window = sliding_window

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 sinks: torch.Tensor | None = None, sliding_window: int | None = None) -> torch.Tensor:
        window = self.sliding_window if sliding_window is None else sliding_window
        lens = [n for n in self.seq_lens if n]
        if len(set(lens)) == 1:  # equal lengths: one batched call
            b, n = len(lens), lens[0]
            out = self._attend(*(t.reshape(b, n, *t.shape[1:]) for t in (q, k, v)), sinks, window)
            return out.reshape(q.shape)
        out = torch.empty_like(q)
        start = 0
        for n in lens:
            sl = slice(start, start + n)
            out[sl] = self._attend(q[None, sl], k[None, sl], v[None, sl], sinks, window)[0]
            start += n
        return out

    @staticmethod
    def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None,
                window: int | None) -> torch.Tensor:
        """[batch, n, heads, head_dim] each -> [batch, n, heads, head_dim]."""
        n = q.shape[1]
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        mask = None
        if window is not None and window < n:
            mask = key_mask(torch.arange(n, device=q.device), n, window)
        return attend(q, k, v, mask, sinks).transpose(1, 2)
