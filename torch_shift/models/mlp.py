"""The gated SiLU MLP: a dense layer's, and a mixture's shared expert (Qwen2-MoE)."""

from __future__ import annotations

import torch
from torch import nn

from torch_shift.models.fused import gate_up_silu
from torch_shift.models.linear import Linear


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gate_up_silu(self.gate_up_proj, x))
