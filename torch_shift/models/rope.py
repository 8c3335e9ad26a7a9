"""Rotary position embeddings (default, linear, llama3, YaRN and LongRoPE scaling), as Hugging Face computes them."""

from __future__ import annotations

import math

import torch

from torch_shift.config import RopeConfig
from torch_shift.models.fused import gpu_rotary, gpu_rotary_applies, rotary, rotary_expression


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        # Llama 3.1 frequency-dependent scaling: long wavelengths divided by `factor`,
        # short ones kept, a linear blend between the two bands.
        old_len = rope.original_max_position_embeddings
        low_freq_wavelen = old_len / rope.low_freq_factor
        high_freq_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    if rope.rope_type == "longrope":
        factors = torch.tensor(rope.long_factor if rope.long else rope.short_factor, dtype=torch.float32)
        return 1.0 / (factors * rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.rope_type == "yarn":
        # YaRN (arXiv 2309.00071): frequencies of fewer than beta_slow rotations over the original context are
        # interpolated (divided by `factor`), of more than beta_fast kept, a linear ramp between
        def dimension(rotations: float) -> float:
            return head_dim * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi)) / (
                2 * math.log(rope.theta))

        low, high = dimension(rope.beta_fast), dimension(rope.beta_slow)
        if rope.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, head_dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        extrapolation = 1 - ramp
        pos_freqs = rope.theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
        return (1.0 / (rope.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq


def attention_scaling(rope: RopeConfig) -> float:
    """The factor YaRN and LongRoPE scale cos and sin by (1 for the other types)."""
    if rope.rope_type == "longrope":
        return rope.attention_factor
    if rope.rope_type != "yarn":
        return 1.0
    if rope.attention_factor is not None:
        return rope.attention_factor

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if rope.mscale and rope.mscale_all_dim:
        return mscale(rope.factor, rope.mscale) / mscale(rope.factor, rope.mscale_all_dim)
    return mscale(rope.factor)


class RotaryEmbedding(torch.nn.Module):
    """cos/sin tables for every position up to `max_positions`, indexed by each token's position."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_positions: int, local_rope: RopeConfig | None = None):
        """`local_rope`: a second table (`local_cos_sin`), which Gemma 3's windowed layers rotate by."""
        super().__init__()
        self.rope = rope
        self.local_rope = local_rope
        self.head_dim = head_dim
        self.max_positions = max_positions
        self.register_buffer("cos_sin", self._table(rope, None), persistent=False)
        self.register_buffer("local_cos_sin", None if local_rope is None else self._table(local_rope, None),
                             persistent=False)

    def _table(self, rope: RopeConfig, device: torch.device | None) -> torch.Tensor:
        inv_freq = inverse_frequencies(rope, self.head_dim)
        if device is not None:
            inv_freq = inv_freq.to(device)
        positions = torch.arange(self.max_positions, device=device, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        scale = attention_scaling(rope)
        if scale != 1.0:
            return torch.stack((emb.cos() * scale, emb.sin() * scale))
        return torch.stack((emb.cos(), emb.sin()))  # [2, max_positions, head_dim], float32

    def materialize(self, device: torch.device) -> None:
        """Rebuild the table after the module was created on the meta device."""
        self.cos_sin = self._table(self.rope, device)
        if self.local_rope is not None:
            self.local_cos_sin = self._table(self.local_rope, device)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                local: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, heads, head_dim], k: [T, kv_heads, head_dim], positions: [T]; `local`: by the local table."""
        cos_sin = self.local_cos_sin if local else self.cos_sin
        if gpu_rotary_applies(positions, q, k, cos_sin):
            return gpu_rotary(positions, q, k, cos_sin)
        fused = rotary(positions, q, k, cos_sin)  # one pass on the CPU
        if fused is not None:
            return fused
        return rotary_expression(positions, q, k, cos_sin)
