"""Linear layers over local shards; the only places a layout's collectives happen in the model. Each has a
`packed` slot that torch_shift.models.linear.prepare_linears fills (see there). And `ShardDecoder`: a shard of such
layers run whole by the C++ decoder, its collectives inside the call."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from torch_shift.models.linear import PackedWeight, linear
from torch_shift.models.moe import Experts, SparseMoeBlock, adopt_routing
from torch_shift.models.native_decoder import NativeDecoder
from torch_shift.parallel import comm


class PartsLinear(nn.Module):
    """A column-parallel fused projection whose parts are separate (possibly strided) tensors, e.g.
    zero-copy views of another layout's shards: one matmul per part, outputs concatenated (one matmul of
    their packed concatenation once prepared)."""

    packed: PackedWeight | None = None

    def __init__(self, weights: list[torch.Tensor], biases: list[torch.Tensor] | None = None):
        super().__init__()
        self.weights = nn.ParameterList(nn.Parameter(w, requires_grad=False) for w in weights)
        self.biases = (nn.ParameterList(nn.Parameter(b, requires_grad=False) for b in biases)
                       if biases is not None else None)
        self.bias = None

    def dense_weight(self) -> torch.Tensor:
        return torch.cat(list(self.weights))

    def drop_dense(self) -> None:
        """Once packed: the parts' views let go of the other layout's storage (the bias is kept whole)."""
        if self.biases is not None:
            self.bias = nn.Parameter(torch.cat(list(self.biases)), requires_grad=False)
        self.weights = nn.ParameterList()
        self.biases = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return self.packed(x, self.bias if self.biases is None else torch.cat(list(self.biases)))
        if self.biases is None:
            return torch.cat([linear(x, w) for w in self.weights], dim=-1)
        return torch.cat([linear(x, w, b) for w, b in zip(self.weights, self.biases)], dim=-1)


class RowParallelLinear(nn.Module):
    """Input features sharded; partial outputs summed over `group` (o_proj, down_proj), then the bias (whole on
    every rank) added once."""

    packed: PackedWeight | None = None

    def __init__(self, weight: torch.Tensor, group: dist.ProcessGroup, bias: torch.Tensor | None = None):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = comm.all_reduce(linear(x, self.weight, None, self.packed), self.group)
        return out if self.bias is None else out + self.bias


class VocabParallelLMHead(nn.Module):
    """Vocabulary rows sharded over the shift group (padded to a multiple of its size); the
    logits are gathered in shift-rank order, which is vocabulary order, and trimmed."""

    packed: PackedWeight | None = None

    def __init__(self, weight: torch.Tensor, vocab_size: int, group: dist.ProcessGroup):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.vocab_size = vocab_size
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = comm.all_gather(linear(x, self.weight, None, self.packed), self.group, dim=-1)
        return logits[..., : self.vocab_size]


class ShardDecoder:
    """A tensor-parallel rank's shard of a dense model (RowParallelLinear o and down projections, an LM head whole or
    VocabParallelLMHead) run by the C++ decoder (torch_shift.models.native_decoder): its partial sums added through
    the group's shared-memory all-reduce inside the call, as the forward's are, and its logits gathered over the
    vocabulary where the head is sharded. Every rank of the layout runs the same steps."""

    def __init__(self, decoder: NativeDecoder, group: dist.ProcessGroup, communicator: int, vocab_size: int | None):
        self.decoder = decoder
        self.group = group
        self.communicator = communicator  # the id the decoder was built with (comm.native_communicator)
        self.vocab_size = vocab_size  # the vocabulary a sharded LM head's gathered logits are trimmed to

    @classmethod
    def build(cls, model: nn.Module) -> ShardDecoder | None:
        """The decoder of `model`'s shard, or None where it does not run it (native_decoder's checks, a group
        without the shared-memory communicator's C++ collectives)."""
        group = getattr(model.layers[0].attn.o_proj, "group", None)
        communicator = comm.native_communicator(group) if group is not None else None
        decoder = NativeDecoder.build(model, group, communicator) if communicator is not None else None
        if decoder is None:
            return None
        head = model.lm_head
        return cls(decoder, group, communicator, head.vocab_size if isinstance(head, VocabParallelLMHead) else None)

    def step(self, input_ids: torch.Tensor, positions: torch.Tensor, logits_indices: torch.Tensor,
             attention: object) -> torch.Tensor | None:
        """The step's logits (every rank's; `logits_indices` may be empty on a rank that returns none), or None
        where the decoder does not take it: more tokens than it runs, another attention, an emulated link (whose
        delays only the Python collectives make), or another communicator than the one it was built with."""
        if (not self.decoder.runs(len(input_ids), attention)
                or comm.native_communicator(self.group) != self.communicator):
            return None
        logits = self.decoder(input_ids, positions, logits_indices, attention)
        # the ledger counts the call's all-reduces (two a layer, [tokens, hidden] each), as the forward's
        model = self.decoder.model
        comm.record_all_reduces(2 * len(model.layers), len(input_ids) * model.config.hidden_size
                                * logits.element_size(), self.group)
        if self.vocab_size is None:
            return logits
        return comm.all_gather(logits, self.group, dim=-1)[..., : self.vocab_size]


class RowParallelSparseMoe(nn.Module):
    """A sparse MoE block whose experts each hold a slice of their FFN's intermediate dim (TP, as the dense MLP:
    gate/up rows, down columns), the router whole; every rank routes the same tokens the same way, and the
    partial outputs are summed over `group`. Its parameters keep SparseMoeBlock's names."""

    def __init__(self, block: SparseMoeBlock, experts: Experts, group: dist.ProcessGroup):
        super().__init__()
        adopt_routing(self, block)
        self.experts = experts
        self.group = group
        self.adds_down_bias = dist.get_rank(group) == 0  # the experts' down_bias (whole) joins the sum once

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts(x, self.router(x), self.top_k, self.norm_topk_prob, self.float32_routing_weights,
                           self.routing, self.swiglu_limit, self.swiglu_alpha, down_bias=self.adds_down_bias)
        return comm.all_reduce(out, self.group)
