"""Linear layers over local shards; the only places a layout's collectives happen in the model."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from torch_shift.parallel import comm


class PartsLinear(nn.Module):
    """A column-parallel fused projection whose parts are separate (possibly strided) tensors, e.g.
    zero-copy views of another layout's shards: one matmul per part, outputs concatenated."""

    def __init__(self, weights: list[torch.Tensor], biases: list[torch.Tensor] | None = None):
        super().__init__()
        self.weights = nn.ParameterList(nn.Parameter(w, requires_grad=False) for w in weights)
        self.biases = (nn.ParameterList(nn.Parameter(b, requires_grad=False) for b in biases)
                       if biases is not None else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.biases is None:
            return torch.cat([F.linear(x, w) for w in self.weights], dim=-1)
        return torch.cat([F.linear(x, w, b) for w, b in zip(self.weights, self.biases)], dim=-1)


class RowParallelLinear(nn.Module):
    """Input features sharded; partial outputs summed over `group` (o_proj, down_proj)."""

    def __init__(self, weight: torch.Tensor, group: dist.ProcessGroup):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return comm.all_reduce(F.linear(x, self.weight), self.group)


class VocabParallelLMHead(nn.Module):
    """Vocabulary rows sharded over the shift group (padded to a multiple of its size); the
    logits are gathered in shift-rank order, which is vocabulary order, and trimmed."""

    def __init__(self, weight: torch.Tensor, vocab_size: int, group: dist.ProcessGroup):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.vocab_size = vocab_size
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = comm.all_gather(F.linear(x, self.weight), self.group, dim=-1)
        return logits[..., : self.vocab_size]
