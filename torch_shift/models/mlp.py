"""The gated MLPs: SiLU (a dense layer's, and a mixture's shared expert: Qwen2-MoE) and GELU's tanh approximation
(Gemma 3's GeGLU)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
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


class GeluMLP(MLP):
    """gelu_tanh(gate) * up, as transformers' Gemma3MLP (`gelu_pytorch_tanh`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)
